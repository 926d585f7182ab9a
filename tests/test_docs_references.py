"""The docs' references to the code, checked against the code (issue 47, item 6): a doc that
names a file, a command-line flag, an environment variable, a module's name or another doc's
section must name one that exists, so the docs cannot drift silently when the code moves.

What is checked (tests/support/docs_checks.py), over README.md, BENCHMARKS.md, docs/**/*.md and
every other tracked markdown file:
- relative markdown links: the file exists inside the repository, and a `#anchor` is a heading
  of that file (GitHub's anchor rule);
- repository paths (`engine/llm.py`, `block_manager/core/`, in code spans, code blocks or prose):
  the file or directory exists; `package.module.name[.member]` in a code span: the module
  defines the name (read with `ast`, nothing imported);
- flags on a command line (`block-manager serve --kv-events-zmq ...`): the flag is one of that
  command's flags, read from its argparse parser (tests/support/docs_code.py: the console
  scripts of pyproject.toml and the `python -m` modules, reached through their `main(argv)`;
  bench/ and tools/ scripts from their `add_argument` calls); a bare `--flag` in a code span
  must be a flag of some project command;
- environment variable names `PAGEDKV_*`: derived from the settings classes (their `env_prefix`
  and nested fields), the argparse help texts and the API server's `PAGEDKV_API_<FLAG>`, or read
  literally somewhere in the code and scripts;
- citations `BENCHMARKS.md, "<title>"` (in docs and in code comments): a section of BENCHMARKS.md
  or of its archive has that title;
- docs/core_api.md's `BlockManager` list: the class's public methods, no more, no fewer.

docs/benchmarks/ is the archive of dated benchmark rounds: it keeps what was true on the day
(flags and files since renamed included), so only its links and citations are checked.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tests.support.docs_checks import (
    benchmark_titles,
    check_citations,
    check_doc,
    citation_aliases,
    docs,
)
from tests.support.docs_code import ROOT, Code, read_code, tracked
from tests.support.docs_markdown import anchors, github_slug


@pytest.fixture(scope="module")
def code() -> Code:
    return read_code()


@pytest.mark.parametrize("doc", docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_references_exist_in_the_code(doc: Path, code: Code) -> None:
    problems = check_doc(doc, ROOT, code)
    assert not problems, "stale references:\n" + "\n".join(problems)


def test_the_code_side_is_read_not_empty(code: Code) -> None:
    """The checks above mean something only if the code's side was found."""
    assert "--kv-events-zmq" in code.commands["block-manager serve"]
    assert "--host-kv-blocks" in code.commands["compute-node serve"]
    assert "--block-manager" in code.commands["pagedkv-serve"]
    assert {"PAGEDKV_DATABASE_URL", "PAGEDKV_CN_NODE_ID", "PAGEDKV_API_PORT"} <= code.env_names
    assert "PAGEDKV_DEFRAG__" in code.env_prefixes
    assert {"engine", "block_manager", "docs"} <= code.top_dirs


def test_a_planted_stale_reference_is_reported(tmp_path: Path, code: Code) -> None:
    """A doc naming a moved file, a flag the command lacks, an unknown setting, a missing page and
    a missing section: each one reported."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "llm.py").write_text("class LLM:\n    def generate(self): ...\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A real section\n")
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n\n## Real round 2: what changed\n")
    doc = tmp_path / "docs" / "planted.md"
    doc.write_text("\n".join([
        "# Planted",
        "",
        "Fine: `engine/llm.py`, [other](other.md#a-real-section), [here](#planted),",
        '`PAGEDKV_DATABASE_URL`, BENCHMARKS.md, "Real round 2", `engine.llm.LLM.generate`,',
        "`block-manager serve --kv-events-zmq tcp://*:5557`.",
        "",
        "Stale: `engine/lm.py` and block_manager/core/nowhere.py,",                          # line 7
        "`PAGEDKV_NO_SUCH_SETTING=1`, [gone](gone.md), [other](other.md#no-such-section),",  # line 8
        "[up](../../outside.md), `--no-such-flag`, `engine.llm.LLM.chat`,",                 # line 9
        'BENCHMARKS.md, "No such round".',                                                  # line 10
        "",
        "```bash",
        "block-manager serve --kv-events-zmq-port 5557 \\",                               # line 13
        "  --listen 0.0.0.0:50051",
        "compute-node serve --kv-events-zmq tcp://*:1",                                      # line 15
        "```",
    ]) + "\n")
    planted_code = dataclasses.replace(code, top_dirs=code.top_dirs | {"engine", "block_manager"})
    problems = "\n".join(check_doc(doc, tmp_path, planted_code))
    expected = [
        "planted.md:7: path engine/lm.py",
        "planted.md:7: path block_manager/core/nowhere.py",
        "planted.md:8: environment variable PAGEDKV_NO_SUCH_SETTING",
        "planted.md:8: link gone.md: no such file",
        "planted.md:8: link other.md#no-such-section: no heading",
        "planted.md:9: link ../../outside.md leaves the repository",
        "planted.md:9: flag --no-such-flag is not a flag of any",
        "planted.md:9: `engine.llm.LLM.chat`: engine.llm.LLM has no chat",
        'planted.md:10: cites BENCHMARKS.md "No such round": no such section',
        "planted.md:13: flag --kv-events-zmq-port is not a flag of `block-manager serve`",
        "planted.md:15: flag --kv-events-zmq is not a flag of `compute-node serve`",
    ]
    missing = [e for e in expected if e not in problems]
    assert not missing, f"not reported: {missing}\nreported:\n{problems}"
    assert problems.count("\n") + 1 == len(expected), f"reported more than planted:\n{problems}"


def test_code_comments_cite_benchmark_sections_that_exist() -> None:
    """A comment or docstring citing `BENCHMARKS.md, "<title>"` names a section of BENCHMARKS.md
    or of its archive, or a shorter name the archive index maps to one."""
    titles = benchmark_titles(ROOT) | citation_aliases(ROOT)
    problems = []
    for name in tracked("*.py", "*.sh", "*.yml", "*.yaml", "*.toml"):
        path = ROOT / name
        text = path.read_text() if path.is_file() else ""
        if "BENCHMARKS" in text and path != Path(__file__).resolve():
            problems += check_citations(path, text, ROOT, titles)
    assert not problems, "\n".join(problems)


def test_github_anchors() -> None:
    assert github_slug("Kernels — CUDA (H200)") == "kernels--cuda-h200"
    assert github_slug("Engine: `LLM` vs transformers (issue 12)") == "engine-llm-vs-transformers-issue-12"
    assert github_slug("Active/standby failover") == "activestandby-failover"
    assert anchors("# A\n## B\n## B\n```\n# not a heading\n```\n") == {"a", "b", "b-1"}


def documented_methods(core_api: str) -> set[str]:
    """The method names docs/core_api.md's `BlockManager` block lists (one or more a line)."""
    block = core_api.split("## `BlockManager` (`manager.py`)", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    names = set()
    for line in block.split("\n"):
        for part in line.split("#", 1)[0].split(";"):
            m = re.match(r"^\s*(?:BlockManager\.)?([a-z_]\w*)\s*(?:\(|->)", part)
            if m:
                names.add(m.group(1))
    return names


def test_core_api_lists_every_public_method_of_the_block_manager() -> None:
    """docs/core_api.md is the core's contract: its `BlockManager` block names each public method
    (and property) of `block_manager.core.BlockManager`, and none that is gone."""
    from block_manager.core import BlockManager

    public = {name for name in dir(BlockManager) if not name.startswith("_")}
    documented = documented_methods((ROOT / "docs" / "core_api.md").read_text())
    assert not public - documented, f"docs/core_api.md lacks {sorted(public - documented)}"
    assert not documented - public, f"docs/core_api.md names what BlockManager lacks: {sorted(documented - public)}"


def test_core_api_module_map_names_every_core_module() -> None:
    """docs/core_api.md's module map names each module of `block_manager/core/`, and no other."""
    text = (ROOT / "docs" / "core_api.md").read_text()
    module_map = text.split("**Module map.**", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`(\w+\.py)`", module_map))
    modules = {Path(n).name for n in tracked("block_manager/core/*.py") if Path(n).parent == Path("block_manager/core")}
    modules.discard("__init__.py")
    assert not modules - named, f"docs/core_api.md's module map lacks {sorted(modules - named)}"
    assert not named - modules, f"docs/core_api.md's module map names what the core lacks: {sorted(named - modules)}"
