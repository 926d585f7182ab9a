"""Nodes out of placement: taken out at their first failure to answer, probed back in.

A node that does not answer a step (UNAVAILABLE: its process died, its host went away; or its
step timed out) would otherwise keep getting work until the block manager fences it when its
lease lapses (10 s by default): every step sent there fails at once and its sequences are
re-queued, only to be placed there again. So the engine takes such a node out of placement at
once (`mark_down`; the engine recomputes its sequences on the other nodes in the same step)
and a background thread probes it (`GetNodeInfo`) with exponential backoff. A node that answers
and still serves the engine's model is readmitted; the engine picks that up between steps
(`down_nodes` is read once per step).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.logging import get_logger

FIRST_PROBE_S = 0.25     # the first probe of a node taken out, doubling after each failed one
MAX_PROBE_S = 5.0
log = get_logger("engine.health")


@dataclass(slots=True)
class _Down:
    since: float
    probe_at: float
    num_probes: int = 0


class NodeHealth:
    """The set of nodes out of placement, and the thread that probes them.

    `probe(node_id)` returns None when the node is healthy again, else why not (it may block up
    to its own timeout: it runs on the probing thread, never on the step path)."""

    def __init__(self, probe: Callable[[str], str | None], *, first_s: float = FIRST_PROBE_S,
                 max_s: float = MAX_PROBE_S) -> None:
        self._probe = probe
        self.first_s = first_s
        self.max_s = max_s
        self._down: dict[str, _Down] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.num_readmitted = 0

    def down_nodes(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._down)

    def is_down(self, node_id: str) -> bool:
        with self._lock:
            return node_id in self._down

    def mark_down(self, node_id: str, reason: str) -> bool:
        """Take `node_id` out of placement; whether it was in (False: already out)."""
        now = time.monotonic()
        with self._lock:
            if node_id in self._down or self._closed:
                return False
            self._down[node_id] = _Down(now, now + self.first_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="node-health", daemon=True)
                self._thread.start()
        log.warning("node_out_of_placement", node_id=node_id, reason=reason, probe_in_s=self.first_s)
        self._wake.set()
        return True

    def readmit(self, node_id: str) -> None:
        """`node_id` answered and serves the model (found again by discovery, say): back now."""
        with self._lock:
            if self._down.pop(node_id, None) is None:
                return
            self.num_readmitted += 1
        log.info("node_readmitted", node_id=node_id)

    def forget(self, node_id: str) -> None:
        """`node_id` is no longer the engine's (a fleet pool handed over): no more probes."""
        with self._lock:
            self._down.pop(node_id, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                due = [(nid, d) for nid, d in self._down.items()]
            now = time.monotonic()
            next_at = now + self.max_s
            for node_id, down in due:
                if down.probe_at > now:
                    next_at = min(next_at, down.probe_at)
                    continue
                problem = self._probe_safely(node_id)
                with self._lock:
                    if problem is None:
                        self._down.pop(node_id, None)
                        self.num_readmitted += 1
                    else:
                        down.num_probes += 1
                        down.probe_at = time.monotonic() + min(self.first_s * 2 ** down.num_probes, self.max_s)
                        next_at = min(next_at, down.probe_at)
                if problem is None:
                    log.info("node_readmitted", node_id=node_id, down_s=round(time.monotonic() - down.since, 3))
            self._wake.wait(max(0.0, next_at - time.monotonic()))
            self._wake.clear()

    def _probe_safely(self, node_id: str) -> str | None:
        try:
            return self._probe(node_id)
        except Exception as exc:  # noqa: BLE001 - any failure to answer is "still down"
            return f"{type(exc).__name__}: {exc}"


__all__ = ["NodeHealth"]
