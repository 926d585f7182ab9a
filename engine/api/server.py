"""The OpenAI-compatible HTTP server: FastAPI over the engine thread (`AsyncLLMEngine`).

    app = build_app(AsyncLLMEngine(llm.engine), llm.tokenizer, "my-model")
    asyncio.run(serve_async(app, host="127.0.0.1", port=8000))    # or: pagedkv-serve --model DIR
    with ServerThread(app) as srv: ...                               # a free port, in a thread: srv.url

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream` as
server-sent events `data: {json}` ending with `data: [DONE]`), `GET /v1/models[/{id}]`,
`GET /health` (200 while the engine thread runs and `health_check` says the nodes answer, else
503), `GET /metrics` (Prometheus text, `engine.api.metrics`).

Each prompt of a request is one engine request (`n` completions each, by fork). Everything a
request took is given back whatever way it ends: a refused prompt aborts its siblings, a
completion that hits a stop string ends its engine request once its siblings are done too, and a
client that goes away mid-request or mid-stream aborts all of it (its blocks are freed with the
engine's next step). Errors are OpenAI's JSON (`{"error": {"message", "type", "param",
"code"}}`): 400 for bad parameters and prompts too long for the context or the KV memory, 401
for a wrong API key, 404 for an unknown model or route, 503 once the engine has stopped, or
while a fleet member owns no model node (`NoNodeOwned`: another engine can serve it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.api.echo import merge_logprobs, prompt_logprobs_part, top_dict, vllm_prompt_logprobs
from engine.api.generation import Choice, Generation, Update
from engine.api.metrics import ApiMetrics
from engine.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Prompt,
    bad_request,
    chat_messages,
    check_unsupported,
    completion_prompts,
    logprobs_count,
    prompt_logprobs_count,
    requested_max_tokens,
    resolve_max_tokens,
    sampling_params,
    stop_strings,
)
from engine.async_engine import AsyncLLMEngine
from engine.errors import NoNodeOwned
from engine.llm_engine import EngineError
from engine.params import InvalidParams
from engine.tokenizer import Tokenizer, TokenizerError
from pagedkv.lifecycle import write_port_file
from pagedkv.logging import get_logger

log = get_logger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16        # OpenAI's default for /v1/completions; chat: the context's room
HealthCheck = Callable[[], Awaitable[tuple[bool, str]]]


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class _ShuttingDown(Exception):
    """The server received SIGTERM / SIGINT while the request was being answered."""


def _shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica or once it is back",
                    type="server_error", code="server_shutdown")


def _finite_logprob(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


# ---- the server ---------------------------------------------------------------------------
class _Server:
    def __init__(self, aeng: AsyncLLMEngine, tokenizer: Tokenizer, model_name: str, *, api_key: str | None,
                 health_check: HealthCheck | None, max_model_len: int | None) -> None:
        self.aeng = aeng
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.health_check = health_check
        engine = aeng.engine
        self.max_model_len = min(max_model_len or engine.max_model_len, engine.max_model_len)
        self.vocab_size = engine.vocab_size
        self.kv_capacity = engine.max_kv_slots   # the largest node's (a fleet member may own none now)
        self.created = int(time.time())
        self.metrics = ApiMetrics(aeng, model_name)
        self.stopping = asyncio.Event()     # set on SIGTERM / SIGINT (`begin_shutdown`)

    def begin_shutdown(self) -> None:
        """End every open request now (streams with a final error event, whole answers with
        503); from the server's event loop."""
        self.stopping.set()

    # -- request checks ----------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", type="invalid_request_error", param="model",
                           code="model_not_found")

    def check_engine(self) -> None:
        if not self.aeng.alive:
            raise APIError(503, f"the engine stopped: {self.aeng.error!r}", type="server_error",
                           code="engine_dead")

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    # -- formatting ----------------------------------------------------------------------------
    def completion_logprobs(self, choice: Choice, start: int, end: int) -> dict[str, Any] | None:
        o = choice.output
        if o is None or o.logprobs is None:
            return None
        tokens, offsets = [], []
        for t in o.token_ids[start:end]:
            text = self.token_text(t)
            tokens.append(text)
            offsets.append(choice.text_offset)
            choice.text_offset += len(text)
        tops = None
        if o.top_logprobs is not None:
            tops = [top_dict([(self.token_text(tid), lp) for tid, lp in row]) for row in o.top_logprobs[start:end]]
        return {"tokens": tokens, "token_logprobs": [_finite_logprob(x) for x in o.logprobs[start:end]],
                "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, choice: Choice, start: int, end: int) -> dict[str, Any] | None:
        o = choice.output
        if o is None or o.logprobs is None:
            return None

        def entry(tid: int, lp: float) -> dict[str, Any]:
            return {"token": self.token_text(tid), "logprob": _finite_logprob(lp),
                    "bytes": list(self.tokenizer.token_bytes(tid))}

        content = []
        for k in range(start, end):
            item = entry(o.token_ids[k], o.logprobs[k])
            rows = o.top_logprobs[k] if o.top_logprobs is not None else []
            item["top_logprobs"] = [entry(tid, lp) for tid, lp in rows]
            content.append(item)
        return {"content": content}

    # -- generation -------------------------------------------------------------------------
    async def run(self, request: Request, gen: Generation, stream: bool,
                  chunks: Callable[[list[Update]], list[dict[str, Any]]],
                  head: list[dict[str, Any]], tail: Callable[[], list[dict[str, Any]]],
                  answer: Callable[[], dict[str, Any]]) -> Response:
        """Run `gen`; answer in one piece, or as events: `head`, `chunks(batch)` per update,
        `tail()` (the usage chunk); a client leaving at any point aborts everything."""
        updates = gen.updates()
        try:
            if not stream:
                await _until_disconnect(request, _drain(updates), self.stopping)
                self.metrics.success(gen.choices[0].finish_reason or "stop")
                return JSONResponse(answer())
            # The first update before the status line: a refusal by the engine is an HTTP error.
            first = await _until_disconnect(request, _first(updates), self.stopping)
        except _ClientGone:
            gen.close()
            self.metrics.failure("client_disconnected")
            return Response(status_code=499)
        except _ShuttingDown:
            gen.close()
            self.metrics.failure("engine_error")
            err = _shutdown_error()
            return JSONResponse(err.body(), err.status)
        except BaseException as exc:
            gen.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise self._failure(exc) from None

        async def events() -> AsyncIterator[str]:
            try:
                for obj in head + chunks(first or []):
                    yield _sse(obj)
                while (batch := await _next_unless(updates, self.stopping)) is not None:
                    for obj in chunks(batch):
                        yield _sse(obj)
                for obj in tail():
                    yield _sse(obj)
                self.metrics.success(gen.choices[0].finish_reason or "stop")
            except _ShuttingDown:
                gen.close()
                self.metrics.failure("engine_error")
                yield _sse(_shutdown_error().body())
            except Exception as exc:  # noqa: BLE001 - the status line is out: report in the stream
                err = self._failure(exc)
                if err.status < 500:
                    self.metrics.failure("invalid_request")
                yield _sse(err.body())
            gen.finished = True
            yield "data: [DONE]\n\n"

        return _EventStream(events(), gen, self.metrics)

    def _failure(self, exc: BaseException) -> APIError:
        """The API error for a failed generation (engine refusals are the client's: 400)."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, NoNodeOwned):     # this engine's state, not the request's: another engine may serve it
            return APIError(503, str(exc), type="server_error", code="no_node")
        if isinstance(exc, (InvalidParams, EngineError)):
            return bad_request(str(exc))
        self.metrics.failure("engine_error")
        if not self.aeng.alive:
            return APIError(503, f"the engine stopped: {self.aeng.error!r}", type="server_error", code="engine_dead")
        log.error("request failed", error=repr(exc))
        return APIError(500, "internal error (logged on the server)", type="server_error")

    # -- endpoints ---------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        self.check_model(req.model)
        self.check_engine()
        check_unsupported(req)
        stops = stop_strings(req)
        special = req.add_special_tokens is not False
        prompts = completion_prompts(req.prompt, lambda text: self.tokenizer.encode(text, add_special_tokens=special),
                                     self.vocab_size)
        requested, param = requested_max_tokens(req)
        max_tokens = resolve_max_tokens(prompts, requested, param, COMPLETIONS_DEFAULT_MAX_TOKENS,
                                        prompt_param="prompt", max_model_len=self.max_model_len,
                                        kv_capacity=self.kv_capacity)
        logprobs, echo = logprobs_count(req), bool(req.echo)
        # max_tokens=0 (echo only): the engine samples one token after the prefill; it is left out
        params = sampling_params(req, max(max_tokens, 1), logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs_count(req, logprobs))
        gen = Generation(self.aeng, self.metrics, prompts, params, stops, f"cmpl-{uuid.uuid4().hex}",
                         echo_only=requested == 0)
        base = {"id": gen.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        body = self._completion_body(gen, echo, logprobs)

        def chunks(batch: list[Update]) -> list[dict[str, Any]]:
            out = []
            for u in batch:
                text, lp = body(u.choice, u.delta, u.start, u.end)
                if not text and u.choice.finish_reason is None and not lp:
                    continue
                out.append({**base, "choices": [{"index": u.choice.index, "text": text, "logprobs": lp,
                                                 "finish_reason": u.choice.finish_reason}],
                            **self.chunk_usage(req, gen)})
            return out

        def tail() -> list[dict[str, Any]]:
            return [{**base, "choices": [], "usage": gen.usage()}] if req.include_usage else []

        def answer() -> dict[str, Any]:
            choices = []
            for c in gen.choices:
                text, lp = body(c, c.text, 0, c.num_tokens)
                choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
                if req.prompt_logprobs is not None:   # vLLM's extension (refused with stream)
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(
                        gen.prompts[c.prompt_index].token_ids, gen.prompt_logprobs.get(c.prompt_index),
                        req.prompt_logprobs)
                choices.append(choice)
            return {**base, "choices": choices, "usage": gen.usage()}

        return await self.run(request, gen, bool(req.stream), chunks, [], tail, answer)

    @staticmethod
    def chunk_usage(req: CompletionRequest | ChatCompletionRequest, gen: Generation) -> dict[str, Any]:
        """A stream chunk's `usage`: absent unless asked, null (the last chunk has it) or, with
        `continuous_usage_stats`, the tokens so far."""
        if not req.include_usage:
            return {}
        return {"usage": gen.usage() if req.continuous_usage else None}

    def _completion_body(self, gen: Generation, echo: bool,
                         logprobs: int | None) -> Callable[[Choice, str, int, int], tuple[str, dict[str, Any] | None]]:
        """A choice update's text and `logprobs` (tokens `start … end` of its completion); with
        `echo`, a choice's first update starts with the prompt and its scores (`engine.api.echo`),
        and the completion's text offsets continue the prompt tokens' (each token's offset is
        the sum of the token texts before it, as vLLM counts them)."""
        echoed: set[int] = set()
        texts = [p.text if p.text is not None else self.tokenizer.decode(p.token_ids)
                 for p in gen.prompts] if echo else []
        if echo:
            ends = [sum(len(self.token_text(t)) for t in p.token_ids) for p in gen.prompts]
            for c in gen.choices:
                c.text_offset = ends[c.prompt_index]

        def body(c: Choice, delta: str, start: int, end: int) -> tuple[str, dict[str, Any] | None]:
            text, lp = ("", None) if gen.echo_only else (delta, self.completion_logprobs(c, start, end))
            if not echo or c.index in echoed:
                return text, lp
            echoed.add(c.index)
            p = gen.prompts[c.prompt_index]
            prompt_lp = prompt_logprobs_part(p.token_ids, gen.prompt_logprobs.get(c.prompt_index),
                                             self.token_text, logprobs) if logprobs is not None else None
            return texts[c.prompt_index] + text, merge_logprobs(prompt_lp, lp)

        return body

    async def chat_completions(self, request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        self.check_model(req.model)
        self.check_engine()
        check_unsupported(req)
        stops = stop_strings(req)
        messages = chat_messages(req.messages)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt
                                                      is not False)
        except TokenizerError as exc:
            raise bad_request(str(exc), "messages") from None
        prompt = Prompt(text, self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens)))
        if not prompt.token_ids:
            raise bad_request("the conversation renders to an empty prompt", "messages")
        requested, param = requested_max_tokens(req)
        max_tokens = resolve_max_tokens([prompt], requested, param, None, prompt_param="messages",
                                        max_model_len=self.max_model_len, kv_capacity=self.kv_capacity)
        params = sampling_params(req, max_tokens, logprobs=logprobs_count(req))
        gen = Generation(self.aeng, self.metrics, [prompt], params, stops, f"chatcmpl-{uuid.uuid4().hex}")
        base = {"id": gen.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}
        head = [{**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}], **self.chunk_usage(req, gen)}
                for c in gen.choices]

        def chunks(batch: list[Update]) -> list[dict[str, Any]]:
            out = []
            for u in batch:
                lp = self.chat_logprobs(u.choice, u.start, u.end)
                if not u.delta and u.choice.finish_reason is None and not (lp and lp["content"]):
                    continue
                out.append({**base, "choices": [{"index": u.choice.index,
                                                 "delta": {"content": u.delta} if u.delta else {},
                                                 "logprobs": lp, "finish_reason": u.choice.finish_reason}],
                            **self.chunk_usage(req, gen)})
            return out

        def tail() -> list[dict[str, Any]]:
            return [{**base, "choices": [], "usage": gen.usage()}] if req.include_usage else []

        def answer() -> dict[str, Any]:
            return {**base, "object": "chat.completion", "choices": [
                {"index": c.index, "message": {"role": "assistant", "content": c.text},
                 "logprobs": self.chat_logprobs(c, 0, c.num_tokens), "finish_reason": c.finish_reason}
                for c in gen.choices
            ], "usage": gen.usage()}

        return await self.run(request, gen, bool(req.stream), chunks, head, tail, answer)

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pagedkv",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}

    async def health(self) -> Response:
        if not self.aeng.alive:
            return JSONResponse({"status": "unhealthy", "detail": f"the engine stopped: {self.aeng.error!r}"}, 503)
        if self.health_check is not None:
            ok, detail = await self.health_check()
            if not ok:
                return JSONResponse({"status": "unhealthy", "detail": detail}, 503)
        return JSONResponse({"status": "ok"})


class _EventStream(StreamingResponse):
    """Server-sent events that abort the generation however the response ends: a client that
    disconnects cancels the response mid-`send` (the event generator may then never be closed
    promptly, so the engine requests are cancelled here, synchronously)."""

    def __init__(self, content: AsyncIterator[str], gen: Generation, metrics: ApiMetrics) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen
        self._metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.close()
            if not self._gen.finished:
                self._metrics.failure("client_disconnected")


async def _first(updates: AsyncIterator[list[Update]]) -> list[Update] | None:
    try:
        return await anext(updates)
    except StopAsyncIteration:
        return None


async def _drain(updates: AsyncIterator[list[Update]]) -> None:
    async for _ in updates:
        pass


async def _until_disconnect(request: Request, aw: Awaitable[Any], stopping: asyncio.Event) -> Any:
    """`aw`'s result, or `_ClientGone` (and `aw` cancelled) when the client disconnects first,
    or `_ShuttingDown` when the server is told to stop first."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_disconnected(request))
    stop = asyncio.ensure_future(stopping.wait())
    try:
        done, _ = await asyncio.wait({task, watch, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch, stop):
            if not t.done():
                t.cancel()
    if task in done:
        return task.result()
    if watch in done:
        raise _ClientGone()
    raise _ShuttingDown()


async def _next_unless(updates: AsyncIterator[list[Update]], stopping: asyncio.Event) -> list[Update] | None:
    """The next batch of updates (None at the end), or `_ShuttingDown` once `stopping` is set."""
    if stopping.is_set():
        raise _ShuttingDown()
    nxt = asyncio.ensure_future(anext(updates))
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not nxt.done():
            nxt.cancel()
    if nxt.done() and not nxt.cancelled():
        try:
            return nxt.result()
        except StopAsyncIteration:
            return None
    raise _ShuttingDown()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _parse(request: Request, model: type[CompletionRequest] | type[ChatCompletionRequest]) -> Any:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        param = str(err["loc"][0]) if err.get("loc") else None
        raise bad_request(f"{loc}: {err.get('msg', 'invalid value')}", param) from None


def build_app(
    async_engine: AsyncLLMEngine,
    tokenizer: Tokenizer,
    model_name: str,
    *,
    api_key: str | None = None,
    health_check: HealthCheck | None = None,
    max_model_len: int | None = None,
) -> FastAPI:
    """The FastAPI app serving `async_engine` as `model_name`. `api_key`: require
    `Authorization: Bearer <key>` on `/v1/*`. `health_check`: an async callable answering
    (ok, detail) for `/health` beyond the engine thread itself (the nodes, the block manager)."""
    server = _Server(async_engine, tokenizer, model_name, api_key=api_key, health_check=health_check,
                     max_model_len=max_model_len)
    app = FastAPI(title="pagedkv OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        if exc.status < 500:
            server.metrics.failure("invalid_request")
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(bad_request(str(exc)).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{exc.detail}: {request.method} {request.url.path}"
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, message, type=kind).body(), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", error=repr(exc))
        return JSONResponse(APIError(500, "internal error (logged on the server)", type="server_error").body(), 500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        server.check_auth(request)
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        server.check_auth(request)
        return await server.chat_completions(request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.check_auth(request)
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        server.check_auth(request)
        server.check_model(model_id)
        return server.model_card()

    @app.get("/health")
    async def health() -> Response:
        return await server.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    return app


# ---- running it ------------------------------------------------------------------------------
class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling (it re-raises a caught SIGTERM once stopped,
    which would kill the process before the engine is shut down): `serve` installs handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _config(app: FastAPI, host: str, port: int, shutdown_grace_s: float, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_config=None, log_level=log_level.lower(),
                          timeout_graceful_shutdown=max(1, math.ceil(shutdown_grace_s)), access_log=False,
                          lifespan="off")


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound (not yet listening) to `host:port`: callers bind before slow start-up
    work so a busy port is reported at once; `serve_async(sock=...)` listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def serve_async(app: FastAPI, *, host: str, port: int, port_file: Path | None = None,
                      shutdown_grace_s: float = 5.0, log_level: str = "info",
                      on_listening: Callable[[int], None] | None = None,
                      sock: socket.socket | None = None) -> None:
    """Serve until SIGTERM / SIGINT (a second SIGINT stops at once). The port file is written
    once the server accepts connections (port 0: the port the kernel picked). `sock`: one
    already bound by `bind_socket` (then `host`/`port` only name it in the log).

    On the signal open streams end first, each with a final error event and `[DONE]`, and
    requests still waiting for a whole answer get 503: uvicorn then finds no connection busy
    and stops well within `shutdown_grace_s` instead of cancelling handlers mid-send."""
    server = _UvicornServer(_config(app, host, port, shutdown_grace_s, log_level))
    sock = sock if sock is not None else bind_socket(host, port)
    api: _Server | None = getattr(app.state, "server", None)
    bound = sock.getsockname()[1]
    loop = asyncio.get_running_loop()

    def stop(sig: int) -> None:
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        if api is not None:
            api.begin_shutdown()
        server.should_exit = True

    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop, sig)
            installed.append(sig)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                await task
                return
            await asyncio.sleep(0.01)
        if port_file is not None:
            write_port_file(port_file, bound)
        if on_listening is not None:
            on_listening(bound)
        log.info("listening", address=f"http://{host}:{bound}")
        await task
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        sock.close()


class ServerThread:
    """The app on a uvicorn server in a background thread (tests, notebooks):

        with ServerThread(app) as srv:
            openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = _UvicornServer(_config(app, host, port, 1.0, "warning"))
        self._sock = bind_socket(host, port)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="api-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the API server thread did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()


__all__ = ["ServerThread", "build_app", "serve_async"]
