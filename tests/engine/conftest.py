"""Tiny random-weight models (built once per session) and their transformers twins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.compute_node.model.model_helpers import load_hf, tiny_model_dir

# small enough for a 2-core CI, shaped like the real thing (GQA, RoPE, SwiGLU)
SPECS: dict[str, dict[str, Any]] = {
    "llama-gqa4-hd64": dict(arch="llama", num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2,
                            head_dim=64, intermediate_size=512, vocab_size=512),
    "qwen2-gqa1-hd64-tied": dict(arch="qwen2", num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=2,
                                 head_dim=64, intermediate_size=256, vocab_size=512, tie_word_embeddings=True),
    "qwen3-gqa8-hd128": dict(arch="qwen3", num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=1,
                             head_dim=128, intermediate_size=512, vocab_size=512),
}


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-models")


@pytest.fixture(scope="session")
def model_dirs(model_root: Path) -> dict[str, Path]:
    return {name: tiny_model_dir(model_root, **{**spec, "seed": 11}) for name, spec in SPECS.items()}


@pytest.fixture(scope="session")
def hf_models(model_dirs: dict[str, Path]) -> dict[str, Any]:
    return {name: load_hf(path) for name, path in model_dirs.items()}
