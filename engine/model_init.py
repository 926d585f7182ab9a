"""Make sure the model directory the stack serves exists (compose's one-shot `model-init`):

    python -m engine.model_init /models/tiny-llama

A directory with a `config.json` is left alone (a real Hugging Face model you mounted, or the
demo model built by an earlier run). A missing one named `tiny-<arch>` (`tiny-llama`,
`tiny-qwen2`, `tiny-qwen3`) is built: a small random-weight model with a real tokenizer and chat
template (`compute_node.model.tiny`), so `docker compose up` serves something without a download.
It talks nonsense; point `PAGEDKV_MODEL_DIR` / `PAGEDKV_MODEL` at a real model for words.
Any other missing name is an error (exit 2): nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from pagedkv.cli import EXIT_RUNTIME, EXIT_USAGE, ArgumentParser, fail, summary

# The demo model: ~4M parameters in float16, fast on a CPU; its KV pool has the compose file's
# model-less geometry (2 layers x 2 KV heads x 64, float16), so the synthetic workloads that drive
# the nodes' Forward (the services demo, the integration tests) cost what they did without it.
DEMO_SPEC: dict[str, Any] = dict(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                                 intermediate_size=768, vocab_size=4096, dtype="float16", seed=0)
TINY_ARCHS = ("llama", "qwen2", "qwen3")


class ModelInitError(Exception):
    pass


def ensure_model(path: str | Path, spec: dict[str, Any] | None = None) -> str:
    """'present' or 'built'; `ModelInitError` when the model is missing and cannot be built."""
    path = Path(path)
    if (path / "config.json").is_file():
        return "present"
    arch = path.name.removeprefix("tiny-")
    if not path.name.startswith("tiny-") or arch not in TINY_ARCHS:
        raise ModelInitError(
            f"no model at {path} (no config.json). Put a Hugging Face model directory there "
            f"(compose: PAGEDKV_MODEL_DIR=<host directory holding it>, PAGEDKV_MODEL=<its name>), "
            f"or name it tiny-llama / tiny-qwen2 / tiny-qwen3 to build a random-weight demo model"
        )
    if path.exists() and any(path.iterdir()):
        raise ModelInitError(f"{path} exists but holds no config.json: not a model directory, not building over it")
    from compute_node.model.tiny import build_tiny_model

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        build_tiny_model(tmp, arch, **(spec or DEMO_SPEC))
        tmp.chmod(0o755)             # mkdtemp's 0700 would hide it from a node running as another user
        for f in tmp.iterdir():      # and the weights' 0600 (written through a private temp file)
            f.chmod(0o644)
        os.replace(tmp, path)        # whole or not at all: a crash mid-build leaves no half model
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return "built"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m engine.model_init", description=summary(__doc__))
    parser.add_argument("model_dir", help="the model directory the stack serves")
    args = parser.parse_args(argv)
    try:
        outcome = ensure_model(args.model_dir)
    except ModelInitError as exc:
        return fail(parser.prog, EXIT_USAGE, str(exc))
    except OSError as exc:       # a parent that cannot be created, a file where the directory goes
        where = exc.filename or args.model_dir
        return fail(parser.prog, EXIT_RUNTIME, f"cannot build {args.model_dir}: {where}: {exc.strerror or exc}")
    print(f"model-init: {args.model_dir}: {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
