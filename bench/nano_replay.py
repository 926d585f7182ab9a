"""Replay a pagedkv trace through nano-vllm's `BlockManager`: the other side of
`bench_replay_vs_nano.py`, run as its own process (stdlib, numpy and xxhash, which nano-vllm's
block manager imports; nothing of pagedkv's).

    .venv/bin/python bench/nano_replay.py NANO_VLLM_DIR TRACE --num-blocks 20000 --block-size 16

NANO_VLLM_DIR is a checkout of https://github.com/GeeeekExplorer/nano-vllm. Only its
`nanovllm/engine/{block_manager,sequence}.py` and `nanovllm/sampling_params.py` are loaded (the
package's `__init__` would import torch and its model code). Each trace op is driven the way
nano-vllm's own scheduler drives its block manager:

- `allocate`: a `Sequence` of the prompt; `can_allocate` (its prefix-cache lookup), `allocate`,
  then the prefill's `hash_blocks` (the scheduler's `postprocess`), all tokens computed;
- `append`: per token, `append_token`, `can_append` / `may_append` (a new block when the token
  opens one), then `hash_blocks` for that one computed token;
- `free`: `deallocate`.

nano-vllm has no fork (parallel samples are separate requests): a trace with `fork` ops is
refused. Out of blocks, a sequence is rejected (allocate) or preempted (append) and later ops
naming it are skipped, as pagedkv's `block-manager replay` does. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import types
from pathlib import Path
from typing import Any


def load_nano(root: Path) -> tuple[Any, Any]:
    """nano-vllm's `BlockManager` and `Sequence`, without running the package's `__init__`."""
    pkg = root / "nanovllm"
    if not (pkg / "engine" / "block_manager.py").exists():
        raise SystemExit(f"{root} is not a nano-vllm checkout (no nanovllm/engine/block_manager.py)")
    for name, path in (("nanovllm", pkg), ("nanovllm.engine", pkg / "engine")):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
    block_manager = importlib.import_module("nanovllm.engine.block_manager")
    sequence = importlib.import_module("nanovllm.engine.sequence")
    return block_manager.BlockManager, sequence.Sequence


def replay(lines: list[str], bm: Any, seq_cls: Any) -> dict[str, int]:
    """Drive `bm` (nano-vllm's BlockManager) through the trace `lines`; what happened, counted."""
    live: dict[str, Any] = {}
    dead: set[str] = set()
    counts = {"ops": 0, "rejected": 0, "preempted": 0, "skipped": 0, "prefix_hit_tokens": 0,
              "prompt_tokens": 0, "appended_tokens": 0}
    for line in lines:
        if not line.strip():
            continue
        op = json.loads(line)
        counts["ops"] += 1
        kind = op["op"]
        if kind == "allocate":
            seq = seq_cls(op["tokens"])
            num_cached = bm.can_allocate(seq)
            if num_cached == -1:
                counts["rejected"] += 1
                dead.add(op["seq"])
                continue
            bm.allocate(seq, num_cached)
            seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
            counts["prefix_hit_tokens"] += seq.num_cached_tokens
            counts["prompt_tokens"] += seq.num_tokens
            bm.hash_blocks(seq)
            seq.num_cached_tokens = seq.num_tokens
            live[op["seq"]] = seq
        elif kind == "append":
            for name, tokens in op["seqs"].items():
                seq = live.get(name)
                if seq is None:
                    counts["skipped"] += 1
                    continue
                for token in tokens:
                    seq.append_token(token)
                    if not bm.can_append(seq):
                        bm.deallocate(seq)
                        del live[name]
                        dead.add(name)
                        counts["preempted"] += 1
                        break
                    bm.may_append(seq)
                    seq.num_scheduled_tokens = 1
                    bm.hash_blocks(seq)
                    seq.num_cached_tokens += 1
                    counts["appended_tokens"] += 1
        elif kind == "free":
            for name in op["seqs"]:
                seq = live.pop(name, None)
                if seq is None:
                    counts["skipped"] += name in dead
                    dead.discard(name)
                    continue
                bm.deallocate(seq)
        else:
            raise SystemExit(f"nano-vllm's block manager has no {kind!r}: replay a trace without it")
    return counts


def main() -> int:
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("nano_vllm", type=Path)
    p.add_argument("trace", type=Path)
    p.add_argument("--num-blocks", type=int, required=True)
    p.add_argument("--block-size", type=int, required=True)
    args = p.parse_args()
    manager_cls, seq_cls = load_nano(args.nano_vllm)
    seq_cls.block_size = args.block_size
    lines = args.trace.read_text().splitlines()
    manager = manager_cls(args.num_blocks, args.block_size)
    t = time.perf_counter()
    counts = replay(lines, manager, seq_cls)
    replay_s = time.perf_counter() - t
    print(json.dumps({**counts, "replay_s": replay_s, "wall_s": time.perf_counter() - started}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
