"""Deterministic cost of the core's append step: a driver to run under valgrind.

Timing on a shared machine is noisy; instruction counts are not. Run this twice under
callgrind, with N and with 0 timed steps, and divide the difference by N:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python \\
        bench/core_instructions.py TREE N [columns|slots] [--aligned] [--no-gc]

Make the two runs identical but for N, or the difference is noise of several million
instructions: a fixed hash seed, no address randomisation, trees compiled beforehand (a run
that writes a .pyc counts the compile), and N large enough (200) that the garbage collector's
full collections, which land in different steps of the two runs, average out (`--no-gc`
switches it off after the setup: the steps' own work alone):

    PYTHONHASHSEED=0 setarch -R valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        .venv/bin/python bench/core_instructions.py TREE 200      # and with 0; divide by 200

TREE is a source tree whose `block_manager` is imported (`.` for this one; another
revision extracted with `git archive REV block_manager pagedkv | tar -x -C DIR`). Each of the
400 iterations closes and settles the pool's step; the first N also append one token (with its
id) to each of 256 sequences, block size 16, lengths staggered so 1/16 cross a block and 1/16
fill one per step (`--aligned`: all in step; N <= 14 then only appends inside blocks). So the
difference counts N appends plus the close/settle work they cause.
"""

from __future__ import annotations

import sys
from array import array


def main() -> None:
    tree, steps = sys.argv[1], int(sys.argv[2])
    api = sys.argv[3] if len(sys.argv) > 3 and not sys.argv[3].startswith("--") else "columns"
    aligned = "--aligned" in sys.argv
    no_gc = "--no-gc" in sys.argv
    sys.path.insert(0, tree)
    from block_manager.core import AppendRequest, BlockManager

    n, bs, total = 256, 16, 400
    m = BlockManager(watermark=0.0)
    m.add_pool("p", n * ((100 + bs + total) // bs + 2), bs)
    for i in range(n):
        m.allocate(f"s{i}", "p", [i] * (97 + (0 if aligned else i % bs)))
    ids = [f"s{i}" for i in range(n)]
    ones = [1] * n
    if no_gc:
        import gc

        gc.disable()
    for s in range(total):
        out = m.close_step("p")
        if out is not None:
            m.settle_steps("p", out.step_id)
        if s < steps:
            if api == "columns":
                m.append_tokens(ids, ones, array("q", [s]) * n)
            else:
                m.append_slots([AppendRequest(sid, 1, (s,)) for sid in ids])


if __name__ == "__main__":
    main()
