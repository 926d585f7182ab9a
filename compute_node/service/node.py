"""The compute node's state machine: registration, lease, table cache, forwards.

Everything that touches the pool or the table cache runs under one asyncio lock, so a forward
and a re-registration after fencing never interleave. The kernels run on the node's one step
thread (`compute_node.service.step_thread`: always the same thread, where the thread budget is
applied) so the event loop keeps answering health checks and sending heartbeats while a long
forward computes.

The scheduler is the one sequencer of the pool's memory: every change reaches the node inside a
Forward, as the block manager's steps for this pool (copy ops, table deltas, drops) followed by
the step's writes. The node applies them in order and makes no block-manager call on the hot
path; the block manager hears of the Forward from the scheduler's next step.

Lifecycle (one background task):
- register the pool (retrying with capped backoff while the block manager is unreachable); the
  pool tensors are allocated at the first registration, when the effective block size is known;
- heartbeat every `lease_ttl / 3` (a timer wait, not a poll). Transient failures (block manager
  down or recovering) are retried with the same epoch — after a recovery the block manager
  restarts every lease, so the node just keeps serving.

Fencing: FAILED_PRECONDITION on the node's own epoch means the block manager has dropped every
sequence of that epoch and reclaimed their blocks. The node then clears its tables and registers
again (new epoch, empty pool); the KV bytes of the old sequences are unreachable garbage from
then on. Forwards carrying steps of the old epoch fail with FAILED_PRECONDITION, and the
scheduler must re-admit its sequences (re-prefill).

A Forward retried with the same request id (its answer was lost) re-runs the writes and the
attention from the state before it: its steps are already applied and are not applied twice.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import torch

from compute_node.disk_tier import DiskTierCorrupt, open_disk_tier
from compute_node.errors import (
    BlockManagerRefused,
    BlockManagerUnavailable,
    ComputeNodeError,
    InvalidForward,
    ModelLoading,
    NodeFenced,
    NotRegistered,
    PeerFetchFailed,
    StaleTable,
    UnknownSequence,
)
from compute_node.forward import ForwardBatch, execute, plan_attention, resolve_sequences
from compute_node.generate import Generator
from compute_node.host_pool import HostKvPool, apply_moves, host_blocks_for_budget
from compute_node.model import ModelRunner
from compute_node.pool import KvPool, PoolGeometry, blocks_for_budget, resolve_device
from compute_node.service.bm_link import (
    BlockManagerLink,
    LinkError,
    LinkFenced,
    LinkNotFound,
    LinkUnavailable,
    Registration,
)
from compute_node.service.config import DEFAULT_NUM_BLOCKS, ComputeNodeConfig
from compute_node.service.dense_threads import DenseThreads, step_tokens, waits_passively
from compute_node.service.metrics import NodeMetrics
from compute_node.service.step_thread import StepThread
from compute_node.tables import NodeTable, SeqId, StagedSteps, TableCache, stage
from compute_node.threads import apply_thread_budget, thread_budget
from compute_node.transfer import BlockPuller, FetchFailed, GrantBook, StagedFetch
from pagedkv.logging import get_logger
from pagedkv.rpc import Backoff
from pagedkv.v1 import compute_node_pb2 as pb

DEFAULT_MODEL_BLOCK_SIZE = 16


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
    last_step_id: int = 0


@dataclass(slots=True)
class ForwardResult:
    outputs: list[tuple[int, torch.Tensor]]   # (layer, [num_tokens, num_heads, head_dim])
    stats: ForwardStats



def cold_fetch_error(exc: LinkError) -> ComputeNodeError:
    """The Forward's error for a refused cold table fetch: the block manager's own status
    (NOT_FOUND, FAILED_PRECONDITION, INVALID_ARGUMENT, ...) with its message; UNAVAILABLE
    only when the block manager could not be reached (or timed out), the one case a
    scheduler should retry."""
    if isinstance(exc, LinkUnavailable):
        return BlockManagerUnavailable(f"block manager unavailable for a cold table fetch: {exc}")
    if isinstance(exc, LinkNotFound):
        return UnknownSequence(exc.details)
    if isinstance(exc, LinkFenced):
        return NodeFenced(exc.details)
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidForward(f"block manager refused the cold table fetch: {exc.details}")
    if exc.code == grpc.StatusCode.ABORTED:
        return StaleTable(f"block manager refused the cold table fetch: {exc.details}")
    if exc.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        # the node's credentials, not the caller's: answering PERMISSION_DENIED would blame the scheduler
        return BlockManagerRefused(
            grpc.StatusCode.INTERNAL,
            f"block manager refused the node's cold table fetch ({exc.code.name}: check the node's credentials): "
            f"{exc.details}",
        )
    return BlockManagerRefused(exc.code, f"block manager refused the cold table fetch: {exc.details}")

class ComputeNode:
    def __init__(self, config: ComputeNodeConfig, *, advertise_address: str = "") -> None:
        self.config = config
        self.advertise_address = advertise_address or config.advertise_address or config.listen_address
        self.device = resolve_device(config.device)
        self.metrics = NodeMetrics()
        self.log = get_logger("compute_node", node_id=config.node_id)
        self.num_threads = thread_budget(config.threads, config.nodes_per_host)
        # every model load, warm-up and step runs on this one thread (OpenMP teams, budgets)
        self.step_thread = StepThread(f"step-{config.node_id}")
        self.link = BlockManagerLink(
            config.block_manager_address, config.node_id, config.rpc_timeout_s, tls=config.tls,
            token=config.block_manager_token,
        )
        self.tables = TableCache()
        self.pool: KvPool | None = None
        # prefix fetch (compute_node/transfer.py, docs/prefix_fetch.md): what this node's steps
        # granted to other nodes, and its puller of other nodes' blocks
        self.grants = GrantBook(config.fetch_grant_ttl_s)
        self.puller = BlockPuller(
            config.node_id, tls=config.tls, token=config.peer_token, timeout_s=config.fetch_timeout_s,
            chunk_bytes=config.fetch_chunk_bytes, max_message_bytes=config.max_message_bytes,
        )
        # The host tier under `pool` (docs/tiers.md): the model runner's on a model node; an
        # attention-only node creates its own with its pool, at the first registration.
        self.host_pool: HostKvPool | None = None
        self.runner: ModelRunner | None = None     # set by `load_model` when a model is served
        self.generator: Generator | None = None
        # per-step torch threads of a CPU model node that waits passively (dense_threads.py)
        self.dense_threads: DenseThreads | None = None
        self.registration: Registration | None = None
        # The last successful Forward: a retry with its request id re-runs it from before it.
        self._last_request_id: str | None = None
        self._last_counts: dict[SeqId, int] = {}
        self._cold_rpcs = 0
        self._lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._registered = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Called with True when the node (re-)registers and False when it is fenced; the
        # server flips its health status from here.
        self.on_registration: Callable[[bool], None] | None = None
        self.metrics.watch_decode_paths(self._decode_paths)

    # ---- lifecycle ------------------------------------------------------------------
    def load_model(self) -> None:
        """Load the configured model and size its KV pool (before registering; blocking: run
        it on `step_thread`, the thread the budget must hold on). Block size: the configured
        one, else 16."""
        cfg = self.config
        applied = apply_thread_budget(self.num_threads)
        self.log.info("thread_budget", torch_threads=self.num_threads, numba_threads=applied,
                      nodes_per_host=cfg.nodes_per_host)
        if cfg.model is None:
            return
        budget = cfg.memory_budget_bytes if cfg.num_blocks is None else None
        num_blocks = cfg.num_blocks if cfg.num_blocks is not None or budget is not None else DEFAULT_NUM_BLOCKS
        self.runner = runner = ModelRunner(
            cfg.model, block_size=cfg.block_size or DEFAULT_MODEL_BLOCK_SIZE, num_blocks=num_blocks,
            kv_memory_bytes=budget, dtype=cfg.model_dtype, device=str(self.device), max_model_len=cfg.max_model_len,
            cuda_graphs=cfg.cuda_graphs, prepack_linear=cfg.prepack_linear, step_graphs=cfg.step_graphs,
        )
        self.pool = runner.pool
        if cfg.host_kv_blocks or cfg.host_kv_memory:
            num_host = runner.attach_host_tier(cfg.host_kv_blocks, cfg.host_kv_memory)
            self.log.info("host_tier", num_blocks=num_host, pinned=bool(runner.host_pool and runner.host_pool.pinned))
        self.host_pool = runner.host_pool
        if cfg.disk_kv_path:
            runner.disk_store = open_disk_tier(cfg.disk_kv_path, cfg.disk_kv_bytes or 0, runner.geometry, cfg.model)
            self.log.info("disk_tier", path=cfg.disk_kv_path, num_blocks=runner.disk_store.num_blocks,
                          blocks_held=len(runner.disk_store.index), discarded=runner.disk_store.num_discarded)
        self.generator = gen = Generator(runner, self.tables, max_batch=cfg.max_batch)
        if self.device.type == "cpu" and self.num_threads > 1 and cfg.serial_dense_tokens > 0 and waits_passively(
                os.environ):
            self.dense_threads = DenseThreads(self.num_threads, cfg.serial_dense_tokens, current=self.num_threads)
            self.log.info("dense_threads", serial_up_to_tokens=cfg.serial_dense_tokens, threads=self.num_threads)
        gen.puller, gen.on_serves, gen.on_fetch_failed = self.puller, self.grants.add, self._fetch_failed
        self.metrics.set_pool(runner.geometry, str(self.device))
        self.log.info("model_loaded", model=cfg.model, architecture=runner.model_config.architecture,
                      dtype=runner.geometry.dtype, num_blocks=runner.geometry.num_blocks,
                      packed_linear=runner.model.packed_linear)

    def _decode_paths(self) -> tuple[dict[str, int], int]:
        """Decode steps by path and the graphs' static bytes (read at each metrics scrape)."""
        if self.pool is None:
            return {}, 0
        path = self.pool.decode_path
        return path.stats.counts() if path.enabled else {}, path.static_bytes()

    @property
    def model_name(self) -> str:
        return "" if self.config.model is None else Path(self.config.model).name

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
        if self.runner is not None and self.runner.disk_store is not None:
            async with self._lock:   # no step is moving blocks through it
                self.runner.disk_store.close()
        self.puller.close()
        self.step_thread.close()

    def _fetch_failed(self, op: object, why: str) -> None:
        """A pull failed: the step recomputes those positions (logged and counted)."""
        self.log.warning("prefix_fetch_failed", fetch_id=getattr(op, "fetch_id", ""), error=why)

    def observe_generate(self, resp: pb.GenerateResponse) -> None:
        st = resp.stats
        if st.fetched_blocks:
            self.metrics.fetched_blocks.inc(st.fetched_blocks)
            self.metrics.fetch_bytes.inc(st.fetch_bytes)
        if st.fetch_recomputed_tokens:
            self.metrics.fetch_recomputed_tokens.inc(st.fetch_recomputed_tokens)

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
        if reply.draining:
            self.log.debug("draining")

    async def _try_register_locked(self) -> None:
        """Register (or re-register) the pool; on failure stay unregistered and log."""
        cfg, g = self.config, self.config.geometry
        pool_geometry = self.geometry
        if pool_geometry is not None:
            g = pool_geometry   # type: ignore[assignment]  # a model's (or an earlier registration's)
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
                host_num_blocks=self._host_num_blocks(g, block_size),
                **self._disk_registration(),
            )
            self.metrics.bm_rpcs.labels("RegisterNode").inc()
        except LinkError as exc:
            self.metrics.bm_failures.labels("RegisterNode").inc()
            self.log.warning("register_failed", error=str(exc), block_manager=self.config.block_manager_address)
            return
        if pool_geometry is None:
            geometry = PoolGeometry(g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, reg.block_size, reg.num_blocks)
            num_host = self._host_num_blocks(g, reg.block_size)
            self.pool = KvPool(geometry, self.device, cuda_graphs=self.config.cuda_graphs)
            if num_host:
                self.host_pool = HostKvPool(geometry, num_host, self.device)
                self.log.info("host_tier", num_blocks=num_host, pinned=self.host_pool.pinned)
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

    def _disk_registration(self) -> dict[str, Any]:
        """The disk tier's slots and the blocks its file holds (seeding the new epoch's index)."""
        disk = None if self.runner is None else self.runner.disk_store
        if disk is None:
            return {}
        return {"disk_num_blocks": disk.num_blocks, "disk_blocks": disk.register_blocks()}

    def _host_num_blocks(self, g: Any, block_size: int | None) -> int:
        """The host tier's size to register: the existing one's, else (an attention-only node
        before its first registration) the configured blocks or what the budget holds."""
        if self.host_pool is not None or self.pool is not None:
            return 0 if self.host_pool is None else self.host_pool.num_blocks
        cfg = self.config
        if cfg.host_kv_blocks is not None:
            return cfg.host_kv_blocks
        if not cfg.host_kv_memory or not block_size:
            return 0
        probe = PoolGeometry(g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, block_size, 1)
        return host_blocks_for_budget(cfg.host_kv_memory, probe)

    def _reset_locked(self, reason: str) -> None:
        """Our epoch is fenced: forget everything tied to it (tables, copy-op cursor)."""
        self.log.warning("fenced", epoch=self.epoch, reason=reason)
        self.metrics.fenced.inc()
        self.registration = None
        self.metrics.epoch.set(0)
        self.tables.clear()
        self.grants.clear()
        if self.generator is not None:
            self.generator.reset()
        self.metrics.cached_tables.set(0)
        self._last_request_id = None
        if self.on_registration is not None:
            self.on_registration(False)

    # ---- generate (a model node) ----------------------------------------------------
    async def generate(self, request: pb.GenerateRequest) -> pb.GenerateResponse:
        """One model step (see `compute_node.generate`), under the node's lock."""
        async with self._lock:
            if self.generator is None:
                if self.config.model is not None:
                    raise ModelLoading("the node is starting: its model is still loading")
                raise InvalidForward("this node serves no model (start it with --model DIR); use Forward")
            if self.registration is None:
                raise NotRegistered("the node is not registered with the block manager")
            epoch = self.registration.epoch
            try:
                resp = await self.step_thread.run(self._generate_step, request, epoch)
            except (NodeFenced, DiskTierCorrupt) as exc:
                # DiskTierCorrupt: the block manager's disk index names a slot whose bytes are bad;
                # a new registration seeds the index from what the file really holds
                self._reset_locked(f"generate: {exc}")
                await self._try_register_locked()
                raise
        self.metrics.cached_tables.set(len(self.tables))
        self.observe_generate(resp)
        return resp

    def _generate_step(self, request: pb.GenerateRequest, epoch: int) -> pb.GenerateResponse:
        """On the step thread: this step's torch threads (decode-sized steps on one, when the
        node waits passively), then the step."""
        if self.dense_threads is not None:
            self.dense_threads.apply(step_tokens(request))
        return self.generator.generate(request, self.config.node_id, epoch)   # type: ignore[union-attr]  # Generate checked it

    # ---- forward --------------------------------------------------------------------
    async def forward(self, batch: ForwardBatch) -> ForwardResult:
        """Apply the batch's steps (copies, then tables), write K/V at each tail, attend."""
        t_start = time.perf_counter()
        async with self._lock:
            if self.registration is None or self.pool is None:
                raise NotRegistered("the node is not registered with the block manager")
            epoch = self.registration.epoch
            pool = self.pool
            self._cold_rpcs = 0
            retry = batch.request_id == self._last_request_id
            if retry:
                # Its steps are applied already: re-run the writes from the counts before it.
                staged = StagedSteps()
                cold: dict[SeqId, NodeTable] = {}
                fetch_s = 0.0
                counts = self._last_counts
                table_of = lambda sid: self._retry_table(sid, counts)  # noqa: E731
            else:
                try:
                    staged = stage(self.tables, batch.steps, self.config.node_id, epoch, pool.geometry.num_blocks,
                                   0 if self.host_pool is None else self.host_pool.num_blocks)
                except NodeFenced as exc:
                    # The block manager registered the pool anew behind our back: start over.
                    self._reset_locked(f"forward: {exc}")
                    await self._try_register_locked()
                    raise
                t_fetch = time.perf_counter()
                cold = await self._cold_tables(batch, staged, epoch)
                fetch_s = time.perf_counter() - t_fetch
                table_of = lambda sid: cold.get(sid) or staged.table(self.tables, sid)  # noqa: E731
            tables = resolve_sequences(batch, table_of, pool.geometry.block_size, cold=set(cold))
            plan = plan_attention(batch, tables, pool.geometry)
            if staged.serves:
                self.grants.add(staged.serves)
            landings: list[tuple[tuple[int, int], Callable[[], None]]] = []
            if staged.fetches:
                # pulled into host buffers before anything of the step is applied (a failed pull
                # fails the Forward whole), landed in the pool in step order: after the moves and
                # copies of the fetch's step, which may still read or write its destination blocks
                pulled = await self.step_thread.run(self._pull_for_forward, pool, staged.fetches)
                landings = [(mark, partial(got.land, pool)) for mark, got in zip(staged.fetch_marks, pulled)]
            t0 = time.perf_counter()
            if staged.tier_moves or landings:   # tier moves, copies and fetches, in step order (as Generate)
                await self.step_thread.run(apply_moves, pool, self.host_pool, staged, None, landings)
            elif staged.copy_pairs:
                await self.step_thread.run(pool.copy_blocks, staged.copy_pairs)
            t1 = time.perf_counter()
            before = {s.seq_id: tables[s.seq_id].num_tokens for s in batch.seqs}
            self.tables.commit(staged)
            for s in batch.seqs:
                table = tables[s.seq_id]
                table.num_tokens = s.context_len
                self.tables.put(s.seq_id, table)
            self._last_request_id, self._last_counts = batch.request_id, before
            outputs, timings = await self.step_thread.run(execute, pool, batch, plan)
            stats = ForwardStats(
                table_fetch_s=fetch_s, copy_ops_s=t1 - t0, write_s=timings.write_s,
                attention_s=timings.attention_s, total_s=time.perf_counter() - t_start,
                num_block_manager_rpcs=self._cold_rpcs, num_copy_ops=len(staged.copy_pairs),
                kv_bytes_read=plan.kv_bytes_read, last_step_id=self.tables.last_step_id,
            )
            self.metrics.cached_tables.set(len(self.tables))
            if staged.copy_pairs:
                n_defrag = staged.num_defrag_copies
                self.metrics.copy_ops.labels("defrag").inc(n_defrag)
                self.metrics.copy_ops.labels("cow").inc(len(staged.copy_pairs) - n_defrag)
        self._observe(batch, stats)
        return ForwardResult([(step.layer, out) for step, out in zip(batch.layers, outputs)], stats)

    def _pull_for_forward(self, pool: KvPool, fetches: list[Any]) -> list[StagedFetch]:
        """An attention-only node's pulls, into host buffers (the pool is not touched): it
        cannot recompute (the scheduler brings K/V), so a failed pull fails the Forward
        (PeerFetchFailed) before anything of it is applied, and the scheduler recomputes."""
        pulled: list[StagedFetch] = []
        for op in fetches:
            try:
                got = self.puller.pull_staged(pool.geometry, op)
            except FetchFailed as exc:
                raise PeerFetchFailed(str(exc)) from None
            pulled.append(got)
            self.metrics.fetched_blocks.inc(len(op.dst_blocks))
            self.metrics.fetch_bytes.inc(got.num_bytes)
        return pulled

    async def _cold_tables(self, batch: ForwardBatch, staged: StagedSteps, epoch: int) -> dict[SeqId, NodeTable]:
        """Tables of sequences the node does not hold (a cold cache: not on the hot path).

        Only safe when the block manager's tables reflect exactly the steps this Forward
        brings the node to (a later closed step may already have changed them): otherwise the
        Forward is refused with ABORTED and the scheduler must send the missing steps.
        """
        self._cold_rpcs = 0
        missing = [s.seq_id for s in batch.seqs if staged.table(self.tables, s.seq_id) is None]
        if not missing:
            return {}
        self._cold_rpcs = 1
        try:
            reply = await self.link.get_tables(epoch, missing)
            self.metrics.bm_rpcs.labels("GetTables").inc()
        except LinkError as exc:
            self.metrics.bm_failures.labels("GetTables").inc()
            raise cold_fetch_error(exc) from None
        applied = staged.last_step_id if staged.last_step_id is not None else self.tables.last_step_id
        if reply.last_step_id != applied:
            raise StaleTable(
                f"cold tables of {missing[:4]} reflect step {reply.last_step_id}, this Forward brings the node to "
                f"step {applied}: send the missing steps"
            )
        self.log.info("cold_tables", num_tables=len(reply.tables))
        return reply.tables

    def _retry_table(self, seq_id: SeqId, counts: dict[SeqId, int]) -> NodeTable | None:
        table = self.tables.get(seq_id)
        if table is None or seq_id not in counts:
            return table
        return NodeTable(table.block_table, table.version, counts[seq_id])

    def _observe(self, batch: ForwardBatch, stats: ForwardStats) -> None:
        m = self.metrics
        for phase in ("table_fetch", "copy_ops", "write", "attention", "total"):
            m.forward_seconds.labels(phase).observe(getattr(stats, f"{phase}_s"))
        m.kv_bytes_read.inc(stats.kv_bytes_read)
        num_decode = sum(1 for s in batch.seqs if s.num_new_tokens == 1)
        m.tokens.labels("decode").inc(num_decode)
        m.tokens.labels("prefill").inc(batch.num_tokens - num_decode)

