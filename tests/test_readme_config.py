"""The configuration tables name every setting of both services, with its environment variable
(issue 10: `PAGEDKV_DEFRAG__ENABLED` and other defrag settings were missing): docs/configuration.md (the
README stays short: issue 24), or the docs/ page of a feature (issue 21's thread budget: docs/compute_node.md)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from block_manager.service.config import BlockManagerConfig
from compute_node.service.config import ComputeNodeConfig

ROOT = Path(__file__).resolve().parents[1]
README = "\n".join([(ROOT / "README.md").read_text(), *(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))])


def _env_names(model: type[BaseModel], prefix: str) -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names += _env_names(annotation, f"{prefix}{name.upper()}__")
        else:
            names.append(f"{prefix}{name.upper()}")
    return names


def test_every_block_manager_setting_is_documented() -> None:
    missing = [n for n in _env_names(BlockManagerConfig, "PAGEDKV_") if f"`{n}`" not in README]
    assert not missing, f"the README or docs/ lacks {missing}"


def test_every_compute_node_setting_is_documented() -> None:
    documented = README.replace("`…__", "`PAGEDKV_CN_GEOMETRY__")   # the geometry row abbreviates
    missing = [n for n in _env_names(ComputeNodeConfig, "PAGEDKV_CN_") if f"`{n}`" not in documented]
    assert not missing, f"README's compute node table lacks {missing}"
