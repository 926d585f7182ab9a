"""The decoder (Llama / Qwen2 / Qwen3) over a flat token batch, with attention on the KV pool.

Weights are held as plain tensors, loaded once from the checkpoint and fused where one matmul
can replace several (q/k/v → one `qkv` weight, gate/up → one `gate_up` weight): fewer, larger
matmuls are what a CPU or GPU runs fastest, and a fused weight's output rows are exactly the
separate ones' (the same dot products), so the numbers do not change. On an x86-64 CPU the
large matmul weights are then reordered once for oneDNN (`compute_node.model.linear`: ~2x faster
decode steps than `F.linear`'s MKL path); `prepack_linear=False` keeps plain weights and `F.linear`.

Where those weights are the panel GEMM's (float32 on an AVX2 CPU without AVX-512), each layer's
dense work runs as two compiled calls around attention (`kernels.cpu.fused_layer`: norm, q/k/v,
RoPE before; o, norm, gate/up, SiLU·mul, down after) instead of 10 calls from Python (4 GEMMs,
2 norms, RoPE, 3 torch ops for SiLU·mul), each with its checks, conversions and output
allocation: 300 such calls a step of the 30-layer SmolLM-135M shape become 60. Its one-row
decode step took 44.9 -> 36.1 and 43.4 -> 42.6 ms of CPU time (one thread, two alternated
pairs on a shared host: `bench/bench_decode_parts.py --threads 1 --clock thread`). Elsewhere
the layer runs op by op, with the fused elementwise kernels where they apply (`fused_cpu_ops`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from compute_node.model import linear as dense
from compute_node.model.attention import AttentionMetadata, PhaseTimer, paged_attention
from compute_node.model.config import DTYPES, ModelConfig
from compute_node.model.errors import WeightsError
from compute_node.model.layers import apply_rope, rms_norm, rope_angles, rope_cos_sin
from compute_node.model.weights import Checkpoint
from compute_node.pool import KvPool
from kernels._validate import KernelInputError
from kernels.cpu.fused_layer import FusedLayers, LayerWeights
from kernels.cpu.rms_norm import rms_norm as cpu_rms_norm
from kernels.cpu.rope import rope_qkv

_MATMUL_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")   # of each DecoderLayer


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor              # [hidden]
    qkv_weight: torch.Tensor              # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None           # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None
    o_weight: torch.Tensor                # [hidden, num_heads * head_dim]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor               # [hidden]
    gate_up_weight: torch.Tensor          # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor             # [hidden, intermediate]
    down_bias: torch.Tensor | None


@dataclass(slots=True)
class _StepBuffers:
    """A fused step's arrays, each also as the NumPy view the kernels take (a view costs ~2 µs
    to make: once per step, not per layer)."""

    hidden: np.ndarray     # the residual stream's view
    normed: torch.Tensor   # [num_tokens, hidden]: a norm's output
    q: torch.Tensor        # [num_tokens, num_heads, head_dim]
    k: torch.Tensor        # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor
    rope: tuple[np.ndarray, np.ndarray]   # cos, sin [num_tokens, head_dim // 2] (fused RoPE)
    normed_np: np.ndarray = field(init=False)
    qkv_np: tuple[np.ndarray, np.ndarray, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.normed_np = self.normed.numpy()
        self.qkv_np = (self.q.numpy(), self.k.numpy(), self.v.numpy())


class DecoderModel:
    """Embedding → decoder layers → final norm → LM head, for one `ModelConfig`."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[DecoderLayer],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
    ) -> None:
        self.config = config
        self.embed = embed                 # [vocab, hidden]
        self.layers = layers
        self.final_norm = final_norm       # [hidden]
        self.lm_head = lm_head             # [vocab, hidden]; the embedding itself when tied
        self.dtype = embed.dtype
        self.device = embed.device
        self.inv_freq = config.rope.inv_freq(config.head_dim).to(self.device)   # float32 [head_dim // 2]
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_heads = (config.num_heads, config.num_kv_heads, config.num_kv_heads)
        self._fused = False
        self.fused_cpu_ops = True
        # With panel-packed weights, each layer's dense work as two compiled calls
        # (`kernels.cpu.fused_layer`); settable: benchmarks run one model both ways.
        self.fused_layers = True
        self._norms_np: list[tuple[np.ndarray, np.ndarray]] | None = None
        self._layer_weights: list[LayerWeights] | None = None   # `_fused_layer_weights`, once
        self._layer_weights_checked = False

    @classmethod
    def load(cls, checkpoint: Checkpoint, config: ModelConfig, dtype: str, device: torch.device,
             prepack_linear: bool = True) -> DecoderModel:
        """The model of `checkpoint`; with `prepack_linear`, its matmul weights packed for oneDNN
        where that applies (`compute_node.model.linear.can_pack`: the CPU, float32/bfloat16)."""
        loader = _Loader(checkpoint, config, DTYPES[dtype], device)
        embed = loader.get("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
        layers = [loader.layer(i) for i in range(config.num_layers)]
        final_norm = loader.get("model.norm.weight", (config.hidden_size,))
        if config.tie_word_embeddings:
            lm_head = embed
        else:
            lm_head = loader.get("lm_head.weight", (config.vocab_size, config.hidden_size))
        model = cls(config, embed, layers, final_norm, lm_head)
        if prepack_linear and dense.can_pack(device, DTYPES[dtype]):
            model.pack_linear_weights()
        return model

    @property
    def packed_linear(self) -> bool:
        """Whether any matmul weight is packed (`dense.pack`: panels or oneDNN's layout; the LM
        head is the largest one)."""
        return dense.is_packed(self.lm_head) or any(
            dense.is_packed(getattr(layer, name)) for layer in self.layers for name in _MATMUL_WEIGHTS)

    def pack_linear_weights(self) -> None:
        """Pack the matmul weights (`dense.pack`), in place: those of at least
        `dense.MIN_PACKED_ELEMENTS` (a tiny model keeps F.linear). Each plain weight is dropped
        once its packed copy exists, so the model's memory stays the same, except for a tied LM
        head: the embedding stays for the lookup and the head is packed as a copy. Nothing
        changes where this CPU cannot run packed weights of the model's dtype (`dense.can_pack`)."""
        if not dense.can_pack(self.lm_head.device, self.lm_head.dtype):
            return
        self._layer_weights, self._layer_weights_checked = None, False
        for layer in self.layers:
            for name in _MATMUL_WEIGHTS:
                setattr(layer, name, dense.pack_if_large(getattr(layer, name)))
        self.lm_head = dense.pack_if_large(self.lm_head)

    def unpack_linear_weights(self) -> None:
        """Back to plain weights and `F.linear` (the values are unchanged by a pack: benchmarks
        switch one model both ways)."""
        self._layer_weights, self._layer_weights_checked = None, False
        for layer in self.layers:
            for name in _MATMUL_WEIGHTS:
                setattr(layer, name, dense.unpack(getattr(layer, name)))
        if self.config.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = dense.unpack(self.lm_head)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        pool: KvPool,
        meta: AttentionMetadata,
        timer: PhaseTimer | None = None,
    ) -> torch.Tensor:
        """Hidden states `[num_tokens, hidden]` after the last layer (before the final norm),
        writing every layer's K/V of these tokens into `pool` on the way.

        The residual stream is one tensor updated in place: each sublayer's output is added
        to it by the norm that follows (`_add_norm`), the layout fused kernels want and the
        same float32 adds as `residual + output`."""
        num_tokens = input_ids.shape[0]
        rope = self._rope_tables(positions)
        hidden = F.embedding(input_ids, self.embed)   # [num_tokens, hidden], the residual stream
        layer_weights = self._fused_layer_weights()
        if layer_weights is not None:
            return self._forward_fused(hidden, rope, layer_weights, pool, meta, timer)
        delta: torch.Tensor | None = None             # the last sublayer's output, not yet added
        bufs = self._step_buffers(hidden, rope)
        norms = self._norms_np if bufs is not None else None
        for index, layer in enumerate(self.layers):
            x = self._add_norm(hidden, delta, layer.input_norm, bufs, norms[index][0] if norms else None)
            qkv = dense.linear(x, layer.qkv_weight, layer.qkv_bias)   # [num_tokens, qkv_size]
            q, k, v = self._qkv_heads(qkv, layer, rope, bufs)
            attn = paged_attention(pool, index, q, k, v, meta, timer)
            out = dense.linear(attn.view(num_tokens, self.q_size), layer.o_weight, layer.o_bias)
            x = self._add_norm(hidden, out, layer.post_norm, bufs, norms[index][1] if norms else None)
            gate_up = dense.linear(x, layer.gate_up_weight, layer.gate_up_bias)
            delta = dense.linear(self._silu_mul(gate_up), layer.down_weight, layer.down_bias)
        if delta is not None:
            hidden += delta
        return hidden

    def _forward_fused(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       layer_weights: list[LayerWeights], pool: KvPool, meta: AttentionMetadata,
                       timer: PhaseTimer | None) -> torch.Tensor:
        """`forward` with each layer's dense work in two compiled calls around attention."""
        cfg = self.config
        step = FusedLayers(hidden, *rope, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                           cfg.rms_norm_eps)
        for index, weights in enumerate(layer_weights):
            q, k, v = step.attention_input(weights)
            step.attention_output_mlp(weights, paged_attention(pool, index, q, k, v, meta, timer))
        step.finish()
        return hidden

    def _fused_layer_weights(self) -> list[LayerWeights] | None:
        """Every layer's weights for `kernels.cpu.fused_layer`, when the fused path applies:
        fused CPU ops on (float32 on the CPU), no per-head q/k norms (Qwen3), and every matmul
        weight of every layer in panels (`dense.pack` on an AVX2 CPU). Made once (pack and
        unpack start over); None where it does not apply."""
        if not (self._fused and self.fused_layers) or self.config.qk_norm:
            return None
        if not self._layer_weights_checked:
            self._layer_weights_checked = True
            try:
                self._layer_weights = [
                    LayerWeights.of(layer.input_norm, layer.qkv_weight, layer.qkv_bias, layer.o_weight, layer.o_bias,
                                    layer.post_norm, layer.gate_up_weight, layer.gate_up_bias, layer.down_weight,
                                    layer.down_bias)
                    for layer in self.layers
                ]
            except KernelInputError:
                self._layer_weights = None
        return self._layer_weights

    # -- the elementwise steps: fused CPU kernels (float32 on the CPU), or torch ops ----------

    @property
    def fused_cpu_ops(self) -> bool:
        """Whether the residual add + RMSNorm and the RoPE of q/k run as fused CPU kernels
        (`kernels.cpu.rms_norm`, `kernels.cpu.rope`): one call and one pass each instead of
        ~5-10 torch calls, which at decode sizes cost more in dispatch than in arithmetic.
        float32 on the CPU; settable (benchmarks run one model both ways)."""
        return self._fused

    @fused_cpu_ops.setter
    def fused_cpu_ops(self, on: bool) -> None:
        self._fused = bool(on) and self.device.type == "cpu" and self.dtype == torch.float32

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fused and not self.config.qk_norm:
            return rope_angles(positions, self.inv_freq)   # [num_tokens, head_dim // 2] each
        return rope_cos_sin(positions, self.inv_freq, self.dtype)

    def _step_buffers(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> _StepBuffers | None:
        """The fused kernels' outputs, allocated once per step and rewritten by every layer:
        each is consumed (by the next matmul, or by attention, which stores k/v in the pool)
        before the next layer writes it, and a torch allocation costs ~5 µs, as much as a
        decode-sized norm."""
        if not self._fused:
            return None
        cfg, rows = self.config, hidden.shape[0]
        kv = (rows, cfg.num_kv_heads, cfg.head_dim)
        if self._norms_np is None:   # the weights never change: their views are made once
            self._norms_np = [(layer.input_norm.numpy(), layer.post_norm.numpy()) for layer in self.layers]
        return _StepBuffers(hidden.numpy(), torch.empty_like(hidden),
                            hidden.new_empty((rows, cfg.num_heads, cfg.head_dim)), hidden.new_empty(kv),
                            hidden.new_empty(kv), (rope[0].numpy(), rope[1].numpy()))

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  bufs: _StepBuffers | None, weight_np: np.ndarray | None = None) -> torch.Tensor:
        """`hidden += delta` (in place; nothing when None), then RMSNorm of the sum."""
        eps = self.config.rms_norm_eps
        if bufs is not None:
            cpu_rms_norm(bufs.hidden, weight_np, eps, bufs.normed_np, residual_delta=delta)
            return bufs.normed
        if delta is not None:
            hidden += delta
        return rms_norm(hidden, weight, eps)

    def _qkv_heads(
        self, qkv: torch.Tensor, layer: DecoderLayer, rope: tuple[torch.Tensor, torch.Tensor],
        bufs: _StepBuffers | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[num_tokens, num_heads, head_dim]`, k and v `[num_tokens, num_kv_heads, head_dim]`,
        contiguous, q and k rotated (after Qwen3's per-head norms)."""
        cfg = self.config
        num_tokens = qkv.shape[0]
        cos, sin = rope
        if bufs is not None and layer.q_norm is None:
            rope_qkv(qkv, *bufs.rope, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, *bufs.qkv_np)
            return bufs.q, bufs.k, bufs.v
        q, k, v = qkv.view(num_tokens, -1, cfg.head_dim).split(self.qkv_heads, dim=1)   # views
        if layer.q_norm is not None and layer.k_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        # v is a strided view into qkv; the kernel stores rows, so it gets a contiguous copy.
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()

    @staticmethod
    def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's `silu(gate) * up`, torch on every device: a fused Numba loop measured 3-10x
        slower than torch's two vectorised ops (its float32 exp does not vectorise there)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of last-layer rows `[rows, hidden]` (one kernel call with the
        fused CPU ops, instead of ~6 torch calls)."""
        if self._fused and hidden.dim() == 2:
            return cpu_rms_norm(hidden.contiguous(), self.final_norm, self.config.rms_norm_eps)
        return rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits `[rows, vocab]` of last-layer hidden rows (final norm applied here)."""
        return dense.linear(self.final_hidden(hidden), self.lm_head).float()


class _Loader:
    """Reads and checks one tensor at a time, converting it to the run dtype and device."""

    def __init__(self, checkpoint: Checkpoint, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.checkpoint = checkpoint
        self.config = config
        self.dtype = dtype
        self.device = device
        missing = sorted(set(self._expected_names()) - checkpoint.names)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise WeightsError(f"checkpoint lacks tensors the model needs: {', '.join(missing[:5])}{more}")

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.checkpoint.get(name)
        if tuple(tensor.shape) != shape:
            raise WeightsError(f"tensor {name!r} has shape {list(tensor.shape)}, the config implies {list(shape)}")
        if not tensor.is_floating_point():
            raise WeightsError(f"tensor {name!r} has dtype {tensor.dtype}, expected a floating point type")
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def layer(self, i: int) -> DecoderLayer:
        cfg = self.config
        p = f"model.layers.{i}."
        hidden, head_dim, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q_size, kv_size = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv_weight = torch.cat([
            self.get(attn + "q_proj.weight", (q_size, hidden)),
            self.get(attn + "k_proj.weight", (kv_size, hidden)),
            self.get(attn + "v_proj.weight", (kv_size, hidden)),
        ])
        qkv_bias = None
        if cfg.qkv_bias:
            qkv_bias = torch.cat([
                self.get(attn + "q_proj.bias", (q_size,)),
                self.get(attn + "k_proj.bias", (kv_size,)),
                self.get(attn + "v_proj.bias", (kv_size,)),
            ])
        gate_up_bias = None
        if cfg.mlp_bias:
            gate_up_bias = torch.cat(
                [self.get(mlp + "gate_proj.bias", (inter,)), self.get(mlp + "up_proj.bias", (inter,))]
            )
        return DecoderLayer(
            input_norm=self.get(p + "input_layernorm.weight", (hidden,)),
            qkv_weight=qkv_weight,
            qkv_bias=qkv_bias,
            q_norm=self.get(attn + "q_norm.weight", (head_dim,)) if cfg.qk_norm else None,
            k_norm=self.get(attn + "k_norm.weight", (head_dim,)) if cfg.qk_norm else None,
            o_weight=self.get(attn + "o_proj.weight", (hidden, q_size)),
            o_bias=self.get(attn + "o_proj.bias", (hidden,)) if cfg.o_bias else None,
            post_norm=self.get(p + "post_attention_layernorm.weight", (hidden,)),
            gate_up_weight=torch.cat([
                self.get(mlp + "gate_proj.weight", (inter, hidden)),
                self.get(mlp + "up_proj.weight", (inter, hidden)),
            ]),
            gate_up_bias=gate_up_bias,
            down_weight=self.get(mlp + "down_proj.weight", (hidden, inter)),
            down_bias=self.get(mlp + "down_proj.bias", (hidden,)) if cfg.mlp_bias else None,
        )

    def _expected_names(self) -> list[str]:
        cfg = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [f"{p}self_attn.{n}_proj.weight" for n in "qkvo"]
            names += [f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
            if cfg.qkv_bias:
                names += [f"{p}self_attn.{n}_proj.bias" for n in "qkv"]
            if cfg.o_bias:
                names.append(p + "self_attn.o_proj.bias")
            if cfg.mlp_bias:
                names += [f"{p}mlp.{n}_proj.bias" for n in ("gate", "up", "down")]
            if cfg.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names
