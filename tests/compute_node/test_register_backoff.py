"""A node whose block manager is unreachable retries registration with a capped, jittered
backoff (issue 10: it logged `register_failed` every 0.5 s forever)."""

from __future__ import annotations

import grpc

from compute_node.service.bm_link import LinkUnavailable
from compute_node.service.node import ComputeNode
from tests.compute_node.harness import cn_config


async def test_registration_retries_back_off_to_the_cap() -> None:
    initial, cap, attempts = 0.05, 0.4, 12
    node = ComputeNode(cn_config("127.0.0.1:9", retry_interval_s=initial, max_retry_interval_s=cap))
    delays: list[float] = []

    async def register(**_: object) -> None:
        raise LinkUnavailable(grpc.StatusCode.UNAVAILABLE, "connection refused")

    async def sleep(seconds: float) -> None:   # no wall clock: record the delay, go on at once
        delays.append(seconds)
        if len(delays) == attempts:
            node._stopping.set()

    node.link.register = register  # type: ignore[method-assign]
    node._sleep = sleep  # type: ignore[method-assign]
    try:
        await node._run()
    finally:
        await node.link.close()
    assert len(delays) == attempts
    for i, delay in enumerate(delays):
        base = min(cap, initial * 2**i)   # doubling, capped; jitter scales into [base / 2, base]
        assert base / 2 <= delay <= base, (i, delay, delays)
    assert all(d >= cap / 2 for d in delays[4:])   # it grew to the cap and stayed there
