"""Forwarding one request to the engines of a plan, and relaying the answer as it arrives.

Retry rule: a request is tried on the next engine only while nothing of an answer has reached
the client: the engine refused or dropped the connection before its status line, or answered
5xx (it is shutting down, its engine thread died, ...). The last engine's 5xx is passed on as
it is. Once a status line below 500 is relayed, the answer streams through unchanged; if the
engine goes away mid-answer the client learns it: a server-sent-events stream ends with an
OpenAI error event and `data: [DONE]` (only whole events are relayed, so the error never lands
inside a half-sent one); any other body is cut off (the connection is aborted).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import StreamingResponse

# Hop-by-hop and framing headers: each side of the router sets its own.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "trailers", "transfer-encoding", "upgrade", "host", "content-length"})
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")


class NoEngineAnswered(Exception):
    """Every engine of the plan refused the connection or dropped it before answering."""


@dataclass(slots=True, frozen=True)
class Attempt:
    """One engine tried and given up on before the first byte (for metrics and logs)."""

    url: str
    failure: str         # "connect" (refused, unreachable), "disconnected" (dropped before answering), "status_5xx",
    detail: str          # "broken" (went away mid-answer: passed on, not retried)
    retried: bool = False  # the request went on to the next engine


def forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers without hop-by-hop ones; `Authorization` goes through unchanged, so
    each engine checks the key itself (the router checks its own `--api-key` first)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


async def open_upstream(client: httpx.AsyncClient, method: str, path: str, headers: Mapping[str, str], body: bytes,
                        urls: tuple[str, ...], on_give_up: Callable[[Attempt], None]) -> tuple[str, httpx.Response]:
    """The first engine of `urls` that answers with a status below 500 (or the last one's 5xx),
    its response opened for streaming (the caller closes it)."""
    for i, url in enumerate(urls):
        more = i + 1 < len(urls)
        request = client.build_request(method, url + path, headers=headers, content=body)
        try:
            response = await client.send(request, stream=True)
        except httpx.ConnectError as exc:
            on_give_up(Attempt(url, "connect", _detail(exc), more))
            continue
        except httpx.TransportError as exc:      # dropped, timed out connecting or writing, a bad address
            on_give_up(Attempt(url, "disconnected", _detail(exc), more))
            continue
        if response.status_code >= 500 and more:
            await response.aclose()
            on_give_up(Attempt(url, "status_5xx", str(response.status_code), more))
            continue
        return url, response
    raise NoEngineAnswered(f"none of {len(urls)} engine(s) answered")


def _detail(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def is_event_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def upstream_error_event(url: str) -> bytes:
    body = {"error": {"message": f"the engine serving this stream went away mid-answer ({url}); the tokens above "
                                 "were delivered, retry the rest", "type": "server_error", "param": None,
                      "code": "upstream_disconnected"}}
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()


async def relay(url: str, response: httpx.Response, on_broken: Callable[[], None]) -> AsyncIterator[bytes]:
    """The response body as it arrives; events whole for an event stream (see the module doc)."""
    sse = is_event_stream(response)
    pending = b""
    try:
        async for chunk in response.aiter_raw():
            if not sse:
                yield chunk
                continue
            pending += chunk
            cut = max(pending.rfind(end) + len(end) if end in pending else 0 for end in _EVENT_ENDS)
            if cut:
                yield pending[:cut]
                pending = pending[cut:]
        if pending:
            yield pending
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        on_broken()
        if not sse:
            raise UpstreamBroken(_detail(exc)) from None
        yield upstream_error_event(url)


class UpstreamBroken(Exception):
    """The engine went away in the middle of a plain (not event-stream) body: the client's
    connection is aborted, so it cannot mistake a cut answer for a whole one."""


class RelayResponse(StreamingResponse):
    """The engine's status, headers and body; the upstream response is closed however the
    relay ends (a client that disconnects mid-stream closes the engine's stream too, which
    aborts the generation there), and `on_done` runs once."""

    def __init__(self, url: str, upstream: httpx.Response, on_broken: Callable[[], None],
                 on_done: Callable[[], None]) -> None:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
        super().__init__(relay(url, upstream, on_broken), status_code=upstream.status_code, headers=headers)
        self._upstream = upstream
        self._on_done = on_done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._upstream.aclose()
            self._on_done()


__all__ = ["Attempt", "NoEngineAnswered", "RelayResponse", "UpstreamBroken", "forward_headers", "open_upstream",
           "relay", "upstream_error_event"]
