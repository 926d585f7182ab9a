"""`pagedkv-router`: the KV-aware entry point in front of several `pagedkv-serve` replicas
(fleet mode, docs/router.md).

    app = Router(RouterConfig(block_manager="127.0.0.1:50051"), Tokenizer(model_dir)).app()
    with ServerThread(app) as srv: ...                 # or: pagedkv-router --block-manager ... --model DIR

Why a router: in fleet mode every engine can serve every request (a prefix cached on another
engine's node is fetched node to node), but a fetch costs a transfer a local hit does not. The
router sends each request to the engine that owns the pool already holding the longest prefix
of its prompt, so shared prefixes stay on one node and the fetch path stays the exception.

Per request (`POST /v1/completions`, `POST /v1/chat/completions`):
1. the prompt's token ids, computed by the engine's own code (`engine.api.protocol`'s prompt
   parsing, `engine.tokenizer`'s chat template): the ids the block manager looks up are those
   the engine will cache (a request the router cannot read is sent by load; the engine answers
   its error);
2. `Route(token_ids, salt=cache_salt)` at the block manager, which names each pool's owner;
3. `Fleet.plan`: the owner with the longest cached prefix (unless it is far busier than the
   least loaded member), else the least loaded member, else (no member known) the static
   `--engines`;
4. forward (`engine.api.router_forward`): retried on the next engine before the first byte,
   relayed as it arrives after it.

`GET /v1/models[/{id}]` goes to the least loaded engine. `GET /health`: 200 while at least one
engine is known. `GET /metrics`: Prometheus text (`RouterMetrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from block_manager.client import AsyncBlockManagerClient
from block_manager.client.errors import BlockManagerError
from block_manager.client.retry import RetryPolicy
from block_manager.client.types import PoolRoute
from engine.api.protocol import APIError, ChatCompletionRequest, CompletionRequest, chat_messages, completion_prompts
from engine.api.router_fleet import Fleet, RoutePlan
from engine.api.router_forward import Attempt, NoEngineAnswered, RelayResponse, forward_headers, open_upstream
from engine.api.router_metrics import RouterMetrics
from engine.tokenizer import Tokenizer, TokenizerError
from pagedkv.logging import get_logger
from pagedkv.tls import TlsSettings

log = get_logger(__name__)

# Only a prefix can be cached: longer prompts are routed on their first tokens (the block
# manager refuses a Route beyond its `max_route_tokens`).
MAX_ROUTED_TOKENS = 1 << 16
_PROMPT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclass(slots=True)
class RouterConfig:
    """`block_manager`: HOST:PORT (None: only the static `engines`). `refresh_s`: how often the
    fleet is re-read in the background (who owns pools, their loads). `route_timeout_s`: a
    Route the block manager does not answer in time sends the request by load instead.
    `max_imbalance`: requests the prefix owner may have beyond the least loaded member before
    the latter serves instead (`Fleet.plan`)."""

    block_manager: str | None = None
    engines: Sequence[str] = ()
    api_key: str | None = None
    tls: TlsSettings | None = None
    token: str | None = None
    refresh_s: float = 2.0
    route_timeout_s: float = 2.0
    connect_timeout_s: float = 3.0
    max_imbalance: int = 16


def prompt_of(path: str, body: bytes, tokenizer: Tokenizer) -> tuple[list[int], str | None] | None:
    """(token ids, cache salt) of the request's (first) prompt, rendered and encoded exactly as
    `engine.api.server` does; None when the body is not a request the engine would accept."""
    try:
        obj = json.loads(body)
        if not isinstance(obj, dict):
            return None
        if path == "/v1/completions":
            req = CompletionRequest.model_validate(obj)
            special = req.add_special_tokens is not False
            prompts = completion_prompts(req.prompt, lambda text: tokenizer.encode(text, add_special_tokens=special),
                                         tokenizer.vocab_size)
            return prompts[0].token_ids, req.cache_salt
        chat = ChatCompletionRequest.model_validate(obj)
        text = tokenizer.apply_chat_template(chat_messages(chat.messages),
                                             add_generation_prompt=chat.add_generation_prompt is not False)
        return tokenizer.encode(text, add_special_tokens=bool(chat.add_special_tokens)), chat.cache_salt
    except (APIError, ValidationError, TokenizerError, ValueError):
        return None


class Router:
    """The router's state: the block manager client, the fleet, the HTTP client to the engines.
    Its clients are created in the serving event loop on first use (`start`)."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.fleet = Fleet(tuple(config.engines), max_imbalance=config.max_imbalance)
        self.metrics = RouterMetrics(self.fleet)
        self._bm: AsyncBlockManagerClient | None = None
        self._http: httpx.AsyncClient | None = None
        self._refresher: asyncio.Task[None] | None = None

    # -- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the clients in the running loop and start the background refresh (idempotent)."""
        if self._http is not None:
            return
        timeout = httpx.Timeout(connect=self.config.connect_timeout_s, read=None, write=30.0, pool=None)
        self._http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None,
                                                                           max_keepalive_connections=64))
        if self.config.block_manager is not None:
            self._bm = AsyncBlockManagerClient(
                self.config.block_manager, timeout_s=self.config.route_timeout_s, tls=self.config.tls,
                token=self.config.token, sessions=False, failover_s=0.0,
                retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.05), scheduler_id="pagedkv-router")
            await self.refresh()
            self._refresher = asyncio.create_task(self._refresh_forever(), name="router-refresh")

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        if self._bm is not None:
            await self._bm.close()
        if self._http is not None:
            await self._http.aclose()

    async def refresh(self) -> None:
        """Re-read the fleet: a one-token Route ranks every pool and names every owner."""
        entries = await self._route([0], None)
        if entries is not None:
            self.fleet.replace(entries)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - the refresh must outlive any one failure
                log.error("fleet refresh failed", error=repr(exc))

    async def _route(self, token_ids: Sequence[int], salt: str | None) -> list[PoolRoute] | None:
        if self._bm is None:
            return None
        try:
            return await self._bm.route(token_ids[:MAX_ROUTED_TOKENS], salt=salt)
        except BlockManagerError as exc:
            self.metrics.route_errors.inc()
            log.warning("the block manager did not answer a Route; routing by load", error=str(exc))
            return None

    # -- requests -----------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def plan_for(self, path: str, body: bytes) -> RoutePlan:
        """Where to try a generation request (a body the router cannot read goes by load)."""
        prompt = await asyncio.to_thread(prompt_of, path, body, self.tokenizer) if path in _PROMPT_PATHS else None
        if prompt is None:
            return self.fleet.plan(None)
        plan = self.fleet.plan(await self._route(*prompt))
        return dataclasses.replace(plan, num_prompt_tokens=len(prompt[0]))

    async def forward(self, request: Request, path: str, plan: RoutePlan, body: bytes) -> Response:
        if not plan.urls:
            raise APIError(503, "no engine is known to the router yet (none has joined the fleet, and no --engines)",
                           type="server_error", code="no_engine")
        if self._http is None:
            raise RuntimeError("Router.start() was not awaited")

        def give_up(attempt: Attempt) -> None:
            self.metrics.give_up(attempt)
            self.fleet.failed(attempt.url)
            log.warning("engine failed before the first byte", engine=attempt.url, failure=attempt.failure,
                        detail=attempt.detail, retried=attempt.retried)

        try:
            url, upstream = await open_upstream(self._http, request.method, path, forward_headers(request.headers),
                                                body, plan.urls, give_up)
        except NoEngineAnswered as exc:
            raise APIError(503, f"no engine answered: {exc}", type="server_error", code="engine_unavailable") from None
        view = self.fleet.view(url)
        if view is not None:
            view.num_in_flight += 1
        self.metrics.engine_requests.labels(url).inc()

        def done() -> None:
            if view is not None:
                view.num_in_flight -= 1

        return RelayResponse(url, upstream, lambda: self.metrics.give_up(Attempt(url, "broken", "mid-answer")), done)

    # -- the app ------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        app = FastAPI(title="pagedkv router", docs_url=None, redoc_url=None, openapi_url=None)
        app.state.router = self

        @app.exception_handler(APIError)
        async def _api_error(_: Request, exc: APIError) -> JSONResponse:
            return JSONResponse(exc.body(), exc.status)

        @app.exception_handler(Exception)
        async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
            log.error("unhandled error", error=repr(exc))
            err = APIError(500, "internal error (logged on the router)", type="server_error")
            return JSONResponse(err.body(), 500)

        @app.exception_handler(StarletteHTTPException)
        async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            err = APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", type=kind)
            return JSONResponse(err.body(), exc.status_code)

        async def generate(request: Request) -> Response:
            await self.start()
            self.check_auth(request)
            body = await request.body()
            plan = await self.plan_for(request.url.path, body)
            self.metrics.routed(plan)
            return await self.forward(request, request.url.path, plan, body)

        app.add_api_route("/v1/completions", generate, methods=["POST"])
        app.add_api_route("/v1/chat/completions", generate, methods=["POST"])

        async def models(request: Request) -> Response:
            await self.start()
            self.check_auth(request)
            return await self.forward(request, request.url.path, self.fleet.plan(None), b"")

        app.add_api_route("/v1/models", models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", models, methods=["GET"])

        @app.get("/health")
        async def health() -> Response:
            await self.start()
            if self.fleet.num_known == 0:
                return JSONResponse({"status": "unhealthy", "detail": "no engine known yet (none owns a node, and no "
                                     "--engines)"}, 503)
            return JSONResponse({"status": "ok", "engines": self.fleet.num_known})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=self.metrics.content_type)

        return app


def build_router_app(config: RouterConfig, tokenizer: Tokenizer) -> FastAPI:
    """The router's FastAPI app (its clients start in the serving loop on first use)."""
    return Router(config, tokenizer).app()


__all__ = ["MAX_ROUTED_TOKENS", "Router", "RouterConfig", "build_router_app", "prompt_of"]
