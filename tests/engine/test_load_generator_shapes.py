"""The request shapes of the load generators people point at an OpenAI-compatible server, sent
over real HTTP to the server (uvicorn on 127.0.0.1:0 over the embedded engine and a tiny model):

- **guidellm** (vllm-project/guidellm, `backends/openai/http.py` + `request_handlers.py`):
  validates the target with `GET /health` (bearer token when it has a key), may list
  `GET /v1/models`; posts `/v1/completions` with `model`, `stream: true`, `stream_options:
  {include_usage: true, continuous_usage_stats: true}`, `max_tokens` + `ignore_eos: true` (its
  `stop: null` is dropped before sending: it filters out `None`) and a text `prompt`; posts
  `/v1/chat/completions` with `max_completion_tokens` instead, and `messages` whose user content
  is a list of `{"type": "text", "text": ...}` parts (a system message for a prefix). It reads
  the `data:` lines up to `data: [DONE]`, joins `choices[0].text` / `delta.content`, and takes the
  token counts from the last non-empty `usage` (`prompt_tokens`, `completion_tokens`).
- **inference-perf** (kubernetes-sigs/inference-perf, `apis/completion.py`, `apis/chat.py`,
  `client/modelserver/openai_client.py`): posts a JSON body it serialised itself with
  `Content-Type: application/json` (and `Authorization: Bearer` with a key): `model`, `prompt` or
  `messages`, `max_tokens`, `ignore_eos`, `stream` (true or false, always present), and with
  streaming `stream_options: {include_usage: true}`; optionally `add_special_tokens` (vLLM's
  extension) on completions. Server-reported `usage.prompt_tokens` is its source of truth for
  input tokens.
- token-id prompts (a list of ints, a list of such lists), as benchmark tools that generate random
  token sequences send them.

The counts are checked against the tokenizer (`transformers`' for chat templates) and the
requested lengths (`ignore_eos` makes `completion_tokens == max_tokens` exact), never against a
re-encoding of the returned text (which need not round-trip to the same tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.api.server import ServerThread, build_app
from engine.async_engine import AsyncLLMEngine
from engine.llm import LLM
from tests.engine import test_api_server
from tests.engine.test_api_server import wait_all_freed

model_dir = test_api_server.model_dir   # the API server tests' model and engine fixtures
llm = test_api_server.llm
API_KEY = "load-generator-key-0123456789"
PROMPT = "The weather in the mountains is hard to predict, and walkers carry a warm coat."
PREFIX = "You are a terse assistant."


@pytest.fixture(scope="module")
def server(llm: LLM, model_dir: Path) -> Iterator[ServerThread]:
    aeng = AsyncLLMEngine(llm.engine)
    try:
        with ServerThread(build_app(aeng, llm.tokenizer, model_dir.name, api_key=API_KEY)) as srv:
            yield srv
    finally:
        aeng.shutdown()


@pytest.fixture
def http(server: ServerThread, llm: LLM) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client
    wait_all_freed(llm)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


BEARER = {"Authorization": f"Bearer {API_KEY}"}


def guidellm_sse(response: httpx.Response, field: str) -> tuple[str, dict[str, Any] | None, list[dict[str, Any]]]:
    """guidellm's reading of a stream: `data:` lines until `data: [DONE]` (required: a stream
    that ends without it is an error here), the text of choice 0, the last non-empty usage."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    texts, usage, events, done = [], None, [], False
    for line in response.iter_lines():
        line = line.strip()
        if not line:
            continue
        assert not done, f"data after [DONE]: {line!r}"
        if line == "data: [DONE]":
            done = True
            continue
        assert line.startswith("data:"), line
        data = json.loads(line[len("data:"):].strip())
        assert "error" not in data, data
        events.append(data)
        choices = data.get("choices") or []
        if choices:
            piece = choices[0].get("text") if field == "text" else choices[0].get("delta", {}).get("content")
            if piece:
                texts.append(piece)
        if data.get("usage"):
            usage = data["usage"]
    assert done, "the stream ended without data: [DONE]"
    return "".join(texts), usage, events


def inference_perf_post(http: httpx.Client, route: str, body: dict[str, Any]) -> httpx.Response:
    """inference-perf's request: its own JSON bytes, Content-Type and bearer headers."""
    headers = {"Content-Type": "application/json", **BEARER}
    return http.post(route, content=json.dumps(body).encode(), headers=headers)


def _check_usage(usage: dict[str, Any] | None, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage is not None, "no usage reported"
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        prompt_tokens, completion_tokens, prompt_tokens + completion_tokens), usage


# ---- guidellm -----------------------------------------------------------------------------------

def test_guidellm_validation_health_and_models(http: httpx.Client, model_dir: Path) -> None:
    health = http.get("/health", headers=BEARER)
    assert health.status_code == 200, health.text
    assert http.get("/health").status_code == 200          # no key needed for the health check
    models = http.get("/v1/models", headers=BEARER)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == model_dir.name
    assert http.get("/v1/models").status_code == 401       # /v1 needs the key


def test_guidellm_streamed_text_completion(http: httpx.Client, llm: LLM, model_dir: Path) -> None:
    body = {"model": model_dir.name, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": 12, "ignore_eos": True, "prompt": f"{PREFIX} {PROMPT}"}
    with http.stream("POST", "/v1/completions", json=body, headers=BEARER) as response:
        text, usage, events = guidellm_sse(response, "text")
    _check_usage(usage, len(llm.tokenizer.encode(f"{PREFIX} {PROMPT}")), 12)
    assert text and events[-1]["choices"] == [] and events[-1]["usage"] == usage
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert finishes == ["length"]
    # continuous_usage_stats: every chunk carries the usage so far (vLLM's extension)
    assert all(e.get("usage") for e in events)
    running = [e["usage"]["completion_tokens"] for e in events]
    assert running == sorted(running) and running[0] >= 1 and running[-1] == 12
    assert {e["usage"]["prompt_tokens"] for e in events} == {usage["prompt_tokens"]}


def test_guidellm_non_streamed_text_completion(http: httpx.Client, llm: LLM, model_dir: Path) -> None:
    body = {"model": model_dir.name, "max_tokens": 7, "ignore_eos": True, "prompt": PROMPT}
    reply = http.post("/v1/completions", json=body, headers=BEARER)
    assert reply.status_code == 200, reply.text
    _check_usage(reply.json()["usage"], len(llm.tokenizer.encode(PROMPT)), 7)
    assert reply.json()["choices"][0]["finish_reason"] == "length"


def test_guidellm_streamed_chat_with_content_parts(http: httpx.Client, hf_tokenizer: Any, model_dir: Path) -> None:
    body = {"model": model_dir.name, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 9, "ignore_eos": True,
            "messages": [{"role": "system", "content": PREFIX},
                         {"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}
    with http.stream("POST", "/v1/chat/completions", json=body, headers=BEARER) as response:
        text, usage, _ = guidellm_sse(response, "content")
    expected = hf_tokenizer.apply_chat_template([{"role": "system", "content": PREFIX},
                                                 {"role": "user", "content": PROMPT}],
                                                add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):      # newer transformers return a BatchEncoding
        expected = expected["input_ids"]
    _check_usage(usage, len(expected), 9)
    assert text


def test_guidellm_concurrent_streams_each_count_their_own_tokens(http: httpx.Client, llm: LLM,
                                                                 model_dir: Path) -> None:
    """guidellm at concurrency 4: every stream's usage is its own request's."""
    prompts = [f"{PROMPT} ({i})" * (i + 1) for i in range(4)]

    def one(i: int) -> dict[str, Any] | None:
        body = {"model": model_dir.name, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "max_tokens": 5 + i, "ignore_eos": True, "prompt": prompts[i]}
        with http.stream("POST", "/v1/completions", json=body, headers=BEARER) as response:
            return guidellm_sse(response, "text")[1]

    with ThreadPoolExecutor(4) as pool:
        usages = list(pool.map(one, range(4)))
    for i, usage in enumerate(usages):
        _check_usage(usage, len(llm.tokenizer.encode(prompts[i])), 5 + i)


# ---- inference-perf -----------------------------------------------------------------------------

def _inference_perf_stream(response: httpx.Response, field: str) -> tuple[str, dict[str, Any] | None]:
    """inference-perf's parse_sse_stream: `data:` lines, `data: ` stripped, usage merged."""
    assert response.status_code == 200, response.text
    text, usage = [], None
    for raw in response.iter_bytes():
        for line in raw.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line.removeprefix(b"data: ").strip()
            if payload == b"[DONE]":
                continue
            data = json.loads(payload)
            choices = data.get("choices") or [{}]
            piece = choices[0].get("text") if field == "text" else choices[0].get("delta", {}).get("content")
            text.append(piece or "")
            if data.get("usage"):
                usage = {**(usage or {}), **data["usage"]}
    return "".join(text), usage


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "unary"])
def test_inference_perf_completion(http: httpx.Client, llm: LLM, model_dir: Path, streaming: bool) -> None:
    body = {"model": model_dir.name, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "stream": streaming,
            **({"stream_options": {"include_usage": True}} if streaming else {})}
    if streaming:
        with http.stream("POST", "/v1/completions", content=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json", **BEARER}) as response:
            text, usage = _inference_perf_stream(response, "text")
    else:
        reply = inference_perf_post(http, "/v1/completions", body)
        assert reply.status_code == 200, reply.text
        text, usage = reply.json()["choices"][0]["text"], reply.json()["usage"]
    _check_usage(usage, len(llm.tokenizer.encode(PROMPT)), 8)
    assert text


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "unary"])
def test_inference_perf_chat(http: httpx.Client, hf_tokenizer: Any, model_dir: Path, streaming: bool) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": model_dir.name, "messages": messages, "max_tokens": 6, "ignore_eos": True, "stream": streaming,
            **({"stream_options": {"include_usage": True}} if streaming else {})}
    if streaming:
        with http.stream("POST", "/v1/chat/completions", content=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json", **BEARER}) as response:
            text, usage = _inference_perf_stream(response, "content")
    else:
        reply = inference_perf_post(http, "/v1/chat/completions", body)
        assert reply.status_code == 200, reply.text
        text, usage = reply.json()["choices"][0]["message"]["content"], reply.json()["usage"]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    _check_usage(usage, len(expected), 6)
    assert text


def test_inference_perf_add_special_tokens_false(http: httpx.Client, llm: LLM, model_dir: Path) -> None:
    body = {"model": model_dir.name, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "stream": False,
            "add_special_tokens": False}
    reply = inference_perf_post(http, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    _check_usage(reply.json()["usage"], len(llm.tokenizer.encode(PROMPT, add_special_tokens=False)), 3)


def test_the_tokenizer_adds_a_bos_so_add_special_tokens_is_observable(llm: LLM) -> None:
    """The test above can fail: the counts with and without special tokens differ."""
    with_bos, without = llm.tokenizer.encode(PROMPT), llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(with_bos) == len(without) + 1 and with_bos[1:] == without


# ---- token-id prompts ---------------------------------------------------------------------------

def test_token_id_prompt_streams_usage(http: httpx.Client, model_dir: Path) -> None:
    ids = [5, 17, 301, 42, 8, 99, 250, 3, 77]
    body = {"model": model_dir.name, "prompt": ids, "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body, headers=BEARER) as response:
        _, usage, events = guidellm_sse(response, "text")
    _check_usage(usage, len(ids), 6)
    assert {c["index"] for e in events for c in e["choices"]} == {0}
    # without continuous_usage_stats only the last chunk counts; the others carry usage: null
    assert [e["usage"] for e in events[:-1]] == [None] * (len(events) - 1) and events[-1]["choices"] == []


def test_list_of_token_id_prompts(http: httpx.Client, model_dir: Path) -> None:
    prompts = [[5, 17, 301, 42], [8, 99, 250, 3, 77, 12, 400]]
    body = {"model": model_dir.name, "prompt": prompts, "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body, headers=BEARER) as response:
        _, usage, events = guidellm_sse(response, "text")
    _check_usage(usage, sum(map(len, prompts)), 4 * len(prompts))
    finishes = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")}
    assert finishes == {0: "length", 1: "length"}
    unary = http.post("/v1/completions", json={**body, "stream": False, "stream_options": None}, headers=BEARER)
    assert unary.status_code == 200, unary.text
    _check_usage(unary.json()["usage"], sum(map(len, prompts)), 4 * len(prompts))
    assert sorted(c["index"] for c in unary.json()["choices"]) == [0, 1]
