"""The block manager service's state machine: core `BlockManager` + node registry.

Every mutation — live RPC or journal replay — goes through `ServiceState.apply(op,
payload, now)`. Payloads are plain JSON-shaped dicts (what the journal stores), so a
recovery replays exactly the code path that produced the original answer; that is what
makes "snapshot + replay" reproduce the acknowledged state. `now` only feeds lease
deadlines, which are not durable (they restart at recovery), so replay stays deterministic.

`apply` validates a whole request before touching anything and raises a typed error
(core `CoreError` or `errors.ServiceError`) with the state unchanged; it returns
`Applied(result, mutated)`, and only mutated results are journaled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from block_manager.core.errors import (
    CoreError,
    DoubleFree,
    FailedPrecondition,
    InvalidRequest,
    NodeFenced,
    UnknownSequence,
)
from block_manager.core.manager import MAX_POOL_BLOCKS, BlockManager
from block_manager.core.nodes import NodeRegistry, check_node_id
from block_manager.core.types import AppendFailure, DefragPlan, DefragPolicy, PoolId, SeqId
from block_manager.service.state_codec import (
    allocation_dict,
    append_outcome,
    append_requests,
    check_allocate_item,
    check_count,
    check_ids,
    check_optional_str,
    plan_dict,
    table_dict,
)

SNAPSHOT_FORMAT = 1
DEFRAG_KINDS = ("compaction", "contiguity")


@dataclass(slots=True, frozen=True)
class StateConfig:
    """Knobs of the state machine (a subset of the server config)."""

    default_block_size: int = 16
    max_blocks: int = 1 << 20
    max_block_size: int = 4096
    prefetch_window: int = 4
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    lease_ttl_s: float = 10.0
    defrag_policy: DefragPolicy | None = None
    max_batch: int = 4096
    remembered_ids: int = 65536     # freed / fenced seq ids kept for precise errors


@dataclass(slots=True, frozen=True)
class Applied:
    result: dict[str, Any]
    mutated: bool


def item_error(exc: CoreError) -> dict[str, Any]:
    """A per-item failure as the journal records it: the error's class name and message.
    The transport's status code is derived from the name at the edge (`service/status.py`)."""
    return {"reason": type(exc).__name__, "message": str(exc)}


class ServiceState:
    """Core + registry + the small bookkeeping the service adds (freed/fenced ids)."""

    def __init__(
        self, config: StateConfig, core: BlockManager | None = None, registry: NodeRegistry | None = None
    ) -> None:
        self.config = config
        self.core = core or BlockManager(
            watermark=config.watermark,
            enable_prefix_caching=config.enable_prefix_caching,
            defrag_policy=config.defrag_policy,
        )
        self.registry = registry or NodeRegistry(config.lease_ttl_s)
        # Remembered so a late request gets FAILED_PRECONDITION (double free / fenced
        # node) instead of a bare NOT_FOUND; bounded, oldest forgotten first.
        self.freed_ids: OrderedDict[SeqId, None] = OrderedDict()
        self.fenced_ids: OrderedDict[SeqId, PoolId] = OrderedDict()
        self._ops: dict[str, Callable[[dict[str, Any], float], Applied]] = {
            "register_node": self._register_node,
            "expire_node": self._expire_node,
            "allocate": self._allocate,
            "append_slots": self._append_slots,
            "fork": self._fork,
            "free": self._free,
            "ack_copy_ops": self._ack_copy_ops,
            "plan_defrag": self._plan_defrag,
            "commit_defrag": self._commit_defrag,
            "abort_defrag": self._abort_defrag,
            "drain_node": self._drain_node,
            "reset_prefix_cache": self._reset_prefix_cache,
        }

    # ---- the one mutation path ------------------------------------------------------
    def apply(self, op: str, payload: Mapping[str, Any], now: float) -> Applied:
        handler = self._ops.get(op)
        if handler is None:
            raise InvalidRequest(f"unknown operation {op!r}")
        if not isinstance(payload, Mapping):
            raise InvalidRequest("payload must be a mapping")
        try:
            return handler(dict(payload), now)
        except (KeyError, TypeError, ValueError) as exc:
            # A payload of the wrong shape can only come from a bug or a corrupt journal;
            # handlers validate before they mutate, so the state is unchanged.
            raise InvalidRequest(f"malformed {op} payload: {exc!r}") from exc

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(self._ops)

    # ---- helpers --------------------------------------------------------------------
    def _remember(self, ids: OrderedDict, key: SeqId, value: Any) -> None:
        ids[key] = value
        ids.move_to_end(key)
        while len(ids) > self.config.remembered_ids:
            ids.popitem(last=False)

    def _forget(self, seq_id: SeqId) -> None:
        self.freed_ids.pop(seq_id, None)
        self.fenced_ids.pop(seq_id, None)

    def _check_pool_epochs(self, pool_epochs: Mapping[str, Any] | None) -> None:
        for pool_id, epoch in sorted((pool_epochs or {}).items()):
            self.registry.check_epoch(pool_id, epoch)

    def _missing_seq_error(self, seq_id: SeqId) -> CoreError:
        pool = self.fenced_ids.get(seq_id)
        if pool is not None:
            return NodeFenced(f"sequence {seq_id!r} was dropped when node {pool!r} was fenced")
        if seq_id in self.freed_ids:
            return DoubleFree(f"sequence {seq_id!r} was already freed")
        return UnknownSequence(f"unknown sequence {seq_id!r}")

    def _drop_pool(self, pool_id: PoolId) -> list[SeqId]:
        if pool_id not in self.core.pool_ids:
            return []
        dropped = self.core.remove_pool(pool_id)
        for sid in dropped:
            self._remember(self.fenced_ids, sid, pool_id)
        return dropped

    def _pool_ids(self, pool_id: str | None) -> list[PoolId]:
        if pool_id is None:
            return list(self.core.pool_ids)
        self.registry.check_active(pool_id)
        return [PoolId(pool_id)]

    # ---- nodes ----------------------------------------------------------------------
    def _register_node(self, p: dict[str, Any], now: float) -> Applied:
        node_id = check_node_id(p["node_id"])
        num_blocks = check_count("num_blocks", p["num_blocks"], 1, min(self.config.max_blocks, MAX_POOL_BLOCKS))
        block_size = p["block_size"] or self.config.default_block_size
        block_size = check_count("block_size", block_size, 1, self.config.max_block_size)
        address = check_optional_str("address", p.get("address"), 256) or ""
        geometry = p.get("geometry") or {}
        if not isinstance(geometry, dict):
            raise InvalidRequest("geometry must be a mapping")
        dropped = self._drop_pool(node_id)
        lease = self.registry.register(node_id, num_blocks, block_size, geometry, address, now)
        self.core.add_pool(node_id, num_blocks, block_size)
        result = {
            "pool_id": node_id,
            "epoch": lease.epoch,
            "lease_ttl_s": lease.lease_ttl_s,
            "block_size": block_size,
            "num_blocks": num_blocks,
            "prefetch_window": self.config.prefetch_window,
            "dropped_seq_ids": dropped,
        }
        return Applied(result, True)

    def _expire_node(self, p: dict[str, Any], now: float) -> Applied:
        node_id, epoch = p["node_id"], p["epoch"]
        if not self.registry.fence(node_id, epoch):
            return Applied({"fenced": False, "dropped_seq_ids": []}, False)
        dropped = self._drop_pool(PoolId(node_id))
        return Applied({"fenced": True, "dropped_seq_ids": dropped}, True)

    def _drain_node(self, p: dict[str, Any], now: float) -> Applied:
        node = self.registry.check_active(p["node_id"])
        draining = bool(p["draining"])
        self.registry.set_draining(node.node_id, draining)
        self.core.set_draining(node.node_id, draining)
        return Applied({"num_sequences": len(self.core.sequences(node.node_id))}, True)

    # ---- sequences ------------------------------------------------------------------
    def _allocate(self, p: dict[str, Any], now: float) -> Applied:
        items = p["items"]
        check_count("number of items", len(items), 1, self.config.max_batch)
        for it in items:
            check_allocate_item(it)
        check_ids("seq_id", [it["seq_id"] for it in items])
        self._check_pool_epochs(p.get("pool_epochs"))
        outcomes: list[dict[str, Any]] = []
        mutated = False
        for it in items:
            try:
                sid = SeqId(it["seq_id"])
                self.registry.check_active(it["pool_id"])
                tokens = it.get("token_ids")
                res = self.core.allocate(
                    sid,
                    PoolId(it["pool_id"]),
                    tuple(tokens) if tokens is not None else None,
                    num_tokens=it.get("num_tokens"),
                    salt=check_optional_str("salt", it.get("salt"), 1024),
                )
            except CoreError as exc:
                outcomes.append({"error": item_error(exc)})
                continue
            self._forget(sid)
            mutated = True
            outcomes.append({"allocation": allocation_dict(res)})
        return Applied({"outcomes": outcomes}, mutated)

    def _append_slots(self, p: dict[str, Any], now: float) -> Applied:
        items = p["items"]
        check_count("number of items", len(items), 1, self.config.max_batch)
        self._check_pool_epochs(p.get("pool_epochs"))
        requests = append_requests(items)
        # Outcomes: an `AppendedRecord` per appended sequence, a {"seq_id", "error"} dict per
        # failed one (`decode_append_outcome` reads either back as a typed record).
        outcomes: list[Any] = []
        add = outcomes.append
        mutated = False
        for res in self.core.append_slots(requests):
            if type(res) is AppendFailure:
                err = res.error
                if isinstance(err, UnknownSequence):
                    err = self._missing_seq_error(res.seq_id)
                add({"seq_id": res.seq_id, "error": item_error(err)})
            else:
                mutated = True
                add(append_outcome(res))  # type: ignore[arg-type]
        return Applied({"outcomes": outcomes}, mutated)

    def _fork(self, p: dict[str, Any], now: float) -> Applied:
        children = p["children"]
        check_count("number of children", len(children), 1, self.config.max_batch)
        check_ids("child seq_id", children)
        self._check_pool_epochs(p.get("pool_epochs"))
        parent = SeqId(p["parent"])
        try:
            self.core.get_sequence(parent)
        except UnknownSequence:
            raise self._missing_seq_error(parent) from None
        views = self.core.fork(parent, [SeqId(c) for c in children])
        for c in children:
            self._forget(SeqId(c))
        return Applied({"children": [table_dict(v) for v in views]}, True)

    def _free(self, p: dict[str, Any], now: float) -> Applied:
        seq_ids = [SeqId(s) for s in p["seq_ids"]]
        check_count("number of seq_ids", len(seq_ids), 1, self.config.max_batch)
        check_ids("seq_id", seq_ids)
        self._check_pool_epochs(p.get("pool_epochs"))
        for sid in seq_ids:
            try:
                self.core.get_sequence(sid)
            except UnknownSequence:
                raise self._missing_seq_error(sid) from None
        self.core.free(seq_ids)
        for sid in seq_ids:
            self._remember(self.freed_ids, sid, None)
        return Applied({"num_freed": len(seq_ids)}, True)

    # ---- copy ops and defragmentation -----------------------------------------------
    def _ack_copy_ops(self, p: dict[str, Any], now: float) -> Applied:
        node = self.registry.check_epoch(p["node_id"], p["epoch"])
        up_to = check_count("up_to_op_id", p["up_to_op_id"], 0, 1 << 62)
        pool_id = node.node_id
        pending_before = self.core.pending_copy_ops(pool_id)
        if pending_before and up_to > pending_before[-1].op_id:
            raise InvalidRequest(f"up_to_op_id {up_to} is beyond the last issued op {pending_before[-1].op_id}")
        if not pending_before or up_to < pending_before[0].op_id:
            return Applied({"committed_plan_ids": []}, False)
        self.core.ack_copy_ops(pool_id, up_to)
        committed: list[int] = []
        plan = self.core.get_defrag_plan(pool_id)
        if plan is not None and all(m.op_id <= up_to for m in plan.moves):
            self.core.commit_defrag(plan.plan_id)
            committed.append(plan.plan_id)
        return Applied({"committed_plan_ids": committed}, True)

    def _plan_defrag(self, p: dict[str, Any], now: float) -> Applied:
        pool_id = p["pool_id"]
        self.registry.check_active(pool_id)
        kind = p.get("kind") or "compaction"
        if kind not in DEFRAG_KINDS:
            raise InvalidRequest(f"unknown defrag kind {kind!r}")
        max_moves = p.get("max_moves")
        if max_moves is not None:
            check_count("max_moves", max_moves, 1, 1 << 30)
        plan = self.core.plan_defrag(PoolId(pool_id), kind, max_moves)
        return Applied({"plan": plan_dict(plan) if plan else None}, plan is not None)

    def _commit_defrag(self, p: dict[str, Any], now: float) -> Applied:
        updated = self.core.commit_defrag(p["plan_id"])
        return Applied({"updated_seq_ids": list(updated)}, True)

    def _abort_defrag(self, p: dict[str, Any], now: float) -> Applied:
        self.core.abort_defrag(p["plan_id"])
        return Applied({}, True)

    def _reset_prefix_cache(self, p: dict[str, Any], now: float) -> Applied:
        pool_ids = self._pool_ids(check_optional_str("pool_id", p.get("pool_id"), 128))
        num = sum(self.core.reset_prefix_cache(pid) for pid in pool_ids)
        return Applied({"num_blocks_reset": num}, num > 0)

    # ---- queries --------------------------------------------------------------------
    def outstanding_plans(self) -> list[DefragPlan]:
        plans = (self.core.get_defrag_plan(pid) for pid in self.core.pool_ids)
        return [plan for plan in plans if plan is not None]

    def check_plan_acked(self, plan_id: int) -> None:
        """FailedPrecondition unless every move of the plan was acknowledged."""
        for plan in self.outstanding_plans():
            if plan.plan_id == plan_id:
                pending = {op.op_id for op in self.core.pending_copy_ops(plan.pool_id)}
                if any(m.op_id in pending for m in plan.moves):
                    raise FailedPrecondition(f"defrag plan {plan_id} has unacknowledged moves")

    def fsck(self) -> list[str]:
        problems = list(self.core.fsck())
        active = {n.node_id for n in self.registry.nodes() if n.active}
        pools = set(self.core.pool_ids)
        for pid in sorted(active - pools):
            problems.append(f"node {pid!r} is active but has no pool")
        for pid in sorted(pools - active):
            problems.append(f"pool {pid!r} has no active node")
        return problems

    # ---- snapshots ------------------------------------------------------------------
    def to_snapshot(self) -> dict[str, Any]:
        return {
            "format": SNAPSHOT_FORMAT,
            "core": self.core.to_snapshot(),
            "registry": self.registry.to_snapshot(),
            "freed_ids": list(self.freed_ids),
            "fenced_ids": [[sid, pid] for sid, pid in self.fenced_ids.items()],
        }

    @classmethod
    def from_snapshot(cls, data: Mapping[str, Any], config: StateConfig, now: float) -> ServiceState:
        try:
            if data["format"] != SNAPSHOT_FORMAT:
                raise InvalidRequest(f"unsupported service snapshot format {data['format']!r}")
            core = BlockManager.from_snapshot(data["core"])
            registry = NodeRegistry.from_snapshot(data["registry"], now, config.lease_ttl_s)
            state = cls(config, core, registry)
            for sid in data["freed_ids"]:
                state.freed_ids[SeqId(sid)] = None
            for sid, pid in data["fenced_ids"]:
                state.fenced_ids[SeqId(sid)] = PoolId(pid)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed service snapshot: {exc!r}") from exc
        return state


__all__ = ["Applied", "ServiceState", "StateConfig", "item_error", "DEFRAG_KINDS"]
