"""The checks of the docs-reference test (tests/test_docs_references.py): each takes a doc's
path and text and returns its problems as `path:line: what`."""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

from tests.support.docs_code import ROOT, Code, tracked
from tests.support.docs_markdown import CODE_SPAN, HEADING, LINK, Line, anchors, doc_lines

ARCHIVE = Path("docs/benchmarks")

_PATH = re.compile(r"(?<![\w/.~$=-])([A-Za-z_][\w.-]*/[\w./-]*[\w/])")
_ENV = re.compile(r"PAGEDKV_[A-Z0-9_]*[A-Z0-9_]")
_WRAPPERS = {"time", "/usr/bin/time", "env", "exec", "nohup", "sudo", "command"}
_PYTHONS = re.compile(r"^(?:.*/)?python(?:3(?:\.\d+)?)?$")


def check_links(doc: Path, text: str, root: Path) -> list[str]:
    problems = []
    for line in doc_lines(text):
        if line.fence is not None:
            continue
        for m in LINK.finditer(CODE_SPAN.sub("", line.text)):
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
        for m in CODE_SPAN.finditer(line.text):
            d = _DOTTED.match(m.group(2).strip())
            problem = dotted_problem(d.group(1), root) if d is not None else None
            if d is not None and problem:
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
            m = HEADING.match(line.text) if line.fence is None else None
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
    for m in CODE_SPAN.finditer(line.text):
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
    return first + [ROOT / n for n in tracked("*.md") if ROOT / n not in first]
