"""ModelRunner behaviour beyond numerics: batch validation (typed errors, pool untouched),
copy-on-write through `copy_blocks`, seeded sampling independent of batch composition and
reproducible after recompute, logprobs, sizing, profiling."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from compute_node.model import (
    ContextTooLong,
    InvalidBatch,
    ModelLoadError,
    ModelRunner,
    SamplingParams,
    SeqWork,
)
from tests.compute_node.model.model_helpers import GREEDY, Request, run_schedule, tiny_model_dir

SPEC = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
        "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 64}
BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("runner"), "llama", seed=3, **SPEC)


@pytest.fixture
def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, block_size=BLOCK, num_blocks=40, device="cpu")


def _snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [c.clone() for c in runner.pool.key_caches + runner.pool.value_caches]


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, SPEC["vocab_size"]) for _ in range(n)]


def _good(seq_id: str = "ok") -> SeqWork:
    return SeqWork(seq_id, _prompt(6), 0, [0, 1], GREEDY)


BAD_BATCHES: dict[str, tuple[type[Exception], Callable[[], list[SeqWork]]]] = {
    "beyond max context": (ContextTooLong, lambda: [_good(), SeqWork("x", [5, 6], 63, list(range(20, 36)))]),
    "table too short": (InvalidBatch, lambda: [_good(), SeqWork("x", _prompt(9), 0, [2, 3])]),
    "token id >= vocab": (InvalidBatch, lambda: [_good(), SeqWork("x", [5, 300], 0, [2])]),
    "negative token id": (InvalidBatch, lambda: [_good(), SeqWork("x", [-1], 0, [2])]),
    "float token id": (InvalidBatch, lambda: [_good(), SeqWork("x", [5, 7.5], 0, [2])]),
    "huge token id": (InvalidBatch, lambda: [_good(), SeqWork("x", [2**70], 0, [2])]),
    "block id outside pool": (InvalidBatch, lambda: [_good(), SeqWork("x", _prompt(5), 0, [2, 40])]),
    "negative block id": (InvalidBatch, lambda: [_good(), SeqWork("x", _prompt(5), 0, [-2, 3])]),
    "float block id": (InvalidBatch, lambda: [_good(), SeqWork("x", _prompt(5), 0, [2.0, 3])]),
    "duplicate seq id": (InvalidBatch, lambda: [_good("a"), SeqWork("a", [7], 0, [5])]),
    "no new tokens": (InvalidBatch, lambda: [_good(), SeqWork("x", [], 0, [5])]),
    "negative num_computed_tokens": (InvalidBatch, lambda: [_good(), SeqWork("x", [7], -1, [5])]),
    "negative num_output_tokens": (InvalidBatch, lambda: [_good(), SeqWork("x", [7], 0, [5], GREEDY, -1)]),
    "sample of the wrong type": (InvalidBatch, lambda: [_good(), SeqWork("x", [7], 0, [5], {"temperature": 0})]),
    "two tokens, one slot": (InvalidBatch, lambda: [_good(), SeqWork("x", [7], 1, [1])]),
    "writes a block another reads": (InvalidBatch, lambda: [_good(), SeqWork("x", [7], 9, [0, 1, 6])]),
    # a prefix share must be of full blocks at the same positions: block 1 holds two of the
    # writer's tokens, and block 0 sits at x's position 4 but at the writer's position 0
    "reads another's partial block": (InvalidBatch, lambda: [_good(), SeqWork("x", [7], 8, [0, 1, 6])]),
    "shares a block at another position": (InvalidBatch, lambda: [_good(), SeqWork("x", [7], 8, [5, 0, 6])]),
    "two writers of one block": (InvalidBatch, lambda: [_good(), SeqWork("x", [7, 8], 2, [1])]),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_bad_batch_raises_before_writing(runner: ModelRunner, case: str) -> None:
    error, make = BAD_BATCHES[case]
    runner.execute([SeqWork("warm", _prompt(8, 1), 0, [10, 11], GREEDY)])   # some content to protect
    before = _snapshot(runner)
    with pytest.raises(error):
        runner.execute(make())
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(runner))), "the pool was written"


def test_bad_copy_pairs_are_rejected(runner: ModelRunner) -> None:
    for pairs in ([(0, 40)], [(-1, 2)], [(1, 2, 3)], [(0.5, 1)]):
        with pytest.raises(InvalidBatch):
            runner.copy_blocks(pairs)  # type: ignore[arg-type]


def test_copy_on_write_fork_continues_like_its_parent(runner: ModelRunner) -> None:
    """A fork shares the parent's full blocks and gets a copy of its partial last block; both
    then decode greedily to the same continuation (the copy carried the right K/V)."""
    prompt = _prompt(10, 2)   # blocks 3, 7 full; block 9 holds 2 tokens
    parent_table = [3, 7, 9]
    first = runner.execute([SeqWork("p", prompt, 0, parent_table, GREEDY)])[0]
    assert first is not None
    runner.copy_blocks([(9, 12)])
    child_table = [3, 7, 12]
    tokens = {"p": [first.token_id], "c": [first.token_id]}
    for step in range(6):
        n = len(prompt) + step
        tables = {"p": parent_table, "c": child_table}
        for seq_id, table in tables.items():
            if n // BLOCK >= len(table):
                table.append({"p": 20, "c": 21}[seq_id] + 2 * step)
        outs = runner.execute([SeqWork(s, [tokens[s][-1]], n, tables[s], GREEDY, step + 1) for s in ("p", "c")])
        for seq_id, out in zip(("p", "c"), outs):
            assert out is not None
            tokens[seq_id].append(out.token_id)
    assert tokens["p"] == tokens["c"]
    # Without the copy the fork reads a zeroed block and goes elsewhere: the check can fail.
    blank = ModelRunner(runner.model_dir, block_size=BLOCK, num_blocks=40, device="cpu")
    blank.execute([SeqWork("p", prompt, 0, [3, 7, 9], GREEDY)])
    diverted = blank.execute([SeqWork("c", [first.token_id], len(prompt), [3, 7, 12], GREEDY, 1)])[0]
    assert diverted is not None and diverted.token_id != tokens["p"][1]


def test_same_step_prefix_share_equals_reading_it_a_step_later(model_dir: Path) -> None:
    """Two prompts with one 8-token prefix in one step, the second reading the prefix blocks
    the first fills in that step (as the block manager admits them together): every layer's
    K/V writes precede its attention, so the second gets what it gets a step later, when the
    blocks are written, and what it gets computing the prefix itself."""
    prefix, a_tail, b_tail = _prompt(8, 4), _prompt(3, 5), _prompt(2, 6)
    params = SamplingParams(temperature=0, logprobs=3)

    def run(schedule: list[list[SeqWork]]) -> dict[str, tuple[int, float | None]]:
        runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=40, device="cpu")
        got = {}
        for step in schedule:
            for work, out in zip(step, runner.execute(step)):
                assert out is not None
                got[work.seq_id] = (out.token_id, out.logprob)
        return got

    a = SeqWork("a", prefix + a_tail, 0, [6, 2, 9], params)
    b_shared = SeqWork("b", b_tail, 8, [6, 2, 11], params)   # blocks 6, 2 are a's prefix
    together = run([[a, b_shared]])
    later = run([[a], [b_shared]])
    alone = run([[SeqWork("b", prefix + b_tail, 0, [6, 2, 11], params)]])
    for other in (later, alone):   # the same tokens; logprobs up to the batch's float rounding
        assert {k: v[0] for k, v in together.items() if k in other} == {k: v[0] for k, v in other.items()}
        assert together["b"][1] == pytest.approx(other["b"][1], abs=1e-4)


def test_seeded_sampling_is_independent_of_batch_and_survives_recompute(model_dir: Path) -> None:
    prompt = _prompt(9, 3)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=77)

    def run(requests: list[Request], index: int) -> list[int]:
        runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=64, device="cpu")
        return run_schedule(runner, requests)[index]

    alone = run([Request(prompt, 12, sample=params)], 0)
    crowded = run([Request(_prompt(14, 4), 15, sample=SamplingParams(seed=1)),
                   Request(_prompt(3, 5), 4, sample=SamplingParams()),
                   Request(prompt, 12, admit_step=2, chunk_size=4, sample=params)], 2)
    assert crowded == alone
    # Preempted after 5 tokens and recomputed: prompt + those tokens as the new prompt, with the
    # output counter at 5, yields the same remaining tokens.
    runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=64, device="cpu")
    context = prompt + alone[:5]
    table = list(range(10, 16))
    new_tokens, resumed = context, []
    for k in range(5, 12):
        out = runner.execute([SeqWork("r", new_tokens, len(context) - len(new_tokens), table, params, k)])[0]
        assert out is not None
        resumed.append(out.token_id)
        context, new_tokens = context + [out.token_id], [out.token_id]
    assert resumed == alone[5:]
    different = run([Request(prompt, 12, sample=SamplingParams(temperature=0.9, top_p=0.95, seed=78))], 0)
    assert different != alone


def test_outputs_align_with_the_batch_and_carry_logprobs(runner: ModelRunner) -> None:
    batch = [
        SeqWork("chunk", _prompt(8, 6), 0, [0, 1], None),                        # middle chunk: no token
        SeqWork("greedy", _prompt(5, 7), 0, [2, 3], SamplingParams(temperature=0.0, logprobs=3)),
        SeqWork("decode", [9], 0, [4], SamplingParams(seed=5, logprobs=0)),
    ]
    outs = runner.execute(batch)
    assert outs[0] is None
    greedy, decode = outs[1], outs[2]
    assert greedy is not None and greedy.seq_id == "greedy" and greedy.top_logprobs is not None
    assert len(greedy.top_logprobs) == 3 and greedy.top_logprobs[0][0] == greedy.token_id
    assert greedy.logprob == pytest.approx(greedy.top_logprobs[0][1])
    assert greedy.logprob <= 0 and greedy.top_logprobs[0][1] >= greedy.top_logprobs[1][1]
    assert decode is not None and decode.seq_id == "decode" and decode.logprob is not None
    assert decode.top_logprobs is None
    assert runner.execute([]) == []


def test_pool_sizing_and_config(model_dir: Path) -> None:
    runner = ModelRunner(model_dir, block_size=8, kv_memory_bytes=1_000_000, device="cpu")
    g = runner.geometry
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.dtype) == (2, 2, 64, "float32")
    assert g.num_blocks == 1_000_000 // g.bytes_per_block
    assert runner.model_config.eos_token_ids == (1, 3) and runner.model_config.is_eos(3)
    assert runner.max_model_len == 64
    with pytest.raises(ModelLoadError):
        ModelRunner(model_dir, block_size=8, device="cpu")
    with pytest.raises(ModelLoadError):
        ModelRunner(model_dir, block_size=8, num_blocks=4, kv_memory_bytes=10, device="cpu")
    with pytest.raises(ModelLoadError):
        ModelRunner(model_dir, block_size=8, num_blocks=4, max_model_len=65, device="cpu")
    with pytest.raises(ModelLoadError):
        ModelRunner(model_dir, block_size=8, num_blocks=4, device="tpu:7")
    capped = ModelRunner(model_dir, block_size=8, num_blocks=4, max_model_len=16, device="cpu")
    with pytest.raises(ContextTooLong):
        capped.execute([SeqWork("x", _prompt(17), 0, [0, 1, 2])])


def test_profile_records_a_phase_split(runner: ModelRunner) -> None:
    runner.profile = True
    runner.execute([SeqWork("a", _prompt(12), 0, [0, 1, 2], GREEDY), SeqWork("b", [5], 0, [3], GREEDY)])
    t = runner.last_timings
    assert t is not None
    assert min(t.prepare_s, t.dense_s, t.attention_s, t.sample_s) > 0
    assert t.prepare_s + t.dense_s + t.attention_s + t.sample_s <= t.total_s


def test_fused_cpu_attention_equals_the_per_kernel_path(model_dir: Path) -> None:
    """The CPU step kernel (one call per layer) runs the generic kernels' arithmetic: a mixed
    schedule (chunked prefills, a shared prefix, decodes joining mid-way) gives the same tokens,
    logprobs and KV pool bytes as the per-kernel write / decode / prefill calls."""
    results = []
    with_logprobs = SamplingParams(temperature=0.0, logprobs=3)
    for fused in (True, False):
        runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=60, device="cpu")
        runner.fused_cpu_attention = fused
        requests = [
            Request(_prompt(23, 1), 9, chunk_size=7, sample=with_logprobs),
            Request(_prompt(23, 1)[:16] + _prompt(5, 2), 6, admit_step=4, share_from=0, shared_blocks=4),
            Request(_prompt(3, 3), 12, admit_step=1),
            Request(_prompt(30, 4), 5, admit_step=2, sample=SamplingParams(temperature=0.8, seed=11, logprobs=2)),
        ]
        tokens = run_schedule(runner, requests, seed=5)
        results.append((tokens, [r.logprobs for r in requests], _snapshot(runner)))
    (tokens_a, logprobs_a, pool_a), (tokens_b, logprobs_b, pool_b) = results
    assert tokens_a == tokens_b and logprobs_a == logprobs_b
    assert all(torch.equal(a, b) for a, b in zip(pool_a, pool_b))
