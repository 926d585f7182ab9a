"""The core state machine (test_core_stateful.py) with late ids mixed in, driven as an async
scheduler drives them: some appends leave their last ids late (placeholders in the call, the
real tokens written by the node), the ids arrive while that step's Forward runs or after it
was reported, and a sequence awaiting ids is refused any other append or a fork. Every check
of the base machine holds after every rule, and every hashing sequence awaiting no ids hashes
exactly its real tokens (a placeholder hashed, or an id put in the wrong place, shows there;
a hash left behind by a failed step shows as a prefix hit reading unwritten memory)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule, run_state_machine_as_test

from block_manager.core import OutOfBlocks, PendingWrite, UnknownSequence
from block_manager.core.errors import LateIdsPending
from tests.block_manager.core.test_core_stateful import EVENTS, POOLS, CoreMachine, has_live


class LateIdsMachine(CoreMachine):
    def __init__(self) -> None:
        super().__init__()
        self.resolve_while_running = False

    @has_live
    @rule(data=st.data(), decode_only=st.booleans(), late=st.booleans())
    def append(self, data, decode_only, late) -> None:
        if late:
            self.append_late(data)
        else:
            super().append(data, decode_only)

    def append_late(self, data) -> None:
        """Appends whose last ids are placeholders; one item may name a sequence already
        awaiting ids (refused alone, nothing changed)."""
        ready = self.appendable()
        if not ready:
            return
        chosen = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=5, unique=True))
        ids, counts, flat, lates, real = [], [], [], [], {}
        for sid in chosen:
            bs = POOLS[self.pool_of[sid]][1]
            n = data.draw(st.integers(1, 3))
            toks = data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
            in_last = (len(self.expected[sid]) + n - 1) % bs + 1
            k = data.draw(st.integers(1, min(n, in_last)))
            ids.append(sid)
            counts.append(n)
            flat.extend([*toks[: n - k], *[0] * k])
            lates.append(k)
            real[sid] = (toks, k)
        refused = sorted(self.late)[0] if self.late and data.draw(st.booleans()) else None
        if refused is not None:
            ids.append(refused)
            counts.append(1)
            flat.append(5)
            lates.append(0)
        views_before = {sid: self.m.get_sequence(sid) for sid in ids}
        out = self.m.append_tokens(ids, counts, flat, num_late=lates)
        failed = dict(out.failures)
        for i, sid in enumerate(ids):
            if sid == refused:
                assert isinstance(failed.get(i), LateIdsPending)
                EVENTS["late_refused"] += 1
            elif i in failed:
                assert isinstance(failed[i], (OutOfBlocks, PendingWrite)), failed[i]
            if i in failed:
                assert self.m.get_sequence(sid) == views_before[sid]
                continue
            toks, k = real[sid]
            EVENTS["late_append"] += 1
            EVENTS["late_fill"] += out.num_tokens[i] % POOLS[self.pool_of[sid]][1] == 0
            self.expected[sid].extend(toks)
            self.pending.setdefault(sid, []).extend(toks)   # the node writes the real tokens
            if self.m._seqs[sid].hashing:   # one that hashes nothing needs no ids (nor waits for them)
                self.late[sid] = toks[len(toks) - k :]

    @rule(pid=st.sampled_from(sorted(POOLS)), fail=st.sampled_from([False] * 4 + [True]), resolve=st.booleans())
    def forward(self, pid, fail, resolve=False) -> None:
        self.resolve_while_running = resolve
        try:
            super().forward(pid, fail)
        finally:
            self.resolve_while_running = False

    def step_closed(self, pid: str) -> None:
        late = sorted(s for s in self.late if self.pool_of[s] == pid)
        if self.resolve_while_running and late:   # the ids arrive with the next Step, the Forward still running
            self.resolve(late)
            EVENTS["late_resolve_unsettled"] += 1

    def step_settled(self, pid: str) -> None:
        late = sorted(s for s in self.late if self.pool_of[s] == pid)
        if late:
            self.resolve(late)

    def resolve(self, ids: list[str]) -> None:
        """The late ids of `ids` arrive (an unknown sequence among them is refused alone)."""
        fails = self.m.resolve_late([*ids, "nobody"], [*(len(self.late[s]) for s in ids), 1],
                                    [t for s in ids for t in self.late[s]] + [3])
        assert [(i, type(e)) for i, e in fails] == [(len(ids), UnknownSequence)]
        for sid in ids:
            del self.late[sid]
        EVENTS["late_resolve"] += 1


def test_core_state_machine_with_late_ids() -> None:
    """~2000 steps (--slow: the base machine's long run), a fixed seed so the run (and its coverage) is reproducible."""
    EVENTS.clear()
    run_state_machine_as_test(LateIdsMachine, settings=settings(
        max_examples=50, stateful_step_count=40, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
    print(dict(EVENTS))
    # the late-id paths (the base machine's own test holds it to the rest)
    for event in ("prefix_hit", "fork", "step_failed", "late_append", "late_fill", "late_resolve",
                  "late_refused", "late_resolve_unsettled"):
        assert EVENTS[event] > 0, f"the state machine never exercised {event}: {dict(EVENTS)}"
