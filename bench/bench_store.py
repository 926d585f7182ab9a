"""Store benchmark: journal commit latency and snapshot cost per backend.

Journal: `append` of one record per transaction, sized like the record the service writes for
an AppendSlots RPC of 1 / 64 / 256 sequences, plus a group commit of 16 one-sequence records
in one transaction. Reports records/s and p50/p99 commit latency on memory://, SQLite
(synchronous FULL and NORMAL, WAL) and a throwaway PostgreSQL cluster (fsync=on).
Snapshot: write and recover the core's state with 100k blocks in use (with and without
prefix-cache token ids).

`--step`: instead, the CPU a durable Step spends on its representations around the state
machine (digest, journal payload, decode, answer, journal result, response), the JSON forms
journaled before `step-request/1` against the packed ones, for a decode Step of `--seqs`
sequences (one token each with its id, the previous step reported, 1/16 crossing a block);
interleaved per step, in one process, with the bytes each journals.

    .venv/bin/python bench/bench_store.py [--appends 300] [--no-postgres] [--json]
    .venv/bin/python bench/bench_store.py --step [--seqs 256] [--iters 400]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from block_manager.store import NewRecord, StoreOptions, canonical_json, open_store, payload_digest  # noqa: E402
from pagedkv.stats import percentile

BLOCK_SIZE = 16


def append_slots_record(request_id: str, num_seqs: int, step: int, columnar: bool = True) -> NewRecord:
    """A record shaped like the service's AppendSlots journal entry: decode steps, one new
    token per sequence, a new block every BLOCK_SIZE steps.

    `columnar` (parallel lists) is the recommended journal shape: for 256 sequences it is
    ~7x smaller and ~10x cheaper to encode than a list of per-sequence objects (`rows`).
    """
    seq_ids = [f"seq-{i:06d}" for i in range(num_seqs)]
    new_block = step % BLOCK_SIZE == 0
    blocks = [i * 64 + step // BLOCK_SIZE for i in range(num_seqs)]
    slots = [b * BLOCK_SIZE + step % BLOCK_SIZE for b in blocks]
    if columnar:
        payload: dict = {"node": "node-0", "epoch": 1, "seq_ids": seq_ids, "num_new_tokens": [1] * num_seqs}
        result: dict = {
            "slot_mapping": slots,
            "new_block_ids": blocks if new_block else [],
            "copy_ops": [],
            "versions": [step] * num_seqs,
            "num_tokens": [128 + step] * num_seqs,
        }
    else:
        payload = {
            "node": "node-0",
            "epoch": 1,
            "requests": [{"seq_id": s, "num_new_tokens": 1} for s in seq_ids],
        }
        result = {
            "results": [
                {
                    "seq_id": s,
                    "slot_mapping": [slot],
                    "new_block_ids": [block] if new_block else [],
                    "copy_ops": [],
                    "version": step,
                    "num_tokens": 128 + step,
                }
                for s, slot, block in zip(seq_ids, slots, blocks, strict=True)
            ]
        }
    return NewRecord(request_id, "append_slots", payload, result, payload_digest(payload))


def snapshot_state(with_token_ids: bool, num_seqs: int = 3125, blocks_per_seq: int = 32) -> dict:
    """The real core's `to_snapshot()` with 100k blocks in use (3125 sequences x 32 blocks
    in a 131072-block pool). With token ids, every full block is hashed and keeps its tokens
    (prefix-cache hits are confirmed against them), which dominates the snapshot size."""
    from block_manager.core.manager import BlockManager

    rng = random.Random(0)
    manager = BlockManager()
    manager.add_pool("node-0", 131_072, BLOCK_SIZE)
    num_tokens = blocks_per_seq * BLOCK_SIZE - 3
    for s in range(num_seqs):
        seq_id = f"seq-{s:06d}"
        if with_token_ids:
            manager.allocate(seq_id, "node-0", [rng.randrange(32_000) for _ in range(num_tokens)])
        else:
            manager.allocate(seq_id, "node-0", num_tokens=num_tokens)
    return {"core": manager.to_snapshot()}


@contextmanager
def backends(with_postgres: bool) -> Iterator[list[tuple[str, Callable[[], str], StoreOptions]]]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-store-"))
    counter = iter(range(1_000_000))
    cluster = None
    rows: list[tuple[str, Callable[[], str], StoreOptions]] = [
        ("memory", lambda: "memory://", StoreOptions()),
        ("sqlite FULL", lambda: f"sqlite:///{tmp / f'f{next(counter)}.db'}", StoreOptions()),
        (
            "sqlite NORMAL",
            lambda: f"sqlite:///{tmp / f'n{next(counter)}.db'}",
            StoreOptions(sqlite_synchronous="NORMAL"),
        ),
    ]
    if with_postgres:
        from tests.fixtures.postgres import PostgresCluster, PostgresUnavailable

        try:
            cluster = PostgresCluster()
            cluster.start()
            rows.append(("postgresql", cluster.create_database, StoreOptions()))
        except PostgresUnavailable as exc:
            print(f"# skipping PostgreSQL: {exc}", file=sys.stderr)
            cluster = None
    try:
        yield rows
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def bench_appends(
    url: str, options: StoreOptions, num_seqs: int, per_txn: int, columnar: bool, n: int
) -> dict:
    store = open_store(url, options)
    try:
        batches = [
            [append_slots_record(f"r{k}-{j}", num_seqs, k, columnar) for j in range(per_txn)] for k in range(n)
        ]
        for batch in batches[: max(1, n // 20)]:  # warm-up (page cache, WAL file growth)
            store.append([NewRecord("w" + r.request_id, r.op, r.payload, r.result, r.payload_digest) for r in batch])
        latencies = []
        t0 = time.perf_counter()
        for batch in batches:
            t = time.perf_counter()
            store.append(batch)
            latencies.append(time.perf_counter() - t)
        total = time.perf_counter() - t0
    finally:
        store.close()
    latencies.sort()
    record = batches[0][0]
    return {
        "record_bytes": len(canonical_json(record.payload)) + len(canonical_json(record.result)),
        "records_per_s": n * per_txn / total,
        "commits_per_s": n / total,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
    }


def bench_snapshot(url: str, options: StoreOptions, state: dict) -> dict:
    """Time `write_snapshot` (encode + compress + commit) and a cold open + `recover`."""
    store = open_store(url, options)
    try:
        store.append([append_slots_record("s0", 1, 0)])
        t = time.perf_counter()
        store.write_snapshot(1, state)
        write_s = time.perf_counter() - t
    finally:
        store.close()
    t = time.perf_counter()
    store = open_store(url, options)
    try:
        recovered = store.recover()
        recover_s = time.perf_counter() - t
        if recovered.snapshot != state:
            raise RuntimeError("snapshot did not round-trip")
    finally:
        store.close()
    return {"write_s": write_s, "recover_s": recover_s}


def step_journal_cost(num_seqs: int, iters: int) -> None:
    """Per Step, µs of the representations around the state machine, JSON forms vs packed."""
    import hashlib

    from block_manager.service.state import ServiceState, StateConfig
    from block_manager.service.step_answer import StepAnswer
    from block_manager.service.step_codec import ReceivedStep, StepInput
    from block_manager.store.records import encode_body
    from pagedkv.v1 import block_manager_pb2 as pb

    state = ServiceState(StateConfig(default_block_size=BLOCK_SIZE, max_blocks=1 << 20))
    state.apply("register_node", {"node_id": "p", "num_blocks": num_seqs * (iters // BLOCK_SIZE + 4),
                                  "block_size": BLOCK_SIZE, "geometry": {}, "address": "h:1"}, 1.0)
    seq_ids = [f"seq-{i:06d}" for i in range(num_seqs)]
    alloc = pb.StepRequest(request_id="a", scheduler_id="bench", alloc_seq_ids=seq_ids, pool_ids=["p"],
                           alloc_pool_index=[0] * num_seqs, alloc_salt_index=[-1] * num_seqs,
                           alloc_num_token_ids=[BLOCK_SIZE + i % BLOCK_SIZE for i in range(num_seqs)],
                           alloc_num_tokens=[0] * num_seqs, alloc_num_compute=[0] * num_seqs)
    alloc.alloc_token_ids.extend(i % 97 for i in range(num_seqs) for _ in range(BLOCK_SIZE + i % BLOCK_SIZE))
    answer, _ = state.step_answer(StepInput.from_pb(alloc, 4096), 1.0)
    last = answer.steps[0]["step_id"]
    times: dict[str, list[float]] = {"json": [], "packed": []}
    sizes: dict[str, int] = {}
    for k in range(iters):
        req = pb.StepRequest(request_id=f"s{k}", scheduler_id="bench", append_seq_ids=seq_ids,
                             append_num_tokens=[1] * num_seqs, append_token_ids=[7 + k % 1000] * num_seqs)
        req.reports.add(pool_id="p", epoch=1, completed_up_to=last)
        answer, _ = state.step_answer(StepInput.from_pb(req, 4096), 1.0)   # the state machine: not timed
        last = answer.steps[0]["step_id"] if answer.steps else last

        def json_forms() -> int:   # before step-request/1 (d9bd5ee's durable path)
            received = ReceivedStep(req)
            hashlib.sha256(b"Step\0" + received.body()).hexdigest()
            payload = canonical_json(received.payload())
            StepInput.from_json(json.loads(payload), 4096)   # it applied the journal form
            result = canonical_json(answer.to_json())
            StepAnswer.from_json(json.loads(result)).fill(pb.StepResponse())
            return len(payload) + len(result)

        def packed_forms() -> int:
            received = ReceivedStep(req, new_response=pb.StepResponse)
            received.digest()
            payload = encode_body(received.journal_form())
            received.decode(4096)
            result = encode_body(received.record(answer))
            return len(payload) + len(result)

        for name, fn in (("json", json_forms), ("packed", packed_forms)) if k % 2 else (
                ("packed", packed_forms), ("json", json_forms)):
            t0 = time.perf_counter()
            sizes[name] = fn()
            times[name].append(time.perf_counter() - t0)
    print(f"# durable Step representations, {num_seqs} sequences, {iters} steps interleaved (µs per Step)")
    print(f"{'form':<8} {'p50 us':>8} {'mean us':>8} {'journaled bytes':>16}")
    for name, ts in times.items():
        ts = sorted(ts[iters // 10:])
        print(f"{name:<8} {percentile(ts, 50) * 1e6:>8.1f} {sum(ts) / len(ts) * 1e6:>8.1f} {sizes[name]:>16}")
    j, p = (percentile(sorted(times[n]), 50) for n in ("json", "packed"))
    print(f"packed / json: {p / j:.2f}x time, {sizes['packed'] / sizes['json']:.2f}x bytes")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=300, help="commits per cell")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--step", action="store_true", help="a durable Step's representations, JSON vs packed")
    parser.add_argument("--seqs", type=int, default=256, help="--step: sequences per Step")
    parser.add_argument("--iters", type=int, default=400, help="--step: Steps")
    args = parser.parse_args(argv)
    if args.step:
        step_journal_cost(args.seqs, args.iters)
        return
    # (sequences per record, records per transaction, columnar)
    shapes = [(1, 1, True), (64, 1, True), (256, 1, True), (512, 1, True), (256, 1, False), (1, 16, True)]
    states = {"ids only": snapshot_state(False), "with tokens": snapshot_state(True)}
    results: dict = {"appends": [], "snapshot": [], "snapshot_sizes": {}}
    for label, state in states.items():
        raw = canonical_json(state).encode()
        results["snapshot_sizes"][label] = {
            "json_bytes": len(raw), "zlib_bytes": len(zlib.compress(raw, 1)),
        }
    with backends(not args.no_postgres) as rows:
        for name, make_url, options in rows:
            for num_seqs, per_txn, columnar in shapes:
                r = bench_appends(make_url(), options, num_seqs, per_txn, columnar, args.appends)
                results["appends"].append(
                    {"backend": name, "seqs": num_seqs, "per_txn": per_txn, "columnar": columnar, **r}
                )
            if name == "memory":
                continue
            for label, state in states.items():
                snap = bench_snapshot(make_url(), options, state)
                results["snapshot"].append({"backend": name, "state": label, **snap})
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{'backend':<14} {'record':<18} {'bytes':>7} {'records/s':>10} {'commits/s':>10} {'p50 ms':>8} {'p99 ms':>8}"
    )
    for r in results["appends"]:
        shape = f"{r['seqs']}-seq" + ("" if r["columnar"] else " rows")
        shape += f" x{r['per_txn']}/txn" if r["per_txn"] > 1 else ""
        print(
            f"{r['backend']:<14} {shape:<18} {r['record_bytes']:>7} {r['records_per_s']:>10.0f} "
            f"{r['commits_per_s']:>10.0f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f}"
        )
    print("\nsnapshot of the core with 100k blocks in use:")
    for label, size in results["snapshot_sizes"].items():
        print(f"  {label}: {size['json_bytes'] / 1e6:.1f} MB JSON, {size['zlib_bytes'] / 1e6:.1f} MB stored (zlib 1)")
    print(f"{'backend':<14} {'state':<12} {'write s':>8} {'open+recover s':>15}")
    for snap in results["snapshot"]:
        print(f"{snap['backend']:<14} {snap['state']:<12} {snap['write_s']:>8.3f} {snap['recover_s']:>15.3f}")


if __name__ == "__main__":
    main()
