"""Loading a model directory: config parsing (both transformers generations of RoPE keys, the
three families' switches), and the typed errors for missing, broken or unsupported input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from compute_node.model import (
    SUPPORTED_ARCHITECTURES,
    InvalidModelConfig,
    ModelConfig,
    ModelNotFound,
    ModelRunner,
    SeqWork,
    UnsupportedModel,
    WeightsError,
)
from compute_node.model.config import RopeConfig, resolve_dtype
from tests.compute_node.model.model_helpers import tiny_model_dir

SPEC = {"num_layers": 1, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32,
        "intermediate_size": 96, "vocab_size": 280}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("loading")


@pytest.fixture
def model_copy(root: Path, tmp_path: Path) -> Path:
    """A private copy of a tiny Llama directory that the test may damage."""
    return Path(shutil.copytree(tiny_model_dir(root, "llama", seed=1, **SPEC), tmp_path / "model"))


def _edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _load(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, block_size=4, num_blocks=4, device="cpu")


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="does not exist"):
        _load(tmp_path / "nope")
    with pytest.raises(ModelNotFound, match="config.json"):
        _load(tmp_path)


def test_unknown_architecture_names_it_and_lists_the_supported(model_copy: Path) -> None:
    _edit_config(model_copy, architectures=["MistralForCausalLM"])
    with pytest.raises(UnsupportedModel) as info:
        _load(model_copy)
    assert "MistralForCausalLM" in str(info.value)
    assert all(name in str(info.value) for name in SUPPORTED_ARCHITECTURES)
    _edit_config(model_copy, architectures=None)
    with pytest.raises(UnsupportedModel, match="no architecture"):
        _load(model_copy)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedModel, "yarn"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, UnsupportedModel, "linear"),
        ({"partial_rotary_factor": 0.5}, UnsupportedModel, "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, UnsupportedModel, "gelu"),
        ({"use_sliding_window": True}, UnsupportedModel, "sliding"),
        ({"torch_dtype": "float64"}, UnsupportedModel, "float64"),
        ({"num_key_value_heads": 3, "num_attention_heads": 4}, InvalidModelConfig, "multiple"),
        ({"hidden_size": 0}, InvalidModelConfig, "hidden_size"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, InvalidModelConfig, "llama3"),
    ],
)
def test_unsupported_or_invalid_config(model_copy: Path, changes: dict, error: type, match: str) -> None:
    _edit_config(model_copy, **changes)
    with pytest.raises(error, match=match):
        _load(model_copy)


def test_malformed_json(model_copy: Path) -> None:
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(InvalidModelConfig):
        _load(model_copy)


def test_weight_errors(model_copy: Path) -> None:
    weights = model_copy / "model.safetensors"
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.0.mlp.up_proj.weight"}, weights)
    with pytest.raises(WeightsError, match="up_proj"):
        _load(model_copy)
    save_file({**tensors, "model.norm.weight": torch.ones(65)}, weights)
    with pytest.raises(WeightsError, match="model.norm.weight"):
        _load(model_copy)
    weights.write_bytes(b"\x00garbage")
    with pytest.raises(WeightsError):
        _load(model_copy)
    weights.unlink()
    with pytest.raises(WeightsError, match="safetensors"):
        _load(model_copy)


def test_sharded_checkpoint_loads_like_the_single_file(root: Path, tmp_path: Path) -> None:
    single = tiny_model_dir(root, "qwen2", seed=4, **SPEC)
    sharded = tiny_model_dir(root, "qwen2", seed=4, sharded=True, num_shards=3, **SPEC)
    assert len(list(sharded.glob("model-*.safetensors"))) == 3 and (sharded / "model.safetensors.index.json").exists()
    batch = [SeqWork("a", [5, 9, 17, 33, 65], 0, [0, 1])]
    a, b = _load(single).debug_forward(batch), _load(sharded).debug_forward(batch)
    assert torch.equal(a.logits, b.logits)
    broken = Path(shutil.copytree(sharded, tmp_path / "broken"))
    next(broken.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(WeightsError, match="00002"):
        _load(broken)


def test_family_switches(root: Path) -> None:
    qwen2 = ModelConfig.from_dir(tiny_model_dir(root, "qwen2", seed=4, **SPEC))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = ModelConfig.from_dir(tiny_model_dir(root, "qwen3", seed=4, **SPEC))
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm) == (False, False, True)
    raw = json.loads((tiny_model_dir(root, "qwen3", seed=4, **SPEC) / "config.json").read_text())
    del raw["head_dim"]
    assert ModelConfig.from_dict(raw).head_dim == 128   # transformers' Qwen3 default
    raw["architectures"] = ["LlamaForCausalLM"]
    assert ModelConfig.from_dict(raw).head_dim == SPEC["hidden_size"] // SPEC["num_heads"]
    llama = ModelConfig.from_dict({**raw, "attention_bias": True})
    assert (llama.qkv_bias, llama.o_bias, llama.qk_norm) == (True, True, False)


def test_rope_keys_of_both_transformers_generations(root: Path) -> None:
    raw = json.loads((tiny_model_dir(root, "llama", seed=1, **SPEC) / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    v4 = ModelConfig.from_dict({**raw, "rope_theta": 5e5, "rope_scaling": scaling})
    v5_raw = {k: v for k, v in raw.items() if k != "rope_theta"}
    v5 = ModelConfig.from_dict({**v5_raw, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    assert v4.rope == v5.rope == RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 64)
    plain = ModelConfig.from_dict({**v5_raw, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope == RopeConfig(1e6)
    assert ModelConfig.from_dict(v5_raw).rope == RopeConfig(10000.0)


def test_llama3_inverse_frequencies_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf_config = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, rope_theta=5e5,
                            rope_scaling=scaling, max_position_embeddings=131072)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    ours = RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 8192).inv_freq(128)
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, RopeConfig(5e5).inv_freq(128))


def test_dtype_and_token_ids(root: Path) -> None:
    raw = json.loads((tiny_model_dir(root, "llama", seed=1, **SPEC) / "config.json").read_text())
    assert ModelConfig.from_dict({**raw, "torch_dtype": None, "dtype": "bfloat16"}).dtype == "bfloat16"
    assert ModelConfig.from_dict({**raw, "torch_dtype": None}).dtype == "float32"
    assert resolve_dtype("bf16", "float32") == "bfloat16" and resolve_dtype(torch.float16, "float32") == "float16"
    assert resolve_dtype(None, "float32") == "float32"
    with pytest.raises(InvalidModelConfig):
        resolve_dtype("int8", "float32")
    config = ModelConfig.from_dict({**raw, "eos_token_id": [7, 1]}, {"eos_token_id": 1, "temperature": 0.6})
    assert config.eos_token_ids == (1, 7) and config.generation_defaults == {"temperature": 0.6}
    with pytest.raises(InvalidModelConfig):
        ModelConfig.from_dict({**raw, "eos_token_id": "x"})
