"""Async scheduling (issue 21, item 2): step N+1's block-manager Step is planned and committed
while the nodes run step N; running sequences are speculated not to stop and reconciled when
step N's tokens arrive (`engine.pipeline`).

Over the in-process block manager and fake nodes (a greedy token is a pure function of what
the engine sent): the overlapped engine emits exactly the tokens, finish reasons and counts of
the engine without overlap, including sequences that stop on a stop token mid-overlap (their
speculative work is dropped), forks, chunked prefill and a node failing under a committed
next Step; nothing is leaked (fsck, no sequence left), generated text is prefix-cached with
the real token ids, and the next Step really is committed while a node is still generating.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from engine.params import SamplingParams
from engine.pipeline import PLACEHOLDER
from tests.engine.fakes import VOCAB, FakeNode, fake_completion, fake_engine

STOPS = list(range(1, VOCAB, 23))    # ~4% of the tokens: stops nobody can foresee


def _workload(seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(20)]
    work = []
    for i in range(24):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, 70))]
        params = SamplingParams(n=rng.choice((1, 1, 2, 3)), temperature=0, max_tokens=rng.randrange(1, 40),
                                ignore_eos=True, stop_token_ids=STOPS if i % 2 else [])
        work.append((prompt, params))
    return work


def _add_greedy(engine: Any, seed: int, num: int, lengths: tuple[int, int],
                max_tokens: int) -> tuple[list[str], list[list[int]]]:
    """`num` greedy requests of random prompts (lengths in `[lo, hi)`): their ids and prompts."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(*lengths))] for _ in range(num)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [engine.add_request(p, params) for p in prompts], prompts


def _check_greedy(done: dict[str, Any], rids: list[str], prompts: list[list[int]], max_tokens: int) -> None:
    for rid, p in zip(rids, prompts):
        assert done[rid].outputs[0].token_ids == fake_completion(p, max_tokens)


def _check_drained(engine: Any) -> None:
    """The last frees sent: nothing held, nothing inconsistent."""
    engine.flush()
    core = engine.client.state.core
    assert core.fsck() == [] and core.sequences() == []


def _run(async_scheduling: bool, seed: int, **config: Any) -> tuple[dict[int, list[tuple[list[int], str]]], Any]:
    engine, _ = fake_engine(2, num_blocks=96, block_size=4, max_num_batched_tokens=48, max_num_seqs=16,
                            async_scheduling=async_scheduling, **config)
    core = engine.client.state.core
    try:
        ids = {engine.add_request(p, params): i for i, (p, params) in enumerate(_workload(seed))}
        outs: dict[int, list[tuple[list[int], str]]] = {}
        for _ in range(5000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                assert ids[out.request_id] not in outs, "a finished request came out twice"
                if out.finished:
                    outs[ids[out.request_id]] = [(list(c.token_ids), c.finish_reason or "") for c in out.outputs]
            assert core.fsck() == []
        _check_drained(engine)
        return outs, engine.stats
    finally:
        engine.close()


def test_overlap_emits_exactly_the_tokens_of_a_run_without_it() -> None:
    for seed in (1, 2):
        plain, plain_stats = _run(False, seed)
        overlapped, stats = _run(True, seed)
        assert overlapped == plain
        assert len(plain) == 24
        assert stats.generated_tokens == plain_stats.generated_tokens
        # it did speculate, some of it on sequences that then stopped on a stop token
        assert stats.speculative_tokens > 0 and stats.speculative_dropped > 0
        assert plain_stats.speculative_tokens == 0
        # tokens that start or fill a block went to the block manager with late ids: no
        # sequence sat a step out, so the overlapped run takes about as many steps as the plain
        # one (a fork still waits for its parent's report; with sit-outs it took 28-45% more)
        assert stats.late_tokens > 0 and stats.speculation_waits == 0
        assert stats.num_steps <= 1.1 * plain_stats.num_steps, (stats.num_steps, plain_stats.num_steps)


def test_overlap_under_preemption_matches_too() -> None:
    """A pool too small for the load: appends out of blocks preempt idle sequences (never one
    with work in the step in flight) and everything recomputes to the same tokens."""
    plain, _ = _run(False, 3, preemption_mode="recompute")
    small, stats = _run(True, 3, preemption_mode="recompute")
    assert small == plain
    engine, _ = fake_engine(1, num_blocks=24, block_size=4, max_num_batched_tokens=32, async_scheduling=True)
    try:
        prompts = [[random.Random(i).randrange(1, VOCAB) for _ in range(9)] for i in range(10)]
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        rids = [engine.add_request(p, params) for p in prompts]
        done: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert engine.stats.num_preemptions > 0
        _check_greedy(done, rids, prompts, 30)
        _check_drained(engine)
    finally:
        engine.close()


class _GatedNode(FakeNode):
    """The k-th Generate returns only once the engine committed k+1 Steps (or after `wait_s`): with
    overlap that happens while it waits, without it never (the engine waits for the node)."""

    def __init__(self, *args: Any, wait_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wait_s = wait_s
        self.commits = 0
        self.cond = threading.Condition()
        self.overlapped: list[bool] = []

    def committed(self) -> None:
        with self.cond:
            self.commits += 1
            self.cond.notify_all()

    def generate(self, step: Any) -> Any:
        with self.cond:
            # the k-th Generate is step k's or later: Step k+1 is committed next
            target = len(self.overlapped) + 2
            self.overlapped.append(self.cond.wait_for(lambda: self.commits >= target, timeout=self.wait_s))
        return super().generate(step)


def _gated_engine(async_scheduling: bool) -> tuple[Any, _GatedNode]:
    from block_manager.service.config import BlockManagerConfig
    from engine.bm_steps import StepSender
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.local_bm import LocalBlockManagerClient

    client = LocalBlockManagerClient(BlockManagerConfig(database_url="memory://", block_size=16, watermark=0.0))
    # generous when the commit must come (a loaded machine); short when it cannot
    node = _GatedNode(client, "gated", 512, wait_s=30.0 if async_scheduling else 0.1)
    engine = LLMEngine(client, {"gated": node}, EngineConfig(async_scheduling=async_scheduling))

    class CountedSender(StepSender):
        def commit(self, batch: Any, *, wait: bool = True) -> Any:
            result = super().commit(batch, wait=wait)
            node.committed()
            return result

    engine.sender = CountedSender(engine.sender.timeout_s)
    return engine, node


def test_the_next_step_is_committed_while_the_node_generates() -> None:
    for async_scheduling in (True, False):
        engine, node = _gated_engine(async_scheduling)
        try:
            rids, prompts = _add_greedy(engine, 7, 4, (20, 21), 12)
            done: dict[str, Any] = {}
            for _ in range(200):
                if not engine.has_unfinished_requests():
                    break
                done.update({o.request_id: o for o in engine.step() if o.finished})
            _check_greedy(done, rids, prompts, 12)
            # every Generate but the last saw the next Step committed while it ran (overlap);
            # without overlap none did (each waited out its timeout)
            if async_scheduling:
                assert all(node.overlapped[:-1]) and len(node.overlapped) >= 12
            else:
                assert not any(node.overlapped)
        finally:
            engine.close()


class _CallerGatedNode(FakeNode):
    """Every Generate but the first waits until the engine's caller saw it running (or
    `wait_s`): the caller looks each time `step()` returned."""

    def __init__(self, *args: Any, wait_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wait_s = wait_s
        self.cond = threading.Condition()
        self.running = self.seen = False
        self.first = True

    def generate(self, step: Any) -> Any:
        with self.cond:
            if not self.first:
                self.running = True
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.seen, timeout=self.wait_s)
            self.first = self.running = self.seen = False
        return super().generate(step)

    def look(self, timeout_s: float) -> bool:
        """Whether a Generate is running now, while the caller has control."""
        with self.cond:
            self.seen = self.cond.wait_for(lambda: self.running, timeout=timeout_s)
            self.cond.notify_all()
            return self.seen


def test_the_nodes_run_the_next_step_while_the_caller_has_the_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With overlap, `step()` returns step N's outputs with step N+1 already running on the
    nodes: the caller's own time (streaming the outputs, adding requests) is off the nodes'
    path, and N's tokens were accepted while N+1 ran. Without overlap nothing runs then."""
    from block_manager.service.config import BlockManagerConfig
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.local_bm import LocalBlockManagerClient
    from engine.scheduler import Scheduler

    accept = Scheduler.accept
    for async_scheduling in (True, False):
        client = LocalBlockManagerClient(BlockManagerConfig(database_url="memory://", block_size=4, watermark=0.0))
        node = _CallerGatedNode(client, "gated", 256, block_size=4, wait_s=30.0 if async_scheduling else 0.05)
        engine = LLMEngine(client, {"gated": node}, EngineConfig(async_scheduling=async_scheduling))
        try:
            rids, prompts = _add_greedy(engine, 5, 4, (3, 12), 14)
            done: dict[str, Any] = {}
            seen: list[bool] = []
            # (call, whether a step was launched on the nodes) at each token accepted
            accepted: list[tuple[int, bool]] = []

            def watched(scheduler: Scheduler, seq: Any, tok: Any, now: float, engine: Any = engine,
                        accepted: Any = accepted, seen: Any = seen) -> None:
                accepted.append((len(seen), engine.pipeline.flight is not None))
                accept(scheduler, seq, tok, now)

            monkeypatch.setattr(Scheduler, "accept", watched)
            for _ in range(200):
                if not engine.has_unfinished_requests():
                    break
                done.update({o.request_id: o for o in engine.step() if o.finished})
                if engine.has_unfinished_requests():
                    seen.append(node.look(30.0 if async_scheduling else 0.05))
            _check_greedy(done, rids, prompts, 14)
            if async_scheduling:
                # every call with requests left left the next step running, and had launched
                # it before accepting the tokens of the step before (the last has none to launch)
                assert all(seen) and len(seen) >= 12, seen
                assert all(launched for call, launched in accepted if call < len(seen)), accepted
            else:
                assert not any(seen) and not any(launched for _, launched in accepted)
            _check_drained(engine)
        finally:
            engine.close()


def test_generated_text_is_prefix_cached_with_its_real_token_ids() -> None:
    """Speculative tokens are hashed only with their real ids (a placeholder never is): a
    prompt that repeats a completion hits the cache over the generated blocks, each filled by
    a token whose id reached the block manager one Step late."""
    engine, _ = fake_engine(1, num_blocks=256, block_size=4, async_scheduling=True)
    try:
        prompt = [random.Random(11).randrange(1, VOCAB) for _ in range(6)]
        first = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        done: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        generated = done[first].outputs[0].token_ids
        assert generated == fake_completion(prompt, 30) and engine.stats.speculative_tokens > 0
        assert engine.stats.late_tokens >= 30 // 4   # every block it filled got its last id late
        engine.flush()
        again = engine.add_request(prompt + generated, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        # every full block of prompt + output but the last token's: (36 - 1) // 4 blocks
        assert done[again].num_cached_tokens == (len(prompt) + 30 - 1) // 4 * 4
        assert PLACEHOLDER not in done[again].outputs[0].token_ids
    finally:
        engine.close()


def test_a_node_failing_under_a_committed_next_step_recomputes_and_leaks_nothing() -> None:
    for fault in ("dead", "restart"):
        engine, nodes = fake_engine(2, num_blocks=128, block_size=4, max_num_batched_tokens=64,
                                    async_scheduling=True)
        engine.health.first_s, engine.health.max_s = 0.005, 0.02
        core = engine.client.state.core
        try:
            rng = random.Random(13)
            prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(12)]
            params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
            rids = [engine.add_request(p, params) for p in prompts]
            done: dict[str, Any] = {}
            for _ in range(6):
                done.update({o.request_id: o for o in engine.step() if o.finished})
            # the step in flight is followed by a committed Step for both nodes when this fails
            victim = nodes["fake-1"]
            if fault == "dead":
                victim.dead = True
            else:
                victim.restart()
            for i in range(3000):
                if not engine.has_unfinished_requests():
                    break
                if i == 10:
                    victim.dead = False
                done.update({o.request_id: o for o in engine.step() if o.finished})
                assert core.fsck() == []
            assert victim.num_failed >= 1 and engine.stats.num_failed_steps >= 1
            assert engine.stats.late_tokens > 0   # blocks filled with ids still to come, faults among them
            _check_greedy(done, rids, prompts, 25)
            _check_drained(engine)
        finally:
            engine.close()


def test_async_scheduling_is_a_setting(monkeypatch: Any) -> None:
    from engine.llm_engine import ASYNC_SCHEDULING_ENV, EngineConfig

    monkeypatch.delenv(ASYNC_SCHEDULING_ENV, raising=False)
    assert EngineConfig().async_scheduling is True
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv(ASYNC_SCHEDULING_ENV, off)
        assert EngineConfig().async_scheduling is False
    monkeypatch.setenv(ASYNC_SCHEDULING_ENV, "1")
    assert EngineConfig().async_scheduling is True
    assert EngineConfig(async_scheduling=False).async_scheduling is False


def _info(address: str | None, device: str) -> Any:
    from engine.node_api import NodeInfo

    return NodeInfo("n", 1, True, 16, 64, "m", 100, 1024, (), address, device)


def test_overlap_is_on_only_where_no_node_computes_on_this_hosts_cpu(monkeypatch: Any) -> None:
    """`LLM(async_scheduling=None)`: the argument, else the environment variable when set, else
    on only when every node is on a GPU or is a CPU node on another host (engine.async_policy)."""
    import socket

    from engine.async_policy import ASYNC_SCHEDULING_ENV, choose_async_scheduling, overlap_pays

    monkeypatch.delenv(ASYNC_SCHEDULING_ENV, raising=False)
    embedded_cpu, embedded_gpu = _info(None, "cpu"), _info(None, "cuda:0")
    local = [_info(a, "cpu") for a in ("127.0.0.1:50061", "127.3.2.1:1", "[::1]:50061", "localhost:7",
                                       "LOCALHOST:7", "unix:/tmp/node.sock", "0.0.0.0:50061",
                                       "ipv4:127.0.0.1:9", "dns:///localhost:9", f"{socket.gethostname()}:9")]
    remote_cpu = [_info(a, "cpu") for a in ("10.0.0.7:50061", "node-1.cluster:50061", "[2001:db8::1]:5")]
    remote_gpu = _info("127.0.0.1:50062", "cuda:1")
    assert overlap_pays([embedded_gpu]) and overlap_pays([remote_gpu])   # a GPU leaves the CPU free
    assert overlap_pays(remote_cpu) and overlap_pays([*remote_cpu, remote_gpu])
    assert not overlap_pays([embedded_cpu])
    for info in local:
        assert not overlap_pays([info]), info.address
        assert not overlap_pays([remote_cpu[0], info]), info.address   # one shares our cores: off
    assert overlap_pays([_info("10.0.0.7:1", "")]) and not overlap_pays([_info("127.0.0.1:1", "")])
    # the argument wins, then the environment variable, then the nodes
    assert choose_async_scheduling(True, [embedded_cpu]) is True
    assert choose_async_scheduling(False, remote_cpu) is False
    assert choose_async_scheduling(None, [embedded_cpu]) is False
    assert choose_async_scheduling(None, remote_cpu) is True
    monkeypatch.setenv(ASYNC_SCHEDULING_ENV, "1")
    assert choose_async_scheduling(None, [embedded_cpu]) is True
    monkeypatch.setenv(ASYNC_SCHEDULING_ENV, "off")
    assert choose_async_scheduling(None, remote_cpu) is False
    assert choose_async_scheduling(True, remote_cpu) is True


def test_overlap_switched_off_mid_run_finishes_the_running_step_first() -> None:
    """`config.async_scheduling` turned off between two calls (as the benchmarks do): the step
    still running on the nodes is waited for and accepted once, then steps run one by one."""
    engine, _ = fake_engine(1, num_blocks=128, block_size=4, async_scheduling=True)
    core = engine.client.state.core
    try:
        rids, prompts = _add_greedy(engine, 17, 5, (3, 15), 16)
        done: dict[str, Any] = {}
        for _ in range(5):
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert engine.pipeline.flight is not None   # a step is running on the node now
        engine.config.async_scheduling = False
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            done.update({o.request_id: o for o in engine.step() if o.finished})
            assert engine.pipeline.flight is None and core.fsck() == []
        _check_greedy(done, rids, prompts, 16)
        _check_drained(engine)
    finally:
        engine.close()
