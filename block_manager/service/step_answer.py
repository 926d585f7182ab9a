"""The `step` operation's answer: one typed value, its journal form and its protobuf form.

`ServiceState.step_answer` builds a `StepAnswer`; a live Step fills its response once
(`fill`) and the journal stores that response's bytes (`step_codec.ReceivedStep.record`: the
recorded answer a retried request gets back, also across restarts). Journals written before
that hold `to_json()`, which the servicer still serves (`StepAnswer.from_json(recorded).fill`).
Both forms live here, next to each other, so a field cannot be added to one and forgotten in
the other.

The JSON form is frozen: journals written with it must replay and their recorded answers must
still be served, so `to_json` writes exactly the lists and keys the service always wrote (in the
same order), and `from_json` accepts the answers of older servers (no `pool_free`,
`alloc_pool_ids`, swaps). A closed pool step stays in its columnar
journal form (`pool_step_dict`): it is copied column by column into `PoolStep`, never read item
by item on the server.

This module is transport-free at run time (the state machine imports it): the protobuf types
appear in annotations only, and the caller hands `fill` the message to fill.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from block_manager.core.errors import CoreError
from block_manager.core.types import SeqId, StepOutput
from block_manager.service.disk_codec import disk_step_blocks, fill_disk_blocks
from block_manager.service.status import code_for_reason
from pagedkv.tiers import TierKind

if TYPE_CHECKING:
    from pagedkv.v1 import block_manager_pb2 as pb
    from pagedkv.v1 import common_pb2


@dataclass(slots=True)
class ItemError:
    """One item of a step that failed on its own: its section (`"alloc"`, `"append"`, ...), its
    index there, the error's class name (the status code is derived from it at the edge,
    `service/status.py`) and message."""

    section: str
    index: int
    reason: str
    message: str

    @classmethod
    def of(cls, section: str, index: int, exc: CoreError) -> ItemError:
        return cls(section, index, type(exc).__name__, str(exc))

    def to_json(self) -> list[Any]:
        return [self.section, self.index, self.reason, self.message]


@dataclass(slots=True)
class SettledPool:
    """A pool's Forward report, applied: the step it is settled up to, the defrag plans that
    committed or aborted with it, the sequences dropped (their step failed)."""

    pool_id: str
    settled_step: int
    committed_plan_ids: list[int]
    aborted_plan_ids: list[int]
    dropped_seq_ids: list[SeqId]

    def to_json(self) -> list[Any]:
        return [self.pool_id, self.settled_step, self.committed_plan_ids, self.aborted_plan_ids,
                self.dropped_seq_ids]

    @classmethod
    def from_json(cls, s: list[Any]) -> SettledPool:
        pool_id, settled_step, committed, aborted, dropped = s
        return cls(pool_id, settled_step, committed, aborted, dropped)


@dataclass(slots=True)
class PoolFree:
    """A pool's room after the step: free blocks, free-or-evictable blocks, and for a pool with
    a host tier its free-or-evictable host blocks (None without one)."""

    pool_id: str
    num_free_blocks: int
    num_usable_blocks: int
    host_usable_blocks: int | None = None

    def to_json(self) -> list[Any]:
        row = [self.pool_id, self.num_free_blocks, self.num_usable_blocks]
        return row if self.host_usable_blocks is None else [*row, self.host_usable_blocks]

    @classmethod
    def from_json(cls, row: list[Any]) -> PoolFree:
        pool_id, num_free, num_usable, *host = row
        return cls(pool_id, num_free, num_usable, host[0] if host else None)


@dataclass(slots=True)
class StepAnswer:
    """What one Step got: the closed pool steps, the applied reports, the failed items, per
    allocation its cached and total tokens and its pool ("" when it failed), per append its
    token count, the leases taken, each pool's room, the swaps done."""

    steps: list[dict[str, Any]]            # closed pool steps, each in its journal form (`pool_step_dict`)
    settled: list[SettledPool]
    errors: list[ItemError]
    alloc_num_cached_tokens: list[int]
    alloc_num_tokens: list[int]
    append_num_tokens: list[int]
    lease_epochs: dict[str, int]
    pool_free: list[PoolFree] = field(default_factory=list)
    swapped_out: list[SeqId] = field(default_factory=list)
    swapped_in: list[tuple[SeqId, int]] = field(default_factory=list)   # (seq id, its tokens)
    alloc_pool_ids: list[str] = field(default_factory=list)

    # ---- the journal form -------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The recorded answer, exactly as the service has always journaled it."""
        return {
            "steps": self.steps,
            "settled": [s.to_json() for s in self.settled],
            "errors": [e.to_json() for e in self.errors],
            "alloc_num_cached_tokens": self.alloc_num_cached_tokens,
            "alloc_num_tokens": self.alloc_num_tokens,
            "append_num_tokens": self.append_num_tokens,
            "lease_epochs": self.lease_epochs,
            "pool_free": [f.to_json() for f in self.pool_free],
            **({"swapped_out": self.swapped_out} if self.swapped_out else {}),
            **({"swapped_in": [[s, n] for s, n in self.swapped_in]} if self.swapped_in else {}),
            "alloc_pool_ids": self.alloc_pool_ids,
        }

    @classmethod
    def from_json(cls, r: Mapping[str, Any]) -> StepAnswer:
        """A recorded answer, also one journaled by an older server (fields it lacked are
        empty)."""
        return cls(
            steps=r["steps"],
            settled=[SettledPool.from_json(s) for s in r["settled"]],
            errors=[ItemError(*e) for e in r["errors"]],
            alloc_num_cached_tokens=r["alloc_num_cached_tokens"],
            alloc_num_tokens=r["alloc_num_tokens"],
            append_num_tokens=r["append_num_tokens"],
            lease_epochs=r["lease_epochs"],
            pool_free=[PoolFree.from_json(f) for f in r.get("pool_free", ())],
            swapped_out=r.get("swapped_out", []),
            swapped_in=[(s, n) for s, n in r.get("swapped_in", ())],
            alloc_pool_ids=r.get("alloc_pool_ids", []),
        )

    # ---- the protobuf form ------------------------------------------------------------
    def fill(self, resp: pb.StepResponse) -> pb.StepResponse:
        """This answer written into `resp` (an empty `StepResponse`), which is returned."""
        for d in self.steps:
            fill_pool_step(resp.steps.add(), d)
        for s in self.settled:
            m = resp.settled.add()
            m.pool_id, m.settled_step = s.pool_id, s.settled_step
            m.committed_plan_ids.extend(s.committed_plan_ids)
            m.aborted_plan_ids.extend(s.aborted_plan_ids)
            m.dropped_seq_ids.extend(s.dropped_seq_ids)
        for e in self.errors:
            err = resp.errors.add()
            err.code, err.reason, err.message = code_for_reason(e.reason).value[0], e.reason, e.message
            err.section, err.index = e.section, e.index
        resp.alloc_num_cached_tokens.extend(self.alloc_num_cached_tokens)
        resp.alloc_num_tokens.extend(self.alloc_num_tokens)
        resp.append_num_tokens.extend(self.append_num_tokens)
        epochs = resp.lease_epochs
        for pool_id, epoch in self.lease_epochs.items():   # (the map's `update` is a Python loop anyway)
            epochs[pool_id] = epoch
        resp.alloc_pool_ids.extend(self.alloc_pool_ids)
        for f in self.pool_free:
            resp.pool_free.add(pool_id=f.pool_id, num_free_blocks=f.num_free_blocks,
                               num_usable_blocks=f.num_usable_blocks, host_usable_blocks=f.host_usable_blocks or 0)
        resp.swapped_out_seq_ids.extend(self.swapped_out)
        for sid, num_tokens in self.swapped_in:
            resp.swapped_in_seq_ids.append(sid)
            resp.swapped_in_num_tokens.append(num_tokens)
        return resp


# ---- a closed pool step (`PoolStep`) ------------------------------------------------------
def pool_step_dict(out: StepOutput, epoch: int, address_of: Callable[[str], str] | None = None) -> dict[str, Any]:
    """One closed core step, columnar as `PoolStep` carries it (its journal form);
    `address_of(pool)`: a fetch source node's address."""
    seq_ids: list[str] = []
    bases: list[int] = []
    versions: list[int] = []
    num_tokens: list[int] = []
    num_rep: list[int] = []
    rep_pos: list[int] = []
    rep_blk: list[int] = []
    num_app: list[int] = []
    app_blk: list[int] = []
    for d in out.deltas:
        seq_ids.append(d.seq_id)
        bases.append(d.base_version)
        versions.append(d.version)
        num_tokens.append(d.num_tokens)
        num_rep.append(len(d.replaced))
        for pos, block in d.replaced:
            rep_pos.append(pos)
            rep_blk.append(block)
        num_app.append(len(d.appended))
        app_blk.extend(d.appended)
    return {
        "pool_id": out.pool_id,
        "epoch": epoch,
        "step_id": out.step_id,
        "copy_src": [op.src for op in out.copy_ops],
        "copy_dst": [op.dst for op in out.copy_ops],
        "copy_is_defrag": [op.kind == "defrag" for op in out.copy_ops],
        "delta_seq_ids": seq_ids,
        "delta_base_versions": bases,
        "delta_versions": versions,
        "delta_num_tokens": num_tokens,
        "delta_num_replaced": num_rep,
        "replaced_positions": rep_pos,
        "replaced_blocks": rep_blk,
        "delta_num_appended": num_app,
        "appended_blocks": app_blk,
        "dropped_seq_ids": list(out.dropped_seq_ids),
        "plan_id": out.plan_id or 0,
        "reset": out.reset,
        "base_step_id": out.base_step_id,
        **({"tier_kind": [TierKind.of(op.kind).value for op in out.tier_ops],
            "tier_src": [op.src for op in out.tier_ops],
            "tier_dst": [op.dst for op in out.tier_ops],
            **({"disk_blocks": disk_step_blocks(out.tier_ops)} if any(op.meta for op in out.tier_ops) else {}),
            } if out.tier_ops else {}),
        **({"fetches": [[op.fetch_id, op.src_pool, address_of(op.src_pool) if address_of else "",
                         list(op.src_blocks), list(op.dst_blocks), op.seq_id, op.first_token, list(op.token_ids),
                         list(op.src_host)] for op in out.fetches]} if out.fetches else {}),
        **({"serves": [[g.fetch_id, g.dst_pool, list(g.blocks), list(g.host)] for g in out.serves]}
           if out.serves else {}),
    }


def fill_pool_step(msg: common_pb2.PoolStep, d: Mapping[str, Any]) -> None:
    """A pool step's journal form (`pool_step_dict`) into its message, column by column."""
    msg.pool_id = d["pool_id"]
    msg.epoch = d["epoch"]
    msg.step_id = d["step_id"]
    msg.copy_src.extend(d["copy_src"])
    msg.copy_dst.extend(d["copy_dst"])
    msg.copy_is_defrag.extend(d["copy_is_defrag"])
    msg.delta_seq_ids.extend(d["delta_seq_ids"])
    msg.delta_base_versions.extend(d["delta_base_versions"])
    msg.delta_versions.extend(d["delta_versions"])
    msg.delta_num_tokens.extend(d["delta_num_tokens"])
    msg.delta_num_replaced.extend(d["delta_num_replaced"])
    msg.replaced_positions.extend(d["replaced_positions"])
    msg.replaced_blocks.extend(d["replaced_blocks"])
    msg.delta_num_appended.extend(d["delta_num_appended"])
    msg.appended_blocks.extend(d["appended_blocks"])
    msg.dropped_seq_ids.extend(d["dropped_seq_ids"])
    msg.plan_id = d["plan_id"]
    msg.reset = d["reset"]
    msg.base_step_id = d["base_step_id"]
    for fid, src, address, src_blocks, dst_blocks, seq_id, first, tokens, src_host in d.get("fetches", ()):
        msg.fetches.add(fetch_id=fid, src_pool_id=src, src_address=address, src_blocks=src_blocks,
                        dst_blocks=dst_blocks, seq_id=seq_id, first_token=first, token_ids=tokens, src_host=src_host)
    for fid, dst, blocks, host in d.get("serves", ()):
        msg.serves.add(fetch_id=fid, dst_pool_id=dst, blocks=blocks, host=host)
    if "tier_kind" in d:   # host tier moves (absent in steps without any)
        msg.tier_kind.extend(d["tier_kind"])
        msg.tier_src.extend(d["tier_src"])
        msg.tier_dst.extend(d["tier_dst"])
        fill_disk_blocks(msg, d.get("disk_blocks", ()))


__all__ = ["ItemError", "PoolFree", "SettledPool", "StepAnswer", "fill_pool_step", "pool_step_dict"]
