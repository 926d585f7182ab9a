"""Prometheus metrics of the API server (`GET /metrics`), one registry per app.

Read from the engine at scrape time: running and waiting requests, KV cache usage, prefix cache
hit rate and its token counters, preemptions, prompt and generated tokens, steps, the nodes it
drives (a fleet member's owned nodes). Observed by
the server per request as its tokens stream: time to first token, inter-token latency,
end-to-end latency, and requests finished or failed. Tokens/s is `rate()` of
`pagedkv_generation_tokens_total`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.async_engine import AsyncLLMEngine

# vLLM's buckets, so dashboards built for it read these the same way
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def _copy(items: Iterable[Any]) -> list[Any]:
    """A list or deque the engine thread mutates, copied (one C call under the GIL; retried
    should an iterator ever see a change)."""
    for _ in range(3):
        try:
            return list(items)
        except RuntimeError:
            continue
    return []


class _EngineCollector(Collector):
    def __init__(self, aeng: AsyncLLMEngine, model_name: str) -> None:
        self.aeng = aeng
        self.labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self) -> Iterator[Metric]:
        engine = self.aeng.engine
        running = {s.request.request_id for s in _copy(engine.running)}
        waiting = {s.request.request_id for s in _copy(engine.waiting)} - running
        s = engine.stats
        yield self._gauge("pagedkv_num_requests_running", "Requests with a sequence in the running batch.",
                          len(running))
        yield self._gauge("pagedkv_num_requests_waiting", "Requests waiting for admission (or preempted).",
                          len(waiting))
        yield self._gauge("pagedkv_kv_cache_usage_ratio", "Fraction of the nodes' KV blocks in use (0-1).",
                          self.aeng.gauges.kv_usage)
        yield self._gauge("pagedkv_prefix_cache_hit_rate",
                          "Prompt tokens served from the prefix cache / prompt tokens, since start (re-admissions "
                          "after a preemption count their hits too; capped at 1).",
                          min(1.0, s.cached_prompt_tokens / s.prompt_tokens) if s.prompt_tokens else 0.0)
        yield self._counter("pagedkv_prompt_tokens", "Prompt tokens of accepted requests.", s.prompt_tokens)
        yield self._counter("pagedkv_prompt_tokens_cached", "Prompt tokens found in the prefix cache at admission.",
                            s.cached_prompt_tokens)
        yield self._counter("pagedkv_generation_tokens", "Generated tokens (tokens/s: rate() of this).",
                            s.generated_tokens)
        yield self._counter("pagedkv_num_preemptions", "Sequences preempted (freed, recomputed later).",
                            s.num_preemptions)
        yield self._counter("pagedkv_engine_steps", "Scheduler steps.", s.num_steps)
        yield self._counter("pagedkv_failed_node_steps", "Node steps that failed (node unreachable or timed out): "
                            "reported failed, their sequences recomputed.", s.num_failed_steps)
        yield self._gauge("pagedkv_engine_alive", "1 while the engine thread runs.", 1.0 if self.aeng.alive else 0.0)
        yield self._gauge("pagedkv_owned_nodes", "Model nodes this engine drives (a fleet member: the nodes the block "
                          "manager assigned it; 0 = not ready).", len(engine.nodes))


class ApiMetrics:
    """The server's registry; `ttft`, `itl`, `e2e`, `success`, `failure` are observed per request."""

    def __init__(self, aeng: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(aeng, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("pagedkv_time_to_first_token_seconds", "Request arrival to its first token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("pagedkv_inter_token_latency_seconds", "Time between two tokens of one completion.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("pagedkv_e2e_request_latency_seconds", "Request arrival to its last token.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter("pagedkv_request_success", "Requests answered in full, by the finish reason of "
                                "their first completion.", [*labels, "finished_reason"], registry=self.registry)
        self._failure = Counter("pagedkv_request_failure", "Requests not answered in full, by reason: "
                                "invalid_request, client_disconnected, engine_error.", [*labels, "reason"],
                                registry=self.registry)
        self._model = model_name
        for reason in ("stop", "length"):
            self._success.labels(model_name, reason)
        for reason in ("invalid_request", "client_disconnected", "engine_error"):
            self._failure.labels(model_name, reason)

    def success(self, finished_reason: str) -> None:
        self._success.labels(self._model, finished_reason).inc()

    def failure(self, reason: str) -> None:
        self._failure.labels(self._model, reason).inc()

    content_type = CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["ApiMetrics"]
