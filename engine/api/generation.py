"""One HTTP request's generation: its prompts as engine requests, their outputs as per-choice
text updates.

`_Fanout` runs one engine request per prompt (`AsyncLLMEngine.generate`) and merges their outputs;
cancelling it aborts them. `Choice` turns the engine's snapshots of one completion into what the
client may see: text that never splits a character and never shows a stop string or what may be
the start of one. `Generation` ties both to the request's metrics (time to first token per
prompt, inter-token latency per completion, end-to-end latency) and ends the engine request of a
prompt whose completions all hit a stop string.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.api.metrics import ApiMetrics
from engine.api.protocol import Prompt
from engine.async_engine import AsyncLLMEngine
from engine.errors import EngineError, NoNodeOwned
from engine.params import CompletionOutput, PromptLogprobs, RequestOutput, SamplingParams


class _Fanout:
    """One engine request per prompt, run concurrently; their outputs merged in arrival order.
    `cancel(i)` / `close()` abort engine requests (leaving `AsyncLLMEngine.generate` early
    aborts: the blocks go back with the engine's next step)."""

    def __init__(self, aeng: AsyncLLMEngine, prompts: list[Prompt], params: SamplingParams, base_id: str) -> None:
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        self._tasks = [
            asyncio.create_task(self._pump(aeng, i, p, params, f"{base_id}-{i}"), name=f"{base_id}-{i}")
            for i, p in enumerate(prompts)
        ]
        self._live = set(range(len(prompts)))

    async def _pump(self, aeng: AsyncLLMEngine, i: int, p: Prompt, params: SamplingParams, rid: str) -> None:
        try:
            async for out in aeng.generate(p.token_ids, params, rid, prompt=p.text):
                self._queue.put_nowait((i, out))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((i, exc))
            return
        self._queue.put_nowait((i, None))

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next output of a live prompt; None once every prompt finished or was cancelled.
        Raises the first failure (the caller then `close()`s the rest)."""
        while self._live:
            i, item = await self._queue.get()
            if i not in self._live:
                continue
            if item is None:
                self._live.discard(i)
                continue
            if isinstance(item, BaseException):
                raise item
            return i, item
        return None

    def cancel(self, i: int) -> None:
        self._live.discard(i)
        self._tasks[i].cancel()

    def close(self) -> None:
        for i in range(len(self._tasks)):
            self.cancel(i)


@dataclass(slots=True)
class Choice:
    """One completion as the client sees it: text sent so far (never a split character, never a
    stop string or what may be the start of one), tokens seen, its own finish."""

    index: int
    prompt_index: int
    stops: tuple[str, ...]
    text: str = ""
    num_tokens: int = 0
    text_offset: int = 0
    finish_reason: str | None = None
    last_token_at: float | None = None
    output: CompletionOutput | None = None

    def advance(self, o: CompletionOutput) -> tuple[str, int, int]:
        """Take the engine's latest snapshot: (new text, first new token, end of new tokens)."""
        start, end = self.num_tokens, len(o.token_ids)
        self.num_tokens = end
        self.output = o
        engine_done = o.finish_reason is not None
        visible = o.text if engine_done else o.text.rstrip("\ufffd")   # an incomplete character waits
        finish = o.finish_reason
        if self.stops:
            cut = _find_stop(visible, self.stops, max(0, len(self.text) - max(map(len, self.stops)) + 1))
            if cut is not None:
                visible, finish = visible[: max(cut, len(self.text))], "stop"
            elif not engine_done:
                visible = visible[: len(visible) - _stop_prefix_len(visible, self.stops, len(self.text))]
        delta = visible[len(self.text):]
        self.text += delta
        if finish is not None:
            self.finish_reason = "stop" if finish == "abort" else finish
        return delta, start, end


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    hits = [p for p in (text.find(s, start) for s in stops) if p >= 0]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stops: tuple[str, ...], floor: int) -> int:
    """Length of the longest tail of `text` (after `floor`) that a stop string starts with."""
    for k in range(min(max(map(len, stops)) - 1, len(text) - floor), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0


@dataclass(slots=True)
class Update:
    choice: Choice
    delta: str
    start: int
    end: int


@dataclass
class Generation:
    """The engine requests of one HTTP request, as a stream of per-choice updates, with the
    request's metrics."""

    aeng: AsyncLLMEngine
    metrics: ApiMetrics
    prompts: list[Prompt]
    params: SamplingParams
    stops: tuple[str, ...]
    request_id: str
    arrival: float = field(default_factory=time.perf_counter)
    choices: list[Choice] = field(init=False)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    finished: bool = False             # the whole answer went out
    # `echo` with max_tokens=0: the engine generates one token (it always samples after the
    # prefill), which the answer leaves out; usage counts no completion token
    echo_only: bool = False
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)   # per prompt, once scored
    _first_token: set[int] = field(default_factory=set)
    _fan: _Fanout | None = None

    def __post_init__(self) -> None:
        n = self.params.n
        self.choices = [Choice(p * n + j, p, self.stops) for p in range(len(self.prompts)) for j in range(n)]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    def usage(self) -> dict[str, Any]:
        completion = 0 if self.echo_only else sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}

    async def updates(self) -> AsyncIterator[list[Update]]:
        """Updates after each engine step that changed the request; ends when every choice has
        finished. Closing it early aborts whatever still runs."""
        metrics, n = self.metrics, self.params.n
        self._fan = fan = _Fanout(self.aeng, self.prompts, self.params, self.request_id)
        try:
            while (item := await fan.next()) is not None:
                i, out = item
                if out.error is not None:   # the engine could not serve it (a refusal: 400; or 503 now)
                    raise NoNodeOwned(out.error) if out.unavailable else EngineError(out.error)
                now = time.perf_counter()
                self.cached_tokens[i] = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs[i] = out.prompt_logprobs
                batch = []
                for o in out.outputs:
                    choice = self.choices[i * n + o.index]
                    if choice.finish_reason is not None:
                        continue
                    new = len(o.token_ids) - choice.num_tokens
                    if new > 0:
                        if i not in self._first_token:
                            self._first_token.add(i)
                            metrics.ttft.observe(now - self.arrival)
                        elif choice.last_token_at is not None:
                            for _ in range(new):
                                metrics.itl.observe((now - choice.last_token_at) / new)
                        choice.last_token_at = now
                    batch.append(Update(choice, *choice.advance(o)))
                if not out.finished and all(c.finish_reason for c in self.choices[i * n : (i + 1) * n]):
                    fan.cancel(i)        # every completion hit a stop string: end the engine request
                if batch:
                    yield batch
        finally:
            fan.close()
        metrics.e2e.observe(time.perf_counter() - self.arrival)

    def close(self) -> None:
        """Abort whatever still runs (idempotent, synchronous: safe in any cleanup path)."""
        if self._fan is not None:
            self._fan.close()


__all__ = ["Choice", "Generation", "Update"]
