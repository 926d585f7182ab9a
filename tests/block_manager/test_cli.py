"""`block-manager` CLI (as a real subprocess) and the `pagedkv-demo` main job."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from block_manager.cli import main as cli
from demo import cli as demo

BIN = Path(sys.executable).parent
SMALL_KNOBS = ["--num-requests", "12", "--prompt-len-max", "120", "--output-len-max", "80", "--seed", "4"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "block-manager"), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_gen_trace_then_replay_prints_one_json_object(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    gen = _run("gen-trace", str(trace), *SMALL_KNOBS, "--parallel-fraction", "0.5")
    assert gen.returncode == 0, gen.stderr
    out = _run("replay", str(trace), "--num-blocks", "2000", "--block-size", "16", "--fsck")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)  # exactly one JSON document, nothing else on stdout
    for key in ("ops", "wall_s", "ops_per_s", "append_step_p50_us", "prefix_query_tokens", "prefix_hit_tokens",
                "peak_used_blocks", "cow_copies", "evictions", "rejected", "preempted", "skipped", "waste_ratio"):
        assert key in report
    assert report["ops"] == len(trace.read_text().splitlines())
    assert report["fsck_problems"] == []
    assert 0 < report["peak_used_blocks"] <= 2000
    no_cache = json.loads(_run("replay", str(trace), "--num-blocks", "2000", "--block-size", "16",
                               "--no-prefix-cache").stdout)
    assert no_cache["prefix_hit_tokens"] == 0


def test_malformed_trace_exits_2_with_one_line_naming_the_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"op": "allocate", "seq": "a", "tokens": [1, 2]}\n{"op": "append", "seqs": {"a": "x"}}\n')
    out = _run("replay", str(trace), "--num-blocks", "8", "--block-size", "4")
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1
    assert "line 2:" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["replay", "/nonexistent/trace.jsonl", "--num-blocks", "8", "--block-size", "4"], "No such file"),
        (["replay", "{trace}", "--num-blocks", "0", "--block-size", "4"], "must be >= 1"),
        (["replay", "{trace}", "--num-blocks", "8", "--block-size", "4", "--watermark", "1.5"], "watermark"),
        (["gen-trace", "{out}", "--num-requests", "0"], "num_requests must be >= 1"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], fragment: str) -> None:
    trace = tmp_path / "ok.jsonl"
    trace.write_text('{"op": "allocate", "seq": "a", "tokens": [1]}\n')
    args = [a.format(trace=trace, out=tmp_path / "out.jsonl") for a in args]
    out = _run(*args)
    assert out.returncode == 2
    assert fragment in out.stderr
    assert "Traceback" not in out.stderr


def test_help_works_everywhere() -> None:
    for args in (["--help"], ["replay", "--help"], ["gen-trace", "--help"]):
        out = _run(*args)
        assert out.returncode == 0 and "usage:" in out.stdout
    top = _run("--help").stdout
    assert "serve" in top and "admin" in top


@pytest.mark.parametrize(("command", "module_name"), [("serve", "block_manager.service.server"),
                                                     ("admin", "block_manager.cli.admin")])
def test_serve_and_admin_pass_the_rest_of_argv_through(
    monkeypatch: pytest.MonkeyPatch, command: str, module_name: str
) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType(module_name)
    fake.main = lambda argv: seen.append(list(argv)) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module_name, fake)
    assert cli.main([command, "--port", "0", "--help"]) == 3
    assert seen == [["--port", "0", "--help"]]


def test_missing_service_module_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "block_manager.service.server", None)  # import raises ModuleNotFoundError
    assert cli.main(["serve"]) == 1
    assert "not available" in capsys.readouterr().err


def test_demo_runs_small_and_reports_the_key_numbers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # no wrapping inside table cells
    assert demo.main(["--mode", "core", "--requests", "12", "--num-blocks", "3000"]) == 0
    out = capsys.readouterr().out
    for label in ("peak KV blocks", "mean KV blocks", "concurrency at equal memory", "waste",
                  "prefix cache hit tokens", "copy-on-write copies", "evictions", "append step p50 / p99"):
        assert label in out
    assert "x" in out.split("concurrency at equal memory")[1].splitlines()[0]


def test_demo_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--mode", "core", "--requests", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
    assert demo.main(["--requests", "0"]) == 2          # services mode checks before starting anything
    assert "must be >= 1" in capsys.readouterr().err
