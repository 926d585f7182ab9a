"""bench/gpu_check: arguments, the no-GPU exit, the phase table, the pure parts of every phase
(sizes, tables, floors, the random model), and the whole script on the CPU (--cpu-smoke)."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _load_bench(name: str = "gpu_check"):
    """A bench module by its top-level name (bench/ on sys.path, as gpu_check.py puts it)."""
    bench = str(REPO / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(name)


def test_out_is_required(capsys) -> None:
    gpu_check = _load_bench()
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args([])
    assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err
    args = gpu_check.parse_args(["--out", "x", "--deadline-s", "100", "--max-reps", "7",
                                 "--skip", "engine_8b"])
    assert args.out == Path("x") and args.deadline_s == 100 and args.max_reps == 7
    assert args.skip == "engine_8b" and not args.cpu_smoke
    assert gpu_check.parse_args(["--out", "x"]).deadline_s == gpu_check.DEFAULT_DEADLINE_S


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the real check applies")
def test_script_exits_clearly_without_gpu(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), str(tmp_path / "r")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    # the wrapper merges the script's stderr into its (tee'd) stdout
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU visible" in proc.stdout + proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the real check applies")
def test_main_returns_no_gpu_status(tmp_path: Path, capsys) -> None:
    assert _load_bench().main(["--out", str(tmp_path / "r")]) == 2
    assert "no CUDA GPU visible" in capsys.readouterr().err


def test_wrapper_requires_results_dir() -> None:
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode == 64 and "usage" in proc.stderr


def test_wrapper_refuses_wheels_it_cannot_install(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable, WHEELS_DIR=str(tmp_path / "none"))
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), str(tmp_path / "r")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 3 and "installing" in proc.stderr
    assert not (tmp_path / "r").exists()


def _phases():
    gpu_check = _load_bench()
    args = gpu_check.parse_args(["--out", "unused", "--cpu-smoke"])
    return gpu_check.build_phases(args, torch, "cpu", {})


def test_the_docstring_budget_table_is_the_phase_table() -> None:
    """Budgets and skip thresholds in gpu_check.py's docstring are the ones the run uses, in
    its order, and the estimates fit the 5-minute command (review §4.3; issue 43 item 4)."""
    gpu_check = _load_bench()
    table = [line.split("|")[1:-1] for line in gpu_check.__doc__.splitlines()
             if re.match(r"\| \d+ \|", line)]
    args = gpu_check.parse_args(["--out", "unused"])
    phases = gpu_check.build_phases(args, torch, "cpu", {})
    assert [cells[1].strip() for cells in table] == [p.name for p in phases]

    def seconds(cell: str) -> float:
        return float(cell.strip().removesuffix(" s")) if cell.strip() != "-" else 0.0

    for cells, phase in zip(table, phases, strict=True):
        assert seconds(cells[5]) == phase.budget_s, phase.name
        assert seconds(cells[6]) == phase.min_s, phase.name
        assert phase.min_s <= phase.budget_s
    estimates = [seconds(cells[4]) for cells in table]
    assert sum(estimates[:-1]) <= gpu_check.DEFAULT_DEADLINE_S < 300  # all but engine_8b
    assert [p.name for p in phases if p.gate] == ["correctness", "million"]


def test_select_phases_keeps_the_order_and_refuses_unknown_names() -> None:
    gpu_check = _load_bench()
    phases = _phases()
    names = [p.name for p in gpu_check.select(phases, "prefill,setup", "")]
    assert names == ["setup", "prefill"]
    assert "engine_8b" not in [p.name for p in gpu_check.select(phases, "", "engine_8b")]
    with pytest.raises(SystemExit, match="unknown phase"):
        gpu_check.select(phases, "decod", "")


def test_jit_variants_cover_what_the_timing_phases_launch() -> None:
    variants = _load_bench().jit_variants(smoke=False)
    assert len(variants) == len(set(variants)) == 18
    for kind, head_dim in (("f16", 128), ("bf16", 128), ("f16", 64), ("bf16", 64)):
        for mode in ("decode", "split", "prefill"):
            assert (mode, kind, head_dim, 16) in variants
    assert {b for m, k, d, b in variants} == {8, 16, 32, 64}


def test_decode_grid_and_ragged_batch() -> None:
    sizes = _load_bench("gpu_sizes")
    grid = sizes.decode_grid(sizes.FULL)
    assert len(grid) == 12 and (64, 32768) in grid and (1, 512) in grid
    # B=256 stops at 8192: its 32768 cell would need 34 GB of paged K/V plus SDPA's copy
    assert [c for b, c in grid if b == 256] == [512, 4096, 8192]
    lens = sizes.ragged_lengths(sizes.FULL)
    assert len(lens) == 65 and lens[-1] == 131072
    assert all(256 <= n <= 32768 for n in lens[:-1]) and len(set(lens)) > 40
    assert lens == sizes.ragged_lengths(sizes.FULL)  # seeded: one run's batch is the next's


def test_decode_tables_and_bytes() -> None:
    dec = _load_bench("gpu_check_decode")
    # fp16, 8 KV heads x 128: 4096 bytes of K + V per token
    assert dec.kv_bytes([512, 1000], 8, 128, "float16") == 1512 * 4096
    assert dec.kv_bytes([10], 8, 64, "float32") == 10 * 8 * 64 * 2 * 4
    assert dec.num_sets(kv=10 << 20, l2_bytes=50 << 20, factor=4) == 20
    assert dec.num_sets(kv=1, l2_bytes=50 << 20, factor=4) == 32
    assert dec.num_sets(kv=8 << 30, l2_bytes=50 << 20, factor=4) == 1
    order = list(range(100))
    tables = dec.table_rows([20, 5], block_size=8, sets=2, order=order)
    assert tables[0] == [[0, 1, 2], [3, 0, 0]] and tables[1] == [[4, 5, 6], [7, 0, 0]]
    shuffled = list(reversed(range(8)))
    used = [b for s in dec.table_rows([20, 5], 8, 2, shuffled) for row in s for b in row[:3]]
    assert sorted(set(used) - {0}) == list(range(1, 8))  # disjoint sets, every block once
    with pytest.raises(ValueError):
        dec.table_rows([20, 5], 8, 3, order[:8])


def test_float64_reference_rows() -> None:
    dec = _load_bench("gpu_check_decode")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen) for s in ((3, 8), (50, 8), (50, 8)))
    ref = dec.reference_rows(torch, q, k, v, 0.5)
    expected = torch.softmax(q.double() @ k.double().T * 0.5, dim=-1) @ v.double()
    assert ref.dtype == torch.float64 and torch.allclose(ref, expected)


def test_model_shapes_and_the_floor() -> None:
    gm = _load_bench("gpu_model")
    one_b = gm.LLAMA_1B
    per_layer = 2048 * 2048 * 2 + 2 * 512 * 2048 + 3 * 2048 * 8192 + 2 * 2048
    assert one_b.num_params() == 16 * per_layer + 2 * 32000 * 2048 + 2048
    assert 1.0e9 < one_b.num_params() < 1.3e9
    # a step reads everything but the embedding table (only one row per sequence is gathered)
    assert one_b.weight_bytes_per_step() == 2 * (one_b.num_params() - 32000 * 2048)
    assert one_b.kv_bytes_per_token() == 16 * 2 * 8 * 64 * 2  # 32 KiB
    eight = gm.LLAMA_8B_LAYERS
    assert (eight.head_dim, eight.hidden, eight.intermediate) == (128, 4096, 14336)
    assert eight.kv_bytes_per_token() == 4 * 2 * 8 * 128 * 2
    # 4000 GB/s = 4e3 bytes per ns = 4e6 bytes per µs
    weights = one_b.weight_bytes_per_step()
    assert gm.step_floor_us(one_b, 4000.0, []) == pytest.approx(weights / 4e6)
    with_kv = gm.step_floor_us(one_b, 4000.0, [1000] * 64)
    assert with_kv == pytest.approx((weights + 64_000 * 32768) / 4e6)
    tied = gm.ModelShape("t", 1, 64, 4, 2, 16, 128, 300, tie_embeddings=True)
    assert "lm_head.weight" not in tied.weight_shapes()
    assert tied.weight_bytes_per_step("float32") == 4 * tied.num_params()


def test_random_model_loads_in_transformers_with_every_weight(tmp_path: Path) -> None:
    """The directory the engine phase builds is a complete checkpoint: transformers finds the
    shape in its config and every parameter in the safetensors (none missing, none unused)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    gm = _load_bench("gpu_model")
    shape = gm.SMOKE_MODEL
    out = gm.build_random_model(tmp_path / "m", shape, "cpu")
    config = AutoConfig.from_pretrained(out)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size,
            config.vocab_size) == (shape.num_layers, shape.hidden, shape.heads, shape.kv_heads,
                                   shape.head_dim, shape.intermediate, shape.vocab)
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert sum(p.numel() for p in model.parameters()) == shape.num_params()
    proj = model.model.layers[0].mlp.down_proj.weight.float()
    assert 0.5 < proj.std().item() * shape.intermediate ** 0.5 < 2.0  # N(0, 1/fan_in)
    requests = gm.workload(5, (3, 9), (2, 4), shape.vocab, seed=1)
    assert len(requests) == 5 and requests == gm.workload(5, (3, 9), (2, 4), shape.vocab, seed=1)
    assert all(3 <= len(p) <= 9 and 2 <= n <= 4 and min(p) >= 4 for p, n in requests)


def test_percentile_and_reps() -> None:
    eng = _load_bench("gpu_check_engine")
    assert eng.percentile([], 0.5) is None
    assert eng.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert eng.percentile([float(i) for i in range(101)], 0.99) == 99.0
    timing = _load_bench("gpu_timing")
    assert timing.reps_for(1000.0) == 20 and timing.reps_for(10.0) == 30
    assert timing.reps_for(1e7) == 5 and timing.reps_for(0.0) == 30
    assert timing.gbs(4e9, 1e6) == pytest.approx(4.0) and timing.gbs(1.0, None) is None


def test_time_call_on_the_cpu_counts_every_call() -> None:
    """Warm-up, the timed repetitions and the back-to-back loop each call fn; on the CPU the
    spin cannot run, so no number claims to be kernel-only."""
    timing = _load_bench("gpu_timing")
    seen = []
    times = timing.time_call(timing.Timer(torch, "cpu"), seen.append, reps=4, warmup=2,
                             b2b_calls=6)
    # warm-up, timed repetitions, back to back, then the synchronous latency calls
    assert seen == [0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert times.reps == 4 and not times.primed
    assert times.kernel_us >= 0 and times.back_to_back_us >= 0 and times.host_us >= 0
    assert times.latency_us >= 0
    assert set(times.as_row("x_")) == {"x_kernel_us", "x_b2b_us", "x_host_us", "x_latency_us",
                                       "x_primed"}


def test_a_compiling_first_call_does_not_set_a_long_spin() -> None:
    """The spin ahead of each timed call outlasts the host's launch (3x the last warm-up
    call, at least 1 ms) but a first call that compiled a kernel must not stretch it to
    seconds per repetition: it is capped."""
    timing = _load_bench("gpu_timing")

    class SpinTimer(timing.Timer):
        def __init__(self) -> None:
            super().__init__(torch, "cpu")
            self.spins: list[float] = []

        def can_spin(self) -> bool:
            return True

        def spin(self, us: float) -> None:
            self.spins.append(us)

    calls = []

    def fn(i: int) -> None:
        calls.append(i)
        if len(calls) == 1:
            import time

            time.sleep(0.05)  # the first call "compiles": 50 ms

    timer = SpinTimer()
    times = timing.time_call(timer, fn, reps=3, warmup=1, b2b_calls=2)
    assert timer.spins == [timing.MAX_SPIN_US] * 3 and times.primed
    assert times.host_us < 50_000  # the compile is not the path's host cost
    timer = SpinTimer()
    timing.time_call(timer, lambda i: None, reps=2, warmup=2)
    assert timer.spins == [1000.0, 1000.0]


def test_issue_targets_are_judged_from_the_rows() -> None:
    """Each target reads its own cells; a target whose cells are missing is "not measured",
    never met."""
    targets_mod = _load_bench("gpu_targets")
    rows = {
        "correctness": [{"check": "a", "ok": True}, {"check": "b", "ok": True}],
        "million": [{"what": "decode", "ok": True}],
        "prefill": [{"prefix": 0, "dtype": "float16", "head_dim": 128, "paged_vs_sdpa": 0.95},
                    {"prefix": 0, "dtype": "bfloat16", "head_dim": 128, "paged_vs_sdpa": 1.2},
                    {"prefix": 0, "dtype": "float16", "head_dim": 64, "paged_vs_sdpa": 9.0},
                    {"prefix": 32768, "q_len": 64, "dtype": "float16", "paged_vs_sdpa": 2.0}],
        "decode": [{"batch": 64, "context": 32768, "kv_mb": 8590.0, "graph_of_copy": 0.93,
                    "graph_speed_vs_sdpa": 1.02},
                   {"batch": 1, "context": 512, "kv_mb": 2.1, "graph_of_copy": 0.01},
                   {"batch": 16, "context": 32768, "kv_mb": 2147.0, "graph_of_copy": 0.85}],
        "engine_1b": [{"what": "batch-1 step at 1024", "vs_floor": 1.25},
                      {"what": "batch-64 step at 1024", "vs_floor": 1.6, "engine_share": 0.05},
                      {"what": "transformers", "ours_vs_hf_throughput": 3.4}],
    }
    got = {t["target"]: (t["measured"], t["met"]) for t in targets_mod.judge(rows)}
    assert got["correctness: every check within tolerance, repeats bitwise equal"] == ("3/3", True)
    assert got["prefill 8k float16 d128: paged time / SDPA flash"] == ("0.95", True)
    assert got["prefill 8k bfloat16 d128: paged time / SDPA flash"] == ("1.20", False)
    assert got["prefill chunk 64 after 32k: speed / SDPA's"] == ("0.50", False)
    # the 2 MB cell does not count; the 2.1 GB one at 0.85 misses
    assert got["decode graph path / copy bandwidth, cells with K/V >= 256 MB"] == ("0.93, 0.85", False)
    assert got["decode B=64 x 32768 graph: speed / SDPA's"] == ("1.02", True)
    assert got["decode ragged batch, graph path / copy bandwidth"] == ("not measured", None)
    assert got["engine_1b: throughput / transformers'"] == ("3.40", True)
    assert got["engine_1b: batch-1 decode step / weights floor"] == ("1.25", True)
    assert got["engine_1b: batch-64 decode step / weights + K/V floor"] == ("1.60", False)
    assert got["engine_1b: host (engine) share of a decode step"] == ("0.05", True)
    assert got["engine_8b: throughput / transformers'"] == ("not measured", None)
    text = "\n".join(targets_mod.lines(targets_mod.judge(rows)))
    assert "| decode B=64 x 32768 graph: speed / SDPA's | >= 1.0 | 1.02 | met |" in text
    assert "| 1.20 | **not met** |" in text
    empty = targets_mod.judge({})
    assert all(t["met"] is None and t["measured"] == "not measured" for t in empty)


def test_prefill_cpu_parts() -> None:
    """Chunking and the causal FLOP count of the prefill timing."""
    gp = _load_bench("gpu_check_prefill")
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


def test_a_crashing_check_group_is_a_failed_check() -> None:
    """An exception inside a group of checks is recorded as a failure (exit status 1), so
    one broken variant cannot hide the others' results."""
    checks = _load_bench("gpu_check_correct").Checks()
    checks.record("fine", 0.0, 1e-3)

    def boom() -> None:
        raise RuntimeError("no kernel image")

    checks.guarded("decode", boom)
    assert [c["ok"] for c in checks.results] == [True, False]
    assert "decode: RuntimeError: no kernel image" in checks.results[1]["check"]


def test_render_lists_failures_and_rows() -> None:
    gpu_check = _load_bench()
    gr = _load_bench("gpu_run")
    result = gr.PhaseResult("correctness", "done", 3.0, [{"check": "a", "ok": False}],
                            ["a"], ["b: RuntimeError: x"], True)
    text = "\n".join(gpu_check.render(result))
    assert "## correctness — done (3.0 s)" in text
    assert "- a" in text and "- b: RuntimeError: x" in text and "| a | False |" in text


def _smoke(out: Path, *options: str) -> tuple[list[dict], dict[str, dict]]:
    """Run bench/gpu_check.sh --cpu-smoke; (its result rows, its phases' end records)."""
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), str(out), "--cpu-smoke",
                           *options], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    ends = {r["phase"]: r for r in records if r.get("event") == "end"}
    assert all(e["status"] == "done" and e["num_errors"] == 0 for e in ends.values()), ends
    summary = json.loads((out / "gpu_check.json").read_text())
    assert [p["name"] for p in summary["phases"]] == list(ends)
    assert len(summary["targets"]) == 15 and "## Issue 43 targets" in (out / "gpu_check.md").read_text()
    assert f"phase {list(ends)[-1]}: done" in (out / "gpu_check.log").read_text()
    return [r for r in records if r.get("event") == "row"], ends


def test_cpu_smoke_runs_every_kernel_phase(tmp_path: Path) -> None:
    """The script end to end on the CPU (tiny sizes, launches stubbed in Numba's simulator),
    as the GPU run will walk it: every phase ends without a cell raising, and the results are
    in all three files. The engine phases are the next test (slow: transformers and the
    engine take longer than the rest together)."""
    rows, ends = _smoke(tmp_path / "r", "--skip", "engine_1b,engine_8b")
    assert not [(r.get("cell"), k) for r in rows for k in r if k.endswith("_error")]
    assert list(ends) == ["setup", "jit", "correctness", "decode", "decode_ab", "million",
                          "prefill", "host", "step_graph", "prefill_ab"]
    cells = {(r["phase"], r.get("cell")) for r in rows}
    for cell in (("decode", "B=4 ctx=256"), ("decode_ab", "ragged"), ("decode_ab", "block 8 B=2 ctx=128"),
                 ("decode_ab", "paging identity B=4 ctx=256"), ("million", "1M decode"),
                 ("million", "1M prefill chunk"), ("prefill", "prompt 32 bfloat16 d64"),
                 ("prefill", "chunk 16 after 128 B=1"), ("host", "DecodeGraphs.run (copy q + replay)"),
                 ("step_graph", "teacher-forced steps"), ("step_graph", "step time B=1")):
        assert cell in cells, cell
    decode = next(r for r in rows if r.get("cell") == "B=4 ctx=256")
    for key in ("direct_kernel_us", "direct_b2b_us", "direct_host_us", "graph_kernel_us",
                "sdpa_kernel_us", "graph_of_copy", "graph_speed_vs_sdpa"):
        assert key in decode, key
    assert "## decode_ab — done" in (tmp_path / "r" / "gpu_check.md").read_text()


def test_a_killed_run_keeps_every_finished_phase(tmp_path: Path) -> None:
    """SIGTERM (what the wrapper's time limit sends) in the middle of a phase: exit 124, a
    `killed` line, the finished phases' summary intact, the running phase's start on disk."""
    import signal
    import time

    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    out = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--out", str(out),
                             "--cpu-smoke", "--phases", "setup,decode,engine_1b"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = out / "gpu_check.jsonl"
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if log.exists() and '"phase": "engine_1b", "event": "start"' in log.read_text():
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 124
    finally:
        if proc.poll() is None:
            proc.kill()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[-1]["event"] == "killed" and records[-1]["phases_done"] == ["setup", "decode"]
    assert not any(r.get("phase") == "engine_1b" and r.get("event") == "end" for r in records)
    summary = json.loads((out / "gpu_check.json").read_text())
    assert [p["name"] for p in summary["phases"]] == ["setup", "decode"]
    assert len(summary["phases"][1]["rows"]) == 4


@pytest.mark.slow
def test_cpu_smoke_prefill_versions(tmp_path: Path) -> None:
    """Two prepared kernel versions (HEAD's kernels/, twice) and this tree, each timed in its
    own process, as the GPU run's prefill_ab phase does."""
    ab = _load_bench("gpu_check_prefill_ab")
    dest = tmp_path / "ab"
    paths = ab.prepare(["HEAD", "HEAD"], dest)
    assert [p.name for p in paths] == ["01-HEAD", "02-HEAD"]
    assert (paths[0] / "kernels" / "cuda" / "prefill.py").is_file()
    assert [label for label, _ in ab.versions(dest)] == ["01-HEAD", "02-HEAD", ab.TREE]
    rows, ends = _smoke(tmp_path / "r", "--phases", "prefill_ab", "--prefill-ab", str(dest))
    timed = [r for r in rows if r.get("version")]
    assert [r["version"] for r in timed] == ["01-HEAD", "02-HEAD", ab.TREE]
    assert all(r["paged_kernel_us"] >= 0 and r["tokens"] == 32 for r in timed)
    assert "speed vs the first version" in rows[-1]["note"]


@pytest.mark.slow
def test_cpu_smoke_engine_phases(tmp_path: Path) -> None:
    """The engine phases on the CPU with a tiny model: ours, transformers, the floors."""
    rows, ends = _smoke(tmp_path / "r", "--phases", "setup,engine_1b,engine_8b")
    assert list(ends) == ["setup", "engine_1b", "engine_8b"]
    engine = {r["cell"]: r for r in rows if r["phase"] == "engine_1b"}
    assert list(engine) == ["start-up", "serve", "batch-1 step", "big-batch step", "transformers"]
    assert engine["serve"]["requests_done"] == 3 and engine["serve"]["tokens_per_s"] > 0
    assert engine["transformers"]["ours_vs_hf_throughput"] > 0
    assert engine["big-batch step"]["floor_ms"] > 0 and engine["batch-1 step"]["vs_floor"] > 0


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
