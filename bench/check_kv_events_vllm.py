"""Decode the block manager's vLLM-format KV events with vLLM's own classes (issue 44).

A real block manager (in this process, over a SQLite file) publishes on ZMQ; a node
registers, sequences allocate (one salted), finish, and a larger one evicts the cached blocks
to the host tier. A SUB socket here records every message; then vLLM's venv decodes each
payload with `msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)` — vLLM's own
schema, not one written here — and prints what it read. Run for both event formats: "map"
must decode, "array" (vLLM's earlier form) must be refused by a vLLM that publishes maps.

    .venv/bin/python bench/check_kv_events_vllm.py --vllm-python V/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DECODE = r"""
import json, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
dec = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for line in open(sys.argv[1]):
    topic, seq, payload = json.loads(line)
    try:
        batch = dec.decode(bytes.fromhex(payload))
    except msgspec.ValidationError as exc:
        out.append({"seq": seq, "error": str(exc)})
        continue
    out.append({"seq": seq, "topic": topic, "events": [
        [type(e).__name__, getattr(e, "medium", None), len(getattr(e, "block_hashes", []) or []),
         len(getattr(e, "token_ids", []) or []), getattr(e, "block_size", None),
         bool(getattr(e, "extra_keys", None))] for e in batch.events]})
print(json.dumps(out))
"""


async def record(event_format: str, db: Path) -> list[tuple[str, int, str]]:
    from block_manager.service.server import BlockManagerServer
    from tests.block_manager.service.kv_events_helpers import step
    from tests.block_manager.service.test_kv_events import register, start, stop

    h = await start(db, kv_events={"zmq_endpoint": "tcp://127.0.0.1:0", "zmq_event_format": event_format})
    server: BlockManagerServer = h.server
    pub = server.kv_events_zmq
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)   # type: ignore[union-attr, arg-type]
    await asyncio.sleep(0.3)    # the subscription reaches the PUB socket
    try:
        await register(h, "n1", num_blocks=4, host=4, disk=0, seeded=[])
        await step(h, allocs=[("a", "n1", [11, 12, 13, 14, 15, 16, 17, 18, 19], 0, "tenant-a", 0)])
        await step(h, frees=["a"])
        await step(h, allocs=[("b", "n1", list(range(100, 114)), 0, None, 0)])   # evicts a's blocks to the host
        await asyncio.sleep(0.3)
        got = []
        while sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            got.append((topic.decode(), int.from_bytes(seq, "big"), payload.hex()))
        return got
    finally:
        sub.close(0)
        ctx.term()
        await stop(h)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True)
    args = p.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("map", "array"):
            messages = asyncio.run(record(fmt, Path(tmp) / f"{fmt}.db"))
            path = Path(tmp) / f"{fmt}.jsonl"
            path.write_text("".join(json.dumps(m) + "\n" for m in messages))
            res = subprocess.run([args.vllm_python, "-c", DECODE, str(path)], capture_output=True, text=True)
            if res.returncode != 0:
                print(res.stderr[-3000:])
                return 1
            decoded = json.loads(res.stdout.strip().splitlines()[-1])
            errors = [d for d in decoded if "error" in d]
            print(f"format {fmt}: {len(messages)} batches, {len(decoded) - len(errors)} decoded by vLLM's "
                  f"KVEventBatch, {len(errors)} refused")
            for d in decoded[:8]:
                print("   ", json.dumps(d)[:200])
            ok &= (not errors and len(messages) > 0) if fmt == "map" else len(errors) == len(messages)
    print("as expected" if ok else "NOT as expected")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
