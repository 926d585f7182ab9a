"""The host tier of a pool: a second set of blocks, in the compute node's host memory, under
its device pool — the ledger of swap preemption, offload of evicted prefix blocks and
onboarding on a host hit.

Host block ids are their own id space (`0 … host_num_blocks-1`, the index into the node's
host tensors); a block lives in a node's device pool, its host pool, or nowhere, and the
pool's two ledgers say which. The host ledger has what the device one has — ref counts, a
free queue, an LRU queue of cached (hashed, unreferenced) blocks and a prefix index — and a
host block's holders are swapped-out sequences (one reference each) and the steps that read
it (a *hold*, released when that step is reported: the source of a move stays pinned until
the report).

Tier moves are ops of the open step (`StepWork.tier_ops`), like copy-on-write copies and
defrag moves: the node runs a step's device→host moves first, then its host→device moves,
then its copy ops, then its writes, so
- a device block released by a swap-out (or evicted and offloaded) may be reused by another
  sequence in the very step: its content is read before anything in the step writes it;
- a host block read by a swap-in or an onboard is held until the step is reported, so no
  device→host move of the same step (or a later one still in flight) can overwrite it;
- a host block is *written* once the step carrying its device→host move is reported
  complete (`write_step <= settled_step`): only then may it be swapped in or onboarded. An
  offloaded block is held by its writing step until then, so it is never evicted (nor
  spilled to disk) before its bytes are there, nor written twice by one step. A
  step reported failed drops the swapped-out sequences it carried (their K/V never reached
  host: the scheduler recomputes them) and forgets the hashes of the blocks it offloaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from block_manager.core.block_list import BlockList
from block_manager.core.errors import FailedPrecondition, InvalidRequest, OutOfBlocks, PendingWrite
from block_manager.core.fetch import host_loan_holders
from block_manager.core.hashing import BlockHash
from block_manager.core.sequence import late_pending
from block_manager.core.types import BlockId, SeqId

# pool.py imports this module (a pool owns its host tier), so the pool and its BlockMeta are
# not imported here (the core's modules form a DAG): `Pool` below is block_manager.core.pool.Pool.
Pool = Any
BlockMeta = Any

TierKind = Literal["swap_out", "swap_in", "offload", "onboard", "disk_offload", "disk_onboard"]
TIER_KINDS: tuple[TierKind, ...] = ("swap_out", "swap_in", "offload", "onboard", "disk_offload", "disk_onboard")
TO_HOST: frozenset[str] = frozenset(("swap_out", "offload"))
DISK_KINDS: frozenset[str] = frozenset(("disk_offload", "disk_onboard"))   # disk_tier.py


@dataclass(slots=True, frozen=True)
class TierOp:
    """Copy one block between tiers on the pool's node (all layers, K and V).

    `swap_out` / `offload`: `src` is a device block, `dst` a host block; `swap_in` /
    `onboard`: `src` is a host block, `dst` a device block. The disk tier's (disk_tier.py):
    `disk_offload` host block -> disk slot, with `meta` (the block's identity, which the node
    keeps with the bytes); `disk_onboard` disk slot -> host block. `op_id` shares the pool's
    copy-op counter, so ops of a pool are totally ordered."""

    op_id: int
    kind: TierKind
    src: BlockId
    dst: BlockId
    meta: Any = None

    @property
    def to_host(self) -> bool:
        return self.kind in TO_HOST


@dataclass(slots=True)
class SwappedSeq:
    """A sequence whose table lives on host: what resuming it on device needs.

    `data_step` is the last step that wrote or changed it on device before the swap-out,
    `swap_step` the step carrying its device→host moves; a failure of either drops it."""

    seq_id: SeqId
    host_table: list[int]
    num_tokens: int
    salt: str | None
    hashing: bool
    tail_token_ids: list[int]
    block_hashes: list[BlockHash]
    data_step: int
    swap_step: int


_COUNTERS = ("swapped_out_blocks", "swapped_in_blocks", "offloaded_blocks", "onboarded_blocks",
             "host_hit_tokens", "host_evictions", "swap_outs", "swap_ins")


class HostTier:
    """The host blocks of one pool (see the module docstring)."""

    __slots__ = ("num_blocks", "ref_cnt", "free_list", "cached_list", "meta", "prefix_index",
                 "write_step", "holds", "swapped", "kv_log", "disk", "on_evict", *_COUNTERS)

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free_list = BlockList(num_blocks)
        self.cached_list = BlockList(num_blocks)
        for b in range(num_blocks):
            self.free_list.push_back(b)
        self.meta: list[BlockMeta | None] = [None] * num_blocks
        self.prefix_index: dict[BlockHash, int] = {}
        self.write_step = [0] * num_blocks
        self.holds: list[tuple[int, int]] = []   # (step id, host block) read by that step
        self.swapped: dict[SeqId, SwappedSeq] = {}
        self.kv_log: Any = None   # a kv_events.KvChangeLog while changes are recorded
        self.disk: Any = None       # the disk tier under this one (disk_tier.attach), if any
        self.on_evict: Any = None   # called with a cached block evicted for good (disk_tier.spill)
        for name in _COUNTERS:
            setattr(self, name, 0)

    # ---- capacity and block transitions -----------------------------------------------
    @property
    def num_available(self) -> int:
        return self.free_list.length + self.cached_list.length

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def take(self) -> int | None:
        """A host block for a new owner (ref_cnt 1): a free one, else the LRU cached one,
        evicted (spilled to the disk tier when there is one). None when every block is held."""
        b = self.free_list.pop_front()
        if b is None:
            b = self.cached_list.pop_front()
            if b is None:
                return None
            if self.on_evict is not None:
                self.on_evict(b)
            self.drop_hash(b)
            self.host_evictions += 1
        self.ref_cnt[b] = 1
        return b

    def share(self, b: int) -> None:
        if self.ref_cnt[b] == 0:
            self.cached_list.remove(b)
        self.ref_cnt[b] += 1

    def release(self, b: int) -> None:
        cnt = self.ref_cnt[b] - 1
        self.ref_cnt[b] = cnt
        if cnt:
            return
        if self.meta[b] is not None:
            self.cached_list.push_back(b)
        else:
            self.free_list.push_front(b)

    def written(self, b: int, settled_step: int) -> bool:
        return self.write_step[b] <= settled_step

    # ---- prefix index -----------------------------------------------------------------
    def lookup(self, block_hash: BlockHash, parent: BlockHash | None, salt: str | None,
               token_ids: tuple[int, ...]) -> int | None:
        b = self.prefix_index.get(block_hash)
        if b is None:
            return None
        m = self.meta[b]
        if m is None or m.token_ids != token_ids or m.parent_hash != parent or m.salt != salt:
            return None
        return b

    def drop_hash(self, b: int) -> None:
        m = self.meta[b]
        if m is not None:
            del self.prefix_index[m.block_hash]
            self.meta[b] = None
            if self.kv_log is not None:
                self.kv_log.removed(m.block_hash)

    def forget(self, b: int) -> None:
        """`b`'s content is not what its hash says (its writing step failed)."""
        self.drop_hash(b)
        if self.ref_cnt[b] == 0 and b in self.cached_list:
            self.cached_list.remove(b)
            self.free_list.push_front(b)

    # ---- steps ------------------------------------------------------------------------
    def release_holds(self, settled_step: int) -> None:
        """Steps up to `settled_step` are reported: the host blocks (and disk slots) they read
        are free to go."""
        if self.disk is not None:
            self.disk.release_holds(settled_step)
        if not self.holds:
            return
        keep: list[tuple[int, int]] = []
        for step_id, b in self.holds:
            if step_id <= settled_step:
                self.release(b)
            else:
                keep.append((step_id, b))
        self.holds = keep

    def counters(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _COUNTERS}


# ---- operations on a pool (the manager validates, these mutate) ---------------------------
def host_of(pool: Pool) -> HostTier:
    if pool.host is None:
        raise FailedPrecondition(f"pool {pool.pool_id!r} has no host tier (registered with 0 host blocks)")
    return pool.host


def _queue(pool: Pool, kind: TierKind, src: int, dst: int) -> TierOp:
    op = TierOp(pool.next_op_id, kind, BlockId(src), BlockId(dst))
    pool.next_op_id += 1
    pool.step.tier_ops.append(op)
    return op


def offload(pool: Pool, b: int) -> None:
    """Device block `b` (cached, hashed) is being evicted: keep its content on host when the
    host tier has room and does not hold that hash yet. Called before `b` loses its hash."""
    host = pool.host
    meta = pool.meta[b]
    if host is None or meta is None or meta.block_hash in host.prefix_index or not pool.written(b):
        return
    h = host.take()
    if h is None:
        return
    # Held by its writing step until that step is reported (then it joins the cached LRU):
    # a block still being written can be neither evicted again nor retaken in the same step,
    # which would give one batched device->host copy two writes into one host block.
    host.holds.append((pool.step.step_id, h))
    host.meta[h] = meta
    host.prefix_index[meta.block_hash] = h
    if host.kv_log is not None:
        host.kv_log.stored(meta)
    host.write_step[h] = pool.step.step_id
    host.offloaded_blocks += 1
    _queue(pool, "offload", b, h)


def host_hits(pool: Pool, tokens: Any, hashes: list[BlockHash], salt: str | None, start: int,
              parent: BlockHash | None) -> list[int]:
    """Host blocks continuing a device prefix hit of `start` blocks (written ones only),
    capped like device hits to leave one prompt token to compute."""
    host = pool.host
    if host is None:
        return []
    bs = pool.block_size
    max_hits = min(len(hashes), (len(tokens) - 1) // bs)
    out: list[int] = []
    for i in range(start, max_hits):
        h = host.lookup(hashes[i], parent, salt, tuple(tokens[i * bs: (i + 1) * bs]))
        if h is None or not host.written(h, pool.settled_step):
            break
        out.append(h)
        parent = hashes[i]
    return out


def pin(pool: Pool, host_blocks: Iterable[int]) -> None:
    """Hold host hits before device blocks are taken (an offload could otherwise evict them)."""
    host = host_of(pool)
    for h in host_blocks:
        host.share(h)


def onboard(pool: Pool, host_blocks: list[int], device_blocks: list[int], block_size: int,
            count_hits: bool = True) -> None:
    """Queue host→device copies of pinned host hits into fresh device blocks; each host block
    stays held until the step is reported."""
    host = host_of(pool)
    step_id = pool.step.step_id
    for h, d in zip(host_blocks, device_blocks):
        _queue(pool, "onboard", h, d)
        host.holds.append((step_id, h))
    host.onboarded_blocks += len(host_blocks)
    if count_hits:   # blocks staged from disk count as disk hits (disk_tier.stage)
        host.host_hit_tokens += len(host_blocks) * block_size


def check_swap_out(pool: Pool, seqs: list[Any]) -> int:
    """Validate a swap-out of `seqs` (all of one pool); the number of host blocks it needs."""
    host = host_of(pool)
    open_id = pool.step.step_id
    distinct: set[int] = set()
    for seq in seqs:
        if (pending := late_pending(seq)) is not None:
            raise pending
        if seq.last_write_step == open_id or any(pool.write_step[b] == open_id for b in seq.block_table):
            raise PendingWrite(
                f"sequence {seq.seq_id!r} has blocks written in open step {open_id} of pool {pool.pool_id!r}; "
                "swap it out after that step's Forward"
            )
        distinct.update(seq.block_table)
    if len(distinct) > host.num_available:
        raise OutOfBlocks(
            f"pool {pool.pool_id!r}: host tier full ({len(distinct)} blocks needed, {host.num_available} available)"
        )
    return len(distinct)


def swap_out(pool: Pool, seqs: list[Any]) -> list[SwappedSeq]:
    """Copy the device blocks of `seqs` to host (a block shared inside the group goes once)
    and record each sequence as swapped out. The caller releases the device side."""
    host = host_of(pool)
    step_id = pool.step.step_id
    mapping: dict[int, int] = {}
    out: list[SwappedSeq] = []
    for seq in seqs:
        table: list[int] = []
        for b in seq.block_table:
            h = mapping.get(b)
            if h is None:
                h = host.take()
                if h is None:   # check_swap_out counted the room: unreachable unless misused
                    raise InvalidRequest("internal: host tier exhausted during swap-out")
                mapping[b] = h
                host.write_step[h] = step_id
                _queue(pool, "swap_out", b, h)
            else:
                host.ref_cnt[h] += 1
            table.append(h)
        rec = SwappedSeq(seq.seq_id, table, seq.num_tokens, seq.salt, seq.hashing, seq.tail_token_ids,
                         list(seq.block_hashes), seq.last_touched_step, step_id)
        host.swapped[seq.seq_id] = rec
        out.append(rec)
    host.swapped_out_blocks += len(mapping)
    host.swap_outs += len(seqs)
    return out


def check_swap_in(pool: Pool, recs: list[SwappedSeq], reserve: int) -> int:
    """Validate a swap-in; the number of device blocks it needs (above `reserve`)."""
    host = host_of(pool)
    distinct: set[int] = set()
    for rec in recs:
        for h in rec.host_table:
            if not host.written(h, pool.settled_step):
                raise PendingWrite(
                    f"sequence {rec.seq_id!r}: its swap-out (step {host.write_step[h]}) is not reported "
                    f"complete yet (pool {pool.pool_id!r} settled up to {pool.settled_step})"
                )
            distinct.add(h)
    available = pool.num_available - reserve
    if len(distinct) > available:
        raise OutOfBlocks(
            f"pool {pool.pool_id!r}: swap-in needs {len(distinct)} blocks, {max(available, 0)} available"
        )
    return len(distinct)


def swap_in(pool: Pool, recs: list[SwappedSeq]) -> dict[SeqId, list[int]]:
    """Copy the host blocks of `recs` into fresh device blocks (shared ones once); their host
    references become holds of the open step. Returns each sequence's new device table."""
    host = host_of(pool)
    step_id = pool.step.step_id
    mapping: dict[int, int] = {}
    tables: dict[SeqId, list[int]] = {}
    for rec in recs:
        table: list[int] = []
        for h in rec.host_table:
            d = mapping.get(h)
            if d is None:
                d = pool.take_block()
                mapping[h] = d
                pool.write_step[d] = step_id
                _queue(pool, "swap_in", h, d)
            else:
                pool.share_block(d)
            table.append(d)
            host.holds.append((step_id, h))
        del host.swapped[rec.seq_id]
        tables[rec.seq_id] = table
    host.swapped_in_blocks += len(mapping)
    host.swap_ins += len(recs)
    return tables


def drop_swapped(pool: Pool, seq_id: SeqId) -> None:
    """Forget a swapped-out sequence (freed, or its K/V never reached host)."""
    host = host_of(pool)
    rec = host.swapped.pop(seq_id)
    for h in reversed(rec.host_table):
        host.release(h)


def fail_from(pool: Pool, failed_from: int, last_closed: int) -> list[SeqId]:
    """Steps `failed_from … last_closed` failed: the swap-outs and offloads they carried never
    wrote host memory, nor did steps before them write what those swap-outs copied. Drops
    those swapped sequences (returned) and forgets the hashes of those offloaded blocks."""
    host = pool.host
    if host is None:
        return []
    dropped = [sid for sid, rec in host.swapped.items()
               if rec.data_step >= failed_from or failed_from <= rec.swap_step <= last_closed]
    for sid in dropped:
        drop_swapped(pool, sid)
    if host.disk is not None:
        host.disk.fail_from(failed_from, last_closed)
    for h in range(host.num_blocks):
        if failed_from <= host.write_step[h] <= last_closed and host.meta[h] is not None:
            host.forget(h)
    return dropped


# ---- snapshot and fsck -----------------------------------------------------------------------
def to_dict(host: HostTier) -> dict[str, Any]:
    return {
        "num_blocks": host.num_blocks,
        "ref_cnt": list(host.ref_cnt),
        "free_list": list(host.free_list),
        "cached_list": list(host.cached_list),
        "hashed_blocks": [[b, m.block_hash.hex(), None if m.parent_hash is None else m.parent_hash.hex(),
                           m.salt, list(m.token_ids)] for b, m in enumerate(host.meta) if m is not None],
        "write_step": [[b, ws] for b, ws in enumerate(host.write_step) if ws],
        "holds": [list(h) for h in host.holds],
        "swapped": [[r.seq_id, r.host_table, r.num_tokens, r.salt, r.hashing, r.tail_token_ids,
                     [h.hex() for h in r.block_hashes], r.data_step, r.swap_step] for r in host.swapped.values()],
        "counters": host.counters(),
        **({"disk": host.disk.to_dict()} if host.disk is not None else {}),
    }


def from_dict(d: dict[str, Any], max_blocks: int, meta_cls: type) -> HostTier:
    """`to_dict` output back; `meta_cls` is the pool's BlockMeta."""
    n = d["num_blocks"]
    if type(n) is not int or not 1 <= n <= max_blocks:
        raise ValueError(f"host num_blocks {n!r}")
    host = HostTier(n)
    ref = [int(x) for x in d["ref_cnt"]]
    if len(ref) != n:
        raise ValueError("host ref_cnt length differs from num_blocks")
    host.ref_cnt = ref
    while host.free_list.pop_front() is not None:
        pass
    for name, lst in (("free_list", host.free_list), ("cached_list", host.cached_list)):
        for b in d[name]:
            if type(b) is not int or not 0 <= b < n or b in host.free_list or b in host.cached_list:
                raise ValueError(f"host {name}: bad or repeated block {b!r}")
            lst.push_back(b)
    for b, h, parent, salt, tokens in d["hashed_blocks"]:
        meta = meta_cls(bytes.fromhex(h), None if parent is None else bytes.fromhex(parent), salt,
                         tuple(int(t) for t in tokens))
        if meta.block_hash in host.prefix_index or not 0 <= b < n:
            raise ValueError("host: two blocks with one hash, or a bad block")
        host.meta[b] = meta
        host.prefix_index[meta.block_hash] = int(b)
    for b, ws in d["write_step"]:
        host.write_step[int(b)] = int(ws)
    host.holds = [(int(s), int(b)) for s, b in d["holds"]]
    for sid, table, num_tokens, salt, hashing, tail, hashes, data_step, swap_step in d["swapped"]:
        host.swapped[SeqId(sid)] = SwappedSeq(SeqId(sid), [int(b) for b in table], int(num_tokens), salt,
                                              bool(hashing), [int(t) for t in tail],
                                              [bytes.fromhex(h) for h in hashes], int(data_step), int(swap_step))
    for name in _COUNTERS:
        setattr(host, name, int(d["counters"][name]))
    return host


def fsck_host(pool: Pool, live_ids: Iterable[SeqId]) -> list[str]:
    """Invariants of a pool's host tier: every block in exactly one place (free queue, cached
    queue, or held), ref counts equal to swapped tables + holds, no block both free and
    mapped, the index and the metadata agree, host and device indexes agree on content."""
    host = pool.host
    if host is None:
        return []
    p: list[str] = []
    name = f"pool {pool.pool_id!r} host"
    p.extend(f"{name} free list: {x}" for x in host.free_list.check())
    p.extend(f"{name} cached list: {x}" for x in host.cached_list.check())
    expected = [0] * host.num_blocks
    for rec in host.swapped.values():
        for h in set(rec.host_table):
            expected[h] += 1
        n_blocks = -(-rec.num_tokens // pool.block_size)
        if len(rec.host_table) != n_blocks:
            p.append(f"{name}: swapped {rec.seq_id!r} has {len(rec.host_table)} blocks for {rec.num_tokens} tokens")
    for _, h in host.holds:
        expected[h] += 1
    for h, n_loans in host_loan_holders(pool).items():   # pinned for another pool's fetch (fetch.py)
        expected[h] += n_loans
    live = set(live_ids)
    for sid in host.swapped:
        if sid in live:
            p.append(f"{name}: sequence {sid!r} is both swapped out and live")
    for b in range(host.num_blocks):
        in_free, in_cached = b in host.free_list, b in host.cached_list
        ref = host.ref_cnt[b]
        if ref != expected[b]:
            p.append(f"{name} block {b}: ref_cnt {ref}, held by {expected[b]}")
        places = int(in_free) + int(in_cached) + int(ref > 0)
        if places != 1:
            p.append(f"{name} block {b}: in {places} places (free={in_free} cached={in_cached} ref={ref})")
        m = host.meta[b]
        if in_free and m is not None:
            p.append(f"{name} block {b}: free but hashed")
        if in_cached and m is None:
            p.append(f"{name} block {b}: cached without a hash")
        if m is not None:
            if host.prefix_index.get(m.block_hash) != b:
                p.append(f"{name} block {b}: its hash is not indexed to it")
            d = pool.prefix_index.get(m.block_hash)
            dm = pool.meta[d] if d is not None else None
            if dm is not None and (dm.token_ids != m.token_ids or dm.parent_hash != m.parent_hash
                                   or dm.salt != m.salt):
                p.append(f"{name} block {b}: device block {d} has its hash with other content")
    if len(host.prefix_index) != sum(m is not None for m in host.meta):
        p.append(f"{name}: index and metadata disagree")
    disk = host.disk
    for op in pool.step.tier_ops:
        src_n, dst_n = (pool.num_blocks, host.num_blocks) if op.to_host else (host.num_blocks, pool.num_blocks)
        if op.kind in DISK_KINDS:
            n_disk = 0 if disk is None else disk.num_blocks
            src_n, dst_n = (host.num_blocks, n_disk) if op.kind == "disk_offload" else (n_disk, host.num_blocks)
        if not (0 <= op.src < src_n and 0 <= op.dst < dst_n):
            p.append(f"{name}: tier op {op} out of range")
    if disk is not None:
        p.extend(disk.fsck(pool))
    return p


__all__ = ["HostTier", "SwappedSeq", "TierOp", "TierKind", "DISK_KINDS", "TIER_KINDS", "TO_HOST"]
