"""The whole docker-compose.yml as processes: block manager, model-init, two nodes serving the test
model, and the OpenAI-compatible server in front; the `openai` client talks to it as to vLLM."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from block_manager.client.admin import AdminClient
from engine.localstack import LocalStack
from integration_tests.conftest import TEST_MODEL_NAME


@pytest.fixture(scope="module")
def api_stack(tmp_path_factory: pytest.TempPathFactory, stack_env: dict[str, str]) -> Iterator[LocalStack]:
    stack = LocalStack(Path(tmp_path_factory.mktemp("api-stack")), interp_env=stack_env)
    try:
        stack.up()          # every service of the file (postgres has its profile)
        yield stack
    finally:
        stack.down()


def test_chat_completion_through_the_stack(api_stack: LocalStack) -> None:
    assert api_stack.completed == {"model-init"} and "api-server" in api_stack.running
    url = "http://" + api_stack.address("api-server")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [TEST_MODEL_NAME]
    messages = [{"role": "user", "content": "What does a block manager do?"}]
    out = client.chat.completions.create(model=TEST_MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=TEST_MODEL_NAME, messages=messages, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == out.choices[0].message.content
    assert httpx.get(url + "/health").status_code == 200
    metrics = httpx.get(url + "/metrics").text
    assert "pagedkv_generation_tokens_total" in metrics and "pagedkv_time_to_first_token_seconds_count" in metrics
    with AdminClient(api_stack.address("block-manager"), timeout_s=20.0) as admin:
        assert admin.fsck().get("ok") is True
        deadline = time.monotonic() + 10       # the engine's idle flush frees the last sequences
        while admin.list_sequences().get("sequences") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not admin.list_sequences().get("sequences")
        assert len(admin.list_nodes()["nodes"]) == 2


def test_health_check_probes_the_nodes_and_the_block_manager(api_stack: LocalStack) -> None:
    from engine.api_cli import node_health_check

    class Node:
        def __init__(self, address: str) -> None:
            self.address = address

    bm = api_stack.address("block-manager")
    live = {"node-0": Node(api_stack.address("compute-node-0")), "node-1": Node(api_stack.address("compute-node-1"))}
    assert asyncio.run(node_health_check(bm, live)()) == (True, "ok")
    ok, detail = asyncio.run(node_health_check(bm, {**live, "node-9": Node("127.0.0.1:1")})())
    assert not ok and "node node-9 UNREACHABLE" in detail
