"""The server comparison's own logic, without vLLM or guidellm installed: the guidellm command
follows the issue's recipe, its JSON report is read per concurrency level, short or failed
outputs are reported instead of counted as speed, each side's processes and its KV space."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_serve_vs_vllm as bsv  # noqa: E402


def _level(streams: int, tok_s: float, ok: int = 4, err: int = 0, out_tokens: float = 256.0) -> dict:
    """One benchmark of a guidellm 0.8 report, reduced to the keys the bench reads (values from
    a real run against pagedkv-serve)."""
    def dist(mean: float, p50: float, p99: float, total: float = 0.0) -> dict:
        return {"successful": {"mean": mean, "median": p50, "total_sum": total,
                               "percentiles": {"p50": p50, "p95": p99 * 0.9, "p99": p99}},
                "errored": {}, "incomplete": {}, "total": {}}

    return {"config": {"strategy": {"type_": "concurrent", "worker_count": streams, "streams": streams}},
            "metrics": {"request_totals": {"successful": ok, "errored": err, "incomplete": 0, "total": ok + err},
                        "output_tokens_per_second": dist(tok_s, 8.08, 36.7),
                        "time_to_first_token_ms": dist(1323.3, 1153.8, 1886.2),
                        "inter_token_latency_ms": dist(65.3, 55.9, 123.7),
                        "output_token_count": dist(64.0, 64.0, 64.0, out_tokens)}}


def test_report_is_read_per_concurrency_level_in_order() -> None:
    report = {"benchmarks": [_level(16, 30.5, ok=16, out_tokens=1024.0), _level(1, 9.25)]}
    levels = bsv.parse_guidellm(json.loads(json.dumps(report)))
    assert [lv.concurrency for lv in levels] == [1, 16]
    one = levels[0]
    assert (one.output_tok_per_s, one.completed, one.errored, one.output_tokens) == (9.25, 4, 0, 256)
    assert (one.ttft_p50_ms, one.ttft_p99_ms, one.itl_p50_ms, one.itl_p99_ms) == (1153.8, 1886.2, 55.9, 123.7)
    assert levels[1].output_tokens == 1024


def test_a_profile_other_than_concurrent_is_refused() -> None:
    level = _level(2, 10.0)
    level["config"]["strategy"]["type_"] = "synchronous"
    with pytest.raises(ValueError, match="concurrent"):
        bsv.parse_guidellm({"benchmarks": [level]})


def test_errors_missing_requests_and_short_outputs_are_problems() -> None:
    ds = bsv.DATASETS["random"]
    good = bsv.parse_guidellm({"benchmarks": [_level(4, 20.0, ok=16, out_tokens=16 * ds.output_tokens)]})
    assert bsv.count_problems(good, ds, 16) == []
    short = bsv.parse_guidellm({"benchmarks": [_level(4, 20.0, ok=16, out_tokens=16 * ds.output_tokens - 3)]})
    assert "expected 16 x 64" in bsv.count_problems(short, ds, 16)[0]
    failed = bsv.parse_guidellm({"benchmarks": [_level(4, 20.0, ok=14, err=2, out_tokens=14 * ds.output_tokens)]})
    problems = bsv.count_problems(failed, ds, 16)
    assert any("2 errored" in p for p in problems) and any("14/16 completed" in p for p in problems)


def test_guidellm_command_follows_the_recipe() -> None:
    cmd = bsv.guidellm_command("G/bin/guidellm", "http://127.0.0.1:9", "m", Path("/models/m"),
                               bsv.DATASETS["shared"], [1, 4, 16], 16, Path("/tmp/out.json"))
    args = dict(zip(cmd[2::2], cmd[3::2]))
    assert cmd[:2] == ["G/bin/guidellm", "run"]
    assert args["--backend"] == "kind=openai_http,target=http://127.0.0.1:9,model=m,request_format=/v1/completions"
    assert json.loads(args["--profile"]) == {"kind": "concurrent", "streams": [1, 4, 16]}
    assert args["--constraint"] == "kind=max_requests,count=16"
    assert args["--data"] == ("kind=synthetic_text,prompt_tokens=128,output_tokens=64,"
                              "prefix_tokens=512,prefix_count=4")
    assert args["--tokenizer"] == "kind=huggingface_auto,model=/models/m"
    assert bsv.DATASETS["random"].guidellm_data() == "kind=synthetic_text,prompt_tokens=256,output_tokens=64"


def test_every_side_gets_the_same_kv_space_and_ours_services_is_three_processes() -> None:
    model = Path("/models/smollm")
    (serve, ready), = bsv.server_commands("ours", model, "m", 8000, "", "smollm-135m")
    assert serve[serve.index("--kv-cache-memory") + 1] == f"{bsv.KV_GIB}GiB" and ready is None
    procs = bsv.server_commands("ours-services", model, "m", 8000, "", "smollm-135m")
    assert [p[0][0].rsplit("/", 1)[-1] for p in procs] == ["block-manager", "compute-node", "pagedkv-serve"]
    assert procs[0][1] is not None and procs[1][1] is not None and procs[2][1] is None
    node = procs[1][0]
    blocks = int(node[node.index("--num-blocks") + 1])
    # SmolLM-135M: 30 layers x (K and V) x 3 KV heads x 64 dims x 4 bytes = 46,080 bytes a token
    assert blocks == bsv.KV_GIB * 2**30 // (46_080 * bsv.BLOCK_SIZE)
    (eager, _), = bsv.server_commands("eager", model, "m", 8000, "V/bin/python", "smollm-135m")
    (compiled, _), = bsv.server_commands("compiled", model, "m", 8000, "V/bin/python", "smollm-135m")
    assert eager[:3] == ["V/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in eager and "--enforce-eager" not in compiled
    assert "--enable-prefix-caching" in compiled and compiled[compiled.index("--dtype") + 1] == "float32"


def test_vllm_omp_binding_is_every_core_unless_asked() -> None:
    assert bsv.server_env("eager", "all")["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")
    assert bsv.server_env("compiled", "auto")["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_ratios_take_the_best_vllm_mode_per_level() -> None:
    def lv(c: int, tps: float) -> bsv.LevelResult:
        return bsv.LevelResult(c, 16, 0, tps, 0, 0, 0, 0, 1024)

    results = {"ours": [lv(1, 12.0), lv(4, 30.0)], "eager": [lv(1, 8.0), lv(4, 25.0)],
               "compiled": [lv(1, 10.0), lv(4, 20.0)]}
    assert bsv.ratios(results, "ours", ["eager", "compiled"]) == {1: 1.2, 4: 1.2}
    lines: list[str] = []
    bsv.report(bsv.DATASETS["random"], results, lines.append)
    row = next(line for line in lines if line.startswith("| pagedkv-serve | 4 "))
    assert row.rstrip(" |").endswith("1.20x")
