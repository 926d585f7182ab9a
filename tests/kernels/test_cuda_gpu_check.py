"""bench/gpu_check: argument parsing, the no-GPU exit, and the report it writes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _load_bench(name: str = "gpu_check"):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_out_is_required(capsys) -> None:
    gpu_check = _load_bench()
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args([])
    assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err
    args = gpu_check.parse_args(["--out", "x", "--block-sizes", "16,32", "--max-reps", "7"])
    assert args.out == Path("x") and args.block_sizes == "16,32" and args.max_reps == 7


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the real check applies")
def test_script_exits_clearly_without_gpu(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), str(tmp_path / "r")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU visible" in proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the real check applies")
def test_main_returns_no_gpu_status(tmp_path: Path, capsys) -> None:
    assert _load_bench().main(["--out", str(tmp_path / "r")]) == 2
    assert "no CUDA GPU visible" in capsys.readouterr().err


def test_wrapper_requires_results_dir() -> None:
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode == 64 and "usage" in proc.stderr


def test_report_files(tmp_path: Path) -> None:
    gpu_check = _load_bench()
    checks = [{"check": "decode fp16", "error": 1e-4, "tolerance": 1e-3, "ok": True},
              {"check": "prefill bf16", "error": float("inf"), "tolerance": 8e-3, "ok": False}]
    base = {"block_size": 16, "batch": 1, "context": 512, "path": "one-pass", "reps": 50,
            "kv_sets": 32, "kv_mb": 2.1, "paged_us": 10.0, "paged_gbs": 210.0,
            "copy_gbs": 4000.0, "ratio_to_copy": 0.05, "sdpa_us": 20.0, "sdpa_gbs": 105.0,
            "speed_vs_sdpa": 2.0, "graph_us": None, "graph_ratio_to_copy": None}
    rows = [base, {**base, "batch": 64, "context": 4096, "graph_us": 55.0,
                   "graph_ratio_to_copy": 0.85}]
    host = {"public API (validation + dispatch)": 31.4, "DecodeGraphs.run (copy q + replay)": 9.0}
    import gpu_check_prefill  # importable once gpu_check is loaded (its sibling)

    prefill = [gpu_check_prefill.prefill_row(0.8, 0.7, 4.0)]
    gpu_check.write_report(tmp_path, "Test GPU", checks, 4000.0, rows, 12.0, host,
                           prefill=prefill)
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| 8192 | 0.800 |" in md and "| 0.700 | 1.14 | 512 | 4.000 | 2048000 |" in md
    assert "| decode fp16 | 1.00e-04 | 1e-03 | yes |" in md
    assert "| prefill bf16 | inf | 8e-03 | **NO** |" in md
    assert "| 16 | 1 | 512 | one-pass | 10.0 | 210 | 0.05 | 20.0 | 105 | 2.00 | - | - |" in md
    assert "| 16 | 64 | 4096 | one-pass | 10.0 | 210 | 0.05 | 20.0 | 105 | 2.00 | 55.0 | 0.85 |" in md
    assert "| DecodeGraphs.run (copy q + replay) | 9.0 |" in md
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["device"] == "Test GPU" and data["decode"][0]["paged_gbs"] == 210.0
    assert data["checks"][1]["error"] is None  # strict JSON for a non-finite error
    assert data["host_path_us"]["public API (validation + dispatch)"] == 31.4
    assert data["prefill"][0]["ratio_vs_sdpa"] == pytest.approx(0.8 / 0.7)


def test_prefill_cpu_parts() -> None:
    """Chunking, the causal FLOP count and the report row of the prefill timing."""
    _load_bench()
    import gpu_check_prefill as gp

    assert gp.chunk_bounds(1100, 512) == [(0, 512), (512, 1024), (1024, 1100)]
    assert gp.chunk_bounds(0, 512) == []
    with pytest.raises(ValueError):
        gp.chunk_bounds(10, 0)
    # 3 tokens, no prefix: 1 + 2 + 3 = 6 (query, key) pairs x 4 FLOP x heads x head_dim
    assert gp.causal_flops(3, 2, 8) == 6 * 4 * 2 * 8
    assert gp.causal_flops(2, 1, 1, prefix=5) == 4 * (10 + 3)
    # chunks of a prompt add up to the whole prompt's pairs
    whole = gp.causal_flops(1100, 4, 64)
    parts = sum(gp.causal_flops(e - b, 4, 64, prefix=b) for b, e in gp.chunk_bounds(1100, 512))
    assert parts == pytest.approx(whole)
    row = gp.prefill_row(2.0, None, 10.0, prompt=4096, chunk=256)
    assert row["ratio_vs_sdpa"] is None and row["chunked_tokens_per_s"] == pytest.approx(409600)
    assert row["paged_tflops"] == pytest.approx(gp.causal_flops(4096, 32, 128) / 2e-3 / 1e12)
    assert "| 4096 | 2.000 |" in "\n".join(gp.prefill_lines([row]))


def test_a_crashing_check_group_is_a_failed_check() -> None:
    """An exception inside a group of checks is recorded as a failure (exit status 1), so
    one broken variant cannot hide the others' results."""
    checks = _load_bench().Checks()
    checks.record("fine", 0.0, 1e-3)

    def boom() -> None:
        raise RuntimeError("no kernel image")

    checks.guarded("decode", boom)
    assert [c["ok"] for c in checks.results] == [True, False]
    assert "decode: RuntimeError: no kernel image" in checks.results[1]["check"]


def test_judge_forced_allows_a_flip_only_at_a_near_tie() -> None:
    """The graph-vs-direct judgement of the model check: agreement, a near-tie flip, a clear
    flip, and a graph pick the direct path does not even rank in its top 2."""
    judge = _load_bench("gpu_check_graphs").judge_forced
    graph_tokens = [[7, 3]]
    graph_tops = [[[(7, -0.50), (2, -1.0)], [(3, -0.70), (4, -0.71)]]]
    same = judge(graph_tokens, graph_tops, [[[(7, -0.50), (2, -1.0)], [(3, -0.70), (4, -0.71)]]])
    assert same == {"worst_logprob_diff": 0.0, "flips": 0.0, "decisions": 2.0, "worst_flip_gap": 0.0}
    tie = judge(graph_tokens, graph_tops, [[[(7, -0.51), (2, -1.0)], [(4, -0.695), (3, -0.705)]]])
    assert tie["flips"] == 1 and tie["worst_flip_gap"] == pytest.approx(0.01)
    assert tie["worst_logprob_diff"] == pytest.approx(0.01)
    clear = judge(graph_tokens, graph_tops, [[[(7, -0.50), (2, -1.0)], [(4, -0.2), (3, -2.0)]]])
    assert clear["flips"] == 1 and clear["worst_flip_gap"] == pytest.approx(1.8)
    unranked = judge(graph_tokens, graph_tops, [[[(7, -0.50), (2, -1.0)], [(4, -0.2), (5, -0.3)]]])
    assert unranked["worst_logprob_diff"] == float("inf")


def test_forced_generation_feeds_the_given_tokens(monkeypatch, tmp_path: Path) -> None:
    """`_generate` on the CPU (no graphs there): a second run forced on the first run's tokens
    reproduces its picks and logprobs exactly, and one forced on other tokens does not, so the
    GPU check's comparison sees what it claims to."""
    from compute_node.model import ModelRunner
    from compute_node.model.tiny import build_tiny_model

    graphs_check = _load_bench("gpu_check_graphs")
    monkeypatch.setattr(graphs_check, "MODEL_STEPS", 4)
    monkeypatch.setattr(graphs_check, "_step_ms", lambda torch, fn: (fn(), 0.0)[1])
    model_dir = build_tiny_model(tmp_path / "m", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2,
                                 head_dim=16, intermediate_size=128, vocab_size=300)
    prompts, tables = [[5, 9, 11], [40, 41, 42, 43, 44, 45]], [[0, 1, 2], [3, 4, 5]]

    def run(forced):
        runner = ModelRunner(model_dir, block_size=4, num_blocks=6, device="cpu", max_model_len=24)
        return graphs_check._generate(torch, runner, prompts, tables, forced=forced)

    tokens, tops, _ = run(None)
    assert [len(t) for t in tokens] == [5, 5] and all(len(t) == 2 for step in tops for t in step)
    again = graphs_check.judge_forced(tokens, tops, run(tokens)[1])
    assert again["flips"] == 0 and again["worst_logprob_diff"] == 0.0 and again["decisions"] == 10
    other = [[(t + 1) % 300 for t in seq] for seq in tokens]
    moved = graphs_check.judge_forced(tokens, tops, run(other)[1])
    assert moved["worst_logprob_diff"] > 0.0
