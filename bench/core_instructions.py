"""Deterministic cost of the core's append step: a driver to run under valgrind.

Timing on a shared machine is noisy; instruction counts are not. Run this twice under
callgrind, with N and with 0 timed steps, and divide the difference by N:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python \\
        bench/core_instructions.py TREE N [columns|slots|service] [--aligned] [--no-gc]

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

`service`: the whole Step handler instead of the core alone, in-process and without the
transport: the first N of 400 iterations send `BlockManagerServicer.Step` the request
bench/bench_scale.py `--only step` sends (256 sequences, one token each with its id, the
previous step reported; the same staggered lengths), on a memory:// runtime with KV events
on, and serialize its response; the others send nothing. So the difference counts the
decode, the checks, the core, the answer, the KV events and the response of N Steps: the
server's CPU per Step less gRPC's own per-call work (the same for a same-size echo).
"""

from __future__ import annotations

import sys
from array import array
from typing import Any


def main() -> None:
    tree, steps = sys.argv[1], int(sys.argv[2])
    api = sys.argv[3] if len(sys.argv) > 3 and not sys.argv[3].startswith("--") else "columns"
    aligned = "--aligned" in sys.argv
    no_gc = "--no-gc" in sys.argv
    sys.path.insert(0, tree)
    if api == "service":
        import asyncio

        asyncio.run(_service_steps(steps, 400, aligned, no_gc))
        return
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


async def _service_steps(steps: int, total: int, aligned: bool, no_gc: bool) -> None:
    """`service` (see the module docstring): Steps through the servicer on a fresh runtime."""
    from block_manager.service.config import load_config
    from block_manager.service.defrag_runner import DefragRunner
    from block_manager.service.runtime import ServiceRuntime
    from block_manager.service.servicer import BlockManagerServicer
    from block_manager.store.memory import MemoryStore
    from pagedkv.v1 import block_manager_pb2 as pb

    n, bs = 256, 16
    cfg = load_config(listen_address="127.0.0.1:0", database_url="memory://", block_size=bs, watermark=0.0,
                      defrag={"enabled": False}, kv_events={"enabled": True}, lease_ttl_s=3600.0)
    runtime = ServiceRuntime(cfg, MemoryStore(), journal=False)
    await runtime.start()
    sv = BlockManagerServicer(runtime, DefragRunner(runtime, cfg.defrag))
    ctx: Any = None   # the servicer reads nothing of the transport's context on these calls
    reg = await sv.RegisterNode(pb.RegisterNodeRequest(
        request_id="register", node_id="p", address="127.0.0.1:1", block_size=bs,
        num_blocks=n * ((100 + bs + total) // bs + 2)), ctx)
    ids = [f"s{i}" for i in range(n)]
    setup = pb.StepRequest(request_id="admit", scheduler_id="bench", pool_ids=["p"])
    for i, sid in enumerate(ids):
        k = 97 + (0 if aligned else i % bs)
        setup.alloc_seq_ids.append(sid)
        setup.alloc_pool_index.append(0)
        setup.alloc_salt_index.append(-1)
        setup.alloc_num_token_ids.append(k)
        setup.alloc_num_tokens.append(0)
        setup.alloc_num_compute.append(0)
        setup.alloc_token_ids.extend([i] * k)
    last = (await sv.Step(setup, ctx)).steps[0].step_id
    if no_gc:
        import gc

        gc.disable()
    for s in range(total):
        if s >= steps:
            continue
        req = pb.StepRequest(request_id=f"step-{s}", scheduler_id="bench")
        req.reports.add(pool_id="p", epoch=reg.epoch, completed_up_to=last)
        req.append_seq_ids.extend(ids)
        req.append_num_tokens.extend([1] * n)
        req.append_token_ids.extend([7 + s] * n)
        resp = await sv.Step(req, ctx)
        if resp.errors:
            raise RuntimeError(f"step {s} failed: {resp.errors[0]}")
        last = resp.steps[0].step_id if resp.steps else last
        resp.SerializeToString()


if __name__ == "__main__":
    main()
