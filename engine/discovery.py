"""Finding model nodes the engine does not drive yet, off the step path.

A node that registers with the block manager after the engine started (scale-out), or a known
pool that comes back at another address (a node restarted elsewhere), shows up in `Route`
answers. `BackgroundDiscovery` asks for them on its own thread (one `Route` a second, never on
the step path), `NodeDiscovery.find` probes such a node once (`GetNodeInfo`) and the engine
adopts what it found between steps (`take`), so `nodes` and `max_model_len` never change in
the middle of a step. A node that does not serve the engine's model (another model,
unreachable, not registered) is probed again only after a backoff, so a bad node costs a probe
now and then, not one per refresh.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from engine.errors import NodeError
from engine.node_api import NodeExecutor, NodeInfo
from pagedkv.logging import get_logger

RETRY_S = 10.0          # a node found unusable is probed again after this long, doubling each time
MAX_RETRY_S = 300.0
INFO_TIMEOUT_S = 5.0    # GetNodeInfo of a newly routed node
REFRESH_S = 1.0         # how often the background discovery asks the block manager for pools
log = get_logger("engine.discovery")


def node_problem(info: NodeInfo, model: str, vocab_size: int) -> str | None:
    """Why a node cannot serve an engine of `model`; None when it can."""
    if not info.model:
        return "serves no model (start it with a model directory)"
    if not info.registered:
        return "is not registered with the block manager"
    if (info.model, info.vocab_size) != (model, vocab_size):
        return f"serves {info.model!r} (vocabulary {info.vocab_size}), not {model!r}: every node must serve " \
               "the same model"
    return None


class NodeDiscovery:
    """Turns routed pools the engine lacks into executors (`connect(pool_id, address)`)."""

    def __init__(self, connect: Callable[[str, str], NodeExecutor], model: str, vocab_size: int) -> None:
        self.connect = connect
        self.model = model
        self.vocab_size = vocab_size
        self._skipped: dict[tuple[str, str], tuple[float, int]] = {}   # (pool, address) -> (retry at, failures)

    def find(
        self, routes: Iterable[Any], known: Mapping[str, NodeExecutor]
    ) -> Iterator[tuple[str, NodeExecutor, NodeInfo]]:
        """(pool id, executor, its info) for each routed pool that `known` lacks or knows at
        another address, and that serves the model."""
        now = time.monotonic()
        for r in routes:
            current = known.get(r.pool_id)
            if current is not None and getattr(current, "address", r.address) == r.address:
                continue
            key = (r.pool_id, r.address)
            retry_at, failures = self._skipped.get(key, (0.0, 0))
            if now < retry_at:
                continue
            node = self.connect(r.pool_id, r.address)
            try:
                info = node.info(timeout_s=INFO_TIMEOUT_S)
                problem = node_problem(info, self.model, self.vocab_size)
            except NodeError as exc:
                info, problem = None, f"did not answer GetNodeInfo: {exc.code or exc.message}"
            if problem is not None or info is None:
                node.close()
                backoff = min(RETRY_S * 2 ** failures, MAX_RETRY_S)
                self._skipped[key] = (now + backoff, failures + 1)
                log.warning("node_skipped", pool_id=r.pool_id, address=r.address, reason=problem, retry_in_s=backoff)
                continue
            self._skipped.pop(key, None)
            log.info("node_adopted", pool_id=r.pool_id, address=r.address, num_blocks=info.num_blocks)
            yield r.pool_id, node, info


Found = tuple[str, NodeExecutor, NodeInfo]


class BackgroundDiscovery:
    """Runs `NodeDiscovery` every `interval_s` on its own thread over `routes()` (the block
    manager's routed pools) against `known()` (the engine's nodes); `take` hands the engine
    what it found since the last call."""

    def __init__(self, discovery: NodeDiscovery, routes: Callable[[], Iterable[Any]],
                 known: Callable[[], Mapping[str, NodeExecutor]], *, interval_s: float = REFRESH_S) -> None:
        self.discovery = discovery
        self.routes = routes
        self.known = known
        self.interval_s = interval_s
        self.num_refreshes = 0
        self._found: list[Found] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-discovery", daemon=True)

    def start(self) -> BackgroundDiscovery:
        self._thread.start()
        return self

    def take(self) -> list[Found]:
        with self._lock:
            found, self._found = self._found, []
        return found

    def refresh(self) -> None:
        """One round: the routed pools, probed where new (on the caller's thread)."""
        try:
            routes = list(self.routes())
        except Exception as exc:  # noqa: BLE001 - an unreachable block manager: next round
            log.warning("discovery_route_failed", error=str(exc))
            return
        with self._lock:
            pending = {pool_id: getattr(node, "address", None) for pool_id, node, _ in self._found}
        known = dict(self.known())
        fresh = [r for r in routes if r.pool_id not in pending or pending[r.pool_id] != r.address]
        found = list(self.discovery.find(fresh, known))
        self.num_refreshes += 1
        if found:
            with self._lock:
                self._found.extend(found)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for _, node, _ in self.take():
            node.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh()


__all__ = ["BackgroundDiscovery", "NodeDiscovery", "node_problem"]
