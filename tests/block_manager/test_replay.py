"""Trace replay: op semantics, memory-pressure accounting, errors and metric consistency."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from block_manager.core.errors import OutOfBlocks
from block_manager.trace.format import TraceError, parse_trace
from block_manager.trace.generate import TraceConfig, generate_trace
from block_manager.trace.replay import REPLAY_POOL, ReplayReport, TraceReplayer, replay


def _ops(*ops: dict[str, object]) -> list[str]:
    return [json.dumps(op) for op in ops]


def _run(lines: list[str], *, num_blocks: int = 64, block_size: int = 4, watermark: float = 0.0,
         **kwargs: object) -> tuple[TraceReplayer, ReplayReport]:
    """Replay with fsck on; returns the replayer too, so tests can inspect the core."""
    replayer = TraceReplayer(num_blocks=num_blocks, block_size=block_size, watermark=watermark, **kwargs)  # type: ignore[arg-type]
    report = replayer.run(parse_trace(lines), fsck=True)
    assert report.fsck_problems == []
    return replayer, report


def test_allocate_and_append_grow_the_table_block_by_block() -> None:
    r, report = _run(_ops(
        {"op": "allocate", "seq": "a", "tokens": [1, 2, 3, 4, 5, 6]},
        {"op": "append", "seqs": {"a": [7, 8]}},
        {"op": "append", "seqs": {"a": [9]}},
    ))
    seq = r.manager.get_sequence("a")  # type: ignore[arg-type]
    assert (seq.num_tokens, len(seq.block_table)) == (9, 3)
    assert report.peak_used_blocks == 3
    assert report.num_append_steps == 2
    # 8 tokens in 2 blocks (no waste), then 9 tokens in 3 blocks (3 of 12 slots empty).
    assert report.waste_ratio == pytest.approx((0 + 3 / 12) / 2)
    assert report.ops == 3 and (report.rejected, report.preempted, report.skipped) == (0, 0, 0)


def test_fork_shares_blocks_and_divergence_copies_the_partial_block() -> None:
    r, report = _run(_ops(
        {"op": "allocate", "seq": "p", "tokens": [1, 2, 3, 4, 5, 6]},
        {"op": "fork", "parent": "p", "children": ["c1", "c2"]},
        {"op": "append", "seqs": {"p": [10], "c1": [11], "c2": [12]}},
    ))
    tables = {s: r.manager.get_sequence(s).block_table for s in ("p", "c1", "c2")}  # type: ignore[arg-type]
    assert tables["p"][0] == tables["c1"][0] == tables["c2"][0], "the full first block stays shared"
    assert len({t[1] for t in tables.values()}) == 3, "each sample owns its diverged last block"
    assert report.cow_copies == 2  # the last writer keeps the original block
    assert report.peak_used_blocks == 4
    assert report.peak_concurrency == 3
    # Contiguous baseline: three separate 7-token regions vs 4 blocks of 4 slots.
    assert report.concurrency_gain == pytest.approx(21 / 16)


def test_free_releases_everything() -> None:
    r, report = _run(_ops(
        {"op": "allocate", "seq": "a", "tokens": [1, 2, 3, 4, 5]},
        {"op": "fork", "parent": "a", "children": ["b"]},
        {"op": "free", "seqs": ["a", "b"]},
    ))
    assert r.manager.sequences() == []
    assert r.manager.metrics(REPLAY_POOL).num_used_blocks == 0
    assert r.live == {}


def test_pressure_counts_rejected_preempted_and_skipped() -> None:
    r, report = _run(_ops(
        {"op": "allocate", "seq": "a", "tokens": list(range(8))},     # 2 blocks
        {"op": "allocate", "seq": "b", "tokens": list(range(50, 58))},  # 2 blocks: pool full
        {"op": "allocate", "seq": "c", "tokens": [1, 2, 3]},           # rejected
        {"op": "append", "seqs": {"c": [1], "a": [9]}},               # c skipped, a preempted
        {"op": "fork", "parent": "c", "children": ["c/1"]},           # skipped; c/1 dead too
        {"op": "append", "seqs": {"a": [10], "c/1": [1], "b": [60]}},  # 2 skips; b gets a's block
        {"op": "free", "seqs": ["a", "b", "c", "c/1"]},               # 3 skips, b freed
    ), num_blocks=4)
    assert (report.rejected, report.preempted, report.skipped) == (1, 1, 7)
    assert report.peak_used_blocks == 4
    assert r.manager.sequences() == []
    assert r.live == {} and r.dead == set()


def test_a_fork_the_core_refuses_for_lack_of_blocks_rejects_each_child(monkeypatch: pytest.MonkeyPatch) -> None:
    # The core's fork only shares blocks, so it cannot run out today; if a core ever
    # reserves blocks at fork time, the replay must count it like a refused allocation.
    replayer = TraceReplayer(num_blocks=16, block_size=4, watermark=0.0)

    def refuse(parent: str, child_ids: list[str]) -> None:
        raise OutOfBlocks("no room for the children")

    monkeypatch.setattr(replayer.manager, "fork", refuse)
    report = replayer.run(parse_trace(_ops(
        {"op": "allocate", "seq": "p", "tokens": [1, 2, 3]},
        {"op": "fork", "parent": "p", "children": ["p/1", "p/2"]},
        {"op": "append", "seqs": {"p": [4], "p/1": [5], "p/2": [6]}},
        {"op": "free", "seqs": ["p", "p/1", "p/2"]},
    )))
    assert (report.rejected, report.preempted, report.skipped) == (2, 0, 4)
    assert report.peak_concurrency == 1


def test_rejected_id_can_be_allocated_again_after_room_frees_up() -> None:
    r, report = _run(_ops(
        {"op": "allocate", "seq": "a", "tokens": list(range(8))},
        {"op": "allocate", "seq": "b", "tokens": list(range(8))},  # rejected (no prefix cache)
        {"op": "free", "seqs": ["a"]},
        {"op": "allocate", "seq": "b", "tokens": list(range(7))},  # fits now
        {"op": "append", "seqs": {"b": [1]}},
    ), num_blocks=2, enable_prefix_caching=False)
    assert (report.rejected, report.skipped) == (1, 0)
    assert r.manager.get_sequence("b").num_tokens == 8  # type: ignore[arg-type]


def test_watermark_rejects_before_the_pool_is_full() -> None:
    lines = _ops({"op": "allocate", "seq": "a", "tokens": list(range(36))})  # 9 of 10 blocks
    assert replay(lines, num_blocks=10, block_size=4, watermark=0.0).rejected == 0
    assert replay(lines, num_blocks=10, block_size=4, watermark=0.2).rejected == 1


def test_prefix_hits_need_the_same_salt() -> None:
    prompt = list(range(20))
    # a step ends at an append: b is admitted after a's prompt was written (hits need that)
    same = _ops(
        {"op": "allocate", "seq": "a", "tokens": prompt, "salt": "t1"},
        {"op": "append", "seqs": {"a": [5]}},
        {"op": "allocate", "seq": "b", "tokens": prompt + [99], "salt": "t1"},
    )
    other = _ops(
        {"op": "allocate", "seq": "a", "tokens": prompt, "salt": "t1"},
        {"op": "append", "seqs": {"a": [5]}},
        {"op": "allocate", "seq": "b", "tokens": prompt + [99], "salt": "t2"},
    )
    assert replay(same, num_blocks=32, block_size=4).prefix_hit_tokens == 20
    assert replay(other, num_blocks=32, block_size=4).prefix_hit_tokens == 0
    assert replay(same, num_blocks=32, block_size=4, enable_prefix_caching=False).prefix_hit_tokens == 0


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"op": "grow", "seq": "a"}', "unknown op 'grow'"),
        ('{"op": "allocate", "seq": "a"}', "missing key(s) tokens"),
        ('{"op": "allocate", "seq": "a", "tokens": [1], "salts": "x"}', "unknown key(s) salts"),
        ('{"op": "allocate", "seq": "a", "tokens": []}', "non-empty list"),
        ('{"op": "allocate", "seq": "a", "tokens": [1, -2]}', "non-negative integers"),
        ('{"op": "allocate", "seq": "a", "tokens": [1, true]}', "non-negative integers"),
        ('{"op": "allocate", "seq": "", "tokens": [1]}', "seq must be a non-empty string"),
        ('{"op": "allocate", "seq": "a", "tokens": [1], "salt": 5}', "salt must be a string"),
        ('{"op": "append", "seqs": {}}', "non-empty object"),
        ('{"op": "append", "seqs": {"a": 3}}', "tokens of 'a'"),
        # an append's items are checked as a whole batch first: a bad one among good ones is
        # still named by the per-item checks
        ('{"op": "append", "seqs": {"x": [1], "b": [2, true]}}', "tokens of 'b' must hold non-negative integers"),
        ('{"op": "append", "seqs": {"x": [1], "b": [2, -1]}}', "tokens of 'b' must hold non-negative integers"),
        ('{"op": "append", "seqs": {"x": [1], "b": [2.5]}}', "tokens of 'b' must hold non-negative integers"),
        ('{"op": "append", "seqs": {"x": [1], "b": []}}', "tokens of 'b' must be a non-empty list"),
        ('{"op": "append", "seqs": {"x": [1], "": [2]}}', "seqs key must be a non-empty string"),
        ('{"op": "fork", "parent": "a", "children": ["a"]}', "equals the parent"),
        ('{"op": "fork", "parent": "a", "children": ["b", "b"]}', "duplicate"),
        ('{"op": "free", "seqs": "a"}', "non-empty list"),
    ],
)
def test_malformed_lines_name_their_line_number(line: str, fragment: str) -> None:
    lines = ['{"op": "allocate", "seq": "x", "tokens": [1]}', "", line]
    with pytest.raises(TraceError) as info:
        replay(lines, num_blocks=8, block_size=4)
    assert info.value.line_no == 3
    assert str(info.value).startswith("line 3: ")
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("ops", "fragment"),
    [
        ([{"op": "append", "seqs": {"ghost": [1]}}], "unknown sequence 'ghost'"),
        ([{"op": "free", "seqs": ["ghost"]}], "unknown sequence 'ghost'"),
        ([{"op": "fork", "parent": "ghost", "children": ["g1"]}], "unknown sequence 'ghost'"),
        ([{"op": "allocate", "seq": "a", "tokens": [1]}, {"op": "allocate", "seq": "a", "tokens": [2]}],
         "already live"),
        ([{"op": "allocate", "seq": "a", "tokens": [1]}, {"op": "free", "seqs": ["a"]},
          {"op": "append", "seqs": {"a": [1]}}], "already freed"),
    ],
)
def test_inconsistent_traces_are_errors_not_memory_events(ops: list[dict[str, object]], fragment: str) -> None:
    with pytest.raises(TraceError, match=fragment) as info:
        replay(_ops(*ops), num_blocks=8, block_size=4)
    assert info.value.line_no == len(ops)


def test_replay_reads_a_file_and_a_list_the_same(tmp_path: Path) -> None:
    lines = list(
        generate_trace(TraceConfig(num_requests=10, prompt_len_max=100, output_len_min=10, output_len_max=40, seed=1))
    )
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    a = replay(path, num_blocks=1000, block_size=16)
    b = replay(lines, num_blocks=1000, block_size=16)
    assert (a.ops, a.peak_used_blocks, a.prefix_hit_tokens, a.waste_ratio) == (
        b.ops, b.peak_used_blocks, b.prefix_hit_tokens, b.waste_ratio)


def test_metrics_are_consistent_on_a_generated_shared_prompt_trace() -> None:
    config = TraceConfig(num_requests=40, prompt_len_max=200, output_len_max=100, system_prompt_len=96,
                         num_system_prompts=2, shared_prompt_fraction=0.8, parallel_fraction=0.3, seed=9)
    lines = list(generate_trace(config))
    report = replay(lines, num_blocks=300, block_size=16, fsck=True)
    assert report.fsck_problems == []
    assert 0 < report.peak_used_blocks <= report.num_blocks
    assert report.mean_used_blocks <= report.peak_used_blocks
    assert 0 < report.prefix_hit_tokens <= report.prefix_query_tokens
    assert report.cow_copies > 0
    assert 0.0 <= report.waste_ratio < 1.0
    assert report.append_step_p50_us <= report.append_step_p99_us <= report.append_step_max_us
    assert report.concurrency_gain > 1.0
    assert report.contiguous_baseline_blocks >= report.peak_used_blocks
    no_cache = replay(lines, num_blocks=300, block_size=16, enable_prefix_caching=False)
    assert no_cache.prefix_hit_tokens == 0
    assert no_cache.evictions == 0


def test_a_small_pool_evicts_and_preempts_but_stays_consistent() -> None:
    config = TraceConfig(num_requests=40, prompt_len_max=200, output_len_max=100, system_prompt_len=96,
                         num_system_prompts=2, shared_prompt_fraction=0.8, seed=9)
    report = replay(list(generate_trace(config)), num_blocks=60, block_size=16, fsck=True)
    assert report.fsck_problems == []
    assert report.peak_used_blocks <= 60
    assert report.rejected + report.preempted > 0
    assert report.evictions > 0


def test_baseline_knobs_only_ever_reserve_more() -> None:
    lines = list(generate_trace(TraceConfig(num_requests=20, prompt_len_max=100, output_len_max=60, seed=2)))
    exact = replay(lines, num_blocks=2000, block_size=16)
    by_output = replay(lines, num_blocks=2000, block_size=16, max_output_len=60)
    by_model = replay(lines, num_blocks=2000, block_size=16, max_model_len=160)
    assert exact.concurrency_gain <= by_output.concurrency_gain <= by_model.concurrency_gain
    assert exact.contiguous_waste_ratio < by_model.contiguous_waste_ratio


def test_a_host_tier_swaps_instead_of_recomputing_and_onboards_evicted_prefixes() -> None:
    """`--host-blocks`: the same small-pool trace, preempted sequences swapped out and back in
    (far fewer recomputed tokens), evicted system-prompt blocks offloaded and onboarded; the
    core stays consistent in both tiers."""
    config = TraceConfig(num_requests=40, prompt_len_max=200, output_len_max=100, system_prompt_len=96,
                         num_system_prompts=4, shared_prompt_fraction=0.8, seed=9)
    lines = list(generate_trace(config))
    without = replay(lines, num_blocks=60, block_size=16, fsck=True)
    with_host = replay(lines, num_blocks=60, block_size=16, fsck=True, host_blocks=400)
    assert without.fsck_problems == [] and with_host.fsck_problems == []
    assert without.host_blocks == 0 and without.swapped_out_blocks == 0 and without.host_hit_tokens == 0
    assert without.preemptions > 0 and without.recomputed_tokens > 0
    assert with_host.host_blocks == 400 and with_host.swapped_out_blocks > 0 and with_host.swapped_in_blocks > 0
    assert with_host.recomputed_tokens < without.recomputed_tokens
    assert with_host.offloaded_blocks > 0
    assert with_host.prefix_hit_tokens + with_host.host_hit_tokens >= without.prefix_hit_tokens
