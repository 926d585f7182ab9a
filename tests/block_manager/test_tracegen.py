"""Trace generator: determinism, schedule validity, and that each knob does what it says."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from block_manager.trace.format import AllocateOp, AppendOp, ForkOp, FreeOp, parse_trace
from block_manager.trace.generate import TraceConfig, TraceConfigError, generate_trace, write_trace
from block_manager.trace.replay import replay

SMALL = dict(num_requests=30, prompt_len_max=200, output_len_max=120, system_prompt_len=64)


def _lines(**knobs: object) -> list[str]:
    return list(generate_trace(TraceConfig(**{**SMALL, **knobs})))  # type: ignore[arg-type]


def _walk(lines: list[str]) -> dict[str, object]:
    """Check the schedule is valid and collect per-request facts."""
    live: set[str] = set()
    seen: set[str] = set()
    prompts: dict[str, list[int]] = {}
    salts: dict[str, str | None] = {}
    outputs: Counter[str] = Counter()
    forks: dict[str, tuple[str, ...]] = {}
    max_live = 0
    for op in parse_trace(lines):
        if isinstance(op, AllocateOp):
            assert op.seq_id not in seen, "ids are never reused"
            live.add(op.seq_id)
            seen.add(op.seq_id)
            prompts[op.seq_id] = list(op.token_ids)
            salts[op.seq_id] = op.salt
        elif isinstance(op, ForkOp):
            assert op.parent_id in live
            assert not live & set(op.child_ids)
            live.update(op.child_ids)
            seen.update(op.child_ids)
            forks[op.parent_id] = op.child_ids
        elif isinstance(op, AppendOp):
            names = [seq_id for seq_id, _ in op.seqs]
            assert set(names) == live, "every running sequence decodes one token per step"
            for seq_id, token_ids in op.seqs:
                assert len(token_ids) == 1
                outputs[seq_id] += 1
        elif isinstance(op, FreeOp):
            assert set(op.seq_ids) <= live
            live.difference_update(op.seq_ids)
        max_live = max(max_live, len(live))
    assert not live, "every sequence is freed by the end"
    return dict(prompts=prompts, salts=salts, outputs=outputs, forks=forks, max_live=max_live)


def test_same_seed_gives_byte_identical_file(tmp_path: Path) -> None:
    config = TraceConfig(**SMALL, parallel_fraction=0.3, num_tenants=3, seed=7)  # type: ignore[arg-type]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_trace(a, config)
    write_trace(b, config)
    assert a.read_bytes() == b.read_bytes()
    other = tmp_path / "c.jsonl"
    write_trace(other, TraceConfig(**SMALL, parallel_fraction=0.3, num_tenants=3, seed=8))  # type: ignore[arg-type]
    assert other.read_bytes() != a.read_bytes()


def test_schedule_is_valid_and_every_request_is_served() -> None:
    facts = _walk(_lines(parallel_fraction=0.5, num_tenants=2, seed=3))
    prompts = facts["prompts"]
    assert len(prompts) == SMALL["num_requests"]  # type: ignore[arg-type]


def test_replay_on_a_huge_pool_has_no_pressure_events() -> None:
    lines = _lines(parallel_fraction=0.5, num_tenants=2, shared_prompt_fraction=0.7, seed=5)
    report = replay(lines, num_blocks=20_000, block_size=16, fsck=True)
    assert (report.rejected, report.preempted, report.skipped) == (0, 0, 0)
    assert report.fsck_problems == []
    assert report.ops == len(lines)


def test_lengths_stay_within_bounds_for_both_distributions() -> None:
    for dist in ("loguniform", "lognormal"):
        facts = _walk(
            _lines(length_dist=dist, shared_prompt_fraction=0.0, prompt_len_min=20, prompt_len_max=90,
                   output_len_min=5, output_len_max=40)
        )
        assert all(20 <= len(p) <= 90 for p in facts["prompts"].values())  # type: ignore[union-attr]
        assert all(5 <= n <= 40 for n in facts["outputs"].values())  # type: ignore[union-attr]


def test_shared_prompt_fraction_controls_shared_prefixes() -> None:
    def num_sharing(fraction: float) -> int:
        prompts = _walk(_lines(shared_prompt_fraction=fraction, num_system_prompts=2))["prompts"]
        heads = Counter(tuple(p[:64]) for p in prompts.values())  # type: ignore[union-attr]
        return sum(count for count in heads.values() if count > 1)

    assert num_sharing(0.0) == 0
    assert num_sharing(1.0) == SMALL["num_requests"]


def test_parallel_sampling_forks_right_after_allocate_and_children_diverge() -> None:
    lines = _lines(parallel_fraction=1.0, parallel_n=3, seed=11)
    ops = [json.loads(line) for line in lines]
    for i, op in enumerate(ops):
        if op["op"] == "allocate":
            assert ops[i + 1] == {"op": "fork", "parent": op["seq"], "children": [f"{op['seq']}/1", f"{op['seq']}/2"]}
    facts = _walk(lines)
    outputs = facts["outputs"]
    lens = [tuple(outputs[s] for s in (p, *c)) for p, c in facts["forks"].items()]  # type: ignore[union-attr,index]
    assert any(len(set(t)) > 1 for t in lens), "samples of a request finish at different lengths"
    assert _walk(_lines(parallel_fraction=0.0))["forks"] == {}


def test_tenants_and_max_running() -> None:
    salts = set(_walk(_lines(num_tenants=3, seed=2))["salts"].values())  # type: ignore[union-attr]
    assert salts == {"tenant-0", "tenant-1", "tenant-2"}
    assert set(_walk(_lines(num_tenants=1))["salts"].values()) == {None}  # type: ignore[union-attr]
    facts = _walk(_lines(max_running=5, arrival_rate=10.0, parallel_fraction=0.5, parallel_n=4))
    assert facts["max_live"] <= 5


def test_arrival_rate_spreads_requests_over_steps() -> None:
    def steps_before_last_arrival(rate: float) -> int:
        steps = 0
        for line in _lines(arrival_rate=rate, max_running=10_000):
            op = json.loads(line)
            if op["op"] == "append":
                steps += 1
            elif op["op"] == "allocate" and op["seq"] == f"r{SMALL['num_requests'] - 1}":
                return steps
        raise AssertionError("last request never arrived")

    assert steps_before_last_arrival(0.2) > 3 * steps_before_last_arrival(5.0)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(num_requests=0),
        dict(prompt_len_min=10, prompt_len_max=5),
        dict(shared_prompt_fraction=1.5),
        dict(arrival_rate=0.0),
        dict(num_system_prompts=0, shared_prompt_fraction=0.5),
        dict(parallel_fraction=0.5, parallel_n=10, max_running=4),
        dict(length_dist="uniform"),
    ],
)
def test_bad_knobs_raise_typed_errors(knobs: dict[str, object]) -> None:
    with pytest.raises(TraceConfigError):
        TraceConfig(**knobs).validate()  # type: ignore[arg-type]
