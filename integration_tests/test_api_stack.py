"""The whole docker-compose.yml as processes: block manager, model-init, two nodes serving the test
model, the two OpenAI-compatible replicas (fleet mode: one node each) and the router in front; the
`openai` client talks to them as to vLLM."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from block_manager.client.admin import AdminClient
from demo.localstack import LocalStack
from integration_tests.conftest import TEST_MODEL_NAME, StackSlot

# A replica left without a node answers 503 after one scheduler lease (the router then retries
# on the other): short here, so the node-killing test does not wait compose's 30 s.
SCHEDULER_LEASE_TTL_S = 4.0


def _up_all(workdir: Path, env: dict[str, str]) -> LocalStack:
    stack = LocalStack(workdir, interp_env=env,
                       overrides={"block-manager": {"PAGEDKV_SCHEDULER_LEASE_TTL_S": str(SCHEDULER_LEASE_TTL_S)}})
    try:
        stack.up()          # every service of the file (postgres has its profile)
    except BaseException:
        stack.down()
        raise
    return stack


@pytest.fixture(scope="module")
def api_slot(tmp_path_factory: pytest.TempPathFactory, stack_env: dict[str, str]) -> Iterator[StackSlot]:
    """The whole file as processes; the node-killing test (last) takes over the stack the others
    used (see integration_tests/conftest.py)."""
    slot = StackSlot(lambda: _up_all(Path(tmp_path_factory.mktemp("api-stack")), stack_env))
    try:
        yield slot
    finally:
        slot.close()


@pytest.fixture
def api_stack(api_slot: StackSlot) -> LocalStack:
    return api_slot.shared()


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
    from engine.api.cli import node_health_check

    class Node:
        def __init__(self, address: str) -> None:
            self.address = address

    bm = api_stack.address("block-manager")
    live = {"node-0": Node(api_stack.address("compute-node-0")), "node-1": Node(api_stack.address("compute-node-1"))}
    assert asyncio.run(node_health_check(bm, live)()) == (True, "ok")
    ok, detail = asyncio.run(node_health_check(bm, {**live, "node-9": Node("127.0.0.1:1")})())
    assert not ok and "node node-9 UNREACHABLE" in detail


def test_requests_survive_a_node_killed_mid_generation(api_slot: StackSlot) -> None:
    """SIGKILL a node while requests sent through the router decode on both replicas (one node
    each): the replica that drove it reports the failed steps, the block manager fences the node
    when its lease lapses, and that replica, left without a node, answers what it held with 503
    before any byte, which the router retries on the other replica: every request is answered
    in full, by the survivor's node; the stack keeps serving."""
    from concurrent.futures import ThreadPoolExecutor

    from integration_tests.helpers import LEASE_TTL_S

    stack = api_slot.take()
    try:
        url = "http://" + stack.address("router")
        replicas = ["http://" + stack.address(s) for s in ("api-server", "api-server-2")]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(i: int) -> openai.types.Completion:
            return client.completions.create(model=TEST_MODEL_NAME, prompt=f"request {i}: " + "tok " * (i % 7),
                                             max_tokens=160, temperature=0, extra_body={"ignore_eos": True})

        def per_replica(name: str) -> list[float]:
            values = []
            for replica in replicas:
                m = re.search(rf"^pagedkv_{name}_total\S* (\S+)$", httpx.get(replica + "/metrics").text, re.M)
                values.append(float(m.group(1)) if m else 0.0)
            return values

        def counter(name: str) -> float:
            return sum(per_replica(name))

        # Both replicas and their nodes warm first: the module's other tests used one replica, and a
        # cold one's first steps (kernel JIT on a loaded machine) can outlast the warm one's whole
        # batch, so the kill would find that replica idle, with no step in flight.
        for replica in replicas:
            openai.OpenAI(base_url=replica + "/v1", api_key="unused", max_retries=0, timeout=300).completions.create(
                model=TEST_MODEL_NAME, prompt="warm up", max_tokens=2, temperature=0)
        # the stack may have served the module's other tests: count from here
        generated_before, failed_before = per_replica("generation_tokens"), counter("failed_node_steps")
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(complete, i) for i in range(8)]
            deadline = time.monotonic() + 120
            # each replica (one node each) decoding: the kill then hits steps in flight, whichever
            # replica's node it is (a total over both could be reached by one replica alone)
            while min(since := [now - before for now, before in zip(per_replica("generation_tokens"),
                                                                     generated_before)]) < 8:
                if time.monotonic() > deadline:
                    pytest.fail(f"both replicas should decode before the kill; tokens per replica: {since}")
                time.sleep(0.02)
            stack.kill("compute-node-1")
            outs = [f.result() for f in futures]
        assert counter("failed_node_steps") > failed_before          # the kill hit steps in flight
        assert all(o.choices[0].finish_reason == "length" for o in outs)
        assert all(o.usage is not None and o.usage.completion_tokens == 160 for o in outs)
        assert httpx.get(url + "/health", timeout=30).status_code == 200   # the router knows the survivor
        after = complete(99)                 # and it keeps serving on the survivor
        assert after.usage is not None and after.usage.completion_tokens == 160
        with AdminClient(stack.address("block-manager"), timeout_s=20.0) as admin:
            deadline = time.monotonic() + LEASE_TTL_S * 4 + 10
            while time.monotonic() < deadline and not {n["node_id"]: n for n in admin.list_nodes()["nodes"]}[
                    "node-1"].get("fenced"):
                time.sleep(0.25)
            assert {n["node_id"]: n for n in admin.list_nodes()["nodes"]}["node-1"].get("fenced")
            while admin.list_sequences().get("sequences") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not admin.list_sequences().get("sequences") and admin.fsck().get("ok") is True
    finally:
        stack.down()
