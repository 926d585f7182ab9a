"""The router under test (`RouterThread`) and its upstream engines (`FakeEngine`): tiny
OpenAI-shaped HTTP servers on real 127.0.0.1 sockets (uvicorn in a thread), each recording what
it received and answering with its name.

Their answers are deterministic bytes (no ids, no timestamps), so a stream fetched directly and
one fetched through the router can be compared byte for byte.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.api.router import Router, RouterConfig
from engine.api.server import ServerThread
from engine.tokenizer import Tokenizer

CLOSE_PATH = "/test-only/close"


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakeEngine:
    """`num_events` stream events per request; `fail_status`: answer that status instead;
    `die_after`: drop the connection after that many events; `split_events`: write each event
    in two pieces (the router must not relay half an event as if it were whole); `gate`: hold
    the stream after its first event until the test sets it."""

    name: str
    num_events: int = 4
    fail_status: int | None = None
    die_after: int | None = None
    split_events: bool = False
    gate: threading.Event | None = None
    received: list[Received] = field(default_factory=list)
    num_aborted: int = 0          # streams that ended before their last event (the client went away)

    def __post_init__(self) -> None:
        self._thread = ServerThread(self._app())

    @property
    def url(self) -> str:
        return self._thread.url

    def __enter__(self) -> FakeEngine:
        self._thread.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.gate is not None:
            self.gate.set()
        self._thread.__exit__(*exc)

    def event(self, i: int) -> bytes:
        return f"data: {json.dumps({'engine': self.name, 'i': i, 'text': 'é' * i})}\n\n".encode()

    def stream_bytes(self) -> bytes:
        return b"".join(self.event(i) for i in range(self.num_events)) + b"data: [DONE]\n\n"

    def _app(self) -> FastAPI:
        app = FastAPI()

        async def generate(request: Request) -> Response:
            body = await request.json()
            self.received.append(Received(request.url.path, body, dict(request.headers)))
            if self.fail_status is not None:
                return JSONResponse({"error": {"message": f"{self.name} fails", "type": "server_error"}},
                                    self.fail_status)
            if not body.get("stream"):
                return JSONResponse({"engine": self.name, "object": "text_completion", "n": len(self.received)})
            return StreamingResponse(self._events(), media_type="text/event-stream")

        app.add_api_route("/v1/completions", generate, methods=["POST"])
        app.add_api_route("/v1/chat/completions", generate, methods=["POST"])

        @app.get("/v1/models")
        async def models(request: Request) -> dict[str, Any]:
            self.received.append(Received(request.url.path, {}, dict(request.headers)))
            return {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": self.name}]}

        return app

    async def _events(self) -> AsyncIterator[bytes]:
        done = False
        try:
            async for event in self._event_list():
                yield event
            done = True
        finally:
            if not done:
                self.num_aborted += 1

    async def _event_list(self) -> AsyncIterator[bytes]:
        for i in range(self.num_events):
            if self.die_after is not None and i == self.die_after:
                raise RuntimeError(f"{self.name} dies mid-stream")     # uvicorn drops the connection
            event = self.event(i)
            if self.split_events:
                yield event[:9]
                await asyncio.sleep(0.01)
                event = event[9:]
            yield event
            if i == 0 and self.gate is not None:
                await asyncio.to_thread(self.gate.wait, 10)
        yield b"data: [DONE]\n\n"


def dead_url() -> str:
    """A base URL nothing listens on (the connection is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class RouterThread:
    """`Router(config, Tokenizer(model_dir))` served on 127.0.0.1:<free port>. Its clients live in
    the server's loop, so closing them is a request to a route only the tests add."""

    def __init__(self, model_dir: Path, **config: Any) -> None:
        self.router = Router(RouterConfig(**config), Tokenizer(model_dir))
        app = self.router.app()

        async def close() -> dict[str, bool]:
            await self.router.close()
            return {"closed": True}

        app.add_api_route(CLOSE_PATH, close, methods=["POST"])
        self._thread = ServerThread(app)

    @property
    def url(self) -> str:
        return self._thread.url

    def __enter__(self) -> RouterThread:
        self._thread.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            httpx.post(self.url + CLOSE_PATH, timeout=10)
        finally:
            self._thread.__exit__(*exc)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the router's /metrics (0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return 0.0


__all__ = ["FakeEngine", "Received", "RouterThread", "dead_url"]
