"""Reading a checkpoint's tensors from safetensors files, single or sharded, memory-mapped.

`Checkpoint` indexes which file holds which tensor (from `model.safetensors.index.json` when
the checkpoint is sharded, else from the files' own headers) and reads a tensor only when asked:
`safe_open` maps the file, so a tensor's bytes are paged in when it is converted to the run
dtype and device, and a sharded checkpoint never needs more host memory than the tensors in
flight.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Self

import torch
from safetensors import SafetensorError, safe_open

from compute_node.model.errors import WeightsError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class Checkpoint:
    """The tensors of one model directory, by name, opened lazily file by file."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.file_of = _locate_tensors(self.model_dir)   # tensor name → file path
        self._handles: dict[Path, Any] = {}

    @property
    def names(self) -> set[str]:
        return set(self.file_of)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored (CPU, the file's dtype)."""
        path = self.file_of.get(name)
        if path is None:
            raise WeightsError(f"checkpoint {str(self.model_dir)!r} has no tensor {name!r}")
        try:
            return self._handle(path).get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise WeightsError(f"cannot read tensor {name!r} from {path.name}: {exc}") from None

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handle(self, path: Path) -> Any:
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = _open(path)
        return handle


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise WeightsError(f"cannot open {str(path)!r} as safetensors: {exc}") from None


def _locate_tensors(model_dir: Path) -> dict[str, Path]:
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        return _from_index(model_dir, index_path)
    if (model_dir / SINGLE_FILE).is_file():
        files = [model_dir / SINGLE_FILE]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{str(model_dir)!r} has no *.safetensors weights (nor {INDEX_FILE})")
    file_of: dict[str, Path] = {}
    for path in files:
        names = _open(path).keys()
        for name in names:
            if name in file_of:
                raise WeightsError(f"tensor {name!r} is stored in both {file_of[name].name} and {path.name}")
            file_of[name] = path
    return file_of


def _from_index(model_dir: Path, index_path: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsError(f"cannot read the weight_map of {str(index_path)!r}: {exc}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"{str(index_path)!r} has an empty or malformed weight_map")
    shards = {str(name): model_dir / str(name) for name in set(weight_map.values())}
    missing = sorted(name for name, path in shards.items() if not path.is_file())
    if missing:
        raise WeightsError(f"{INDEX_FILE} names shards that are missing: {', '.join(missing)}")
    return {str(tensor): shards[str(name)] for tensor, name in weight_map.items()}
