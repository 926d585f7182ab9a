"""`AsyncLLMEngine`: the engine on its own thread, for asyncio servers (the OpenAI API server).

One thread owns the `LLMEngine` and runs steps while there is work; asyncio code submits
requests and aborts through a thread-safe inbox and receives each request's outputs on its own
`asyncio.Queue` (filled with `call_soon_threadsafe`). A request whose consumer goes away (a
client disconnecting mid-stream) is aborted, which frees its blocks with the next step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.llm_engine import LLMEngine
from engine.params import RequestOutput, SamplingParams
from pagedkv.logging import get_logger

log = get_logger(__name__)

IDLE_GAUGE_REFRESH_S = 2.5   # keep refreshing the gauges this long after the engine went idle


@dataclass(slots=True)
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    outbox: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class EngineGauges:
    """What /metrics exports, refreshed by the engine thread after every step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.gauges = EngineGauges()
        self._inbox: queue.Queue[_Submit | _Abort | None] = queue.Queue()
        self._outboxes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._idle_wait_s = idle_wait_s
        self._stopped = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ---- asyncio side ---------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str, *, prompt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs after every step that changed it; the last one is finished.
        Raises the engine's refusal (`InvalidParams`, `EngineError`) before the first output.
        Leaving the iteration early (a client went away) aborts the request."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error!r}")
        loop = asyncio.get_running_loop()
        outbox: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        self._inbox.put(_Submit(request_id, list(prompt_token_ids), params, prompt, outbox, loop, accepted))
        finished = False
        try:
            # inside the try: a consumer cancelled while the engine thread is busy with a step
            # must abort too (aborting a refused or unknown request changes nothing)
            await accepted
            while True:
                out = await outbox.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def shutdown(self) -> None:
        self._stopped.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        idle_since: float | None = None
        try:
            while not self._stopped.is_set():
                block = not engine.has_unfinished_requests()
                self._drain_inbox(block)
                if engine.has_unfinished_requests():
                    idle_since = None
                    self._deliver(engine.step())
                    self._refresh_gauges()
                else:
                    engine.flush()
                    # the gauges settle after the last frees (KV usage is read at most once a second)
                    now = time.monotonic()
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since < IDLE_GAUGE_REFRESH_S:
                        self._refresh_gauges()
        except BaseException as exc:  # noqa: BLE001 - surfaced to every waiting request
            self.error = exc
            log.exception("engine stopped")
            for loop, outbox in self._outboxes.values():
                _post(loop, outbox.put_nowait, exc)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self._idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is None:
                self._stopped.set()
                return
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: _Submit | _Abort) -> None:
        engine = self.engine
        if isinstance(item, _Abort):
            if item.request_id in engine.requests:
                engine.abort_request(item.request_id)
            self._outboxes.pop(item.request_id, None)
            return
        try:
            engine.add_request(item.prompt_token_ids, item.params, prompt=item.prompt, request_id=item.request_id)
        except Exception as exc:  # noqa: BLE001 - the caller gets the refusal
            _post(item.loop, _settle, item.accepted, exc)
            return
        if not _post(item.loop, _settle, item.accepted, None):
            engine.abort_request(item.request_id)     # its consumer's event loop is gone
            return
        self._outboxes[item.request_id] = (item.loop, item.outbox)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._outboxes.get(out.request_id)
            if target is None:
                continue
            loop, outbox = target
            if not _post(loop, outbox.put_nowait, _snapshot(out)):
                del self._outboxes[out.request_id]   # its consumer's event loop is gone
                if not out.finished:
                    self.engine.abort_request(out.request_id)
                continue
            if out.finished:
                del self._outboxes[out.request_id]

    def _refresh_gauges(self) -> None:
        e = self.engine
        g = self.gauges
        g.num_running = len(e.running)
        g.num_waiting = len(e.waiting)
        g.kv_usage = e.kv_usage()
        s = e.stats
        g.counters = {
            "generated_tokens": s.generated_tokens, "prompt_tokens": s.prompt_tokens,
            "cached_prompt_tokens": s.cached_prompt_tokens, "preemptions": s.num_preemptions,
            "finished_requests": s.num_finished, "steps": s.num_steps, "time": time.time(),
        }


def _post(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> bool:
    """Run `fn(*args)` on a consumer's event loop; False when that loop is closed (the consumer
    went away with it: the engine thread must not die of it)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the asyncio side may read while the engine thread goes on appending."""
    from dataclasses import replace

    return replace(out, prompt_token_ids=list(out.prompt_token_ids), outputs=[
        replace(o, token_ids=list(o.token_ids),
                logprobs=None if o.logprobs is None else list(o.logprobs),
                top_logprobs=None if o.top_logprobs is None else list(o.top_logprobs))
        for o in out.outputs
    ])


__all__ = ["AsyncLLMEngine", "EngineGauges"]

