"""Build a complete, random-weight Hugging Face model directory, offline.

`build_tiny_model` writes what a real checkpoint has — `config.json`, `generation_config.json`,
safetensors weights (single file, or shards plus `model.safetensors.index.json`), and a
byte-level BPE tokenizer trained here on built-in English text (`tokenizer.json`,
`tokenizer_config.json` with BOS/EOS and a ChatML chat template) — for a Llama, Qwen2 or Qwen3
architecture. Tests build tiny ones; the demo builds a ~50M-parameter Llama without a download.

Weights are drawn so activations and logits keep an O(1) spread (embeddings N(0, 1), linear
layers N(0, 1/fan_in), norms near 1): with the usual 0.02 init a tiny model's logits would be
near-uniform and greedy decoding a sequence of near-ties, useless for testing.

    python -m compute_node.model.tiny OUT_DIR [--arch llama|qwen2|qwen3] [--num-layers N] ...
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from compute_node.model._tiny_corpus import CORPUS
from compute_node.model.config import DTYPES

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]   # ids 0, 1, 2, 3
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + 1   # the byte alphabet, the specials, one merge


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 12,
    hidden_size: int = 512,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 2048,
    vocab_size: int = 8192,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    sharded: bool = False,
    num_shards: int = 2,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    attention_bias: bool = False,
) -> Path:
    """Write the model directory `out_dir` (created if needed) and return its path.

    The defaults are the demo's ~54M-parameter Llama. `attention_bias` applies to Llama and
    Qwen3 (Qwen2 always has q/k/v biases); `rope_scaling` is written as config.json's
    `rope_scaling` (e.g. a Llama 3 one).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB} (byte alphabet + special tokens), got {vocab_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(arch, num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size,
                     vocab_size, tie_word_embeddings, dtype, max_position_embeddings, rope_theta, rope_scaling,
                     attention_bias)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": 0, "eos_token_id": [1, 3], "pad_token_id": 1}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tensors = _random_weights(config, arch, seed, DTYPES[dtype])
    _save_weights(out, tensors, num_shards if sharded else 1)
    _write_tokenizer(out, vocab_size, max_position_embeddings)
    return out


def _config(
    arch: str, num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
    intermediate_size: int, vocab_size: int, tie: bool, dtype: str, max_pos: int, rope_theta: float,
    rope_scaling: dict[str, Any] | None, attention_bias: bool,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "use_cache": True,
    }
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = attention_bias
    if arch == "llama":
        config["mlp_bias"] = False
    if arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    return config


def _random_weights(config: dict[str, Any], arch: str, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim, vocab = config["head_dim"], config["vocab_size"]
    q_size, kv_size = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    qkv_bias = arch == "qwen2" or config.get("attention_bias", False)
    o_bias = arch != "qwen2" and config.get("attention_bias", False)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    def bias(size: int) -> torch.Tensor:
        return 0.1 * torch.randn(size, generator=gen)

    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm(hidden)
        for name, rows in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            tensors[f"{p}self_attn.{name}_proj.weight"] = linear(rows, hidden)
            if qkv_bias:
                tensors[f"{p}self_attn.{name}_proj.bias"] = bias(rows)
        tensors[p + "self_attn.o_proj.weight"] = linear(hidden, q_size)
        if o_bias:
            tensors[p + "self_attn.o_proj.bias"] = bias(hidden)
        if arch == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = norm(head_dim)
            tensors[p + "self_attn.k_norm.weight"] = norm(head_dim)
        tensors[p + "post_attention_layernorm.weight"] = norm(hidden)
        tensors[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    tensors["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = linear(vocab, hidden)
    return {name: t.to(dtype).contiguous() for name, t in tensors.items()}


def _save_weights(out: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    metadata = {"format": "pt"}
    if num_shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    filled = 0
    for name, tensor in tensors.items():   # consecutive tensors fill shard after shard
        shards[min(num_shards - 1, filled * num_shards // total)][name] = tensor
        filled += tensor.numel() * tensor.element_size()
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{num_shards:05d}.safetensors"
        save_file(shard, str(out / file_name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file_name))
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids: the specials, the 256 byte
    symbols, merges learned from `CORPUS`, and reserved specials if the corpus runs out of
    merges (so every id the model can emit decodes)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} ids, expected {vocab_size}")
    return tokenizer


def _write_tokenizer(out: Path, vocab_size: int, max_length: int) -> None:
    train_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def count_parameters(model_dir: str | Path) -> int:
    """Total elements of every tensor in a directory's safetensors files (headers only)."""
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            names = handle.keys()
            for name in names:
                total += math.prod(handle.get_slice(name).get_shape())
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m compute_node.model.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharded", action="store_true")
    args = parser.parse_args(argv)
    path = build_tiny_model(
        args.out_dir, args.arch, num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
        intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
        tie_word_embeddings=args.tie_word_embeddings, dtype=args.dtype, seed=args.seed, sharded=args.sharded,
    )
    num_params = count_parameters(path)
    print(f"wrote {args.arch} model ({num_params / 1e6:.1f}M parameters) to {path}")


if __name__ == "__main__":
    main()
