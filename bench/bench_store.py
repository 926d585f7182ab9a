"""Store benchmark: journal commit latency and snapshot cost per backend.

Journal: `append` of one record per transaction, sized like the record the service writes for
an AppendSlots RPC of 1 / 64 / 256 sequences, plus a group commit of 16 one-sequence records
in one transaction. Reports records/s and p50/p99 commit latency on memory://, SQLite
(synchronous FULL and NORMAL, WAL) and a throwaway PostgreSQL cluster (fsync=on).
Snapshot: write and recover the core's state with 100k blocks in use (with and without
prefix-cache token ids).

    .venv/bin/python bench/bench_store.py [--appends 300] [--no-postgres] [--json]
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=300, help="commits per cell")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
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
