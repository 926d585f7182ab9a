"""What the runner needs from a Hugging Face model directory's `config.json`, parsed without
`transformers`.

One `ModelConfig` describes all three supported families; they differ only in a few switches:

| architecture | q/k/v bias | o bias | q/k RMSNorm | head_dim when absent |
|---|---|---|---|---|
| LlamaForCausalLM | `attention_bias` | `attention_bias` | no | hidden / heads |
| Qwen2ForCausalLM | always | never | no | hidden / heads |
| Qwen3ForCausalLM | `attention_bias` | `attention_bias` | per head | 128 (transformers' default) |

Both generations of the RoPE keys are read: `rope_theta` + `rope_scaling` (transformers 4.x)
and `rope_parameters` (5.x). Anything the runner would silently compute wrong — another
activation, a sliding window, a RoPE scaling other than Llama 3's, partial rotary — is refused
with `UnsupportedModel` at load time instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compute_node.model.errors import InvalidModelConfig, ModelNotFound, UnsupportedModel

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
DTYPE_NAMES = ("float32", "float16", "bfloat16")


def __getattr__(name: str) -> Any:
    """`DTYPES` (name -> torch dtype) is built on first use: reading a config.json must not
    import torch, so a process that only checks a model directory (a CLI refusing a missing or
    unsupported model) exits without paying torch's ~2 CPU-s import."""
    if name == "DTYPES":
        import torch

        table: dict[str, torch.dtype] = {n: getattr(torch, n) for n in DTYPE_NAMES}
        globals()["DTYPES"] = table
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
# generation_config.json keys that are sampling defaults the engine may apply to requests.
_GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "do_sample")


@dataclass(slots=True, frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    # Llama 3 frequency scaling (rope_type == "llama3").
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """float32 `[head_dim // 2]` inverse frequencies, computed as transformers does (same
        operations in the same precision) so positions rotate bit-identically."""
        import torch

        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "default":
            return inv_freq
        # Llama 3: low frequencies (long wavelengths) are divided by `factor`, high ones kept,
        # and the band in between interpolated smoothly.
        low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: str                              # the checkpoint's dtype: "float32" | "float16" | "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()     # config.json's and generation_config.json's, merged
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.eos_token_ids

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` when present) of a model directory."""
        path = Path(model_dir)
        if not path.is_dir():
            raise ModelNotFound(f"model directory {str(path)!r} does not exist")
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ModelNotFound(f"{str(path)!r} has no config.json: not a Hugging Face model directory")
        raw = _read_json(config_path)
        generation = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        generation = generation or {}
        architecture = _architecture(raw)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"hidden_act {act!r} is not supported (only 'silu', the SwiGLU MLP)")
        if raw.get("use_sliding_window") or any(t != "full_attention" for t in raw.get("layer_types") or ()):
            raise UnsupportedModel("sliding-window attention layers are not supported")
        hidden_size = _positive_int(raw, "hidden_size")
        num_heads = _positive_int(raw, "num_attention_heads")
        num_kv_heads = _positive_int(raw, "num_key_value_heads") if "num_key_value_heads" in raw else num_heads
        if num_heads % num_kv_heads:
            raise InvalidModelConfig(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        is_qwen3 = architecture == "Qwen3ForCausalLM"
        if raw.get("head_dim") is not None:
            head_dim = _positive_int(raw, "head_dim")
        elif is_qwen3:
            head_dim = 128
        elif hidden_size % num_heads == 0:
            head_dim = hidden_size // num_heads
        else:
            raise InvalidModelConfig(f"hidden_size {hidden_size} is not a multiple of {num_heads} heads")
        if head_dim % 2:
            raise InvalidModelConfig(f"head_dim {head_dim} must be even for rotary embeddings")
        attention_bias = bool(raw.get("attention_bias", False))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        return cls(
            architecture=architecture,
            vocab_size=_positive_int(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_layers=_positive_int(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope(raw),
            max_position_embeddings=_positive_int(raw, "max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=is_qwen3,
            dtype=_checkpoint_dtype(raw),
            bos_token_id=_first_id(generation.get("bos_token_id", raw.get("bos_token_id"))),
            eos_token_ids=_merge_ids(generation.get("eos_token_id"), raw.get("eos_token_id")),
            generation_defaults={k: generation[k] for k in _GENERATION_DEFAULT_KEYS if k in generation},
        )


def resolve_dtype(dtype: str | torch.dtype | None, default: str) -> str:
    """The dtype name to run in: an explicit override, else the checkpoint's."""
    if dtype is None:
        return default
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    aliases = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    name = aliases.get(name, name)
    if name not in DTYPE_NAMES:
        raise InvalidModelConfig(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPE_NAMES)}")
    return name


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidModelConfig(f"cannot read {str(path)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidModelConfig(f"{str(path)!r} must hold a JSON object")
    return data


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list) or not architectures:
        raise UnsupportedModel(
            f"config.json names no architecture; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise UnsupportedModel(
        f"architecture {', '.join(map(str, architectures))} is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _positive_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidModelConfig(f"config.json {key} must be a positive integer, got {value!r}")
    return value


def _checkpoint_dtype(raw: dict[str, Any]) -> str:
    # transformers 4.x writes `torch_dtype`, 5.x writes `dtype`; absent means float32.
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in DTYPE_NAMES:
        raise UnsupportedModel(f"checkpoint dtype {name!r} is not supported; use one of {sorted(DTYPE_NAMES)}")
    return name


def _rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise InvalidModelConfig(f"rope_scaling/rope_parameters must be an object, got {params!r}")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModel(f"partial_rotary_factor {partial} is not supported (only full rotary)")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    try:
        rope = RopeConfig(
            theta=theta,
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
            ),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidModelConfig(f"llama3 rope scaling needs factor, low/high_freq_factor: {exc}") from None
    if rope.high_freq_factor <= rope.low_freq_factor:
        raise InvalidModelConfig("llama3 rope scaling needs high_freq_factor > low_freq_factor")
    return rope


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise InvalidModelConfig(f"token ids must be non-negative integers, got {value!r}")
    return values


def _first_id(value: Any) -> int | None:
    ids = _as_ids(value)
    return ids[0] if ids else None


def _merge_ids(*values: Any) -> tuple[int, ...]:
    merged: list[int] = []
    for value in values:
        merged.extend(i for i in _as_ids(value) if i not in merged)
    return tuple(merged)
