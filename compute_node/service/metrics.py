"""Prometheus metrics of one compute node (its own `CollectorRegistry`, so several nodes can
live in one test process).

Forward latency is one histogram labelled by phase — `table_fetch`, `copy_ops`, `write`,
`attention`, `total` — so a dashboard shows where a step's time goes and the service overhead
(total minus attention) directly. Pool geometry is exported as labelled gauges so operators can
see what memory a node holds without asking it. Decode steps by attention path (`graph`, or
`fallback_<reason>` when a step did not fit the CUDA graphs) and the graphs' static bytes are
read from the pool at each scrape (`watch_decode_paths`), so the hot path updates no metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from compute_node.pool import PoolGeometry

LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)
PHASES = ("table_fetch", "copy_ops", "write", "attention", "total")


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.forward_seconds = Histogram(
            "pagedkv_cn_forward_seconds", "Forward latency by phase", ["phase"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.forwards = Counter("pagedkv_cn_forwards", "Forward RPCs by status code", ["code"], registry=r)
        self.tokens = Counter("pagedkv_cn_tokens", "New tokens written, by kind", ["kind"], registry=r)
        self.kv_bytes_read = Counter("pagedkv_cn_kv_bytes_read", "K/V bytes read by attention kernels", registry=r)
        self.copy_ops = Counter("pagedkv_cn_copy_ops", "Copy ops applied, by kind", ["kind"], registry=r)
        self.bm_rpcs = Counter("pagedkv_cn_block_manager_rpcs", "Calls to the block manager", ["rpc"], registry=r)
        self.bm_failures = Counter(
            "pagedkv_cn_block_manager_failures", "Failed calls to the block manager", ["rpc"], registry=r
        )
        self.fetched_blocks = Counter("pagedkv_cn_fetched_blocks", "Prefix blocks pulled from other nodes",
                                      registry=r)
        self.fetch_recomputed_tokens = Counter(
            "pagedkv_cn_fetch_recomputed_tokens", "Prefix tokens recomputed because a pull failed", registry=r)
        self.fetch_bytes = Counter("pagedkv_cn_fetch_bytes", "K/V bytes pulled from other nodes", registry=r)
        self.served_blocks = Counter("pagedkv_cn_served_blocks", "Prefix blocks served to other nodes", registry=r)
        self.fenced = Counter("pagedkv_cn_fenced", "Times this node found its epoch fenced", registry=r)
        self.epoch = Gauge("pagedkv_cn_epoch", "Current registration epoch (0: not registered)", registry=r)
        self.cached_tables = Gauge("pagedkv_cn_cached_tables", "Block tables in the node's cache", registry=r)
        self.pool = Gauge(
            "pagedkv_cn_pool_info",
            "Pool geometry (value 1; the geometry is in the labels)",
            ["num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "device"],
            registry=r,
        )
        self.pool_blocks = Gauge("pagedkv_cn_pool_blocks", "Blocks in the pool", registry=r)
        self.pool_bytes = Gauge("pagedkv_cn_pool_bytes", "Bytes of K/V memory in the pool", registry=r)

    def set_pool(self, geometry: PoolGeometry, device: str) -> None:
        self.pool.labels(
            str(geometry.num_layers), str(geometry.num_kv_heads), str(geometry.head_dim), geometry.dtype,
            str(geometry.block_size), device,
        ).set(1)
        self.pool_blocks.set(geometry.num_blocks)
        self.pool_bytes.set(geometry.num_bytes)

    def watch_decode_paths(self, read: Callable[[], tuple[dict[str, int], int]]) -> None:
        """Export `read()` — (decode steps by path, graphs' static bytes) — at each scrape."""
        self.registry.register(_DecodePaths(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, address: str, port: int) -> tuple[object, int]:
        """Start the `/metrics` HTTP endpoint; returns (server, bound port). `OSError` naming the
        address when it cannot listen."""
        try:
            server, _thread = start_http_server(port, addr=address, registry=self.registry)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}") from None
        return server, int(server.server_port)


class _DecodePaths:
    """A custom collector: the pool's own counts, read when scraped."""

    def __init__(self, read: Callable[[], tuple[dict[str, int], int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        counts, static_bytes = self._read()
        steps = CounterMetricFamily(
            "pagedkv_cn_decode_steps", "Decode steps by attention path (graph, or fallback_<reason>)", labels=["path"]
        )
        for path, n in sorted(counts.items()):
            steps.add_metric([path], n)
        yield steps
        yield GaugeMetricFamily(
            "pagedkv_cn_decode_graph_bytes", "Device bytes of the decode CUDA graphs' static buffers",
            value=static_bytes,
        )
