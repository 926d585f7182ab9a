"""The compute node's state machine: registration, lease, table cache, copy ops, forwards.

Everything that touches the pool or the table cache runs under one asyncio lock, so a forward,
a heartbeat-triggered copy-op sync and a re-registration after fencing never interleave. The
kernels run in a worker thread (`asyncio.to_thread`) so the event loop keeps answering health
checks and sending heartbeats while a long forward computes.

Lifecycle (one background task):
- register the pool (retrying while the block manager is unreachable); the pool tensors are
  allocated at the first registration, when the effective block size is known;
- heartbeat every `lease_ttl / 3` (a timer wait, not a poll). Transient failures (block manager
  down or recovering) are retried with the same epoch — after a recovery the block manager
  restarts every lease, so the node just keeps serving;
- when the heartbeat reports copy ops newer than the last applied one (a defrag plan), apply
  and acknowledge them without waiting for the next forward, so plans commit on idle nodes too.

Fencing: FAILED_PRECONDITION on the node's own epoch means the block manager has dropped every
sequence of that epoch and reclaimed their blocks. The node then clears its table cache and
copy-op cursor and registers again (new epoch, empty pool); the KV bytes of the old sequences
are unreachable garbage from then on. A forward that discovers the fencing fails with
FAILED_PRECONDITION; later forwards for the old sequences get NOT_FOUND (the block manager
no longer knows them in this pool), and the scheduler must re-admit them (re-prefill).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from compute_node.errors import (
    BlockManagerUnavailable,
    ComputeNodeError,
    InvalidForward,
    NodeFenced,
    NotRegistered,
    StaleTable,
    UnknownSequence,
)
from compute_node.forward import ForwardBatch, check_slots, execute, plan_attention
from compute_node.pool import KvPool, PoolGeometry, blocks_for_budget, resolve_device
from compute_node.service.bm_link import (
    BlockManagerLink,
    LinkError,
    LinkFenced,
    LinkNotFound,
    LinkRejected,
    LinkUnavailable,
    Registration,
    TablesReply,
)
from compute_node.service.config import ComputeNodeConfig
from compute_node.service.metrics import NodeMetrics
from compute_node.tables import CachedTable, SeqId, TableCache
from pagedkv.logging import get_logger
from pagedkv.rpc import Backoff

CopyOpTuple = tuple[int, int, int, str]


@dataclass(slots=True)
class ForwardStats:
    table_fetch_s: float = 0.0
    copy_ops_s: float = 0.0
    write_s: float = 0.0
    attention_s: float = 0.0
    total_s: float = 0.0
    num_block_manager_rpcs: int = 0
    num_copy_ops: int = 0
    kv_bytes_read: int = 0


@dataclass(slots=True)
class ForwardResult:
    outputs: list[tuple[int, torch.Tensor]]   # (layer, [num_tokens, num_heads, head_dim])
    stats: ForwardStats


class ComputeNode:
    def __init__(self, config: ComputeNodeConfig, *, advertise_address: str = "") -> None:
        self.config = config
        self.advertise_address = advertise_address or config.advertise_address or config.listen_address
        self.device = resolve_device(config.device)
        self.metrics = NodeMetrics()
        self.log = get_logger("compute_node", node_id=config.node_id)
        self.link = BlockManagerLink(config.block_manager_address, config.node_id, config.rpc_timeout_s)
        self.tables = TableCache(config.table_cache_size)
        self.pool: KvPool | None = None
        self.registration: Registration | None = None
        self.last_applied_op_id = 0
        self.last_acked_op_id = 0
        self.bm_last_pending_op_id = 0     # from heartbeats
        self._lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._registered = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Block manager calls made under the lock by the current forward (heartbeats run
        # concurrently and are not counted).
        self._forward_rpcs = 0
        # Called with True when the node (re-)registers and False when it is fenced; the
        # server flips its health status from here.
        self.on_registration: Callable[[bool], None] | None = None

    # ---- lifecycle ------------------------------------------------------------------
    @property
    def geometry(self) -> PoolGeometry | None:
        return None if self.pool is None else self.pool.geometry

    @property
    def epoch(self) -> int:
        return 0 if self.registration is None else self.registration.epoch

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"compute-node-{self.config.node_id}")

    async def wait_registered(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._registered.wait(), timeout_s)

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.link.close()

    async def _run(self) -> None:
        # Registration is retried until it succeeds: capped, jittered backoff, so a node whose
        # block manager is down neither floods its log nor hammers the manager when it returns.
        backoff = Backoff(initial_s=self.config.retry_interval_s, max_s=self.config.max_retry_interval_s)
        while not self._stopping.is_set():
            if self.registration is None:
                async with self._lock:
                    await self._try_register_locked()
                if self.registration is None:
                    await self._sleep(backoff.next_delay())
                continue
            backoff.reset()
            await self._sleep(self.registration.lease_ttl_s / 3)
            if self.registration is not None and not self._stopping.is_set():
                await self._beat(self.registration.epoch)

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass

    async def _beat(self, epoch: int) -> None:
        try:
            reply = await self.link.heartbeat(epoch)
            self.metrics.bm_rpcs.labels("Heartbeat").inc()
        except (LinkFenced, LinkNotFound) as exc:
            async with self._lock:
                if self.epoch == epoch:
                    self._reset_locked(f"heartbeat: {exc}")
                    await self._try_register_locked()
            return
        except LinkError as exc:
            # Block manager down or recovering: keep the epoch, retry on the next beat.
            self.metrics.bm_failures.labels("Heartbeat").inc()
            self.log.warning("heartbeat_failed", epoch=epoch, error=str(exc))
            return
        self.bm_last_pending_op_id = max(self.bm_last_pending_op_id, int(reply.last_pending_op_id))
        if self.bm_last_pending_op_id > self.last_applied_op_id or self.last_acked_op_id < self.last_applied_op_id:
            try:
                async with self._lock:
                    if self.epoch == epoch:
                        await self._sync_copy_ops_locked(epoch, [])
            except ComputeNodeError as exc:
                self.log.warning("copy_op_sync_failed", epoch=epoch, error=str(exc))

    async def _try_register_locked(self) -> None:
        """Register (or re-register) the pool; on failure stay unregistered and log."""
        cfg, g = self.config, self.config.geometry
        pool_geometry = self.geometry
        if pool_geometry is not None:
            block_size: int | None = pool_geometry.block_size
            num_blocks = pool_geometry.num_blocks
        else:
            block_size = cfg.block_size
            num_blocks = cfg.num_blocks or blocks_for_budget(
                cfg.memory_budget_bytes or 0, num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                head_dim=g.head_dim, dtype=g.dtype, block_size=cfg.block_size or 0,
            )
        try:
            reg = await self.link.register(
                num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, dtype=g.dtype,
                device=str(self.device), block_size=block_size, num_blocks=num_blocks, address=self.advertise_address,
            )
            self.metrics.bm_rpcs.labels("RegisterNode").inc()
        except LinkError as exc:
            self.metrics.bm_failures.labels("RegisterNode").inc()
            self.log.warning("register_failed", error=str(exc), block_manager=self.config.block_manager_address)
            return
        if pool_geometry is None:
            geometry = PoolGeometry(g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, reg.block_size, reg.num_blocks)
            self.pool = KvPool(geometry, self.device)
            self.metrics.set_pool(geometry, str(self.device))
        elif (reg.block_size, reg.num_blocks) != (pool_geometry.block_size, pool_geometry.num_blocks):
            # Cannot happen with an honest block manager (we sent both explicitly).
            self.log.error("registration_geometry_mismatch", block_size=reg.block_size, num_blocks=reg.num_blocks)
            return
        self.registration = reg
        self.metrics.epoch.set(reg.epoch)
        self._registered.set()
        if self.on_registration is not None:
            self.on_registration(True)
        self.log.info(
            "registered", epoch=reg.epoch, block_size=reg.block_size, num_blocks=reg.num_blocks,
            lease_ttl_s=reg.lease_ttl_s, device=str(self.device),
        )

    def _reset_locked(self, reason: str) -> None:
        """Our epoch is fenced: forget everything tied to it (tables, copy-op cursor)."""
        self.log.warning("fenced", epoch=self.epoch, reason=reason)
        self.metrics.fenced.inc()
        self.registration = None
        self.metrics.epoch.set(0)
        self.tables.clear()
        self.metrics.cached_tables.set(0)
        self.last_applied_op_id = self.last_acked_op_id = self.bm_last_pending_op_id = 0
        if self.on_registration is not None:
            self.on_registration(False)

    # ---- forward --------------------------------------------------------------------
    async def forward(self, batch: ForwardBatch) -> ForwardResult:
        """Fetch what the batch lacks, apply pending copy ops, write K/V, attend."""
        t_start = time.perf_counter()
        async with self._lock:
            if self.registration is None or self.pool is None:
                raise NotRegistered("the node is not registered with the block manager")
            epoch = self.registration.epoch
            pool = self.pool
            self.tables.drop(batch.freed_seq_ids)
            self._forward_rpcs = 0
            t0 = time.perf_counter()
            tables, ops = await self._resolve_tables_locked(batch, epoch)
            t1 = time.perf_counter()
            check_slots(batch, tables, pool.geometry.block_size)
            plan = plan_attention(batch, tables, pool.geometry)
            t2 = time.perf_counter()
            await self._apply_copy_ops_locked(epoch, ops)
            t3 = time.perf_counter()
            outputs, timings = await asyncio.to_thread(execute, pool, batch, plan)
            stats = ForwardStats(
                table_fetch_s=t1 - t0, copy_ops_s=t3 - t2, write_s=timings.write_s,
                attention_s=timings.attention_s, total_s=time.perf_counter() - t_start,
                num_block_manager_rpcs=self._forward_rpcs, num_copy_ops=len(ops),
                kv_bytes_read=plan.kv_bytes_read,
            )
            self.metrics.cached_tables.set(len(self.tables))
        self._observe(batch, stats)
        return ForwardResult([(step.layer, out) for step, out in zip(batch.layers, outputs)], stats)

    def _observe(self, batch: ForwardBatch, stats: ForwardStats) -> None:
        m = self.metrics
        for phase in ("table_fetch", "copy_ops", "write", "attention", "total"):
            m.forward_seconds.labels(phase).observe(getattr(stats, f"{phase}_s"))
        m.kv_bytes_read.inc(stats.kv_bytes_read)
        num_decode = sum(1 for s in batch.seqs if s.num_new_tokens == 1)
        m.tokens.labels("decode").inc(num_decode)
        m.tokens.labels("prefill").inc(batch.num_tokens - num_decode)

    async def _resolve_tables_locked(
        self, batch: ForwardBatch, epoch: int
    ) -> tuple[dict[SeqId, CachedTable], list[CopyOpTuple]]:
        """Tables for every sequence of the batch, fetching only stale/missing ones in one call,
        plus the pending copy ops that call returned (not yet applied)."""
        need = [s for s in batch.seqs if not self.tables.is_fresh(s.seq_id, s.version)]
        need_ops = self.bm_last_pending_op_id > self.last_applied_op_id
        resolved: dict[SeqId, CachedTable] = {}
        ops: list[CopyOpTuple] = []
        if need or need_ops:
            known = {s.seq_id: v for s in need if (v := self.tables.known_version(s.seq_id)) is not None}
            reply = await self._get_tables_locked(epoch, [s.seq_id for s in need], known)
            for table in reply.tables:
                self.tables.put(table)
                resolved[table.seq_id] = table
            ops = [op for op in reply.copy_ops if op[0] > self.last_applied_op_id]
            if ops:
                # Remember them even if this forward fails validation before applying them:
                # the next forward must fetch them again before it writes anything.
                self.bm_last_pending_op_id = max(self.bm_last_pending_op_id, ops[-1][0])
        for s in batch.seqs:
            table = resolved.get(s.seq_id)
            if table is None:
                table = self.tables.get(s.seq_id)
                if table is None:
                    raise UnknownSequence(f"sequence {s.seq_id!r} is not in this node's pool")
                self.tables.confirm(s.seq_id)   # the block manager had nothing newer
                resolved[s.seq_id] = table
            if table.version < s.version:
                raise StaleTable(
                    f"sequence {s.seq_id!r}: the request needs table version {s.version}, "
                    f"the block manager has {table.version}"
                )
        return resolved, ops

    async def _get_tables_locked(self, epoch: int, seq_ids: list[SeqId], known: dict[SeqId, int]) -> TablesReply:
        self._forward_rpcs += 1
        try:
            reply = await self.link.get_tables(epoch, seq_ids, known, self.last_applied_op_id)
            self.metrics.bm_rpcs.labels("GetTables").inc()
            return reply
        except LinkError as exc:
            self.metrics.bm_failures.labels("GetTables").inc()
            if isinstance(exc, LinkFenced):
                await self._fenced_or_dropped_locked(epoch, exc)
            raise self._translate(exc) from None

    async def _fenced_or_dropped_locked(self, epoch: int, exc: LinkFenced) -> None:
        """FAILED_PRECONDITION from GetTables is either our epoch (fenced) or one of the
        sequences (dropped with an older epoch): a heartbeat tells which."""
        self._forward_rpcs += 1
        try:
            await self.link.heartbeat(epoch)
        except (LinkFenced, LinkNotFound):
            self._reset_locked(f"get_tables: {exc.details}")
            await self._try_register_locked()
            raise NodeFenced(
                f"node epoch {epoch} was fenced by the block manager; its sequences are gone, "
                f"re-admit them (new epoch {self.epoch or 'pending'})"
            ) from None
        except LinkError as hb_exc:
            raise BlockManagerUnavailable(f"block manager unreachable: {hb_exc}") from None
        raise UnknownSequence(exc.details) from None

    @staticmethod
    def _translate(exc: LinkError) -> ComputeNodeError:
        if isinstance(exc, LinkUnavailable):
            return BlockManagerUnavailable(f"block manager unavailable: {exc.details}")
        if isinstance(exc, LinkNotFound):
            return UnknownSequence(exc.details)
        if isinstance(exc, LinkRejected) and exc.code.name == "INVALID_ARGUMENT":
            return InvalidForward(exc.details)
        if isinstance(exc, LinkRejected) and exc.code.name == "ABORTED":
            return StaleTable(exc.details)
        return ComputeNodeError(f"block manager refused: {exc.code.name}")

    async def _apply_copy_ops_locked(self, epoch: int, ops: list[CopyOpTuple]) -> None:
        """Run ops (op_id order) in every layer, then acknowledge the applied prefix."""
        if ops and self.pool is not None:
            await asyncio.to_thread(self.pool.copy_blocks, [(src, dst) for _, src, dst, _ in ops])
            self.last_applied_op_id = ops[-1][0]
            for _, _, _, kind in ops:
                self.metrics.copy_ops.labels(kind).inc()
            self.log.info("copy_ops_applied", num_ops=len(ops), up_to_op_id=self.last_applied_op_id)
        if self.last_acked_op_id >= self.last_applied_op_id:
            return
        self._forward_rpcs += 1
        try:
            committed = await self.link.ack_copy_ops(epoch, self.last_applied_op_id)
            self.metrics.bm_rpcs.labels("AckCopyOps").inc()
        except LinkFenced as exc:
            self._reset_locked(f"ack_copy_ops: {exc.details}")
            await self._try_register_locked()
            raise NodeFenced(f"node epoch {epoch} was fenced by the block manager") from None
        except LinkError as exc:
            # The ops are applied; the ack is retried by the next heartbeat or forward.
            self.metrics.bm_failures.labels("AckCopyOps").inc()
            self.log.warning("ack_failed", up_to_op_id=self.last_applied_op_id, error=str(exc))
            return
        self.last_acked_op_id = self.last_applied_op_id
        if committed:
            # Committed plans rewrote tables and freed their source blocks: re-check every
            # cached table before it is used again (this forward may still read the sources:
            # nothing can overwrite them before the next forward, which runs after ours).
            self.tables.mark_all_suspect()
            self.log.info("defrag_committed", plan_ids=committed)

    async def _sync_copy_ops_locked(self, epoch: int, seq_ids: list[SeqId]) -> None:
        """Fetch, apply and acknowledge pending copy ops outside any forward."""
        reply = await self._get_tables_locked(epoch, seq_ids, {})
        for table in reply.tables:
            self.tables.put(table)
        ops = [op for op in reply.copy_ops if op[0] > self.last_applied_op_id]
        await self._apply_copy_ops_locked(epoch, ops)
