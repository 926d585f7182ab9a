"""Prometheus metrics of one block manager server (its own `CollectorRegistry`).

Pool gauges and counters are not mirrored on every mutation: a custom collector reads the
core's `PoolMetrics` at scrape time. The scrape runs on the HTTP server's thread, so it
hops onto the event loop (`run_coroutine_threadsafe`) to read a consistent state without
locks. Per-RPC latency is a histogram labelled by method and status code, observed by the
error-mapping interceptor. Names follow vLLM's (`*_kv_cache_usage_perc`,
`*_prefix_cache_queries_total`, ...) with the `pagedkv_` prefix.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from block_manager.core.types import DiskTierMetrics, HostTierMetrics
    from block_manager.service.runtime import ServiceRuntime

RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BLOCK_STATES = ("free", "used", "cached", "reserved")


class _StateCollector(Collector):
    def __init__(self, runtime: ServiceRuntime, loop: asyncio.AbstractEventLoop) -> None:
        self._runtime = runtime
        self._loop = loop
        self._loop_thread = threading.get_ident()  # constructed on the loop's thread

    def _read(self) -> dict[str, Any]:
        rt = self._runtime
        pools = [rt.state.core.metrics(pid) for pid in rt.state.core.pool_ids]
        hosts = [h for pid in rt.state.core.pool_ids if (h := rt.state.core.host_metrics(pid)) is not None]
        disks = [d for pid in rt.state.core.pool_ids if (d := rt.state.core.disk_metrics(pid)) is not None]
        fetches = [(pid, *rt.state.core.fetch_counts(pid)) for pid in rt.state.core.pool_ids]
        nodes = rt.state.registry.nodes()
        return {
            "pools": pools,
            "hosts": hosts,
            "disks": disks,
            "fetches": fetches,
            "nodes_active": sum(1 for n in nodes if n.active and not n.draining),
            "nodes_draining": sum(1 for n in nodes if n.active and n.draining),
            "nodes_fenced": sum(1 for n in nodes if n.fenced),
            "journal_records": rt.writer.num_records,
            "journal_transactions": rt.writer.num_transactions,
            "last_seq_no": rt.writer.last_seq_no,
            "serving": 1.0 if rt.phase == "serving" else 0.0,
            "sessions": len(rt.sessions),
            "session_answers": rt.sessions.num_answers,
            "session_refusals": rt.sessions.num_expired_refusals,
            "kv_events": rt.kv_events,
            # fleet mode: each member and how many pools it owns
            "fleet": [(m.scheduler_id, len(rt.state.leases.held_by(m.scheduler_id))) for m in rt.fleet.fleet.members()],
        }

    async def _read_async(self) -> dict[str, Any]:
        return self._read()

    def _snapshot(self) -> dict[str, Any] | None:
        if self._loop.is_closed():
            return None
        try:
            if threading.get_ident() == self._loop_thread:
                return self._read()
            return asyncio.run_coroutine_threadsafe(self._read_async(), self._loop).result(timeout=5.0)
        except Exception:  # noqa: BLE001 - a scrape during shutdown yields nothing
            return None

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if snap is None:
            return
        usage = GaugeMetricFamily(
            "pagedkv_kv_cache_usage_perc", "Fraction of the pool's blocks in use (0-1).", labels=["pool"]
        )
        blocks = GaugeMetricFamily("pagedkv_blocks", "Blocks of the pool by state.", labels=["pool", "state"])
        hwm = GaugeMetricFamily("pagedkv_high_water_mark", "Highest used block id + 1.", labels=["pool"])
        waste = GaugeMetricFamily("pagedkv_waste_slots", "Allocated slots holding no token.", labels=["pool"])
        seqs = GaugeMetricFamily("pagedkv_sequences", "Live sequences on the pool.", labels=["pool"])
        contiguity = GaugeMetricFamily(
            "pagedkv_contiguity", "Fraction of physically adjacent logical block pairs.", labels=["pool"]
        )
        queries = CounterMetricFamily(
            "pagedkv_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels=["pool"]
        )
        hits = CounterMetricFamily(
            "pagedkv_prefix_cache_hits", "Prompt tokens served from the prefix cache.", labels=["pool"]
        )
        cow = CounterMetricFamily("pagedkv_cow_copies", "Copy-on-write block copies.", labels=["pool"])
        evictions = CounterMetricFamily("pagedkv_evictions", "Cached blocks evicted.", labels=["pool"])
        moves = CounterMetricFamily("pagedkv_defrag_moves", "Blocks moved by committed defrag plans.", labels=["pool"])
        plans = CounterMetricFamily(
            "pagedkv_defrag_plans", "Defrag plans by outcome and kind.", labels=["pool", "outcome", "kind"]
        )
        for m in snap["pools"]:
            pool = [m.pool_id]
            usage.add_metric(pool, m.usage)
            for state, value in zip(
                BLOCK_STATES,
                (m.num_free_blocks, m.num_used_blocks, m.num_cached_blocks, m.num_reserved_blocks),
                strict=True,
            ):
                blocks.add_metric([m.pool_id, state], value)
            hwm.add_metric(pool, m.high_water_mark)
            waste.add_metric(pool, m.waste_slots)
            seqs.add_metric(pool, m.num_sequences)
            contiguity.add_metric(pool, m.contiguity)
            queries.add_metric(pool, m.prefix_query_tokens)
            hits.add_metric(pool, m.prefix_hit_tokens)
            cow.add_metric(pool, m.cow_copies)
            evictions.add_metric(pool, m.evictions)
            moves.add_metric(pool, m.defrag_moves)
            plans.add_metric([m.pool_id, "committed", "compaction"], m.compaction_plans)
            plans.add_metric([m.pool_id, "committed", "contiguity"], m.contiguity_plans)
            plans.add_metric([m.pool_id, "aborted", ""], m.aborted_plans)
        yield from (usage, blocks, hwm, waste, seqs, contiguity, queries, hits, cow, evictions, moves, plans)
        yield from _host_families(snap.get("hosts", ()))
        yield from _disk_families(snap.get("disks", ()))
        yield from _fetch_families(snap.get("fetches", ()))
        nodes = GaugeMetricFamily("pagedkv_nodes", "Registered nodes by state.", labels=["state"])
        for state in ("active", "draining", "fenced"):
            nodes.add_metric([state], snap[f"nodes_{state}"])
        yield nodes
        yield CounterMetricFamily(
            "pagedkv_journal_records", "Journal records committed.", value=snap["journal_records"]
        )
        yield CounterMetricFamily(
            "pagedkv_journal_transactions", "Journal transactions (group commits).", value=snap["journal_transactions"]
        )
        yield GaugeMetricFamily(
            "pagedkv_journal_last_seq_no", "Last committed journal seq_no.", value=snap["last_seq_no"]
        )
        yield GaugeMetricFamily("pagedkv_serving", "1 while the server accepts mutations.", value=snap["serving"])
        yield GaugeMetricFamily("pagedkv_client_sessions", "Open client sessions.", value=snap["sessions"])
        yield GaugeMetricFamily(
            "pagedkv_client_session_answers", "Answers held for resends, all sessions.", value=snap["session_answers"]
        )
        yield CounterMetricFamily(
            "pagedkv_client_session_refusals",
            "Resends refused as expired (a number whose answer is gone, or an unknown session).",
            value=snap["session_refusals"],
        )
        yield from _kv_event_families(snap["kv_events"])
        members = snap.get("fleet", [])
        yield GaugeMetricFamily("pagedkv_fleet_members", "Live fleet members (schedulers that heartbeat).",
                                value=len(members))
        owned = GaugeMetricFamily("pagedkv_fleet_owned_pools", "Pools each fleet member owns.", labels=["scheduler"])
        for sid, n in members:
            owned.add_metric([sid], n)
        yield owned


def _kv_event_families(hub: Any) -> Iterator[Metric]:
    """The KV events stream (docs/kv_events.md)."""
    yield GaugeMetricFamily("pagedkv_kv_event_subscribers", "Open SubscribeKvEvents streams.",
                            value=len(hub.subscribers))
    yield CounterMetricFamily("pagedkv_kv_events", "KV events published since start.", value=hub.num_published)
    yield CounterMetricFamily("pagedkv_kv_event_resyncs", "Resyncs sent (a snapshot each).", value=hub.num_resyncs)
    yield CounterMetricFamily("pagedkv_kv_event_overflows",
                              "Subscribers dropped to a Resync because their buffer overflowed.",
                              value=hub.num_overflows)


def _fetch_families(fetches: Iterable[tuple[str, int, int]]) -> Iterator[Metric]:
    """Prefix fetch between nodes (docs/prefix_fetch.md): blocks a pool fetched from other pools
    instead of recomputing them, and blocks it lends now (pinned for another pool's fetch)."""
    fetched = CounterMetricFamily("pagedkv_fetched_blocks", "Prefix blocks fetched from other pools.",
                                  labels=["pool"])
    lent = GaugeMetricFamily("pagedkv_lent_blocks", "Blocks pinned for other pools' fetches.", labels=["pool"])
    for pid, num_fetched, num_lent in fetches:
        fetched.add_metric([pid], num_fetched)
        lent.add_metric([pid], num_lent)
    yield from (fetched, lent)


def _host_families(hosts: Iterable[HostTierMetrics]) -> Iterator[Metric]:
    """The host tier's metrics (docs/tiers.md): blocks by state, moves by kind, host hit tokens."""
    blocks = GaugeMetricFamily("pagedkv_host_blocks", "Host tier blocks of the pool by state.",
                               labels=["pool", "state"])
    swapped = GaugeMetricFamily("pagedkv_swapped_sequences", "Sequences swapped out to host.", labels=["pool"])
    moves = CounterMetricFamily("pagedkv_tier_moves", "Blocks moved between tiers, by kind.", labels=["pool", "kind"])
    host_hits = CounterMetricFamily("pagedkv_host_hit_tokens", "Prompt tokens onboarded from the host tier.",
                                    labels=["pool"])
    host_evictions = CounterMetricFamily("pagedkv_host_evictions", "Host blocks evicted for good.", labels=["pool"])
    for h in hosts:
        for state, value in (("free", h.num_free_blocks), ("used", h.num_used_blocks), ("cached", h.num_cached_blocks)):
            blocks.add_metric([h.pool_id, state], value)
        swapped.add_metric([h.pool_id], h.num_swapped_sequences)
        for kind, value in (("swap_out", h.swapped_out_blocks), ("swap_in", h.swapped_in_blocks),
                            ("offload", h.offloaded_blocks), ("onboard", h.onboarded_blocks)):
            moves.add_metric([h.pool_id, kind], value)
        host_hits.add_metric([h.pool_id], h.host_hit_tokens)
        host_evictions.add_metric([h.pool_id], h.host_evictions)
    yield from (blocks, swapped, moves, host_hits, host_evictions)


def _disk_families(disks: Iterable[DiskTierMetrics]) -> Iterator[Metric]:
    """The disk tier's metrics (docs/tiers.md): slots by state, moves by kind, disk hit tokens."""
    blocks = GaugeMetricFamily("pagedkv_disk_blocks", "Disk tier slots of the pool by state.", labels=["pool", "state"])
    moves = CounterMetricFamily("pagedkv_disk_moves", "Blocks moved to / from the disk tier.", labels=["pool", "kind"])
    hits = CounterMetricFamily("pagedkv_disk_hit_tokens", "Prompt tokens onboarded from the disk tier.",
                               labels=["pool"])
    evictions = CounterMetricFamily("pagedkv_disk_evictions", "Disk slots overwritten for good.", labels=["pool"])
    for d in disks:
        for state, value in (("free", d.num_free_blocks), ("cached", d.num_cached_blocks),
                             ("held", d.num_blocks - d.num_free_blocks - d.num_cached_blocks)):
            blocks.add_metric([d.pool_id, state], value)
        moves.add_metric([d.pool_id, "disk_offload"], d.disk_offloaded_blocks)
        moves.add_metric([d.pool_id, "disk_onboard"], d.disk_onboarded_blocks)
        hits.add_metric([d.pool_id], d.disk_hit_tokens)
        evictions.add_metric([d.pool_id], d.disk_evictions)
    yield from (blocks, moves, hits, evictions)


class ServiceMetrics:
    """The registry, the RPC instruments and (optionally) the HTTP endpoint."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.rpc_latency = Histogram(
            "pagedkv_rpc_latency_seconds",
            "Server-side RPC latency.",
            ["method", "code"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self.rpc_requests = Counter(
            "pagedkv_rpc_requests", "RPCs handled.", ["method", "code"], registry=self.registry
        )
        self._http: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def attach(self, runtime: ServiceRuntime, loop: asyncio.AbstractEventLoop) -> None:
        self.registry.register(_StateCollector(runtime, loop))

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpc_latency.labels(method, code).observe(seconds)
        self.rpc_requests.labels(method, code).inc()

    def serve(self, address: str, port: int) -> int:
        """Start the text endpoint (`GET /metrics`); returns the bound port. `OSError` naming
        the address when it cannot listen (a bare "[Errno 98]" says neither what nor where)."""
        try:
            self._http, self._thread = start_http_server(port, addr=address, registry=self.registry)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}") from None
        self.port = int(self._http.server_port)
        return self.port

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


__all__ = ["ServiceMetrics"]
