"""Complete, JSON-serialisable snapshots of a `BlockManager`.

Recovery is "latest snapshot + replay of the journaled calls after it", so a snapshot
must carry everything a later call can observe: free-queue *order* (it decides which
block the next allocation gets), counters, next ids, pending copy ops, the outstanding
plan and step counters. Hashes are hex strings, tuples become lists, and the layout is
plain so `to_snapshot(from_snapshot(d)) == d` holds after a JSON round trip.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from block_manager.core.errors import CoreError, InvalidRequest

from .pool import MAX_POOL_BLOCKS, BlockMeta, PlanState, Pool
from .sequence import Sequence
from .steps import DirtyTable, StepRecord, StepWork
from .types import BlockId, CopyOp, DefragPolicy, PlanId, PoolId, SeqId, StepId


@dataclass(slots=True)
class CoreParts:
    """Everything a `BlockManager` holds: what a snapshot stores and restores. The manager
    hands its parts here and builds itself from them, so this module never needs the class."""

    watermark: float
    enable_prefix_caching: bool
    defrag_policy: DefragPolicy
    pools: dict[PoolId, Pool]
    seqs: dict[SeqId, Sequence]
    next_plan_id: int
    max_unsettled_steps: int

FORMAT = 2
_COUNTERS = (
    "num_used", "num_reserved", "next_op_id", "num_steps", "last_defrag_step",
    "prefix_query_tokens", "prefix_hit_tokens", "cow_copies", "evictions", "defrag_moves",
    "compaction_plans", "contiguity_plans", "aborted_plans", "last_version", "settled_step",
)


def _hex(h: bytes | None) -> str | None:
    return None if h is None else h.hex()


def _unhex(s: str | None) -> bytes | None:
    return None if s is None else bytes.fromhex(s)


def _op(op: CopyOp) -> list:
    return [op.op_id, op.src, op.dst, op.kind]


def _unop(d: list) -> CopyOp:
    op_id, src, dst, kind = d
    if kind not in ("cow", "defrag"):
        raise ValueError(f"copy op kind {kind!r}")
    return CopyOp(int(op_id), BlockId(int(src)), BlockId(int(dst)), kind)


def _pool_to_dict(pool: Pool) -> dict[str, Any]:
    d: dict[str, Any] = {
        "pool_id": pool.pool_id,
        "num_blocks": pool.num_blocks,
        "block_size": pool.block_size,
        "draining": pool.draining,
        "ref_cnt": list(pool.ref_cnt),
        "free_list": list(pool.free_list),
        "cached_list": list(pool.cached_list),
        "hashed_blocks": [
            [b, m.block_hash.hex(), _hex(m.parent_hash), m.salt, list(m.token_ids)]
            for b, m in enumerate(pool.meta)
            if m is not None
        ],
        "reserved": [b for b in range(pool.num_blocks) if pool.reserved[b]],
        "pinned": [b for b in range(pool.num_blocks) if pool.pinned[b]],
        # Only steps above the settled one matter ("not yet written"); the rest read as 0.
        "write_step": [[b, ws] for b, ws in enumerate(pool.write_step) if ws > pool.settled_step],
        "step": _step_to_dict(pool.step),
        "unsettled": [[r.step_id, _regs(r.registrations), r.plan_id, r.base_step_id] for r in pool.unsettled],
        "plan": None
        if pool.plan is None
        else {
            "plan_id": pool.plan.plan_id,
            "kind": pool.plan.kind,
            "moves": [_op(op) for op in pool.plan.moves],
            "step_id": pool.plan.step_id,
        },
        "sequences": [
            {
                "seq_id": s.seq_id,
                "block_table": list(s.block_table),
                "num_tokens": s.num_tokens,
                "version": s.version,
                "salt": s.salt,
                "hashing": s.hashing,
                "tail_token_ids": list(s.tail_token_ids),
                "block_hashes": [h.hex() for h in s.block_hashes],
                "last_step": s.last_step,
                "last_write_step": s.last_write_step,
            }
            for s in pool.seqs.values()
        ],
    }
    for name in _COUNTERS:
        d[name] = getattr(pool, name)
    return d


def _regs(registrations: list[tuple[int, bytes]]) -> list[list[Any]]:
    return [[b, h.hex()] for b, h in registrations]


def _unregs(data: list[list[Any]]) -> list[tuple[int, bytes]]:
    return [(int(b), bytes.fromhex(h)) for b, h in data]


def _step_to_dict(step: StepWork) -> dict[str, Any]:
    return {
        "step_id": step.step_id,
        "copy_ops": [_op(op) for op in step.copy_ops],
        "dirty": [
            [sid, d.created, d.base_version, d.base_len, d.covered, sorted(d.replaced)] for sid, d in step.dirty.items()
        ],
        "dropped": list(step.dropped),
        "registrations": _regs(step.registrations),
        "plan_id": step.plan_id,
        "has_writes": step.has_writes,
        "reset": step.reset,
        "base_step_id": step.base_step_id,
    }


def _step_from_dict(d: dict[str, Any]) -> StepWork:
    return StepWork(
        StepId(int(d["step_id"])),
        [_unop(op) for op in d["copy_ops"]],
        {
            SeqId(sid): DirtyTable(bool(created), int(bv), int(bl), int(cov), {int(i) for i in replaced})
            for sid, created, bv, bl, cov, replaced in d["dirty"]
        },
        [SeqId(s) for s in d["dropped"]],
        _unregs(d["registrations"]),
        None if d["plan_id"] is None else PlanId(int(d["plan_id"])),
        bool(d["has_writes"]),
        bool(d["reset"]),
        None if d["base_step_id"] is None else int(d["base_step_id"]),
    )


def to_snapshot(parts: CoreParts) -> dict[str, Any]:
    """The parts as a JSON-serialisable dict."""
    policy = parts.defrag_policy
    return {
        "format": FORMAT,
        "watermark": parts.watermark,
        "enable_prefix_caching": parts.enable_prefix_caching,
        "defrag_policy": {
            "every_n_steps": policy.every_n_steps,
            "max_high_water_ratio": policy.max_high_water_ratio,
            "min_contiguity": policy.min_contiguity,
        },
        "next_plan_id": parts.next_plan_id,
        "max_unsettled_steps": parts.max_unsettled_steps,
        "seq_order": list(parts.seqs),
        "pools": [_pool_to_dict(p) for p in parts.pools.values()],
    }


def _pool_from_dict(d: dict[str, Any]) -> Pool:
    num_blocks, block_size = d["num_blocks"], d["block_size"]
    if type(num_blocks) is not int or not 1 <= num_blocks <= MAX_POOL_BLOCKS:
        raise ValueError(f"num_blocks {num_blocks!r}")
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size {block_size!r}")
    if not isinstance(d["pool_id"], str) or not d["pool_id"]:
        raise ValueError(f"pool id {d['pool_id']!r}")
    pool = Pool(PoolId(d["pool_id"]), num_blocks, block_size)
    n = pool.num_blocks
    pool.draining = bool(d["draining"])
    ref = [int(x) for x in d["ref_cnt"]]
    if len(ref) != n:
        raise ValueError("ref_cnt length differs from num_blocks")
    pool.ref_cnt = ref
    while pool.free_list.pop_front() is not None:
        pass
    for name, lst in (("free_list", pool.free_list), ("cached_list", pool.cached_list)):
        for b in d[name]:
            if not 0 <= b < n or b in pool.free_list or b in pool.cached_list:
                raise ValueError(f"{name}: bad or repeated block {b}")
            lst.push_back(int(b))
    for b, h, parent, salt, tokens in d["hashed_blocks"]:
        meta = BlockMeta(bytes.fromhex(h), _unhex(parent), salt, tuple(int(t) for t in tokens))
        if meta.block_hash in pool.prefix_index:
            raise ValueError("two blocks with one hash")
        pool.meta[b] = meta
        pool.prefix_index[meta.block_hash] = int(b)
    for b in d["reserved"]:
        pool.reserved[b] = 1
    for b in d["pinned"]:
        pool.pinned[b] = 1
    pool.write_step = array("q", bytes(8 * n))
    for b, ws in d["write_step"]:
        pool.write_step[b] = int(ws)
    pool.step = _step_from_dict(d["step"])
    # A record's base step: written since the fix of two failed steps in a row; older snapshots
    # lack it, and for them the previous step is what the old code assumed.
    pool.unsettled = [StepRecord(StepId(int(r[0])), _unregs(r[1]), None if r[2] is None else PlanId(int(r[2])),
                                 int(r[3]) if len(r) > 3 else int(r[0]) - 1)
                      for r in d["unsettled"]]
    plan = d["plan"]
    if plan is not None:
        if plan["kind"] not in ("compaction", "contiguity") or not plan["moves"]:
            raise ValueError("bad plan")
        pool.plan = PlanState(PlanId(int(plan["plan_id"])), plan["kind"],
                              [_unop(op) for op in plan["moves"]], StepId(int(plan["step_id"])))
    for name in _COUNTERS:
        setattr(pool, name, int(d[name]))
    for s in d["sequences"]:
        seq = Sequence(
            SeqId(s["seq_id"]), pool.pool_id, [int(b) for b in s["block_table"]],
            int(s["num_tokens"]), int(s["version"]), s["salt"], bool(s["hashing"]),
            [int(t) for t in s["tail_token_ids"]], [bytes.fromhex(h) for h in s["block_hashes"]],
            int(s["last_step"]),
            int(s["last_write_step"]),
        )
        pool.seqs[seq.seq_id] = seq
    return pool


def from_snapshot(data: Mapping[str, Any]) -> CoreParts:
    """Decode `to_snapshot()` output (shape only; the manager runs fsck on the result);
    InvalidRequest if malformed."""
    try:
        if data.get("format") != FORMAT:
            raise ValueError(f"snapshot format {data.get('format')!r}, expected {FORMAT}")
        pol = data["defrag_policy"]
        pools: dict[PoolId, Pool] = {}
        seqs: dict[SeqId, Sequence] = {}
        for pd in data["pools"]:
            pool = _pool_from_dict(pd)
            if pool.pool_id in pools:
                raise ValueError(f"duplicate pool {pool.pool_id!r}")
            pools[pool.pool_id] = pool
            for sid, seq in pool.seqs.items():
                if sid in seqs:
                    raise ValueError(f"duplicate sequence {sid!r}")
                seqs[sid] = seq
        order = data["seq_order"]
        if sorted(order) != sorted(seqs):
            raise ValueError("seq_order does not list exactly the pools' sequences")
        return CoreParts(
            watermark=data["watermark"],
            enable_prefix_caching=data["enable_prefix_caching"],
            defrag_policy=DefragPolicy(pol["every_n_steps"], pol["max_high_water_ratio"], pol["min_contiguity"]),
            pools=pools,
            seqs={SeqId(sid): seqs[sid] for sid in order},
            next_plan_id=int(data["next_plan_id"]),
            max_unsettled_steps=int(data["max_unsettled_steps"]),
        )
    except CoreError as exc:
        raise InvalidRequest(f"malformed snapshot: {exc}") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise InvalidRequest(f"malformed snapshot: {type(exc).__name__}: {exc}") from None
