"""The docs' references to the code, checked against the code (issue 47, item 6): a doc that
names a file, a command-line flag, an environment variable or another doc's section must name
one that exists, so the docs cannot drift silently when the code moves.

What is checked, over README.md, BENCHMARKS.md and docs/**/*.md:
- relative markdown links: the file exists, and a `#anchor` is a heading of that file (GitHub's
  anchor rule);
- repository paths (`engine/llm.py`, `block_manager/core/`, in code spans, code blocks or prose):
  the file or directory exists;
- flags on a command line (`block-manager serve --kv-events-zmq ...`): the flag is one of that
  command's flags, read from its argparse parser (the console scripts of pyproject.toml, reached
  through their `main(argv)`; bench/ and tools/ scripts from their `add_argument` calls); a bare
  `--flag` in a code span must be a flag of some project command;
- environment variable names `PAGEDKV_*`: derived from the settings classes (their `env_prefix`
  and nested fields), the argparse help texts and the API server's `PAGEDKV_API_<FLAG>`, or read
  literally somewhere in the code and scripts.

docs/benchmarks/ is the archive of dated benchmark rounds: it keeps what was true on the day
(flags and files since renamed included), so only its links are checked.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import re
import shlex
import signal
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = Path("docs/benchmarks")


# --- reading markdown -----------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


@dataclass(slots=True)
class Line:
    """One line of a doc: its number, its text, and whether it sits in a fenced code block (and
    which language the fence named)."""

    number: int
    text: str
    fence: str | None   # None: prose; "" or the language: inside a fenced block


def doc_lines(text: str) -> list[Line]:
    lines, fence, marker = [], None, ""
    for number, raw in enumerate(text.split("\n"), 1):
        m = _FENCE.match(raw)
        if m and fence is None:
            fence, marker = m.group(2).lower(), m.group(1)[0]
            continue
        if m and fence is not None and raw.strip().startswith(marker * 3):
            fence = None
            continue
        lines.append(Line(number, raw, fence))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than `-`
    and `_` removed, each space a hyphen (so "Kernels — CUDA (H200)" is `kernels--cuda-h200`)."""
    text = _LINK.sub(lambda m: m.group(1), heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in doc_lines(text):
        found.update(_HTML_ANCHOR.findall(line.text))
        if line.fence is not None:
            continue
        m = _HEADING.match(line.text)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def prose_without_code(text: str) -> str:
    return _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)


# --- what the code says ---------------------------------------------------------------------


class _Captured(BaseException):
    """Raised by a patched `parse_args` to hand back the parser a `main(argv)` built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def _capture_parser(entry: Callable[[list[str]], object], argv: list[str]) -> argparse.ArgumentParser | None:
    """The parser `entry(argv)` parses its command line with, without running the command."""

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    sigint = signal.getsignal(signal.SIGINT)   # a `main` may take Ctrl-C over (pagedkv.cli.catch_ctrl_c)
    argparse.ArgumentParser.parse_args = capture  # type: ignore[assignment]  # restored below
    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[assignment]  # restored below
    try:
        entry(argv)
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
        signal.signal(signal.SIGINT, sigint)
    return None


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of a parser and of the subcommands below it."""
    found = {s for a in parser._actions for s in a.option_strings}
    for sub in _subparsers(parser).values():
        found |= _options(sub)
    return found


def _help_texts(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        yield action.help or ""
    yield parser.epilog or ""
    for sub in _subparsers(parser).values():
        yield from _help_texts(sub)


def _script_flags(path: Path) -> set[str]:
    """The `add_argument("--x", ...)` flags of a script (bench/, tools/), read from its source and
    from the project modules in its own folder that it imports: running them would import torch."""
    flags: set[str] = set()
    seen: set[Path] = set()
    todo = [path]
    while todo:
        p = todo.pop()
        if p in seen or not p.is_file():
            continue
        seen.add(p)
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("add_argument", "addoption"):
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                          and a.value.startswith("-")}
            elif isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] == path.parent.name:
                    todo.append(ROOT.joinpath(*parts).with_suffix(".py"))
                elif node.level == 0 and len(parts) == 1:
                    todo.append(p.parent / f"{parts[0]}.py")
            elif isinstance(node, ast.Import):
                todo += [p.parent / f"{a.name}.py" for a in node.names if "." not in a.name]
    return flags


@dataclass(slots=True)
class Code:
    """What the docs may refer to, read from the code."""

    commands: dict[str, set[str]] = field(default_factory=dict)   # "block-manager serve" -> its flags
    env_names: set[str] = field(default_factory=set)
    env_prefixes: set[str] = field(default_factory=set)            # "PAGEDKV_CN_", "PAGEDKV_DEFRAG__", ...
    top_dirs: set[str] = field(default_factory=set)

    def all_flags(self) -> set[str]:
        return set().union(*self.commands.values())


def _entry_points() -> dict[str, Callable[[list[str]], object]]:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entries = {}
    for name, target in scripts.items():
        module, func = target.split(":")
        entries[name] = getattr(importlib.import_module(module), func)
    return entries


def _settings_env(code: Code) -> None:
    """`PAGEDKV_*` names of every `YamlEnvSettings` class in the services (prefix + field, nested
    fields joined by the class's delimiter)."""
    from pydantic import BaseModel

    from pagedkv.settings import YamlEnvSettings

    for name in _tracked("*.py"):   # the modules that declare settings classes
        if name.split("/", 1)[0] in _PACKAGES and "env_prefix=" in (ROOT / name).read_text():
            importlib.import_module(".".join(Path(name).with_suffix("").parts))

    def walk(model: type[BaseModel], prefix: str, delimiter: str) -> None:
        for name, info in model.model_fields.items():
            ann = info.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                code.env_prefixes.add(f"{prefix}{name.upper()}{delimiter}")
                walk(ann, f"{prefix}{name.upper()}{delimiter}", delimiter)
            else:
                code.env_names.add(f"{prefix}{name.upper()}")

    todo = list(YamlEnvSettings.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        prefix = cls.model_config.get("env_prefix") or ""
        if prefix.startswith("PAGEDKV_"):
            code.env_prefixes.add(prefix)
            walk(cls, prefix, cls.model_config.get("env_nested_delimiter") or "__")


_PACKAGES = ("block_manager", "compute_node", "engine", "kernels", "pagedkv", "demo", "tools")


def _tracked(*patterns: str) -> list[str]:
    return subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


def _literal_env(code: Code) -> None:
    """Names read straight from the environment somewhere: any `PAGEDKV_*` literal in a tracked
    file that is not documentation."""
    files = _tracked()
    for name in files:
        if name.endswith(".md") or "_pb2" in name or ROOT / name == Path(__file__).resolve():
            continue   # this file's planted names are not the code's
        try:
            text = (ROOT / name).read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for m in re.finditer(r"PAGEDKV_[A-Z0-9_]*[A-Z0-9]", text):
            if text[m.end():m.end() + 1] in ("<", "{", "*"):   # f"PAGEDKV_API_{flag}", prefixes
                code.env_prefixes.add(m.group(0) + "_")
            else:
                code.env_names.add(m.group(0))
    code.top_dirs = {n.split("/", 1)[0] for n in files if "/" in n}


def read_code() -> Code:
    code = Code()
    for name, entry in _entry_points().items():
        top = _capture_parser(entry, [])
        assert top is not None, f"{name}: main([]) parsed no command line"
        code.commands[name] = _options(top)
        for text in _help_texts(top):
            code.env_names.update(re.findall(r"PAGEDKV_[A-Z0-9_]*[A-Z0-9]", text))
        for sub, sub_parser in _subparsers(top).items():
            own = _capture_parser(entry, [sub])       # `block-manager serve` passes its argv on
            parser = own if own is not None and own.prog != top.prog else sub_parser
            code.commands[f"{name} {sub}"] = _options(top) | _options(parser)
            for text in _help_texts(parser):
                code.env_names.update(re.findall(r"PAGEDKV_[A-Z0-9_]*[A-Z0-9]", text))
        if name == "pagedkv-serve":   # each flag also as PAGEDKV_API_<FLAG> (engine/api/cli.py)
            prefix = importlib.import_module(entry.__module__).ENV_PREFIX
            code.env_names |= {prefix + f[2:].upper().replace("-", "_") for f in _options(top) if f.startswith("--")}
    for folder in ("bench", "tools", "scripts"):
        for path in sorted((ROOT / folder).glob("*.py")):
            code.commands[f"{folder}/{path.name}"] = _script_flags(path)
    for name in _tracked("*.py"):   # `python -m pagedkv.healthcheck --tls-env ...`
        text = (ROOT / name).read_text()
        if name.split("/", 1)[0] in _PACKAGES and "__main__" in text and "add_argument" in text:
            module = ".".join(Path(name).with_suffix("").parts)
            light = "def main(" in text and not re.search(r"^(import|from) torch", text, re.MULTILINE)
            entry = getattr(importlib.import_module(module), "main", None) if light else None   # torch: seconds
            parser = _capture_parser(entry, []) if entry is not None else None
            code.commands[f"-m {module}"] = _options(parser) if parser is not None else _script_flags(ROOT / name)
    code.commands["pytest"] = _script_flags(ROOT / "conftest.py") | _script_flags(ROOT / "tests" / "conftest.py")
    _settings_env(code)
    _literal_env(code)
    return code


# --- the checks ------------------------------------------------------------------------------

_PATH = re.compile(r"(?<![\w/.~$=-])([A-Za-z_][\w.-]*/[\w./-]*[\w/])")
_ENV = re.compile(r"PAGEDKV_[A-Z0-9_]*[A-Z0-9_]")
_WRAPPERS = {"time", "/usr/bin/time", "env", "exec", "nohup", "sudo", "command"}
_PYTHONS = re.compile(r"^(?:.*/)?python(?:3(?:\.\d+)?)?$")


def check_links(doc: Path, text: str, root: Path) -> list[str]:
    problems = []
    for line in doc_lines(text):
        if line.fence is not None:
            continue
        for m in _LINK.finditer(_CODE_SPAN.sub("", line.text)):
            target = m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (doc.parent / path_part).resolve() if path_part else doc.resolve()
            where = f"{doc.relative_to(root)}:{line.number}"
            if root.resolve() not in (dest, *dest.parents):
                problems.append(f"{where}: link {target} leaves the repository")
            elif not dest.exists():
                problems.append(f"{where}: link {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                problems.append(f"{where}: link {target}: no heading #{anchor} in {dest.relative_to(root.resolve())}")
    return problems


def check_paths(doc: Path, text: str, root: Path, code: Code) -> list[str]:
    problems = []
    for line in doc_lines(text):
        for m in _PATH.finditer(line.text):
            raw = m.group(1)
            top = raw.split("/", 1)[0]
            if top not in code.top_dirs or re.search(r"[*<>{}…]|\.\.\.|/\.$", raw):
                continue
            path = re.sub(r"(::\w.*|:\d[\d,-]*)$", "", raw).rstrip(".")
            if not (raw.endswith("/") or Path(path).suffix or (root / top / "__init__.py").exists()):
                continue   # `deploy/block-manager` is a kubectl name; a file has a suffix, a package an __init__
            if not ((root / path).exists() or (root / f"{path}.py").exists()):
                problems.append(f"{doc.relative_to(root)}:{line.number}: path {path}: no such file or directory")
    return problems


def _logical_lines(text: str) -> list[Line]:
    """A doc's lines with a shell block's `\\`-continued lines joined (numbered by the first)."""
    joined: list[Line] = []
    for line in doc_lines(text):
        previous = joined[-1] if joined else None
        if (previous is not None and previous.fence is not None and line.fence is not None
                and previous.number >= 0 and previous.text.rstrip().endswith("\\")):
            previous.text = previous.text.rstrip()[:-1] + " " + line.text.strip()
        else:
            joined.append(Line(line.number, line.text, line.fence))
    return joined


_SUFFIXES = {"py", "md", "proto", "yaml", "yml", "json", "toml", "txt", "sh", "db", "svg", "png"}
_DOTTED = re.compile(r"^([a-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?$")


def _names_in(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            names |= _names_in(node.body) | _names_in(getattr(node, "orelse", []))
    return names


def proto_names(root: Path) -> set[str]:
    """`package.Name` of every service, message and enum the .proto files declare."""
    names: set[str] = set()
    for path in root.glob("proto/**/*.proto"):
        text = path.read_text()
        package = re.search(r"^package\s+([\w.]+);", text, re.MULTILINE)
        for m in re.finditer(r"^\s*(?:service|message|enum)\s+(\w+)", text, re.MULTILINE):
            names.add(f"{package.group(1)}.{m.group(1)}" if package else m.group(1))
    return names


def dotted_problem(name: str, root: Path) -> str | None:
    """Why `package.module.name[.member]` names nothing in the tree (None: it does, or it is
    not one of the project's packages, or it is a file name or a protobuf name)."""
    parts = name.split(".")
    if not (root / parts[0] / "__init__.py").exists() or parts[-1] in _SUFFIXES:
        return None
    if name in proto_names(root) or ".".join(parts[:-1]) in proto_names(root):
        return None
    i = 1
    while i < len(parts) and ((root.joinpath(*parts[:i + 1]).with_suffix(".py")).exists()
                              or (root.joinpath(*parts[:i + 1]) / "__init__.py").exists()):
        i += 1
    rest = parts[i:]
    if not rest:
        return None
    module = root.joinpath(*parts[:i])
    source = module / "__init__.py" if module.is_dir() else module.with_suffix(".py")
    tree = ast.parse(source.read_text())
    names = _names_in(tree.body)
    if "__getattr__" in names:   # a lazy re-export: the name is the module's to resolve
        return None
    if rest[0] not in names:
        return f"{'.'.join(parts[:i])} has no {rest[0]}"
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if len(rest) > 1 and rest[0] in classes and not classes[rest[0]].bases:
        members = _names_in(classes[rest[0]].body) | {
            t.attr for n in ast.walk(classes[rest[0]]) if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Attribute)}
        if rest[1] not in members:
            return f"{'.'.join(parts[:i + 1])} has no {rest[1]}"
    return None


def check_dotted(doc: Path, text: str, root: Path) -> list[str]:
    problems = []
    for line in doc_lines(text):
        if line.fence is not None:
            continue
        for m in _CODE_SPAN.finditer(line.text):
            d = _DOTTED.match(m.group(2).strip())
            problem = dotted_problem(d.group(1), root) if d else None
            if problem:
                problems.append(f"{doc.relative_to(root)}:{line.number}: `{d.group(1)}`: {problem}")
    return problems


_CITATION = re.compile(r'BENCHMARKS(?:\.md)?,?\s+"([^"]+)"')


def _normal(text: str) -> str:
    text = re.sub(r"\n\s*(?:#|\*)?\s*", " ", text)   # a citation wrapped in a comment or docstring
    return " ".join(text.replace("`", "").split())


def benchmark_titles(root: Path) -> set[str]:
    """The headings of BENCHMARKS.md and of its archive (docs/benchmarks/), as cited: by title."""
    titles: set[str] = set()
    for path in [root / "BENCHMARKS.md", *sorted((root / ARCHIVE).glob("*.md"))]:
        for line in doc_lines(path.read_text()):
            m = _HEADING.match(line.text) if line.fence is None else None
            if m:
                titles.add(_normal(m.group(2)))
    return titles


def citation_aliases(root: Path) -> set[str]:
    """Shorter names code comments use for a section, listed in BENCHMARKS.md's archive index
    ("| cited as | in | the section |")."""
    text = (root / "BENCHMARKS.md").read_text()
    return {_normal(m.group(1)) for m in re.finditer(r'^\| "([^"]+)" \|', text, re.MULTILINE)}


def check_citations(path: Path, text: str, root: Path, titles: set[str]) -> list[str]:
    """`BENCHMARKS.md, "<title>"`: some heading of BENCHMARKS.md or of the archive starts so."""
    problems = []
    for m in _CITATION.finditer(text):
        cited = _normal(m.group(1)).rstrip("…").strip()
        if "<" not in cited and not any(t.startswith(cited) for t in titles):
            number = text.count("\n", 0, m.start()) + 1
            problems.append(f"{path.relative_to(root)}:{number}: cites BENCHMARKS.md \"{cited}\": no such section")
    return problems


def _commands_in(line: Line) -> Iterator[str]:
    """Command lines a doc line holds: the whole line in a shell block, a code span in prose."""
    if line.fence is not None:
        if line.fence in ("", "bash", "sh", "shell", "console", "zsh"):
            yield line.text.strip().removeprefix("$ ")
        return
    for m in _CODE_SPAN.finditer(line.text):
        yield m.group(2).strip()


def _command_of(words: list[str], code: Code) -> tuple[str | None, list[str]]:
    """Which project command a shell segment runs (None: not one of ours), and its arguments."""
    while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0] in _WRAPPERS
                     or (words[0].startswith("-") and len(words) > 1 and words[0] in ("-v", "-u"))):
        words = words[1:]
    if not words:
        return None, []
    first = words[0]
    name = Path(first).name if "/bin/" in first or first.startswith("./") else first
    if _PYTHONS.match(first) and len(words) > 1:
        script = words[1].removeprefix("./")
        if script in code.commands:
            return script, words[2:]
        if script == "-m" and len(words) > 2 and words[2] == "pytest":
            return "pytest", words[3:]
        if script == "-m" and len(words) > 2 and f"-m {words[2]}" in code.commands:
            return f"-m {words[2]}", words[3:]
        return None, []
    if name == "pytest":
        return "pytest", words[1:]
    if len(words) > 1 and f"{name} {words[1]}" in code.commands:
        return f"{name} {words[1]}", words[2:]
    if name in code.commands:
        return name, words[1:]
    if first.removeprefix("./") in code.commands:   # bench/x.py, scripts/x.py run directly
        return first.removeprefix("./"), words[1:]
    return None, []


def check_flags(doc: Path, text: str, root: Path, code: Code) -> list[str]:
    problems = []
    known = code.all_flags()
    for line in _logical_lines(text):
        for command_line in _commands_in(line):
            for segment in re.split(r"\|\||&&|[|;&]|\$\(|\)", command_line):
                try:
                    words = shlex.split(segment, comments=True)
                except ValueError:
                    words = segment.split()
                where = f"{doc.relative_to(root)}:{line.number}"
                command, args = _command_of(words, code)
                if command is None:
                    if line.fence is None and words and re.match(r"^--[a-z][\w-]*$", words[0].split("=")[0]):
                        flag = words[0].split("=")[0]
                        if flag not in known:
                            problems.append(f"{where}: flag {flag} is not a flag of any of the project's commands")
                    continue
                if command == "pytest":
                    continue   # pytest's own flags are many; its project flags are in the union above
                for arg in args:
                    flag = arg.split("=", 1)[0]
                    if re.match(r"^--[a-z][\w-]*$", flag) and flag not in code.commands[command]:
                        problems.append(f"{where}: flag {flag} is not a flag of `{command}`")
    return problems


def check_env(doc: Path, text: str, root: Path, code: Code) -> list[str]:
    problems = []
    for line in doc_lines(text):
        for m in _ENV.finditer(line.text):
            name, after = m.group(0), line.text[m.end():m.end() + 1]
            if after in ("*", "<", "{", "…") or name.endswith("_"):
                if not any(n.startswith(name) for n in code.env_names | code.env_prefixes):
                    problems.append(f"{doc.relative_to(root)}:{line.number}: no setting starts with {name}")
            elif name not in code.env_names:
                problems.append(f"{doc.relative_to(root)}:{line.number}: environment variable {name} "
                                "is not a setting nor read by the code")
    return problems


def check_doc(doc: Path, root: Path, code: Code) -> list[str]:
    text = doc.read_text()
    problems = check_links(doc, text, root) + check_citations(doc, text, root, benchmark_titles(root))
    if ARCHIVE not in doc.relative_to(root).parents:
        problems += check_paths(doc, text, root, code)
        problems += check_dotted(doc, text, root)
        problems += check_flags(doc, text, root, code)
        problems += check_env(doc, text, root, code)
    return problems


def docs() -> list[Path]:
    """README.md, BENCHMARKS.md, docs/ (with the benchmark archive), and every other tracked
    markdown file (the packages' READMEs, proto/README.md)."""
    first = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return first + [ROOT / n for n in _tracked("*.md") if ROOT / n not in first]


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
    for name in _tracked("*.py", "*.sh", "*.yml", "*.yaml", "*.toml"):
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
