"""`python -m engine.model_init`: compose's one-shot that makes sure the served model exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model_init import ModelInitError, ensure_model, main

SMALL = dict(num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128,
             vocab_size=300, seed=1)


def test_builds_a_missing_tiny_model_once(tmp_path: Path) -> None:
    target = tmp_path / "models" / "tiny-qwen2"
    assert ensure_model(target, SMALL) == "built"
    assert (target / "config.json").is_file() and (target / "tokenizer.json").is_file()
    assert "Qwen2ForCausalLM" in (target / "config.json").read_text()
    assert [p.name for p in target.parent.iterdir()] == ["tiny-qwen2"]      # no temp directory left behind
    # readable by a node running as another user (compose): the weights too, not 0600
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in target.iterdir()} == {
        p.name: "0o644" for p in target.iterdir()}
    assert ensure_model(target, SMALL) == "present"


def test_never_invents_a_real_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ModelInitError, match="PAGEDKV_MODEL_DIR"):
        ensure_model(tmp_path / "Qwen2.5-0.5B-Instruct")
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "notes.txt").write_text("not a model")
    with pytest.raises(ModelInitError, match="not a model directory"):
        ensure_model(tmp_path / "tiny-llama")
    assert main([str(tmp_path / "Llama-3-8B")]) == 2
    assert "no model at" in capsys.readouterr().err
    real = tmp_path / "mine"
    real.mkdir()
    (real / "config.json").write_text("{}")
    assert main([str(real)]) == 0 and "present" in capsys.readouterr().out


def test_an_unbuildable_place_is_one_line_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    assert main([str(tmp_path / "file" / "tiny-llama")]) == 1      # its parent is a file
    err = capsys.readouterr().err
    assert err.startswith("python -m engine.model_init: error: cannot build ") and err.count("\n") == 1, err
    (tmp_path / "tiny-qwen3").write_text("")                        # a file where the directory goes
    assert main([str(tmp_path / "tiny-qwen3")]) == 1
    assert "cannot build" in capsys.readouterr().err
