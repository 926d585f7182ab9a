"""Prometheus metrics of the router (`GET /metrics` of `pagedkv-router`), one registry per app.

How requests were placed: `pagedkv_router_routed_by_prefix_total` (the owner of the longest
cached prefix), `..._routed_by_load_total` (nothing cached: the least loaded member),
`..._routed_static_total` (no member known: the static `--engines`), `..._routed_by_balance_total`
(the prefix owner was too busy: the least loaded member fetches the prefix); the prompt tokens the
chosen pool already held (`..._prefix_cached_tokens_total`, against `..._prompt_tokens_total`).
What the engines did: requests relayed per engine, engines given up on per reason (`connect`,
`disconnected`, `status_5xx` before the first byte: retried; `broken` mid-answer: passed on),
`..._retries_total`, `..._route_errors_total` (Route unanswered: routed by load). Read at
scrape time: the engines known, and each one's load as the router sees it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api.router_fleet import Fleet, RoutedBy, RoutePlan
from engine.api.router_forward import Attempt


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        known = GaugeMetricFamily("pagedkv_router_engines_known", "Engines the router may forward to, by source: "
                                  "fleet (owners the block manager names) or static (--engines).", labels=["source"])
        known.add_metric(["fleet"], len(self.fleet.members))
        known.add_metric(["static"], len(self.fleet.statics))
        yield known
        load = GaugeMetricFamily("pagedkv_router_engine_load", "Each engine's load as the router ranks it: running "
                                 "and waiting (the block manager's view) and in flight from this router.",
                                 labels=["engine", "kind"])
        for view in [*self.fleet.members.values(), *self.fleet.statics.values()]:
            for kind, value in (("running", view.num_running), ("waiting", view.num_waiting),
                                ("in_flight", view.num_in_flight)):
                load.add_metric([view.url, kind], value)
        yield load


class RouterMetrics:
    def __init__(self, fleet: Fleet) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_FleetCollector(fleet))
        r = self.registry
        self._routed = {
            RoutedBy.PREFIX: Counter("pagedkv_router_routed_by_prefix", "Requests sent to the owner of the pool with "
                                     "the longest cached prefix of their prompt.", registry=r),
            RoutedBy.LOAD: Counter("pagedkv_router_routed_by_load", "Requests with no cached prefix anywhere (or no "
                                   "Route answer), sent to the least loaded member.", registry=r),
            RoutedBy.STATIC: Counter("pagedkv_router_routed_static", "Requests sent to a static --engines entry (the "
                                     "block manager named no owner).", registry=r),
            RoutedBy.BALANCE: Counter("pagedkv_router_routed_by_balance", "Requests whose prefix owner had more than "
                                      "--max-imbalance requests beyond the least loaded member, which got them.",
                                      registry=r),
        }
        self.prompt_tokens = Counter("pagedkv_router_prompt_tokens", "Prompt tokens of routed requests (the first "
                                     "prompt of each).", registry=r)
        self.cached_tokens = Counter("pagedkv_router_prefix_cached_tokens", "Of those, tokens the chosen engine's "
                                     "pool held already (per the block manager).", registry=r)
        self.retries = Counter("pagedkv_router_retries", "Requests tried again on the next engine (the previous one "
                               "failed before the first byte).", registry=r)
        self.route_errors = Counter("pagedkv_router_route_errors", "Route calls the block manager did not answer.",
                                    registry=r)
        self.engine_requests = Counter("pagedkv_router_engine_requests", "Requests each engine answered (status "
                                       "line relayed).", ["engine"], registry=r)
        self.engine_failures = Counter("pagedkv_router_engine_failures", "Engines given up on, by reason: connect, "
                                       "disconnected, status_5xx (before the first byte), broken (mid-answer).",
                                       ["engine", "reason"], registry=r)

    def routed(self, plan: RoutePlan) -> None:
        self._routed[plan.routed_by].inc()
        self.prompt_tokens.inc(plan.num_prompt_tokens)
        self.cached_tokens.inc(plan.num_cached_tokens)

    def give_up(self, attempt: Attempt) -> None:
        self.engine_failures.labels(attempt.url, attempt.failure).inc()
        if attempt.retried:
            self.retries.inc()

    content_type = CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["RouterMetrics"]
