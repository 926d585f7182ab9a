"""The README's in-process embedding example runs as written."""

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_embed_core_example(capsys) -> None:  # type: ignore[no-untyped-def]
    runpy.run_path(str(ROOT / "examples" / "embed_core.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "req-b reused 64 cached tokens" in out
    assert "copy-on-write [(4, 6)]" in out


def test_readme_embeds_the_examples() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in ("embed_core.py", "embed_client.py"):
        body = (ROOT / "examples" / name).read_text().strip()
        assert body in readme, f"README's copy of examples/{name} is stale"
