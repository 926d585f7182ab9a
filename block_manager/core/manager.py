"""`BlockManager`: the deterministic state machine over pools, sequences and blocks.

Every public method either raises a `CoreError` before touching anything or completes
fully, so the service can journal a call and replay it to the same state. Nothing here
reads a clock, draws random numbers or iterates an unordered collection whose order
could leak into a result.

The one-sequencer contract (steps.py): everything a call changes in a pool's memory is
recorded in the pool's open step; `close_step` hands it to the scheduler, whose Forward for
the step runs the step's copy ops (copy-on-write, defrag moves) before any of its writes and
applies its table deltas; the scheduler reports the Forward with `settle_steps`. A block is a
defrag or copy-on-write source only once the step that wrote it is settled, a defrag plan
commits when the step carrying its moves is settled, and a failed step drops what it wrote.
So even when a copy's source is released and handed to another sequence in the same step,
the copy still reads the old content: the new owner's writes come after the step's copies.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from itertools import chain
from operator import attrgetter

import numpy as np

from block_manager.core import append as _append
from block_manager.core import defrag as _defrag
from block_manager.core import disk_tier as _disk
from block_manager.core import fetch as _fetch
from block_manager.core import kv_events as _kv_events
from block_manager.core import tiers as _tiers
from block_manager.core.append import INT64_MAX, INT64_MIN, AppendOutcome, append_columns, item_error
from block_manager.core.append_item import resolve_late
from block_manager.core.errors import (
    CoreError,
    FailedPrecondition,
    InvalidRequest,
    OutOfBlocks,
    PendingWrite,
    PoolDraining,
    SequenceExists,
    StepsUnsettled,
    UnknownPlan,
    UnknownPool,
    UnknownSequence,
    VersionConflict,
)
from block_manager.core.fsck import fsck
from block_manager.core.hashing import hash_prefix, token_array
from block_manager.core.kv_events import IndexView, KvChange
from block_manager.core.pool import MAX_POOL_BLOCKS, BlockMeta, Pool
from block_manager.core.sequence import Sequence, late_pending
from block_manager.core.slots import slot_range
from block_manager.core.snapshot import CoreParts, from_snapshot, to_snapshot
from block_manager.core.steps import StepRecord, StepWork, base_step, build_output, note_created, note_dropped
from block_manager.core.types import (
    AllocateResult,
    AppendFailure,
    AppendRequest,
    AppendResult,
    BlockId,
    CopyOp,
    DefragKind,
    DefragPlan,
    DefragPolicy,
    DiskTierMetrics,
    HostTierMetrics,
    PlanId,
    PoolId,
    PoolMetrics,
    RouteEntry,
    SeqId,
    SequenceView,
    SettleResult,
    StepId,
    StepOutput,
)

DEFAULT_MAX_UNSETTLED_STEPS = 4
_SEQ_ID = attrgetter("seq_id")
_NUM_NEW = attrgetter("num_new_tokens")
_TOKEN_IDS = attrgetter("token_ids")
_VERSION = attrgetter("version")
_POOL_ID = attrgetter("pool_id")


def _check_count(name: str, value: object, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise InvalidRequest(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class BlockManager:
    """Pools, sequences and their block tables; see docs/core_api.md for the contract."""

    def __init__(
        self,
        *,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        defrag_policy: DefragPolicy | None = None,
        max_unsettled_steps: int = DEFAULT_MAX_UNSETTLED_STEPS,
    ) -> None:
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not (
            0.0 <= watermark < 1.0
        ):
            raise InvalidRequest(f"watermark must be in [0, 1), got {watermark!r}")
        self.watermark = float(watermark)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.defrag_policy = defrag_policy if defrag_policy is not None else DefragPolicy()
        self.max_unsettled_steps = _check_count("max_unsettled_steps", max_unsettled_steps, 1)
        self._pools: dict[PoolId, Pool] = {}
        self._seqs: dict[SeqId, Sequence] = {}
        self._next_plan_id = 1
        self._kv_changes: list[KvChange] | None = None   # recorded prefix-index changes (kv_events.py)

    # ---- KV events --------------------------------------------------------------------
    def record_kv_changes(self) -> None:
        """From now on every prefix-index change of every pool is recorded (O(1) each) until
        `take_kv_changes` hands them over (see core/kv_events.py)."""
        if self._kv_changes is None:
            self._kv_changes = []
            for pool in self._pools.values():
                _kv_events.attach(pool, self._kv_changes)

    def take_kv_changes(self) -> list[KvChange]:
        """The changes recorded since the last call, oldest first (empty when not recording)."""
        out = self._kv_changes
        if not out:
            return []
        changes = list(out)
        out.clear()
        return changes

    def num_prefix_hashes(self, pool_id: PoolId) -> int:
        """Blocks of the pool's device tier findable by their hash (in use or cached)."""
        return len(self._pool(pool_id).prefix_index)

    def kv_index_view(self, with_tokens: bool = False) -> IndexView:
        """Every tier's prefix index as the KV events describe it (what a replay reproduces);
        `with_tokens`: each entry also carries the block's token ids."""
        return _kv_events.index_view(self._pools, with_tokens)

    # ---- lookups --------------------------------------------------------------------
    def _pool(self, pool_id: PoolId) -> Pool:
        pool = self._pools.get(pool_id)
        if pool is None:
            raise UnknownPool(f"unknown pool {pool_id!r}")
        return pool

    def _seq(self, seq_id: SeqId) -> Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            if self._swapped_pool(seq_id) is not None:
                raise FailedPrecondition(f"sequence {seq_id!r} is swapped out to host; swap it in first")
            raise UnknownSequence(f"unknown sequence {seq_id!r}")
        return seq

    def _swapped_pool(self, seq_id: SeqId) -> Pool | None:
        """The pool whose host tier holds `seq_id` swapped out, if any."""
        for pool in self._pools.values():
            if pool.host is not None and seq_id in pool.host.swapped:
                return pool
        return None

    def _watermark_blocks(self, pool: Pool) -> int:
        return int(self.watermark * pool.num_blocks)

    @property
    def pool_ids(self) -> list[PoolId]:
        return list(self._pools)

    # ---- pools ----------------------------------------------------------------------
    def add_pool(self, pool_id: PoolId, num_blocks: int, block_size: int, host_num_blocks: int = 0,
                 disk_num_blocks: int = 0, disk_blocks: Seq[_disk.SeedBlock] = ()) -> None:
        """A new pool, with a host tier of `host_num_blocks` and under it a disk tier of
        `disk_num_blocks` slots seeded with `disk_blocks` (what the node's segment file holds:
        docs/tiers.md). All or nothing."""
        if not isinstance(pool_id, str) or not pool_id:
            raise InvalidRequest(f"pool id must be a non-empty string, got {pool_id!r}")
        if pool_id in self._pools:
            raise InvalidRequest(f"pool {pool_id!r} already exists")
        _check_count("num_blocks", num_blocks, 1)
        _check_count("block_size", block_size, 1)
        if num_blocks > MAX_POOL_BLOCKS:
            raise InvalidRequest(f"num_blocks {num_blocks} exceeds {MAX_POOL_BLOCKS}")
        _check_count("host_num_blocks", host_num_blocks, 0)
        if host_num_blocks > MAX_POOL_BLOCKS:
            raise InvalidRequest(f"host_num_blocks {host_num_blocks} exceeds {MAX_POOL_BLOCKS}")
        _check_count("disk_num_blocks", disk_num_blocks, 0)
        if disk_num_blocks > MAX_POOL_BLOCKS:
            raise InvalidRequest(f"disk_num_blocks {disk_num_blocks} exceeds {MAX_POOL_BLOCKS}")
        if disk_num_blocks and not host_num_blocks:
            raise InvalidRequest("a disk tier needs a host tier above it (host_num_blocks > 0)")
        if disk_blocks and not disk_num_blocks:
            raise InvalidRequest("disk blocks given for a pool without a disk tier")
        pool = Pool(pool_id, num_blocks, block_size)
        if host_num_blocks:
            pool.host = _tiers.HostTier(host_num_blocks)
        if disk_num_blocks:
            _disk.attach(pool, _disk.DiskTier(disk_num_blocks))
        if self._kv_changes is not None:
            _kv_events.attach(pool, self._kv_changes)
        if disk_num_blocks:   # seeds are disk-tier events; malformed ones raise before any change
            _disk.seed(pool.host.disk, disk_blocks, block_size, BlockMeta)   # (the pool is not added)
        self._pools[pool_id] = pool

    def remove_pool(self, pool_id: PoolId) -> list[SeqId]:
        """Drop a pool with its sequences, pending ops and plan; returns the dropped ids."""
        pool = self._pool(pool_id)
        dropped = list(pool.seqs)
        for sid in dropped:
            del self._seqs[sid]
        if pool.host is not None:
            dropped.extend(pool.host.swapped)
        # its fetches never run now: the source blocks lent for them are unpinned (its own
        # loans go with it; a destination's pull from it fails and recomputes on the node)
        _fetch.repay(self._pools, pool_id, pool.step.step_id)
        del self._pools[pool_id]
        if self._kv_changes is not None:
            self._kv_changes.append((_kv_events.CLEARED, pool_id, None))
        return dropped

    def set_draining(self, pool_id: PoolId, draining: bool) -> None:
        self._pool(pool_id).draining = bool(draining)

    # ---- allocation -----------------------------------------------------------------
    def can_allocate(self, pool_id: PoolId, num_tokens: int) -> bool:
        """Whether a fresh (uncached) prompt of `num_tokens` would be admitted now."""
        pool = self._pool(pool_id)
        _check_count("num_tokens", num_tokens, 1)
        if pool.draining:
            return False
        needed = -(-num_tokens // pool.block_size)
        return needed <= pool.num_available - self._watermark_blocks(pool)

    def allocate(
        self,
        seq_id: SeqId,
        pool_id: PoolId,
        token_ids: Seq[int] | None = None,
        *,
        num_tokens: int | None = None,
        salt: str | None = None,
        num_compute: int | None = None,
        fetch_sources: Seq[PoolId] = (),
    ) -> AllocateResult:
        """Create a sequence for a prompt, reusing prefix-cached full blocks.

        All or nothing. Admission keeps `watermark * num_blocks` free-or-evictable blocks
        in reserve for running sequences' appends. When every block of the prompt is
        cached, the last block is still computed (num_cached_tokens <= num_tokens - 1):
        the model needs at least one query token to produce the next token's logits, and
        recomputing a whole block keeps the slot mapping block-aligned.
        Passing `num_tokens` instead of `token_ids` disables hashing for the sequence.

        `num_compute` caps how many tokens beyond the cached prefix get slots now (chunked
        prefill): the prefix lookup still sees the whole prompt, the sequence holds
        `num_cached_tokens + min(num_compute, rest)` tokens, and the scheduler appends the
        rest of the prompt (with its token ids) in later steps. The new tokens' slots are
        recorded in the pool's open step.

        `fetch_sources`: pools whose cached prefix blocks may be *fetched* (copied node to
        node, block_manager/core/fetch.py) where the prompt's cached prefix on this pool ends;
        the one with the longest prefix lends its blocks. Fetched tokens count as cached.
        """
        if not isinstance(seq_id, str) or not seq_id:
            raise InvalidRequest(f"sequence id must be a non-empty string, got {seq_id!r}")
        if seq_id in self._seqs or self._swapped_pool(seq_id) is not None:
            raise SequenceExists(f"sequence {seq_id!r} already exists")
        pool = self._pool(pool_id)
        if pool.draining:
            raise PoolDraining(f"pool {pool_id!r} is draining")
        if (token_ids is None) == (num_tokens is None):
            raise InvalidRequest("give exactly one of token_ids and num_tokens")
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequest(f"salt must be a string or None, got {type(salt).__name__}")
        if num_compute is not None:
            _check_count("num_compute", num_compute, 1)
        tokens = token_array(token_ids) if token_ids is not None else None
        prompt_len = len(tokens) if tokens is not None else _check_count("num_tokens", num_tokens, 1)
        if prompt_len == 0:
            raise InvalidRequest("empty prompt")
        bs = pool.block_size
        hashing = tokens is not None and self.enable_prefix_caching
        hashes = hash_prefix(tokens, bs, salt) if hashing else []
        hits = self._prefix_hits(pool, tokens, hashes, salt) if hashing else []
        # host hits continue the device prefix: onboarded (host->device copy) instead of recomputed
        onboard = (_tiers.host_hits(pool, tokens, hashes, salt, len(hits), hashes[len(hits) - 1] if hits else None)
                   if hashing and pool.host is not None else [])
        # disk hits continue the host ones: disk->host->device in this step (disk_tier.py)
        from_disk: list[int] = []
        if hashing and pool.host is not None and pool.host.disk is not None:
            n_on = len(hits) + len(onboard)
            room = pool.host.num_available - sum(1 for h in onboard if pool.host.ref_cnt[h] == 0)
            from_disk = _disk.disk_hits(pool, tokens, hashes, salt, n_on, hashes[n_on - 1] if n_on else None, room)
        # another node's prefix continues this node's own (device, host, disk): fetched node to node
        num_local = len(hits) + len(onboard) + len(from_disk)
        fetch = (self._fetch_plan(pool, tokens, hashes, salt, num_local, fetch_sources)
                 if hashing and fetch_sources else None)
        num_fetch = 0 if fetch is None else len(fetch.src_blocks)
        total = prompt_len
        if num_compute is not None:
            total = min(prompt_len, (num_local + num_fetch) * bs + num_compute)
            if tokens is not None:
                tokens = tokens[:total]
            hashes = hashes[: total // bs]
        num_new = -(-total // bs) - len(hits)
        hits_in_queue = sum(1 for b in hits if pool.ref_cnt[b] == 0)
        available = pool.num_available - hits_in_queue - self._watermark_blocks(pool)
        if available < num_new <= available + self._unsent_plan_blocks(pool):
            self._reclaim_unsent_plan(pool)   # all or nothing: only when it makes room enough
            available = pool.num_available - hits_in_queue - self._watermark_blocks(pool)
        if num_new > available:
            raise OutOfBlocks(
                f"pool {pool_id!r}: {num_new} blocks needed, {max(available, 0)} available "
                f"above the watermark"
            )

        for b in hits:
            pool.share_block(b)
        if onboard:
            _tiers.pin(pool, onboard)
        staged: list[int] = []
        if from_disk:
            _disk.pin(pool, from_disk)
            staged = _disk.stage(pool, from_disk)   # host blocks, taken before any device block
        table = hits + [pool.take_block() for _ in range(num_new)]
        if onboard:
            _tiers.onboard(pool, onboard, table[len(hits):len(hits) + len(onboard)], bs)
        if staged:
            first = len(hits) + len(onboard)
            _tiers.onboard(pool, staged, table[first:first + len(staged)], bs, count_hits=False)
        step = pool.step
        if fetch is not None:
            first = num_local
            fid = _fetch.fetch_id(pool_id, step.step_id, seq_id)
            _fetch.lend(fetch.src, pool.pool_id, step.step_id, fid, fetch.src_blocks, fetch.src_host)
            _fetch.queue_fetch(pool, _fetch.FetchOp(
                fid, fetch.src.pool_id, tuple(BlockId(b) for b in fetch.src_blocks),
                tuple(BlockId(b) for b in table[first:first + num_fetch]), SeqId(seq_id), first * bs,
                tuple(tokens[first * bs:(first + num_fetch) * bs].tolist()),   # type: ignore[index]
                tuple(fetch.src_host) if any(fetch.src_host) else (),
            ))
        # the pool's own id object: the batched append tells pools apart by identity
        seq = Sequence(seq_id, pool.pool_id, table, total, pool.new_version(), salt, hashing, cols=pool.cols)
        num_cached = (num_local + num_fetch) * bs
        step.has_writes = True
        seq.last_step = seq.last_write_step = step.step_id
        for b in table[len(hits) :]:
            pool.write_step[b] = step.step_id
        if hashing:
            parent = hashes[len(hits) - 1] if hits else None
            for i in range(len(hits), len(hashes)):
                block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
                if pool.register(table[i], hashes[i], parent, salt, block_tokens):
                    step.registrations.append((table[i], hashes[i]))
                parent = hashes[i]
            seq.block_hashes = hashes
            seq.tail_token_ids = tokens[len(hashes) * bs :].tolist()
            pool.prefix_query_tokens += prompt_len
            pool.prefix_hit_tokens += len(hits) * bs
        self._seqs[seq_id] = seq
        pool.seqs[seq_id] = seq
        note_created(step, seq, num_cached)
        return AllocateResult(
            seq_id, pool_id, tuple(table), num_cached, slot_range(table, bs, num_cached, total),
            seq.version,
        )

    def _prefix_hits(
        self, pool: Pool, tokens: array, hashes: list[bytes], salt: str | None, *, same_step: bool = True,
    ) -> list[int]:
        """Blocks of the longest cached prefix, capped to leave one token to compute.

        A hit is read, never written, by the new sequence's Forward, so it must hold its K/V
        by the time that Forward reads it. Blocks whose writing step is reported complete
        count; so, with `same_step`, do blocks filled in this very step (two prompts with one
        prefix admitted together, as vLLM's scheduler shares them): the node runs a step's
        K/V writes of a layer — copies, onboards and fetches before them — ahead of that
        layer's attention, and if the step fails every sequence it touched is dropped, the
        reader with the writer. Without it (a fetch source: another node reads the block
        before this step's Forward runs) only written blocks count. A block filled by a step
        still in flight is never a hit: the next step computes the prefix itself."""
        bs = pool.block_size
        max_hits = min(len(hashes), (len(tokens) - 1) // bs)
        hits: list[int] = []
        parent = None
        open_step = pool.step.step_id if same_step else None
        for i in range(max_hits):
            b = pool.lookup(hashes[i], parent, salt, tuple(tokens[i * bs : (i + 1) * bs]))
            if b is None or not (pool.written(b) or pool.write_step[b] == open_step):
                break
            hits.append(b)
            parent = hashes[i]
        return hits

    def _fetch_plan(
        self, pool: Pool, tokens: array, hashes: list[bytes], salt: str | None, num_local: int,
        sources: Seq[PoolId],
    ) -> _fetch.FetchPlan | None:
        """The source pool among `sources` with the longest written prefix beyond `num_local`
        blocks — its device hits, then host-tier hits continuing them — (ties: pool id), and the
        blocks to fetch from it; None: nothing worth fetching."""
        best: tuple[Pool, list[int], list[int]] | None = None
        for sid in sorted(set(sources)):
            src = self._pools.get(sid)
            if (src is None or src is pool or src.block_size != pool.block_size
                    or not _fetch.can_lend(src, self.max_unsettled_steps)):
                continue
            src_hits = self._prefix_hits(src, tokens, hashes, salt, same_step=False)
            host_hits = (_tiers.host_hits(src, tokens, hashes, salt, len(src_hits),
                                          hashes[len(src_hits) - 1] if src_hits else None)
                         if src.host is not None else [])
            if best is None or len(src_hits) + len(host_hits) > len(best[1]) + len(best[2]):
                best = (src, src_hits, host_hits)
        return None if best is None else _fetch.plan(best[0], best[1], best[2], num_local)

    def can_append(self, seq_id: SeqId, num_new_tokens: int) -> bool:
        """Whether `append_slots` would succeed for this sequence alone (appends may use
        the watermark reserve; a copy-on-write needs its source's step settled)."""
        seq = self._seq(seq_id)
        _check_count("num_new_tokens", num_new_tokens, 1)
        pool = self._pools[seq.pool_id]
        bs = pool.block_size
        needed = -(-(seq.num_tokens + num_new_tokens) // bs) - len(seq.block_table)
        if seq.num_tokens % bs and pool.ref_cnt[seq.block_table[-1]] > 1:
            if not pool.written(seq.block_table[-1]):
                return False  # the copy-on-write source is not written yet (PendingWrite)
            needed += 1
        return needed <= pool.num_available

    def append_tokens(
        self,
        seq_ids: Seq[SeqId],
        num_new_tokens: Seq[int],
        token_ids: Seq[int] | None = None,
        *,
        already_written: bool = False,
        num_late: Seq[int] | None = None,
    ) -> AppendOutcome:
        """Add tokens to a batch of sequences (one scheduler step), columnar: sequence i gets
        `num_new_tokens[i]` tokens; `token_ids` holds all their ids back to back (or is None:
        hashing then stops for those sequences, the chain cannot continue without content).
        With `num_late`, the last `num_late[i]` ids of item i are placeholders: the real ones
        come with `resolve_late` before the sequence takes anything else (late ids, for a
        scheduler that plans a step before the previous one sampled; see append_item.py).

        Per sequence: blocks added at block boundaries, and a copy-on-write op when the
        partial last block is shared (ref_cnt > 1: the sequence gets a fresh block, the node
        copies the old one first — only once the step that wrote that block is settled,
        `PendingWrite` otherwise). A sequence that fails (unknown, malformed, out of blocks)
        is listed in `failures` and is unchanged; the others proceed in request order. The
        new tokens' slots follow from the tables (`slot_range`), which reach the node as the
        step's deltas. Counts one step for each pool touched.

        `already_written=True` reports tokens the scheduler already wrote into the
        sequence's exclusive partial last block without asking (see append.py).
        """
        return append_columns(self._pools, self._seqs, seq_ids, num_new_tokens, token_ids,
                              already_written=already_written, num_late=num_late)

    def resolve_late(
        self, seq_ids: Seq[SeqId], num_token_ids: Seq[int], token_ids: Seq[int]
    ) -> list[tuple[int, CoreError]]:
        """The late ids of earlier appends: sequence i gets the next `num_token_ids[i]` of
        `token_ids` for its tokens that await theirs (all of them at once); a full last block
        is hashed then. Per item: a failed item (unknown sequence, wrong count, a bad id)
        changes nothing and is listed; the others apply in order."""
        if len(num_token_ids) != len(seq_ids):
            raise InvalidRequest(f"{len(num_token_ids)} late-id counts for {len(seq_ids)} sequences")
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidRequest("a sequence appears twice among the late ids")
        if sum(num_token_ids) != len(token_ids):
            raise InvalidRequest(f"{len(token_ids)} late ids for counts summing to {sum(num_token_ids)}")
        failures: list[tuple[int, CoreError]] = []
        pos = 0
        for i, (sid, k) in enumerate(zip(seq_ids, num_token_ids)):
            ids = token_ids[pos : pos + k]
            pos += k
            seq = self._seqs.get(sid)
            if seq is None:
                failures.append((i, UnknownSequence(f"unknown sequence {sid!r}")))
                continue
            bad = next((t for t in ids if type(t) is not int or not INT64_MIN <= t <= INT64_MAX), None)
            try:
                if bad is not None:
                    raise InvalidRequest(f"token id {bad!r} is not an int64 integer")
                resolve_late(self._pools[seq.pool_id], seq, ids)
            except CoreError as exc:
                failures.append((i, exc))
        return failures

    def append_slots(
        self, requests: Seq[AppendRequest], *, already_written: bool = False
    ) -> list[AppendResult | AppendFailure]:
        """`append_tokens` with one request object per sequence and, per sequence, its new
        tokens' slots, the blocks it gained and its copy-on-write op (what an embedding
        scheduler that drives its workers directly wants)."""
        reqs = list(requests)
        seqs = self._seqs
        seq_ids = list(map(_SEQ_ID, reqs))
        counts = list(map(_NUM_NEW, reqs))
        token_ids = list(map(_TOKEN_IDS, reqs))
        if token_ids.count(None) == len(reqs) or (
            None not in token_ids and list(map(len, token_ids)) == counts  # type: ignore[arg-type]
        ):
            # The common batch: one columnar append, whose screen finds every item error.
            ids = None if not reqs or token_ids[0] is None else list(chain.from_iterable(token_ids))  # type: ignore[arg-type]
            out = append_columns(self._pools, seqs, seq_ids, counts, ids, already_written=already_written)
            bad: dict[int, CoreError] = dict(out.failures)
            ops = out.copy_ops
            after = out.num_tokens
        else:
            bad, ops = self._append_slots_itemwise(reqs, already_written)
            after = [0 if i in bad else seqs[sid].num_tokens for i, sid in enumerate(seq_ids)]
        if not bad and len(reqs) >= _append.VECTOR_MIN_ITEMS and counts.count(1) == len(reqs):
            decoded = self._decode_results(seq_ids, after, ops)
            if decoded is not None:
                return decoded
        results: list[AppendResult | AppendFailure] = []
        push = results.append
        pools = self._pools
        last_pid = None
        bs = 1
        # Tables cover exactly their tokens (len == ceil(num_tokens / block_size)), so what a
        # sequence had before follows from its count after: no copy of the state up front.
        for i, (sid, n, nt) in enumerate(zip(seq_ids, counts, after)):
            if bad and i in bad:
                push(AppendFailure(sid, bad[i]))
                continue
            seq = seqs[sid]
            if seq.pool_id is not last_pid:
                last_pid = seq.pool_id
                bs = pools[last_pid].block_size
            table = seq.block_table
            op = ops.get(i) if ops else None
            old = nt - n
            if n == 1:   # decode: its slot is in the last block, which is new when `old` was aligned
                off = old % bs
                last = table[-1]
                push(AppendResult(sid, (last * bs + off,), () if off else (last,), () if op is None else (op,),
                                  seq.version, nt))
            else:
                push(AppendResult(   # block ids are plain ints at run time (BlockId is a NewType)
                    sid, slot_range(table, bs, old, nt), tuple(table[-(-old // bs):]),
                    () if op is None else (op,), seq.version, nt,
                ))
        return results

    def _decode_results(
        self, seq_ids: list[SeqId], after: list[int], ops: dict[int, CopyOp]
    ) -> list[AppendResult | AppendFailure] | None:
        """`append_slots` results of a decode batch of one pool (one token each, none failed),
        from the columns: the token went to the (new) last block, which is a new block when
        the sequence was block-aligned before. None: several pools (the general loop runs)."""
        pool = self._pools[self._seqs[seq_ids[0]].pool_id]
        cols = pool.cols
        try:
            rows = np.fromiter(map(cols.row_of.__getitem__, seq_ids), np.intp, len(seq_ids))
        except KeyError:
            return None
        bs = pool.block_size
        last = cols.last_block_np[rows]
        off = (np.array(after, np.int64) - 1) % bs
        slots = list(zip((last * bs + off).tolist()))
        new: list[tuple[int, ...]] = [()] * len(seq_ids)
        crossed = (off == 0).nonzero()[0]
        for i, b in zip(crossed.tolist(), last[crossed].tolist()):
            new[i] = (b,)
        copies: list[tuple[CopyOp, ...]] = [()] * len(seq_ids)
        for i, op in ops.items():
            copies[i] = (op,)
        versions = list(map(_VERSION, map(self._seqs.__getitem__, seq_ids)))
        return list(map(AppendResult, seq_ids, slots, new, copies, versions, after))

    def _append_slots_itemwise(
        self, reqs: list[AppendRequest], already_written: bool
    ) -> tuple[dict[int, CoreError], dict[int, CopyOp]]:
        """`append_slots` of a batch whose items' token tuples disagree with their counts (a
        flat list cannot say which) or that mixes items with and without token ids: each
        item validated alone, then columnar runs (mixed: one item at a time). Several runs
        are still one scheduler step: each pool counts it once (the defrag policy's
        `every_n_steps` cadence reads the count)."""
        bad: dict[int, CoreError] = {}
        seen: set[str] = set()
        for i, r in enumerate(reqs):
            err = item_error(self._seqs, self._pools, seen, r.seq_id, r.num_new_tokens, r.token_ids, already_written)
            if err is not None:
                bad[i] = err
            if r.seq_id in self._seqs:
                seen.add(r.seq_id)
        good = [i for i in range(len(reqs)) if i not in bad]
        with_ids = [i for i in good if reqs[i].token_ids is not None]
        runs = [good] if len(with_ids) in (0, len(good)) else [[i] for i in good]
        ops: dict[int, CopyOp] = {}
        steps_before = {pid: pool.num_steps for pid, pool in self._pools.items()}
        for run in runs:
            rs = [reqs[i] for i in run]
            ids = None if rs and rs[0].token_ids is None else [t for r in rs for t in r.token_ids]  # type: ignore[union-attr]
            out = append_columns(self._pools, self._seqs, [r.seq_id for r in rs], [r.num_new_tokens for r in rs],
                                 ids, already_written=already_written)
            for j, err in out.failures:
                bad[run[j]] = err
            for j, op in out.copy_ops.items():
                ops[run[j]] = op
        for pid, num_steps in steps_before.items():
            pool = self._pools[pid]
            pool.num_steps = min(pool.num_steps, num_steps + 1)
        return bad, ops

    def fork(self, parent: SeqId, child_ids: Seq[SeqId]) -> list[SequenceView]:
        """Children share every block of the parent (ref counts up, nothing copied); the
        first write into a shared partial block triggers copy-on-write."""
        src = self._seq(parent)
        children = list(child_ids)
        if not children:
            raise InvalidRequest("fork needs at least one child id")
        if len(set(children)) != len(children):
            raise InvalidRequest("duplicate child ids")
        for cid in children:
            if not isinstance(cid, str) or not cid:
                raise InvalidRequest(f"sequence id must be a non-empty string, got {cid!r}")
            if cid in self._seqs or self._swapped_pool(cid) is not None:
                raise SequenceExists(f"sequence {cid!r} already exists")
        pool = self._pools[src.pool_id]
        if pool.draining:
            raise PoolDraining(f"pool {src.pool_id!r} is draining")
        if (pending := late_pending(src)) is not None:   # the children would inherit placeholders
            raise pending
        views: list[SequenceView] = []
        step = pool.step
        for cid in children:
            for b in src.block_table:
                pool.share_block(b)
            child = Sequence(
                cid, src.pool_id, list(src.block_table), src.num_tokens, pool.new_version(), src.salt,
                src.hashing, list(src.tail_token_ids), list(src.block_hashes),
                # A child's table is announced in this step: if the step fails the node never
                # learns it (and the parent's unsettled writes are the child's too).
                last_step=step.step_id, cols=pool.cols,
            )
            self._seqs[cid] = child
            pool.seqs[cid] = child
            note_created(step, child, src.num_tokens)
            views.append(child.view())
        return views

    def free(self, seq_ids: Seq[SeqId]) -> None:
        """Release sequences. Full hashed blocks that drop to ref_cnt 0 stay cached (the
        sequence's tail is evicted first); other blocks are free at once. All or nothing;
        `PendingWrite` for a sequence with tokens to write in its pool's open step."""
        ids = list(seq_ids)
        if len(set(ids)) != len(ids):
            raise InvalidRequest("duplicate sequence ids in free")
        for sid in ids:
            self.check_can_free(sid)
        for sid in ids:
            host_pool = self._swapped_pool(sid) if sid not in self._seqs else None
            if host_pool is not None:
                _tiers.drop_swapped(host_pool, sid)   # a swapped-out sequence frees its host blocks
            else:
                self._drop(sid)

    def check_can_free(self, seq_id: SeqId) -> None:
        """`UnknownSequence`, or `PendingWrite` when the sequence has tokens to write in its
        pool's open step (its writes, which forks and prefix hits may share, would never run)."""
        if seq_id not in self._seqs and self._swapped_pool(seq_id) is not None:
            return   # swapped out: nothing to write, its host blocks go at once
        seq = self._seq(seq_id)
        open_id = self._pools[seq.pool_id].step.step_id
        if seq.last_write_step == open_id:
            raise PendingWrite(
                f"sequence {seq_id!r} has tokens to write in open step {open_id} of pool {seq.pool_id!r}; "
                "close the step and run its Forward before freeing it"
            )

    def _drop(self, seq_id: SeqId) -> None:
        seq = self._seqs.pop(seq_id)
        pool = self._pools[seq.pool_id]
        del pool.seqs[seq_id]
        for b in reversed(seq.block_table):
            pool.release_block(b)
        seq.release()
        note_dropped(pool.step, seq_id)

    # ---- views ----------------------------------------------------------------------
    def get_sequence(self, seq_id: SeqId) -> SequenceView:
        return self._seq(seq_id).view()

    def has_sequence(self, seq_id: SeqId) -> bool:
        """Whether the sequence exists (on device, or swapped out to host)."""
        return seq_id in self._seqs or self._swapped_pool(seq_id) is not None

    def pools_of(self, seq_ids: Seq[SeqId]) -> set[PoolId]:
        """The pools of the known sequences among `seq_ids` (unknown ones are skipped);
        cheap: no view is built (a Step asks this for every sequence it names)."""
        pools = set(map(_POOL_ID, filter(None, map(self._seqs.get, seq_ids))))
        for pool in self._pools.values():
            if pool.host is not None and pool.host.swapped and not pool.host.swapped.keys().isdisjoint(seq_ids):
                pools.add(pool.pool_id)
        return pools

    def get_tables(
        self, seq_ids: Seq[SeqId], known_versions: Mapping[SeqId, int] | None = None
    ) -> list[SequenceView]:
        """Views of the sequences whose table is newer than the caller's version."""
        known = known_versions or {}
        seqs = [self._seq(sid) for sid in seq_ids]
        out: list[SequenceView] = []
        for seq in seqs:
            have = known.get(seq.seq_id)
            if have is not None and have > seq.version:
                raise VersionConflict(
                    f"sequence {seq.seq_id!r}: caller has version {have}, core {seq.version}"
                )
            if have is None or have < seq.version:
                out.append(seq.view())
        return out

    def sequences(self, pool_id: PoolId | None = None) -> list[SequenceView]:
        if pool_id is None:
            return [s.view() for s in self._seqs.values()]
        return [s.view() for s in self._pool(pool_id).seqs.values()]

    # ---- steps ----------------------------------------------------------------------
    def open_step_id(self, pool_id: PoolId) -> StepId:
        """The step new work of the pool is recorded in."""
        return self._pool(pool_id).step.step_id

    def settled_step_id(self, pool_id: PoolId) -> int:
        """Every step of the pool up to this one is reported (complete or failed)."""
        return self._pool(pool_id).settled_step

    def unsettled_step_ids(self, pool_id: PoolId) -> list[StepId]:
        """Closed steps whose Forward is not reported yet, oldest first."""
        return [r.step_id for r in self._pool(pool_id).unsettled]

    def writers_since(self, pool_id: PoolId, step_id: int) -> list[SeqId]:
        """The sequences a failure of `step_id` (and later steps) would drop."""
        return [sid for sid, seq in self._pool(pool_id).seqs.items() if seq.last_touched_step >= step_id]

    def abandon_pool(self, pool_id: PoolId) -> list[SeqId]:
        """Hand the pool to a new scheduler: drop every sequence (the old scheduler's), count its
        unsettled steps as failed (their hashes forgotten), abort its plan, and make the next
        step a reset (the node forgets every table of the pool). Returns the dropped ids."""
        pool = self._pool(pool_id)
        if pool.plan is not None:
            _defrag.abort(pool)
        dropped = list(pool.seqs)
        for sid in dropped:
            seq = self._seqs.pop(sid)
            del pool.seqs[sid]
            for b in reversed(seq.block_table):
                pool.release_block(b)
            seq.release()
        if pool.host is not None:
            # The old scheduler's unsettled and open steps never run: their host writes are void.
            dropped.extend(_tiers.fail_from(pool, pool.settled_step + 1, pool.step.step_id))
            for sid in list(pool.host.swapped):
                _tiers.drop_swapped(pool, sid)
                dropped.append(sid)
            pool.host.release_holds(pool.step.step_id)
        for registrations in [*(r.registrations for r in pool.unsettled), pool.step.registrations]:
            for b, block_hash in registrations:
                pool.unregister(b, block_hash)
        _fetch.repay(self._pools, pool_id, pool.step.step_id)   # its fetches never run
        pool.unsettled = []
        pool.settled_step = pool.step.step_id - 1
        # The open step's own work belonged to the old scheduler too: the next step only resets.
        pool.step = StepWork(pool.step.step_id, reset=True, base_step_id=0)
        return dropped

    def can_close_step(self, pool_id: PoolId) -> bool:
        """Whether `close_step` would hand out a step now (it has work and the pool is below
        its limit of unsettled steps)."""
        pool = self._pool(pool_id)
        return pool.step.has_work and len(pool.unsettled) < self.max_unsettled_steps

    def close_step(self, pool_id: PoolId, *, force: bool = False) -> StepOutput | None:
        """Close the pool's open step and hand it to the scheduler (None: it has no work).

        Table changes alone (new, rewritten or dropped tables) do not close a step: they wait
        for the next step that writes (its Forward applies them first). `force=True` hands
        them out anyway (a scheduler that wants its nodes' tables in sync now).
        `StepsUnsettled` (state unchanged, the work stays in the open step) when
        `max_unsettled_steps` closed steps already await their Forward report.
        """
        pool = self._pool(pool_id)
        step = pool.step
        if not (step.has_work or (force and (step.dirty or step.dropped))):
            return None
        if len(pool.unsettled) >= self.max_unsettled_steps:
            raise StepsUnsettled(
                f"pool {pool_id!r}: steps {[r.step_id for r in pool.unsettled]} await their Forward report; "
                f"settle them before closing step {step.step_id}"
            )
        out = build_output(pool_id, step, pool.seqs)
        pool.unsettled.append(StepRecord(step.step_id, step.registrations, step.plan_id, base_step(step)))
        pool.step = StepWork(StepId(step.step_id + 1))
        return out

    def close_steps(self) -> list[StepOutput]:
        """Close the open step of every pool that has work, in pool order."""
        return [out for pid in list(self._pools) if self.can_close_step(pid) and (out := self.close_step(pid))]

    def settle_steps(self, pool_id: PoolId, completed_up_to: int, failed_from: int | None = None) -> SettleResult:
        """The scheduler's report of its Forwards: every closed step up to `completed_up_to`
        ran; every closed step from `failed_from` on (which must directly follow the completed
        ones) did not.

        Completed: their blocks count as written; a defrag plan whose moves they carried
        commits (its table rewrites go into the open step, to be delivered with the next
        one). Failed: their plan aborts, the sequences they wrote are dropped (their K/V is
        missing; announced as dropped in the open step), and the prefix-cache hashes of the
        blocks they filled are forgotten. Reporting an already settled step again is a no-op.
        """
        pool = self._pool(pool_id)
        _check_count("completed_up_to", completed_up_to, 0)
        last_closed = pool.last_closed_step
        if completed_up_to > last_closed:
            raise StepsUnsettled(
                f"pool {pool_id!r}: step {completed_up_to} was never handed out (last closed step {last_closed})"
            )
        done = max(completed_up_to, pool.settled_step)
        if failed_from is not None:
            _check_count("failed_from", failed_from, 1)
            if failed_from <= done:
                raise InvalidRequest(
                    f"pool {pool_id!r}: step {failed_from} is reported failed but is already settled "
                    f"(settled up to {done})"
                )
            if failed_from != done + 1:
                raise InvalidRequest(
                    f"pool {pool_id!r}: a failed step must directly follow the completed ones "
                    f"(completed up to {done}, failed from {failed_from})"
                )
            if failed_from > last_closed:
                raise StepsUnsettled(f"pool {pool_id!r}: step {failed_from} was never handed out")
        committed: list[PlanId] = []
        aborted: list[PlanId] = []
        dropped: list[SeqId] = []
        pool.settled_step = done
        pool.unsettled = [r for r in pool.unsettled if r.step_id > done]
        if pool.host is not None:
            pool.host.release_holds(done)
        if pool.plan is not None and pool.plan.step_id <= done:
            committed.append(pool.plan.plan_id)
            _defrag.commit(pool)
        if failed_from is not None and failed_from > done:
            failed = pool.unsettled
            pool.unsettled = []
            pool.settled_step = last_closed
            # The next step builds on what the first failed step was built on: the node holds
            # that state and lacks every failed step (`failed_from - 1` may itself have failed
            # in an earlier report, so it is not necessarily applied).
            pool.step.base_step_id = failed[0].base_step_id
            if pool.plan is not None and pool.plan.step_id >= failed_from:
                aborted.append(pool.plan.plan_id)
                _defrag.abort(pool)
            dropped = [sid for sid, seq in pool.seqs.items() if seq.last_touched_step >= failed_from]
            for sid in dropped:
                self._drop(sid)
            for record in failed:
                for b, block_hash in record.registrations:
                    pool.unregister(b, block_hash)
            if pool.host is not None:
                dropped.extend(_tiers.fail_from(pool, failed_from, last_closed))
                pool.host.release_holds(last_closed)
        # the fetches of reported steps are over (pulled, or recomputed by the node): unpin
        _fetch.repay(self._pools, pool_id, pool.settled_step)
        return SettleResult(pool_id, StepId(pool.settled_step), tuple(committed), tuple(aborted), tuple(dropped))

    # ---- host tier: swap preemption ---------------------------------------------------
    def is_swapped(self, seq_id: SeqId) -> bool:
        return seq_id not in self._seqs and self._swapped_pool(seq_id) is not None

    def swapped_ids(self, pool_id: PoolId | None = None) -> list[SeqId]:
        pools = [self._pool(pool_id)] if pool_id is not None else list(self._pools.values())
        return [sid for p in pools if p.host is not None for sid in p.host.swapped]

    def _by_pool(self, items: list, pool_of) -> list[tuple[Pool, list]]:
        groups: dict[PoolId, list] = {}
        for it in items:
            groups.setdefault(pool_of(it), []).append(it)
        return [(self._pools[pid], group) for pid, group in groups.items()]

    def can_swap_out(self, seq_ids: Seq[SeqId]) -> bool:
        """Whether `swap_out` would succeed now (host room, no writes pending in the open step)."""
        try:
            self._check_swap_out(list(seq_ids))
        except CoreError:
            return False
        return True

    def _check_swap_out(self, ids: list[SeqId]) -> list[tuple[Pool, list]]:
        if not ids:
            raise InvalidRequest("swap_out needs at least one sequence id")
        if len(set(ids)) != len(ids):
            raise InvalidRequest("duplicate sequence ids in swap_out")
        seqs = [self._seq(sid) for sid in ids]
        groups = self._by_pool(seqs, _POOL_ID)
        for pool, group in groups:
            _tiers.check_swap_out(pool, group)
        return groups

    def swap_out(self, seq_ids: Seq[SeqId]) -> None:
        """Preempt sequences to their pool's host tier: their blocks are copied device->host in
        the open step (a block shared inside the group once), their device blocks released (the
        copy reads them before anything of the step writes them), their tables dropped from the
        node. All or nothing: `OutOfBlocks` when the host tier lacks room (the scheduler falls
        back to recompute), `PendingWrite` when a sequence has writes in the open step."""
        for pool, group in self._check_swap_out(list(seq_ids)):
            _tiers.swap_out(pool, group)
            for seq in group:
                self._drop(seq.seq_id)

    def can_swap_in(self, seq_ids: Seq[SeqId]) -> bool:
        try:
            self._check_swap_in(list(seq_ids))
        except CoreError:
            return False
        return True

    @staticmethod
    def _unsent_plan_blocks(pool: Pool) -> int:
        """Blocks `_reclaim_unsent_plan` would return to the free queue."""
        plan = pool.plan
        if plan is None or plan.step_id != pool.step.step_id:
            return 0
        return sum(1 + (pool.ref_cnt[op.src] == 0) for op in plan.moves)

    def _reclaim_unsent_plan(self, pool: Pool) -> bool:
        """Abort a defrag plan still in the pool's open step (no node has its copies), because
        its reserved blocks are needed now; whether one was aborted. Why: a pool's open step
        closes only with token work (service/state.py), so a plan made as the pool's last
        running sequence finished holds its blocks until new work comes — and the work waiting
        (swap-ins, admissions) may need exactly those blocks: a livelock. Its copies leave
        the open step with it, so nothing later taken from its destinations is overwritten."""
        plan = pool.plan
        if plan is None or plan.step_id != pool.step.step_id:
            return False
        moves = {op.op_id for op in plan.moves}
        pool.step.copy_ops = [op for op in pool.step.copy_ops if op.op_id not in moves]
        pool.step.plan_id = None
        _defrag.abort(pool)
        return True

    def _check_swap_in(self, ids: list[SeqId], reclaim: bool = False) -> list[tuple[Pool, list]]:
        if not ids:
            raise InvalidRequest("swap_in needs at least one sequence id")
        if len(set(ids)) != len(ids):
            raise InvalidRequest("duplicate sequence ids in swap_in")
        recs = []
        for sid in ids:
            pool = self._swapped_pool(sid)
            if pool is None:
                if sid in self._seqs:
                    raise FailedPrecondition(f"sequence {sid!r} is not swapped out")
                raise UnknownSequence(f"unknown sequence {sid!r}")
            recs.append((pool.pool_id, pool.host.swapped[sid]))  # type: ignore[union-attr]
        groups = [(pool, [r for _, r in group]) for pool, group in self._by_pool(recs, lambda x: x[0])]
        for pool, group in groups:
            if pool.draining:
                raise PoolDraining(f"pool {pool.pool_id!r} is draining")
            try:
                _tiers.check_swap_in(pool, group, self._watermark_blocks(pool))
            except OutOfBlocks:
                if not (reclaim and self._reclaim_unsent_plan(pool)):
                    raise
                _tiers.check_swap_in(pool, group, self._watermark_blocks(pool))
        return groups

    def swap_in(self, seq_ids: Seq[SeqId]) -> list[SequenceView]:
        """Resume swapped-out sequences on device: fresh device blocks (any ids), host->device
        copies in the open step, their tables announced anew in it (the node's next write for
        each starts at its token count). All or nothing: `PendingWrite` while the swap-out's
        step is unreported, `OutOfBlocks` above the watermark."""
        views: list[SequenceView] = []
        for pool, recs in self._check_swap_in(list(seq_ids), reclaim=True):
            tables = _tiers.swap_in(pool, recs)
            step = pool.step
            for rec in recs:
                seq = Sequence(rec.seq_id, pool.pool_id, tables[rec.seq_id], rec.num_tokens, pool.new_version(),
                               rec.salt, rec.hashing, rec.tail_token_ids, rec.block_hashes,
                               last_step=step.step_id, cols=pool.cols)
                self._seqs[rec.seq_id] = seq
                pool.seqs[rec.seq_id] = seq
                note_created(step, seq, rec.num_tokens)
                views.append(seq.view())
        return views

    # ---- prefix cache ---------------------------------------------------------------
    def route(
        self, token_ids: Seq[int], salt: str | None = None, fetch_sources: Seq[PoolId] | None = None,
    ) -> list[RouteEntry]:
        """Pools that admit new sequences, best first by the fetch cost model
        (`fetch.score`: tokens to recompute + fetched tokens / FETCH_SPEEDUP; so the longest
        local prefix still wins), then most free-or-evictable blocks, then pool id. Per pool:
        its local prefix tokens, the tokens it could fetch beyond them from the best other
        pool among `fetch_sources` (None: every pool, draining ones included) and the rest."""
        tokens = token_array(token_ids)
        if not tokens:
            raise InvalidRequest("empty prompt")
        hashes_by_size: dict[int, list[bytes]] = {}
        hits: dict[PoolId, int] = {}        # device hits (a pool's local prefix)
        lendable: dict[PoolId, int] = {}    # a source's device hits + host hits continuing them
        sources = set(self._pools) if fetch_sources is None else set(fetch_sources) & set(self._pools)
        if self.enable_prefix_caching:
            for pool in self._pools.values():
                if pool.draining and pool.pool_id not in sources:
                    continue
                hashes = hashes_by_size.get(pool.block_size)
                if hashes is None:
                    hashes = hash_prefix(tokens, pool.block_size, salt)
                    hashes_by_size[pool.block_size] = hashes
                device = self._prefix_hits(pool, tokens, hashes, salt)
                hits[pool.pool_id] = len(device)
                # lent only once written (`_fetch_plan`): not the blocks of this open step
                n = next((i for i, b in enumerate(device) if not pool.written(b)), len(device))
                if pool.pool_id in sources and pool.host is not None:
                    n += len(_tiers.host_hits(pool, tokens, hashes, salt, n, hashes[n - 1] if n else None))
                lendable[pool.pool_id] = n
        entries: list[RouteEntry] = []
        for pool in self._pools.values():
            if pool.draining:
                continue
            local = hits.get(pool.pool_id, 0)
            best: PoolId | None = None
            for sid in sorted(sources):
                src = self._pools[sid]
                if (sid != pool.pool_id and src.block_size == pool.block_size
                        and lendable.get(sid, 0) - local >= _fetch.MIN_FETCH_BLOCKS
                        and _fetch.can_lend(src, self.max_unsettled_steps)
                        and (best is None or lendable[sid] > lendable[best])):
                    best = sid
            bs = pool.block_size
            fetchable = 0 if best is None else (lendable[best] - local) * bs
            entries.append(RouteEntry(pool.pool_id, local * bs, self.free_blocks(pool.pool_id)[1], fetchable,
                                      len(tokens) - local * bs - fetchable, best))
        entries.sort(key=lambda e: (_fetch.score(len(tokens), e.num_cached_tokens, e.num_fetchable_tokens),
                                    -e.num_free_blocks, e.pool_id))
        return entries

    def is_lending(self, pool_id: PoolId) -> bool:
        """Whether the pool's open step carries serve grants (prefix fetch): it must be closed
        and handed to its node with the step whose fetches they serve."""
        return bool(self._pool(pool_id).step.serves)

    def fetch_counts(self, pool_id: PoolId) -> tuple[int, int]:
        """(blocks this pool fetched from others, blocks it lends now) — prefix fetch gauges."""
        pool = self._pool(pool_id)
        return pool.fetched_blocks, sum(len(loan.blocks) for loan in pool.lent.values())

    def evict(self, pool_id: PoolId, num_blocks: int) -> int:
        """Evict up to `num_blocks` cached blocks (LRU); returns how many were evicted."""
        pool = self._pool(pool_id)
        _check_count("num_blocks", num_blocks, 0)
        return pool.evict(num_blocks)

    def reset_prefix_cache(self, pool_id: PoolId | None = None) -> int:
        """Forget all content hashes (of one pool or all); cached blocks become free.
        Returns the number of cached blocks dropped."""
        pools = [self._pool(pool_id)] if pool_id is not None else list(self._pools.values())
        return sum(p.reset_prefix_cache() for p in pools)

    # ---- defragmentation ------------------------------------------------------------
    def plan_defrag(
        self, pool_id: PoolId, kind: DefragKind = "compaction", max_moves: int | None = None
    ) -> DefragPlan | None:
        """Reserve destinations and queue the copies of a defrag plan in the pool's open step
        (None: nothing to do). Only full blocks whose writing step is settled move; the plan
        commits when the step carrying its moves is settled (`settle_steps`) and aborts when
        that step fails. See `block_manager.core.defrag` for the algorithms."""
        pool = self._pool(pool_id)
        if kind not in ("compaction", "contiguity"):
            raise InvalidRequest(f"unknown defrag kind {kind!r}")
        if max_moves is not None:
            _check_count("max_moves", max_moves, 1)
        if pool.plan is not None:
            raise FailedPrecondition(
                f"pool {pool_id!r} already has outstanding plan {pool.plan.plan_id}"
            )
        if pool.lent:
            return None   # blocks lent to another pool's fetch must stay put until it is reported
        if kind == "compaction":
            pairs = _defrag.plan_compaction(pool, max_moves)
        else:
            pairs = _defrag.plan_contiguity(pool, max_moves)
        if not pairs:
            return None
        plan_id = PlanId(self._next_plan_id)
        self._next_plan_id += 1
        state = _defrag.reserve(pool, plan_id, kind, pairs)
        return DefragPlan(plan_id, pool_id, kind, tuple(state.moves), state.step_id)

    def _plan_pool(self, plan_id: PlanId) -> Pool:
        for pool in self._pools.values():
            if pool.plan is not None and pool.plan.plan_id == plan_id:
                return pool
        raise UnknownPlan(f"unknown defrag plan {plan_id!r}")

    def abort_defrag(self, plan_id: PlanId) -> None:
        """Roll a plan back: destinations return to the free queue, sources are unpinned.
        The moves may still run in their step's Forward: harmless, since a released
        destination's next owner writes only in a later step (after that step's copies)."""
        pool = self._plan_pool(plan_id)
        _defrag.abort(pool)

    def get_defrag_plan(self, pool_id: PoolId) -> DefragPlan | None:
        pool = self._pool(pool_id)
        if pool.plan is None:
            return None
        p = pool.plan
        return DefragPlan(p.plan_id, pool_id, p.kind, tuple(p.moves), p.step_id)

    def defrag_due(self, pool_id: PoolId) -> DefragKind | None:
        """Which defragmentation the policy asks for now ("compaction"/"contiguity"), or
        None. Pure query: it changes nothing."""
        return _defrag.due(self._pool(pool_id), self.defrag_policy)

    # ---- metrics, fsck, snapshots ---------------------------------------------------
    def free_blocks(self, pool_id: PoolId) -> tuple[int, int]:
        """(free, usable: free, evictable, or held by a defrag plan no node has yet, which an
        allocation or swap-in that needs them aborts) blocks of a pool: a scheduler's gauges."""
        pool = self._pool(pool_id)
        return pool.num_free, pool.num_available + self._unsent_plan_blocks(pool)

    def metrics(self, pool_id: PoolId) -> PoolMetrics:
        pool = self._pool(pool_id)
        bs = pool.block_size
        num_tokens = 0
        partial: dict[int, int] = {}
        for seq in pool.seqs.values():
            num_tokens += seq.num_tokens
            fill = seq.num_tokens % bs
            if fill:
                partial[seq.block_table[-1]] = fill
        waste = sum(bs - fill for fill in partial.values())
        return PoolMetrics(
            pool_id=pool.pool_id,
            num_blocks=pool.num_blocks,
            block_size=bs,
            num_free_blocks=pool.num_free,
            num_used_blocks=pool.num_used,
            num_cached_blocks=pool.num_cached,
            num_reserved_blocks=pool.num_reserved,
            usage=pool.num_used / pool.num_blocks,
            high_water_mark=pool.high_water_mark(),
            num_tokens=num_tokens,
            allocated_slots=pool.num_used * bs,
            waste_slots=waste,
            prefix_query_tokens=pool.prefix_query_tokens,
            prefix_hit_tokens=pool.prefix_hit_tokens,
            cow_copies=pool.cow_copies,
            evictions=pool.evictions,
            defrag_moves=pool.defrag_moves,
            compaction_plans=pool.compaction_plans,
            contiguity_plans=pool.contiguity_plans,
            aborted_plans=pool.aborted_plans,
            num_sequences=len(pool.seqs),
            contiguity=_defrag.contiguity_score(pool),
        )

    def host_metrics(self, pool_id: PoolId) -> HostTierMetrics | None:
        """The pool's host tier counters and gauges (None: the pool has no host tier)."""
        host = self._pool(pool_id).host
        if host is None:
            return None
        return HostTierMetrics(
            pool_id, host.num_blocks, host.free_list.length, host.cached_list.length,
            host.num_blocks - host.num_available, len(host.swapped), **host.counters(),
        )

    def disk_metrics(self, pool_id: PoolId) -> DiskTierMetrics | None:
        """The pool's disk tier counters and gauges (None: the pool has no disk tier)."""
        host = self._pool(pool_id).host
        disk = None if host is None else host.disk
        if disk is None:
            return None
        return DiskTierMetrics(pool_id, disk.num_blocks, disk.free_list.length, disk.cached_list.length,
                               **disk.counters())

    def fsck(self) -> list[str]:
        """Check every invariant; human-readable violations, empty when healthy."""
        problems = fsck(self._pools, self._seqs, self._next_plan_id)
        for pool in self._pools.values():
            problems.extend(_tiers.fsck_host(pool, self._seqs))
        problems.extend(_fetch.fsck_loans(self._pools))
        return problems

    def to_snapshot(self) -> dict:
        """The complete state as a JSON-serialisable dict (see core/snapshot.py)."""
        return to_snapshot(
            CoreParts(
                self.watermark, self.enable_prefix_caching, self.defrag_policy,
                self._pools, self._seqs, self._next_plan_id, self.max_unsettled_steps,
            )
        )

    @classmethod
    def from_snapshot(cls, data: dict) -> BlockManager:
        """Rebuild a manager from `to_snapshot()` output; InvalidRequest if malformed or if
        the decoded state fails fsck."""
        parts = from_snapshot(data)
        manager = cls(
            watermark=parts.watermark,
            enable_prefix_caching=parts.enable_prefix_caching,
            defrag_policy=parts.defrag_policy,
            max_unsettled_steps=parts.max_unsettled_steps,
        )
        manager._pools, manager._seqs, manager._next_plan_id = parts.pools, parts.seqs, parts.next_plan_id
        problems = manager.fsck()
        if problems:
            raise InvalidRequest(f"snapshot fails fsck: {problems[:5]}")
        return manager


__all__ = ["BlockManager", "BlockId", "MAX_POOL_BLOCKS"]
