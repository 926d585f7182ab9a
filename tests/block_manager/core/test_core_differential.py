"""Differential test: the array core (block_manager.core) against the object-based core it
replaced (a test-only copy in `reference_core/`), on seeded random traces.

Both managers get the same calls; every answer must be equal (results as plain data, errors
as type name + message), and after every call the complete state must be equal: the
snapshots (tables, free-queue order, hashes, ref counts, steps, counters), the metrics of
every pool (hits, evictions, CoW copies, ...) and fsck. The traces mix everything the core
does — prompts with shared prefixes (hits), chunked prefill, decode and multi-token appends
(in-block, block crossings, blocks that fill and get hashed), forks and copy-on-write, frees,
evictions under pressure, steps settled or failed, defrag plans, pool hand-over — with small
pools so that running out of blocks happens often. Each trace runs twice: with the batched
append vectorised from one item on, and with the default threshold (small batches item by
item).
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path
from typing import Any

import pytest

import block_manager.core as new_core
import block_manager.core.append as new_append

sys.path.insert(0, str(Path(__file__).parent))
import reference_core as old_core  # noqa: E402  (test-only copy of the object-based core)

POOLS = {"p": (48, 4), "q": (40, 3), "r": (64, 8)}
_NEW_EMPTY = frozenset(("tier_ops", "fetches", "serves"))
_NEW_ROUTE = frozenset(("num_fetchable_tokens", "num_missing_tokens", "fetch_pool_id"))


def plain(value: Any) -> Any:
    """Results of either core as comparable plain data (their classes differ)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # `tier_ops` (host tier moves) and `fetches` / `serves` (prefix fetch) are new in the array
        # core; empty here: no pool has a host tier, and the pools' block sizes differ (no fetch).
        # Route's fetch split (fetchable / missing / source) is new too: the ranking is compared.
        return (type(value).__name__, *(plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                                        if not (f.name in _NEW_EMPTY and not getattr(value, f.name))
                                        and f.name not in _NEW_ROUTE))
    if isinstance(value, BaseException):
        return ("error", type(value).__name__, str(value))
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, set):
        return sorted(value)
    return value


def call(m: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return plain(getattr(m, name)(*args, **kwargs))
    except Exception as exc:   # noqa: BLE001 - both cores must raise the same thing
        if type(exc).__module__.split(".")[0] not in ("block_manager", "reference_core"):
            raise
        return plain(exc)


class Trace:
    """Drives both cores with one random trace and compares after every call."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.old = old_core.BlockManager(watermark=0.05)
        self.new = new_core.BlockManager(watermark=0.05)
        self.calls = 0
        for pid, (n, bs) in POOLS.items():
            self.both("add_pool", pid, n, bs)
        self.next_seq = 0
        self.live: list[str] = []
        self.prefixes = [[self.rng.randrange(50) for _ in range(24)] for _ in range(4)]

    def both(self, name: str, *args: Any, **kwargs: Any) -> Any:
        a = call(self.old, name, *args, **kwargs)
        b = call(self.new, name, *args, **kwargs)
        assert a == b, f"call {self.calls} {name}{args}{kwargs}: old {a!r} != new {b!r}"
        self.calls += 1
        return a

    def check_state(self) -> None:
        assert self.old.to_snapshot() == self.new.to_snapshot(), f"state differs after call {self.calls}"
        for pid in POOLS:
            if pid in self.old.pool_ids:
                assert plain(self.old.metrics(pid)) == plain(self.new.metrics(pid))
        assert self.new.fsck() == []

    def refresh_live(self) -> None:
        self.live = [v[1] for v in self.both("sequences")]

    # ---- actions ----------------------------------------------------------------------
    def allocate(self) -> None:
        r = self.rng
        sid = f"s{self.next_seq}"
        self.next_seq += 1
        pid = r.choice(list(POOLS))
        if r.random() < 0.15:
            self.both("allocate", sid, pid, num_tokens=r.randint(1, 20))
            return
        prompt = list(r.choice(self.prefixes)[: r.randint(1, 24)]) + [r.randrange(50) for _ in range(r.randint(0, 6))]
        if not prompt:
            prompt = [1]
        kw: dict[str, Any] = {"salt": r.choice([None, None, "t"])}
        if r.random() < 0.3:
            kw["num_compute"] = r.randint(1, 8)
        self.both("allocate", sid, pid, prompt, **kw)

    def append(self) -> None:
        r = self.rng
        if not self.live:
            return
        k = r.randint(1, len(self.live))
        ids = r.sample(self.live, k)
        if r.random() < 0.05:
            ids.append("nope")
        if r.random() < 0.05 and ids:
            ids.append(ids[0])    # duplicate
        counts = [1 if r.random() < 0.6 else r.randint(1, 10) for _ in ids]
        if r.random() < 0.03:
            counts[0] = 0
        with_ids = r.random() < 0.85
        toks = [r.randrange(50) for _ in range(sum(max(c, 0) for c in counts))] if with_ids else None
        already = r.random() < 0.05
        if r.random() < 0.3:
            items = [(s, c, None if toks is None else tuple(toks[:c])) for s, c in zip(ids, counts)]
            if items and r.random() < 0.15:   # an item whose ids disagree with its count, or has none
                s0, c0, t0 = items[0]
                items[0] = (s0, c0, r.choice([None, (*(t0 or ()), 3)]))
            reqs_old = [old_core.AppendRequest(*item) for item in items]
            reqs_new = [new_core.AppendRequest(*item) for item in items]
            a = call(self.old, "append_slots", reqs_old, already_written=already)
            b = call(self.new, "append_slots", reqs_new, already_written=already)
            assert a == b, f"call {self.calls} append_slots: old {a!r} != new {b!r}"
            self.calls += 1
        else:
            self.both("append_tokens", ids, counts, toks, already_written=already)

    def step(self) -> None:
        r = self.rng
        for pid in POOLS:
            if pid not in self.new.pool_ids:
                continue
            self.both("close_step", pid, force=r.random() < 0.2)
            unsettled = self.both("unsettled_step_ids", pid)
            if unsettled and r.random() < 0.8:
                if r.random() < 0.1:
                    done = self.both("settled_step_id", pid)
                    self.both("settle_steps", pid, done, done + 1)
                else:
                    self.both("settle_steps", pid, unsettled[-1])

    def free(self) -> None:
        if self.live:
            self.both("free", self.rng.sample(self.live, self.rng.randint(1, min(4, len(self.live)))))

    def fork(self) -> None:
        if self.live:
            kids = [f"s{self.next_seq + i}" for i in range(self.rng.randint(1, 2))]
            self.next_seq += len(kids)
            self.both("fork", self.rng.choice(self.live), kids)

    def housekeeping(self) -> None:
        r = self.rng
        pid = r.choice(list(POOLS))
        action = r.choice(["evict", "reset", "defrag", "abort", "route", "tables", "can", "abandon", "due"])
        if action == "evict":
            self.both("evict", pid, r.randint(0, 5))
        elif action == "reset":
            self.both("reset_prefix_cache", r.choice([None, pid]))
        elif action == "defrag":
            self.both("plan_defrag", pid, r.choice(["compaction", "contiguity"]), r.choice([None, 1, 3]))
        elif action == "abort":
            plan = self.both("get_defrag_plan", pid)
            if plan is not None:
                self.both("abort_defrag", plan[1])
        elif action == "route":
            self.both("route", list(r.choice(self.prefixes)[: r.randint(1, 24)]), r.choice([None, "t"]))
        elif action == "tables" and self.live:
            ids = r.sample(self.live, min(3, len(self.live)))
            self.both("get_tables", ids, {ids[0]: r.randint(0, 3)})
        elif action == "can" and self.live:
            self.both("can_append", r.choice(self.live), r.randint(1, 9))
            self.both("can_allocate", pid, r.randint(1, 40))
        elif action == "abandon" and r.random() < 0.2:
            self.both("abandon_pool", pid)
        elif action == "due":
            self.both("defrag_due", pid)

    def run(self, num_calls: int) -> None:
        actions = [(self.allocate, 3), (self.append, 6), (self.step, 5), (self.free, 2), (self.fork, 1),
                   (self.housekeeping, 2)]
        fns = [f for f, w in actions for _ in range(w)]
        for _ in range(num_calls):
            self.rng.choice(fns)()
            self.refresh_live()
            self.check_state()
        # round trip: a snapshot of the new core rebuilds an equal core
        again = new_core.BlockManager.from_snapshot(self.new.to_snapshot())
        assert again.to_snapshot() == self.old.to_snapshot()


@pytest.mark.parametrize("vector_min", [1, new_append.VECTOR_MIN_ITEMS])
# 4 seeds by default (each 250 random calls, every state compared after each); 12 with --slow.
@pytest.mark.parametrize("seed", [*range(4), *(pytest.param(s, marks=pytest.mark.slow) for s in range(4, 12))])
def test_array_core_matches_object_core(seed: int, vector_min: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(new_append, "VECTOR_MIN_ITEMS", vector_min)
    Trace(seed).run(250)


def test_large_decode_batches_match() -> None:
    """Steady decode of a big batch (the vectorised path at its default threshold): staggered
    lengths so that blocks fill, get hashed and are crossed in every step, with frees and new
    prompts that hit the blocks the batch filled."""
    t = Trace(1234)
    r = t.rng
    t.both("add_pool", "big", 2400, 4)
    base = [r.randrange(8) for _ in range(32)]
    for i in range(100):   # above VECTOR_MIN_ITEMS: the default threshold vectorises
        t.both("allocate", f"d{i}", "big", base[: 5 + i % 8])
    t.both("close_step", "big")
    t.both("settle_steps", "big", t.both("unsettled_step_ids", "big")[-1])
    for step in range(40):
        live = [v[1] for v in t.both("sequences", "big")]
        toks = [r.randrange(8) for _ in live]
        if step % 2:
            t.both("append_tokens", live, [1] * len(live), toks)
        else:   # the embedders' per-object API (its decode results come from the columns)
            a = call(t.old, "append_slots", [old_core.AppendRequest(s, 1, (k,)) for s, k in zip(live, toks)])
            b = call(t.new, "append_slots", [new_core.AppendRequest(s, 1, (k,)) for s, k in zip(live, toks)])
            assert a == b
        out = t.both("close_step", "big")
        if out is not None:
            t.both("settle_steps", "big", out[2])
        if step % 7 == 6:
            t.both("free", live[:5])
            for j in range(5):
                t.both("allocate", f"n{step}-{j}", "big", base[:12] + [r.randrange(8) for _ in range(5)])
        t.check_state()
    m = t.new.metrics("big")
    assert m.prefix_hit_tokens > 0 and m.num_sequences > new_append.VECTOR_MIN_ITEMS


@pytest.mark.parametrize("vector_min", [1, new_append.VECTOR_MIN_ITEMS])
def test_fill_then_evicting_crossing_keep_request_order(vector_min: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block that fills with the content of a cached block, then (later in the same batch)
    a crossing that has to evict that very cached block: the filled block must stay anonymous
    (the cached one still owned the hash when it filled), exactly as item-by-item order says."""
    monkeypatch.setattr(new_append, "VECTOR_MIN_ITEMS", vector_min)
    t = Trace(7)
    t.both("add_pool", "e", 12, 2)
    for m in (t.old, t.new):
        m.watermark = 0.0

    def forward() -> None:
        out = t.both("close_step", "e", force=True)
        if out is not None:
            t.both("settle_steps", "e", out[2])

    t.both("allocate", "x", "e", [1, 2, 3])
    forward()
    t.both("append_tokens", ["x"], [1], [4])          # fills [3, 4]: hashed, registered
    forward()
    t.both("free", ["x"])                             # both blocks cached
    forward()
    t.both("allocate", "a", "e", [1, 2, 3])          # hits [1, 2]; [3] in a new block
    t.both("allocate", "b", "e", [9, 9])              # a full table: its next token crosses
    fillers = 0
    while t.new.metrics("e").num_free_blocks > 0:     # no free block left, [3, 4] still cached
        t.both("allocate", f"f{fillers}", "e", num_tokens=2)
        fillers += 1
    forward()
    assert t.new.metrics("e").num_cached_blocks == 1
    extra = [f"f{i}" for i in range(fillers)] if vector_min > 1 else []
    # a (fills [3, 4]) comes before b (crosses, evicting the cached [3, 4])
    t.both("append_tokens", ["a", "b", *extra], [1, 1, *([1] * len(extra))], [4, 5, *([6] * len(extra))])
    t.check_state()
    assert t.new.metrics("e").evictions >= 1
