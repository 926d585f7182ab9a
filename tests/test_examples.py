"""The embedding examples (docs/protocol.md quotes them, the README runs them) work as written."""

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_embed_core_example(capsys) -> None:  # type: ignore[no-untyped-def]
    runpy.run_path(str(ROOT / "examples" / "embed_core.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "req-b reused 64 cached tokens" in out
    assert "copy-on-write [(4, 6)]" in out


def test_the_protocol_doc_embeds_the_examples() -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text()
    for name in ("embed_core.py", "embed_client.py"):
        body = (ROOT / "examples" / name).read_text().strip()
        assert body in doc, f"docs/protocol.md's copy of examples/{name} is stale"


def test_client_example_without_nodes_says_so(tmp_path: Path) -> None:
    """Against a fresh `block-manager serve` (no node registered yet) the client example stops
    with a message, not an IndexError from `route(...)[0]`."""
    import os
    import subprocess
    import sys

    from demo.localstack import ServiceProcess

    argv = [sys.executable, "-m", "block_manager.cli.main", "serve", "--listen", "127.0.0.1:0",
            "--database-url", "memory://"]
    with ServiceProcess.start(argv, workdir=tmp_path, name="bm") as bm:
        env = {**os.environ, "PAGEDKV_TARGET": bm.address}
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "embed_client.py")], env=env,
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    expected = f"no compute node is registered with the block manager at {bm.address}: start one first"
    assert run.stderr.strip() == expected
