"""`LLM(block_manager=...)` as a scheduler among secured services, and as nodes come and go.

- With role tokens on the block manager and the nodes, the engine's scheduler token reaches both
  (Step/Route at the block manager, Generate at the node); without it the engine cannot start.
- A node that registers after the engine started is adopted when the block manager routes
  requests to it; a node serving another model is skipped (probed once, never given work).
- A node that dies mid-generation costs its requests a recompute, not their completion.
- A block manager restart mid-generation is waited out: no request lost, none computed twice.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from block_manager.client import AdminClient
from block_manager.client.errors import UnauthenticatedError
from engine.async_policy import async_scheduling_from_env
from engine.errors import NodeRefused
from engine.executor import RemoteNode
from engine.llm import LLM
from engine.node_api import NodeStep
from engine.params import SamplingParams
from tests.compute_node.model.model_helpers import compare_greedy, hf_greedy
from tests.engine.services import Services
from tests.support.polling import eventually_sync

MODEL = "llama-gqa4-hd64"
OTHER_MODEL = "qwen2-gqa1-hd64-tied"
SCHED_TOKEN = "scheduler-token-0123456789abcdef"
NODE_TOKEN = "node-0-token-0123456789abcdef"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompts(seed: int, n: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(rng.randrange(3, 12))]} for _ in range(n)]


def _check_greedy(hf: Any, prompts: list[dict[str, list[int]]], outs: list[Any]) -> None:
    for i, (p, out) in enumerate(zip(prompts, outs)):
        compare_greedy(out.outputs[0].token_ids, hf_greedy(hf, p["prompt_token_ids"], GREEDY.max_tokens), f"prompt {i}")


def _drive(engine: Any, prompts: list[dict[str, list[int]]], max_tokens: int, on_step: Any) -> list[Any]:
    """Run greedy requests for `prompts` step by step, calling `on_step()` after each step;
    their outputs in order, each checked against transformers by the caller."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p["prompt_token_ids"], params) for p in prompts]
    done: dict[str, Any] = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        on_step()
    return [done[i] for i in ids]


class _OnceNodeDecodes:
    """An `on_step` hook for `_drive`: runs `action` once, after the first step in which
    `node_id` holds a sequence that has generated a token (so the node has work in flight)."""

    def __init__(self, engine: Any, node_id: str, action: Any) -> None:
        self.engine, self.node_id, self.action = engine, node_id, action
        self.fired = False

    def __call__(self) -> None:
        if not self.fired and any(s.node_id == self.node_id and s.num_output_tokens > 0 for s in self.engine.running):
            self.action()
            self.fired = True


def _check_drive(hf: Any, prompts: list[dict[str, list[int]]], outs: list[Any], max_tokens: int) -> None:
    for i, (p, out) in enumerate(zip(prompts, outs)):
        compare_greedy(out.outputs[0].token_ids, hf_greedy(hf, p["prompt_token_ids"], max_tokens), f"prompt {i}")


def _until_adopted(engine: Any, node_id: str, address: str) -> None:
    """Step the (idle) engine until its background discovery found `node_id` at `address` and
    the engine adopted it between steps."""
    deadline = time.monotonic() + 30
    while getattr(engine.nodes.get(node_id), "address", None) != address and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.05)
    assert getattr(engine.nodes.get(node_id), "address", None) == address


def _generates_ok(server: Any) -> float:
    return server.node.metrics.registry.get_sample_value("pagedkv_cn_forwards_total", {"code": "OK"}) or 0.0


def test_scheduler_token_reaches_the_block_manager_and_the_nodes(
    model_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    services = Services(
        model_dirs[MODEL], num_nodes=1,
        bm={"auth": {"tokens": {"scheduler": SCHED_TOKEN, "node:node-0": NODE_TOKEN}}},
        node={"block_manager_token": NODE_TOKEN, "auth": {"tokens": {"scheduler": SCHED_TOKEN}}},
    )
    try:
        with pytest.raises(UnauthenticatedError):
            LLM(model_dirs[MODEL], block_manager=services.bm.address)
        # the node itself refuses a Generate without the scheduler's token, and its own token
        for token in (None, NODE_TOKEN):
            anonymous = RemoteNode("node-0", services.nodes[0].address, timeout_s=20, token=token)
            with pytest.raises(NodeRefused) as refused:
                anonymous.generate(NodeStep("anonymous"))
            anonymous.close()
            assert refused.value.code == "UNAUTHENTICATED"
        prompts = _prompts(1, 4)
        with LLM(model_dirs[MODEL], block_manager=services.bm.address, token=SCHED_TOKEN) as llm:
            outs = llm.generate(prompts, GREEDY)
        _check_greedy(hf_models[MODEL], prompts, outs)
        assert _generates_ok(services.nodes[0]) > 0
    finally:
        services.close()


def test_nodes_registering_later_are_adopted_and_other_models_skipped(
    model_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    services = Services(model_dirs[MODEL], num_nodes=1, bm={})
    try:
        with LLM(model_dirs[MODEL], block_manager=services.bm.address, max_num_batched_tokens=16) as llm:
            # CPU nodes on loopback share this host's cores: no overlap by default (engine.async_policy)
            assert llm.engine.config.async_scheduling is (async_scheduling_from_env() is True)
            first = _prompts(2, 2)
            _check_greedy(hf_models[MODEL], first, llm.generate(first, GREEDY))
            assert set(llm.engine.nodes) == {"node-0"}
            # more free blocks than node-0: the block manager routes new prompts there first
            late = services.add_node("node-1", model_dirs[MODEL], num_blocks=192)
            other = services.add_node("node-x", model_dirs[OTHER_MODEL], num_blocks=512)
            _until_adopted(llm.engine, "node-1", late.address)   # found off the step path
            second = _prompts(3, 6)
            _check_greedy(hf_models[MODEL], second, llm.generate(second, GREEDY))
            assert set(llm.engine.nodes) == {"node-0", "node-1"}
            assert _generates_ok(late) > 0 and _generates_ok(other) == 0
    finally:
        services.close()


def test_one_steps_admissions_spread_over_the_nodes(model_dirs: dict[str, Path]) -> None:
    """Eight new prompts admitted in one step go to both nodes (data parallel), not all to the
    one that ranked first when the step's single Route was answered."""
    services = Services(model_dirs[MODEL], num_nodes=2, bm={})
    try:
        with LLM(model_dirs[MODEL], block_manager=services.bm.address, max_num_batched_tokens=512) as llm:
            engine = llm.engine
            for p in _prompts(7, 8):
                engine.add_request(p["prompt_token_ids"], GREEDY)
            engine.step()
            per_node = {nid: sum(s.node_id == nid for s in engine.running) for nid in ("node-0", "node-1")}
            assert sum(per_node.values()) == 8 and min(per_node.values()) >= 3, per_node
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        services.close()


def test_a_fork_refused_by_a_draining_node_admits_the_children_elsewhere(
    model_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    """n = 3: the parent's prompt is computed on one node, then an operator drains that node
    before the parent forks. The fork is refused (no new sequences there); the parent finishes
    where it is, the children are admitted on the other node, every completion is correct and
    nothing is left held."""
    services = Services(model_dirs[MODEL], num_nodes=2, bm={})
    try:
        with LLM(model_dirs[MODEL], block_manager=services.bm.address) as llm, \
                AdminClient(services.bm.address) as admin:
            engine = llm.engine
            (prompt,) = _prompts(8, 1)
            params = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
            rid = engine.add_request(prompt["prompt_token_ids"], params)
            engine.step()                                     # the parent's prompt, one short of the fork
            (parent,) = engine.running
            admin.drain_node(parent.node_id)
            outs = []
            while engine.has_unfinished_requests():
                outs += [o for o in engine.step() if o.finished and o.request_id == rid]
            engine.flush()
            ref = hf_greedy(hf_models[MODEL], prompt["prompt_token_ids"], 8)
            for c in outs[0].outputs:
                compare_greedy(c.token_ids, ref, f"completion {c.index}")
            assert not admin.list_sequences().get("sequences") and admin.fsck().get("ok") is True
    finally:
        services.close()


def test_a_node_dying_mid_generation_loses_no_request(
    model_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    """Node 1 stops while sequences run on it: its steps fail (UNAVAILABLE), the engine reports
    them failed and recomputes those requests, on node 0 once the block manager fenced node 1
    (its lease lapsed). Every request completes with the tokens it would have had anyway. When
    node 1 comes back elsewhere, the engine serves there again."""
    services = Services(model_dirs[MODEL], num_nodes=2, bm={"lease_ttl_s": 1.5})
    stop: _OnceNodeDecodes | None = None
    try:
        with LLM(model_dirs[MODEL], block_manager=services.bm.address, max_num_batched_tokens=32,
                 async_scheduling=True) as llm:   # overlap over services, as across hosts
            engine = llm.engine
            prompts = _prompts(4, 8)
            stop = _OnceNodeDecodes(engine, "node-1", lambda: services._run(services.nodes[1].stop(0)))
            outs = _drive(engine, prompts, 12, stop)
            assert stop.fired and not engine.has_unfinished_requests()
            assert engine.stats.num_failed_steps > 0
            # node 1 comes back (a new epoch, another port, more blocks): the engine follows it there
            back = services.add_node("node-1", model_dirs[MODEL], num_blocks=192)
            _until_adopted(engine, "node-1", back.address)
            more = _prompts(6, 4)
            _check_greedy(hf_models[MODEL], more, llm.generate(more, GREEDY))
            assert getattr(engine.nodes["node-1"], "address", None) == back.address and _generates_ok(back) > 0
        _check_drive(hf_models[MODEL], prompts, outs, 12)
    finally:
        if stop is not None and stop.fired:
            services.nodes.pop(1)   # already stopped (a restarted node-1 is appended after it)
        services.close()


def test_a_node_restarted_in_place_costs_a_recompute(
    model_dirs: dict[str, Path], hf_models: dict[str, Any]
) -> None:
    """Node 1 restarts on the same address within its lease (a container restart): it
    registers a new epoch, which fences the old one at once. Steps the engine sends it with
    the old epoch's tables are refused; the engine reports them failed and recomputes those
    requests, on either node. Every request completes correctly, nothing is left held."""
    services = Services(model_dirs[MODEL], num_nodes=2, bm={})
    try:
        with LLM(model_dirs[MODEL], block_manager=services.bm.address, max_num_batched_tokens=32,
                 async_scheduling=True) as llm:   # overlap over services, as across hosts
            engine = llm.engine
            prompts = _prompts(12, 8)

            def restart_in_place() -> None:
                old = services.nodes.pop(1)
                services._run(old.stop(0))
                services.add_node("node-1", model_dirs[MODEL], listen_address=old.address)

            restart = _OnceNodeDecodes(engine, "node-1", restart_in_place)
            outs = _drive(engine, prompts, 12, restart)
            assert restart.fired and engine.stats.num_failed_steps > 0
            engine.flush()
        _check_drive(hf_models[MODEL], prompts, outs, 12)
        with AdminClient(services.bm.address) as admin:
            assert admin.fsck().get("ok") is True and not admin.list_sequences().get("sequences")
    finally:
        services.close()


def _restart_block_manager(services: Services, db: str, down_s: float, down: Any = None) -> None:
    """Stop the block manager, keep it down `down_s`, start it again on the same file and
    address; `down` (a threading.Event), when given, is set once it has stopped."""
    from block_manager.service.server import BlockManagerServer
    from tests.support.configs import bm_test_config

    address = services.bm.address
    services._run(services.bm.stop(0))
    if down is not None:
        down.set()
    time.sleep(down_s)
    server = BlockManagerServer(bm_test_config(block_size=4, database_url=db, listen_address=address))
    services._run(server.start())
    services.bm = server


def test_a_block_manager_restart_mid_generation_is_ridden_out(
    model_dirs: dict[str, Path], hf_models: dict[str, Any], tmp_path: Path
) -> None:
    """The block manager stops while sequences decode and comes back 1.5 s later on the same
    SQLite file and address: the engine resends its unanswered Step (same request id, applied
    once) until it is back, and every request completes with the tokens it would have had."""
    import threading

    db = f"sqlite:///{tmp_path / 'bm.db'}"
    services = Services(model_dirs[MODEL], num_nodes=1, bm={"database_url": db})
    try:
        with LLM(model_dirs[MODEL], block_manager=services.bm.address, max_num_batched_tokens=32) as llm:
            engine = llm.engine
            prompts = _prompts(5, 6)
            restarter: threading.Thread | None = None
            down = threading.Event()

            def restart_once_decoding() -> None:
                nonlocal restarter
                if restarter is None and any(s.num_output_tokens >= 3 for s in engine.running):
                    restarter = threading.Thread(target=_restart_block_manager, args=(services, db, 1.5, down))
                    restarter.start()
                    # the next step finds the block manager gone: wait for the stop itself, not a
                    # fixed sleep (a starved thread on a loaded machine stops it later)
                    assert down.wait(30), "the block manager did not stop"

            outs = _drive(engine, prompts, 16, restart_once_decoding)
            assert restarter is not None
            restarter.join(30)
        _check_drive(hf_models[MODEL], prompts, outs, 16)
        with AdminClient(services.bm.address) as admin:
            assert admin.fsck().get("ok") is True and not admin.list_sequences().get("sequences")
    finally:
        services.close()


def test_the_api_server_rides_out_a_block_manager_restart(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The same through the OpenAI server: requests in flight while the block manager is down
    complete once it is back; down again while the engine idles, the engine thread keeps
    running (its idle flush and its gauges wait the outage out) and serves when it is back."""
    import threading

    import httpx

    from engine.api.server import ServerThread, build_app
    from engine.async_engine import AsyncLLMEngine

    db = f"sqlite:///{tmp_path / 'bm.db'}"
    services = Services(model_dirs[MODEL], num_nodes=1, bm={"database_url": db})
    try:
        with LLM(model_dirs[MODEL], block_manager=services.bm.address) as llm:
            aeng = AsyncLLMEngine(llm.engine)
            try:
                with ServerThread(build_app(aeng, llm.tokenizer, model_dirs[MODEL].name)) as srv:
                    def ask(i: int) -> httpx.Response:
                        body = {"prompt": f"request {i}", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
                        return httpx.post(srv.url + "/v1/completions", json=body, timeout=120)

                    replies: list[httpx.Response] = []
                    askers = [threading.Thread(target=lambda i=i: replies.append(ask(i))) for i in range(4)]
                    for t in askers:
                        t.start()
                    # in flight (admitted and decoding) when the block manager goes, not a fixed sleep
                    eventually_sync(lambda: any(s.num_output_tokens > 0 for s in list(llm.engine.running)),
                                    timeout_s=60, what="requests decoding")
                    _restart_block_manager(services, db, 2.5)   # longer than the client's own retries
                    for t in askers:
                        t.join(120)
                    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
                    assert all(r.json()["usage"]["completion_tokens"] == 64 for r in replies)
                    # down again while the engine idles (its gauges read the pools once a second)
                    _restart_block_manager(services, db, 2.5)
                    assert aeng.alive and ask(9).status_code == 200
            finally:
                aeng.shutdown()
    finally:
        services.close()
