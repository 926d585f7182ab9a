"""The vLLM comparison's own logic, without vLLM: both sides get identical workloads, tokens are
counted from the outputs (a short output is an error, not a faster run), the report's ratios and
identity counts, and the file vLLM's venv runs imports nothing of pagedkv's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_vs_vllm as bvv  # noqa: E402
import roofline as rl  # noqa: E402
import vllm_workloads as wl  # noqa: E402


@pytest.mark.parametrize("name", sorted(wl.WORKLOADS))
def test_a_workload_is_the_same_for_both_sides_and_new_each_repeat(name: str) -> None:
    a, b = wl.make_workload(name, 0, 1000), wl.make_workload(name, 0, 1000)
    assert a == b
    assert a != wl.make_workload(name, 1, 1000)   # a repeat never hits the previous one's cache
    for prompt, n in a:
        assert n > 0 and prompt and all(wl.FIRST_ID <= t < 1000 for t in prompt)


def test_workload_shapes() -> None:
    batch = wl.make_workload("batch", 0, 500)
    assert len(batch) == 32 and all(16 <= len(p) <= 512 and n == 64 for p, n in batch)
    shared = wl.make_workload("shared", 0, 500)
    assert len(shared) == 24 and len({tuple(p[:256]) for p, _ in shared}) == 1
    assert all(16 <= len(p) - 256 <= 64 and n == 64 for p, n in shared)
    assert [(len(p), n) for p, n in wl.make_workload("single", 0, 500)] == [(128, 128)]
    assert all(1024 <= len(p) <= 2048 for p, _ in wl.make_workload("long", 0, 500))
    with pytest.raises(ValueError, match="unknown workload"):
        wl.make_workload("nope", 0, 500)


def test_summary_counts_generated_tokens_and_refuses_short_outputs() -> None:
    reqs = [([5, 6], 3), ([7], 2)]
    run = wl.RunResult(seconds=2.0, ttft_s=[0.5, 1.5], outputs=[[1, 2, 3], [4, 5]])
    s = wl.summarize(reqs, run)
    assert s["output_tokens"] == 5 and s["tok_per_s"] == 2.5
    assert s["ttft_p50_s"] == 1.0 and s["ttft_max_s"] == 1.5
    with pytest.raises(ValueError, match="asked for 2 tokens and got 1"):
        wl.summarize(reqs, wl.RunResult(2.0, [0.5, 1.5], [[1, 2, 3], [4]]))
    with pytest.raises(ValueError, match="1 outputs for 2 requests"):
        wl.summarize(reqs, wl.RunResult(2.0, [0.5], [[1, 2, 3]]))


def test_output_comparison() -> None:
    assert wl.compare_outputs([[1, 2], [3]], [[1, 2], [4]]) == (1, 2)
    assert wl.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert wl.first_divergence([1, 2], [1, 2]) is None
    assert wl.first_divergence([1, 2], [1, 2, 3]) == 2


def _run(tok_per_s: float, outputs: list[list[int]]) -> dict:
    summary = {"tok_per_s": tok_per_s, "ttft_p50_s": 1.0}
    return {"results": {"shared": {"summary": summary, "outputs": outputs}}, "peak_rss_mib": 100.0}


def test_report_takes_the_best_vllm_mode_and_counts_identical_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    runs = {
        "ours": [_run(120.0, [[1, 2], [3]]), _run(100.0, [[1, 2], [3]])],
        "eager": [_run(80.0, [[1, 2], [3]]), _run(90.0, [[1, 2], [3]])],
        "compiled": [_run(100.0, [[1, 2], [9]]), _run(100.0, [[1, 2], [3]])],
    }
    (row,) = bvv.report("shape", ["shared"], ["ours", "eager", "compiled"], runs)
    assert row["tok_per_s"] == {"ours": 110.0, "eager": 85.0, "compiled": 100.0}   # medians over repeats
    assert row["ratio"] == pytest.approx(1.1)                                      # ÷ the best vLLM mode
    assert row["identical"] == [7, 8]
    assert "| shared | 110.0 | 85.0 | 100.0 | 1.10x |" in capsys.readouterr().out


def test_report_gives_each_side_its_share_of_the_roofline(capsys: pytest.CaptureFixture[str]) -> None:
    runs = {"ours": [_run(60.0, [[1]])], "compiled": [_run(40.0, [[1]])]}
    machine = rl.Machine(peak_flops=100e9, read_bytes_per_s=20e9)
    (row,) = bvv.report("smollm-135m", ["shared"], ["ours", "compiled"], runs, machine)
    roof = rl.roofline_tok_per_s(wl.SHAPES["smollm-135m"], wl.make_workload("shared", 0, 49152), machine)
    assert row["roofline_tok_per_s"] == pytest.approx(roof)
    assert f"| {roof:.1f} | {60 / roof:.2f} | {40 / roof:.2f} |" in capsys.readouterr().out


TINY = wl.Shape("tiny", "llama", num_layers=2, hidden_size=4, num_heads=2, num_kv_heads=1, head_dim=2,
                intermediate_size=8, vocab_size=10, tie_word_embeddings=True)
# per layer q 4x4, k and v 4x2 each, o 4x4, gate/up/down 3 x 4x8 -> 144; two layers; head 4x10
TINY_DENSE, TINY_HEAD = 2 * 144, 40
TINY_ATTN = 4 * 2 * 2 * 2        # QK^T and PV, 2 multiply-adds each, per key: layers x heads x head_dim


def test_roofline_counts_a_shared_prefix_once() -> None:
    assert rl.trie_positions([[1, 2, 3], [1, 2, 4], [5]]) == [1, 2, 3, 3, 1]
    shared = rl.count_work(TINY, [([1, 2, 3], 1), ([1, 2, 4], 1)])
    alone = rl.count_work(TINY, [([1, 2, 3], 1), ([6, 7, 4], 1)])
    # positions 1 and 2 are computed once when the prompts share them
    assert alone.prefill_flops - shared.prefill_flops == 2 * TINY_DENSE * 2 + TINY_ATTN * (1 + 2)
    # one position: its matmuls, attention over one key; the LM head once per request
    assert rl.count_work(TINY, [([3], 1)]).prefill_flops == 2 * TINY_DENSE + TINY_ATTN + 2 * TINY_HEAD
    assert shared.decode_steps == () and shared.output_tokens == 2


def test_roofline_decode_steps_follow_the_requests_that_still_run() -> None:
    work = rl.count_work(TINY, [([1, 2], 3), ([1, 5], 2)])
    assert [s.rows for s in work.decode_steps] == [2, 1]      # a request's first token is its prefill's
    first = work.decode_steps[0]
    # both rows: weights and the LM head, attention over their contexts (2 + 1 keys each)
    assert first.flops == 2 * (2 * (TINY_DENSE + TINY_HEAD) + TINY_ATTN * 3)
    # weights once; K/V of the distinct positions: prompts' trie (1, 2, 2) + one generated each
    kv_per_pos = 2 * 2 * 1 * 2 * 4
    assert first.bytes_read == (TINY_DENSE + TINY_HEAD) * 4 + (3 + 2) * kv_per_pos
    fast_memory = rl.Machine(peak_flops=1e3, read_bytes_per_s=1e12)     # every step compute-bound
    assert rl.roofline_seconds(work, fast_memory) == pytest.approx(
        (work.prefill_flops + sum(s.flops for s in work.decode_steps)) / 1e3)
    slow_memory = rl.Machine(peak_flops=1e15, read_bytes_per_s=1.0)     # decode memory-bound
    assert rl.roofline_seconds(work, slow_memory) == pytest.approx(
        work.prefill_flops / 1e15 + sum(s.bytes_read for s in work.decode_steps))


def test_the_worker_file_imports_nothing_of_pagedkv() -> None:
    """vLLM's venv runs bench_vs_vllm.py as its worker: importing it may load only the
    standard library and vllm_workloads (pagedkv and torch come in only on our side)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_vs_vllm; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'numpy', 'engine', 'compute_node', 'block_manager', 'kernels', 'pagedkv')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-I", "-c", code, str(BENCH)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_driver_refuses_unknown_workloads_and_modes() -> None:
    with pytest.raises(SystemExit):
        bvv.main(["--vllm-python", "", "--workloads", "nope"])
    with pytest.raises(SystemExit):
        bvv.main(["--vllm-python", "python3", "--vllm-modes", "fast"])


def test_step_loop_times_first_tokens_and_collects_outputs() -> None:
    """Both sides' step loop: TTFT is the first output that carries a token for a request
    (an output without one, a prefill chunk, does not count); outputs in the given order."""
    from types import SimpleNamespace as NS

    def out(rid: str, tokens: list[int], finished: bool = False) -> NS:
        return NS(request_id=rid, outputs=[NS(token_ids=tokens)], finished=finished)

    script = [[out("a", [])], [out("a", [7]), out("b", [])], [out("b", [3], True)], [out("a", [7, 8], True)]]

    class Engine:
        def has_unfinished_requests(self) -> bool:
            return bool(script)

        def step(self) -> list:
            return script.pop(0)

    run = bvv.step_loop(Engine(), ["b", "a"], started=0.0)
    assert run.outputs == [[3], [7, 8]]
    assert run.ttft_s[1] <= run.ttft_s[0] <= run.seconds   # a's first token came a step before b's


# ---- where the time goes: py-spy samples sorted into categories (bench/profile_split.py) ----

import profile_split as ps  # noqa: E402

_OURS = ("process 1:\"python bench_vs_vllm.py worker\";Thread.run (threading.py:982);"
         "ModelRunner.run_step (compute_node/model/runner.py:170);"
         "DecoderModel.forward (compute_node/model/model.py:{})")
_VLLM = ("process 1:\"python w\";process 2:\"VLLM::EngineCore\";process 3:\"VLLM::Worker\";"
         "Worker.execute_model (vllm/v1/worker/gpu_worker.py:1);Runner.call ({}.py:{})")


def test_profile_split_charges_a_sample_to_the_work_not_the_dispatch(tmp_path: Path) -> None:
    inductor = "c" + "a" * 50
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / f"{inductor}.py").write_text(
        "x\n        cpp_fused_add_mean_mul_pow_rsqrt_1(buf0)\n        buf2 = torch.ops.mkldnn._linear_pointwise(a, b)\n"
        "        torch.ops.vllm.unified_attention(q)\n        buf3 = reinterpret_tensor(buf2)\n")
    samples = [
        _OURS.format(169) + ";linear (compute_node/model/linear.py:82);"
        "OpOverloadPacket.__call__ (torch/_ops.py:1279);0x7f (?) 7",
        _OURS.format(166) + ";paged_attention (compute_node/model/attention.py:88) 2",
        _OURS.format(163) + ";DecoderModel._add_norm (compute_node/model/model.py:214) 1",
        "process 1:\"python w\";ModelRunner.run_step (compute_node/model/runner.py:173);DecoderModel.logits "
        "(compute_node/model/model.py:251);linear (compute_node/model/linear.py:82) 3",
        "process 1:\"python w\";LLMEngine.step (engine/llm_engine.py:235);Scheduler.plan (engine/planning.py:51) 4",
        _VLLM.format(inductor, 2) + ";kernel (c" + "b" * 50 + ".main.cpp:96);_mm256_mul_ps (avxintrin.h:320) 5",
        _VLLM.format(inductor, 3) + ";OpOverload.__call__ (torch/_ops.py:875) 6",
        _VLLM.format(inductor, 4) + ";cpu_attention::AttentionMainLoop (cpu_attn_impl.hpp:1624);"
        "std::__atomic_base<int>::load (atomic_base.h:501) 8",
        _VLLM.format(inductor, 5) + ";OpOverload.__call__ (torch/_ops.py:875) 1",   # glue: its caller decides
        "process 1:\"python w\";process 2:\"VLLM::EngineCore\";busy_loop (vllm/v1/engine/core.py:1);"
        "sched_yield (vllm/distributed/utils.py:46) 9",
    ]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "compiled-shared.txt").write_text("\n".join(samples) + "\n")
    out = ps.split(tmp_path / "run" / "compiled-shared.txt", ps.SourceLines([tmp_path / "src"]))
    assert dict(out["main"]) == {"dense": 7, "attention": 2, "elementwise": 1, "lm head + sampler": 3,
                                 "engine + other": 4}
    assert dict(out["VLLM::Worker"]) == {"elementwise": 5, "dense": 6, "attention": 8, "engine + other": 1}
    assert dict(out["VLLM::EngineCore"]) == {"waiting": 9}
    text = ps.table({"run/compiled-shared.txt": out})
    assert "| run/compiled-shared.txt | VLLM::EngineCore | 9 | 0% | 0% | 0% | 0% | 0% | 100% |" in text


def test_profile_split_counts_a_compile_on_the_clock_apart(tmp_path: Path) -> None:
    (tmp_path / "ours-shared.txt").write_text(
        _OURS.format(166) + ";paged_attention (compute_node/model/attention.py:88);"
        "CompilerBase._compile_core (numba/core/compiler.py:473);_call_function_pointer (callproc.c:943) 5\n"
        + _OURS.format(166) + ";paged_attention (compute_node/model/attention.py:88) 5\n")
    assert dict(ps.split(tmp_path / "ours-shared.txt")["main"]) == {"JIT compile": 5, "attention": 5}
