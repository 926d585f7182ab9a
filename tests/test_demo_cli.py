"""`pagedkv-demo` and `scripts/run.sh demo` as a user meets them (issue 10): the plot goes to the
working directory or `--plot`, a bad `--plot` is refused before the run, Ctrl-C is one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from demo import cli as demo
from demo import services as demo_services
from tests.support.polling import eventually_sync

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(args: object) -> int:
        raise AssertionError("the services run started although --plot is unusable")

    monkeypatch.setattr(demo_services, "run", refuse)


@pytest.mark.parametrize(
    ("plot", "reason"),
    [
        ("missing-dir/out.svg", "does not exist"),
        (".", "is a directory"),
        ("out.nosuchformat", "unsupported image type"),
    ],
)
def test_bad_plot_path_is_refused_before_the_run(
    plot: str, reason: str, no_run: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert demo.main(["--requests", "2", "--plot", plot]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedkv-demo: error: --plot") and reason in err, err


def test_default_plot_goes_to_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Path] = []
    monkeypatch.setattr(demo_services, "run", lambda args: seen.append(args.plot) or 0)
    monkeypatch.chdir(tmp_path)
    assert demo.main(["--requests", "2"]) == 0
    assert seen == [tmp_path / "pagedkv-demo.svg"]


def test_run_sh_demo_starts_in_the_callers_directory(tmp_path: Path) -> None:
    """run.sh cds to the repository to install; the demo itself must run where it was called
    from (its plot landed in the repository root whatever the working directory)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    fake_demo = venv / "bin" / "pagedkv-demo"
    fake_demo.write_text("#!/bin/sh\npwd\n")
    fake_demo.chmod(0o755)
    (venv / ".pagedkv-installed-demo").touch()   # "installed": run.sh skips pip
    os.utime(venv / ".pagedkv-installed-demo", (4102444800, 4102444800))   # newer than pyproject.toml
    work = tmp_path / "work"
    work.mkdir()
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run.sh"), "demo"], cwd=work, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PAGEDKV_VENV": str(venv)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(work)


def _children(pid: int) -> set[int]:
    """Pids whose parent is `pid` (from /proc: no psutil here)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue   # exited meanwhile
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_ctrl_c_is_one_line_and_stops_the_stack(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "demo.cli", "--requests", "200", "--plot", str(tmp_path / "p.svg")],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert "starting block manager" in proc.stdout.readline()
        services = eventually_sync(lambda: _children(proc.pid), what="the first service process")
        proc.send_signal(signal.SIGINT)   # mid start-up: the stack is half up
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == demo.EXIT_INTERRUPTED
    assert err.strip() == "pagedkv-demo: interrupted", err[-2000:]
    assert not [pid for pid in services if _alive(pid)], "a service outlived the demo"


def test_the_demo_check_compares_greedy_outputs_batched_and_says_how_many(tmp_path: Path) -> None:
    """The services demo's correctness check on real engine outputs (the embedded engine, the
    demo's own workload): every greedy completion compared with transformers in batches, the
    count and the sampled ones stated, progress printed when piped, a bound honoured, and a
    corrupted token caught."""
    import copy
    import dataclasses
    import io

    from rich.console import Console

    from compute_node.model.tiny import build_tiny_model
    from demo.services import ModelDemoReport, _check_reference, build_workload, check_summary, render
    from engine.llm import LLM

    model_dir = build_tiny_model(tmp_path / "tiny-llama", "llama", num_layers=1, hidden_size=64, num_heads=2,
                                 num_kv_heads=1, head_dim=32, intermediate_size=128, vocab_size=512, seed=5)
    with LLM(model_dir, block_size=16, num_kv_blocks=512, device="cpu") as llm:
        workload = [dataclasses.replace(r, params=dataclasses.replace(r.params, max_tokens=r.params.max_tokens // 4))
                    for r in build_workload(llm.tokenizer, 12, seed=1, vocab=512)]     # 4-24 tokens: cheap
        outputs = llm.generate([{"prompt_token_ids": r.prompt_ids} for r in workload], [r.params for r in workload])
    greedy = sum(len(o.outputs) for r, o in zip(workload, outputs) if r.params.greedy)
    sampled = sum(len(o.outputs) for r, o in zip(workload, outputs) if not r.params.greedy)
    assert greedy >= 4 and sampled >= 1

    piped = io.StringIO()
    report = ModelDemoReport(model="tiny-llama", built=True)
    _check_reference(report, model_dir, workload, outputs, Console(file=piped, width=120))
    assert (report.checked, report.matched, report.greedy_total, report.sampled) == (greedy, greedy, greedy, sampled)
    assert report.reference == "transformers" and report.mismatches == []
    assert f"against transformers: 0/{greedy}" in piped.getvalue() and "done in" in piped.getvalue()
    summary = check_summary(report)
    assert f"checked: {greedy} of {greedy} greedy completions" in summary and f"{sampled} sampled" in summary
    shown = io.StringIO()
    render(report, Console(file=shown, width=400))
    assert f"OK {greedy}/{greedy}" in shown.getvalue() and summary in shown.getvalue()
    # the tier counters (issue 18): swapped vs recomputed preemptions, host moves, host hits
    report.stats = {"preemptions": 5, "swap_outs": 3, "swapped_out_blocks": 7, "swapped_in_blocks": 6,
                    "offloaded_blocks": 11, "onboarded_blocks": 4, "prefix_hit_tokens": 96, "host_hit_tokens": 64}
    shown = io.StringIO()
    render(report, Console(file=shown, width=400))
    text = shown.getvalue()
    assert "swapped / recomputed" in text and "3 / 2" in text and "7 / 6, 11 / 4" in text and "96 / 64" in text

    bounded = ModelDemoReport(model="tiny-llama", built=True)
    _check_reference(bounded, model_dir, workload, outputs, Console(file=io.StringIO()), max_checked=2)
    assert bounded.checked == 2 and f"the other {greedy - 2} skipped" in check_summary(bounded)

    corrupted = copy.deepcopy(outputs)
    victim = next(o for r, o in zip(workload, corrupted) if r.params.greedy)
    victim.outputs[0].token_ids[1] = (victim.outputs[0].token_ids[1] + 1) % 512
    caught = ModelDemoReport(model="tiny-llama", built=True)
    _check_reference(caught, model_dir, workload, corrupted, Console(file=io.StringIO()))
    assert caught.matched == greedy - 1 and caught.mismatches == [f"{victim.request_id}/0 at token 1"]
