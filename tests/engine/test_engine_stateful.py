"""The engine under random arrivals, aborts, forks, preemptions and faults (issues 21, 47).

A Hypothesis state machine drives an engine over the in-process block manager and two fake
nodes with a small host tier (`tests.engine.fakes`: a greedy token is a pure function of what
the engine sent, so a run with faults must give every request exactly the tokens of a
fault-free run). Preemption swaps to the host tier (and falls back to recompute when the host
is full). Faults: a node dies (unreachable) and comes back, restarts in place (a new epoch: its
step is refused and its sequences are gone, swapped ones included), or turns slow; the block
manager is down for the next few Steps (the engine resends them). It runs with async
scheduling (the default: faults and aborts land while a step is in flight and the next one is
committed) and without. After every rule:

- the block manager's fsck is clean;
- every sequence is where its state says (RUNNING: in `running`, with an id and a node;
  SWAPPED: in `swapped`, with an id and a node; WAITING / PREEMPTED: queued, no id; FORKING /
  FINISHED: none of them, no id), once;
- every sequence the block manager holds is one the engine runs, has swapped or is about to
  free (no leak).

At the end (faults healed) every request that was not aborted completes with the fault-free
tokens, and nothing is left held. Over each test's runs, swap-outs, swap-ins and resent Steps
must all have happened (else the machine no longer drives them: a test that cannot fail).
"""

from __future__ import annotations

import random
import time
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from engine.params import SamplingParams
from engine.sequence import SeqStatus
from tests.engine.fakes import VOCAB, fake_completion, fake_engine

NODES = ("fake-0", "fake-1")
SHARED = [random.Random(5).randrange(1, VOCAB) for _ in range(12)]   # a common prefix: prefix hits
EVENTS: Counter[str] = Counter()   # what the runs drove, summed by teardown


class EngineMachine(RuleBasedStateMachine):
    ASYNC_SCHEDULING = True    # step N+1 planned while the nodes run step N (engine.pipeline)
    # The two switches of issue 47, each of which found a bug. The host tier: a request failed
    # for nothing (a fork child's append refused PendingWrite, now a WAIT row of the failure
    # table). The block manager down: DoubleFree, a swapped sequence given up (its node out of
    # placement) while a Step was planned had its free sent a Step after the failed report that
    # dropped it (tests/engine/test_engine_swap_lost.py).
    HOST_TIER = True           # a small host tier on each node: preemption swaps
    BM_DOWN = True             # the block manager down for a few Steps (a rule)
    # What the runs must have driven. With overlap a preemption victim is rare (every running
    # sequence has work in the step in flight), so swaps are required of the plain machine only.
    MUST_HAPPEN: tuple[str, ...] = ("failed_node_steps",)

    @initialize()
    def start(self) -> None:
        self.engine, self.nodes = fake_engine(2, num_blocks=20, block_size=4, max_num_batched_tokens=20,
                                              max_num_seqs=8, host_num_blocks=12 if self.HOST_TIER else 0,
                                              async_scheduling=self.ASYNC_SCHEDULING)
        self.engine.health.first_s, self.engine.health.max_s = 0.005, 0.02
        self.engine.sender.first_wait_s = 0.001   # resends of a Step the block manager did not answer
        self.client = self.engine.client
        self.core = self.engine.client.state.core
        self.expected: dict[str, tuple[list[int], int]] = {}
        self.finished: dict[str, object] = {}
        self.aborted: set[str] = set()

    # ---- arrivals, aborts, steps ---------------------------------------------------------
    @rule(data=st.data(), length=st.integers(2, 18), n=st.integers(1, 3), max_tokens=st.integers(1, 10),
          shared=st.booleans())
    def arrive(self, data: st.DataObject, length: int, n: int, max_tokens: int, shared: bool) -> None:
        tail = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=length, max_size=length))
        prompt = (SHARED if shared else []) + tail
        rid = self.engine.add_request(prompt, SamplingParams(n=n, temperature=0, max_tokens=max_tokens,
                                                             ignore_eos=True))
        self.expected[rid] = (prompt, max_tokens)

    @precondition(lambda self: bool(self.engine.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.engine.requests)))
        self.engine.abort_request(rid)
        self.aborted.add(rid)

    @rule(num_steps=st.integers(1, 4))
    def step(self, num_steps: int) -> None:
        for _ in range(num_steps):
            for out in self.engine.step():
                if out.finished:
                    self.finished[out.request_id] = out

    # ---- faults ----------------------------------------------------------------------------
    @rule(node=st.sampled_from(NODES))
    def kill(self, node: str) -> None:
        self.nodes[node].dead = True

    @rule(node=st.sampled_from(NODES))
    def revive(self, node: str) -> None:
        self.nodes[node].dead = False

    @rule(node=st.sampled_from(NODES))
    def restart_in_place(self, node: str) -> None:
        self.nodes[node].restart()

    @rule(node=st.sampled_from(NODES), slow=st.booleans())
    def slow(self, node: str, slow: bool) -> None:
        self.nodes[node].delay_s = 0.003 if slow else 0.0

    @precondition(lambda self: self.BM_DOWN)
    @rule(num_steps=st.integers(1, 3))
    def block_manager_down(self, num_steps: int) -> None:
        """Down for the next `num_steps` Steps (the engine waits it out, resending)."""
        self.client.down_steps = num_steps

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def block_manager_is_consistent(self) -> None:
        if hasattr(self, "core"):
            assert self.core.fsck() == []

    @invariant()
    def every_sequence_is_where_its_state_says(self) -> None:
        if not hasattr(self, "engine"):
            return
        engine = self.engine
        queues = {"running": engine.running, "waiting": list(engine.waiting), "swapped": list(engine.swapped)}
        for queue in queues.values():
            assert len(set(map(id, queue))) == len(queue)
        home = {SeqStatus.RUNNING: "running", SeqStatus.SWAPPED: "swapped", SeqStatus.WAITING: "waiting",
                SeqStatus.PREEMPTED: "waiting"}
        for req in engine.requests.values():
            for seq in req.seqs:
                where = {name for name, queue in queues.items() if seq in queue}
                want = home.get(seq.status)
                assert where == ({want} if want else set()), (seq, where)
                if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPED):
                    assert seq.seq_id and seq.node_id == seq.admitted.node_id, seq
                else:
                    assert seq.seq_id is None and seq.node_id is None, seq

    @invariant()
    def nothing_is_held_that_the_engine_forgot(self) -> None:
        if not hasattr(self, "engine"):
            return
        engine = self.engine
        known = ({s.seq_id for s in [*engine.running, *engine.swapped]}
                 | set(engine.scheduler.queues.to_free))
        held = {s.seq_id for s in self.core.sequences()}
        assert held <= known, held - known

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        engine = self.engine
        try:
            for node in self.nodes.values():
                node.dead, node.restart_next, node.delay_s = False, False, 0.0
            self.client.down_steps = 0
            deadline = time.monotonic() + 60
            while engine.has_unfinished_requests() and time.monotonic() < deadline:
                for out in engine.step():
                    if out.finished:
                        self.finished[out.request_id] = out
            assert not engine.has_unfinished_requests()
            for rid, (prompt, max_tokens) in self.expected.items():
                if rid in self.aborted:
                    continue
                out = self.finished[rid]
                want = fake_completion(prompt, max_tokens)
                assert all(c.token_ids == want for c in out.outputs), rid   # type: ignore[attr-defined]
            engine.flush()
            assert self.core.fsck() == [] and self.core.sequences() == []
            stats = engine.stats
            EVENTS.update(swap_outs=stats.num_swap_outs, swap_ins=stats.num_swap_ins,
                          swap_fallbacks=stats.recompute_fallbacks, resends=engine.sender.num_resends,
                          refused_steps=self.client.num_refused, failed_node_steps=stats.num_failed_steps)
        finally:
            engine.close()


class PlainEngineMachine(EngineMachine):
    ASYNC_SCHEDULING = False   # one step after the other
    MUST_HAPPEN = ("failed_node_steps", "swap_outs", "swap_ins")


SETTINGS = settings(max_examples=25, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _run(machine: type[EngineMachine]) -> None:
    """Run the machine (random examples: it explores), then once more on Hypothesis's fixed
    seed, whose runs must have driven what the machine is for (`MUST_HAPPEN`, and with `BM_DOWN`
    a block manager down at least once: refused Steps, resent): a check that gives the same
    answer every time, where random runs only drive it most of the time. The fixed seed's first
    examples are short ones; with 25 the plain machine failed no node step, with 50 it does."""
    run_state_machine_as_test(machine, settings=SETTINGS)
    EVENTS.clear()
    run_state_machine_as_test(machine, settings=settings(SETTINGS, derandomize=True, max_examples=50))
    for event in machine.MUST_HAPPEN + (("resends", "refused_steps") if machine.BM_DOWN else ()):
        assert EVENTS[event] > 0, (event, dict(EVENTS))


def test_engine_state_machine() -> None:
    _run(EngineMachine)


def test_engine_state_machine_without_overlap() -> None:
    _run(PlainEngineMachine)
