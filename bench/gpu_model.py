"""Real-size random Llama models for the GPU check's engine phase, and their physical floor.

The 2026-12-04 engine benchmark used the 54M-parameter demo model in fp32: on a GPU that takes
the SIMT fallback kernels and is launch-bound, so its parity with transformers said nothing
about the tensor-core path. Issue 43 asks for a bf16 Llama-3.2-1B shape (16 layers, hidden
2048, 32/8 heads x 64, intermediate 8192) and a Llama-3-8B layer shape (hidden 4096, 32/8 x
128, intermediate 14336; fewer layers, so it fits the run's minutes).

`build_random_model` writes a directory the engine and transformers both load: the tokenizer,
config and generation config of `compute_node.model.tiny` (a tiny skeleton, vocab as asked),
the config's shape fields set to the target, and random weights drawn on the GPU (a 1B model
in fp32 on one CPU core would take most of a minute; on the GPU it is the disk write). Weights
follow tiny's scheme (linear layers N(0, 1/fan_in), norms near 1, embeddings N(0, 1)) so
activations keep an O(1) spread.

The floor of a decode step is what it must move: every weight but the embedding table (one row
per sequence), plus the K/V of every sequence's context, at the copy bandwidth measured in the
same run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the checkpoint (Hugging Face Llama names) and its shape."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, self.hidden)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (self.hidden,),
                p + "self_attn.q_proj.weight": (q, self.hidden),
                p + "self_attn.k_proj.weight": (kv, self.hidden),
                p + "self_attn.v_proj.weight": (kv, self.hidden),
                p + "self_attn.o_proj.weight": (self.hidden, q),
                p + "post_attention_layernorm.weight": (self.hidden,),
                p + "mlp.gate_proj.weight": (self.intermediate, self.hidden),
                p + "mlp.up_proj.weight": (self.intermediate, self.hidden),
                p + "mlp.down_proj.weight": (self.hidden, self.intermediate),
            })
        shapes["model.norm.weight"] = (self.hidden,)
        if not self.tie_embeddings:
            shapes["lm_head.weight"] = (self.vocab, self.hidden)
        return shapes

    def num_params(self) -> int:
        total = 0
        for shape in self.weight_shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def weight_bytes_per_step(self, dtype: str = "bfloat16") -> int:
        """Weight bytes a decode step reads: all but the embedding table, which is only
        gathered (unless tied, when it is the LM head and read whole)."""
        params = self.num_params()
        if not self.tie_embeddings:
            params -= self.vocab * self.hidden
        return params * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        return self.num_layers * 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]


LLAMA_1B = ModelShape("Llama-3.2-1B shape", num_layers=16, hidden=2048, heads=32, kv_heads=8,
                      head_dim=64, intermediate=8192, vocab=32000)
LLAMA_8B_LAYERS = ModelShape("Llama-3-8B layer shape x4", num_layers=4, hidden=4096, heads=32,
                             kv_heads=8, head_dim=128, intermediate=14336, vocab=32000)
SMOKE_MODEL = replace(LLAMA_1B, name="smoke", num_layers=2, hidden=128, heads=4, kv_heads=2,
                      head_dim=32, intermediate=256, vocab=512)


def step_floor_us(shape: ModelShape, copy_gbs: float, context_lens: list[int],
                  dtype: str = "bfloat16") -> float:
    """Microseconds a decode step of sequences at `context_lens` must take at least: weights
    + K/V bytes (module doc) at `copy_gbs` (GB/s, read + write bytes of a device copy)."""
    nbytes = shape.weight_bytes_per_step(dtype) + sum(context_lens) * shape.kv_bytes_per_token(dtype)
    return nbytes / (copy_gbs * 1e3)


def build_random_model(out_dir: Path, shape: ModelShape, device: str, dtype: str = "bfloat16",
                       seed: int = 0, max_position_embeddings: int = 8192) -> Path:
    """Write a loadable random model of `shape` to `out_dir` (module doc); returns its path."""
    import torch
    from safetensors.torch import save_file

    from compute_node.model.tiny import build_tiny_model

    out = build_tiny_model(out_dir, "llama", num_layers=1, hidden_size=64, num_heads=4,
                           num_kv_heads=2, head_dim=16, intermediate_size=128,
                           vocab_size=shape.vocab, tie_word_embeddings=shape.tie_embeddings,
                           dtype=dtype, seed=seed, max_position_embeddings=max_position_embeddings)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.update(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.num_layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    gen = torch.Generator(device=device).manual_seed(seed)
    tdtype = getattr(torch, dtype)
    tensors: dict[str, Any] = {}
    for name, dims in shape.weight_shapes().items():
        t = torch.randn(dims, generator=gen, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        elif name != "model.embed_tokens.weight":
            t = t / dims[-1] ** 0.5
        tensors[name] = t.to(tdtype).cpu().contiguous()
        del t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
             vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Requests (prompt token ids, output tokens), lengths uniform in the ranges, ids >= 4
    (past the tokenizer's special tokens)."""
    import random

    rng = random.Random(seed)
    return [([rng.randrange(4, vocab) for _ in range(rng.randint(*prompt_range))],
             rng.randint(*output_range)) for _ in range(num_requests)]
