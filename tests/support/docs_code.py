"""What the docs may refer to, read from the code, for the docs-reference test
(tests/test_docs_references.py): each command's flags from its argparse parser, the `PAGEDKV_*`
names from the settings classes, the parsers' help and the code's own literals, the tracked
files."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import signal
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]


class _Captured(BaseException):
    """Raised by a patched `parse_args` to hand back the parser a `main(argv)` built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def _capture_parser(entry: Callable[[list[str]], object], argv: list[str]) -> argparse.ArgumentParser | None:
    """The parser `entry(argv)` parses its command line with, without running the command."""

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Captured(self)

    sigint = signal.getsignal(signal.SIGINT)   # a `main` may take Ctrl-C over (pagedkv.cli.catch_ctrl_c)
    try:
        with (mock.patch.object(argparse.ArgumentParser, "parse_args", capture),
              mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture)):
            entry(argv)
    except _Captured as c:
        return c.parser
    finally:
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

    for name in tracked("*.py"):   # the modules that declare settings classes
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


def tracked(*patterns: str) -> list[str]:
    return subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


def _literal_env(code: Code) -> None:
    """Names read straight from the environment somewhere: any `PAGEDKV_*` literal in a tracked
    file that is not documentation."""
    files = tracked()
    for name in files:
        if name.endswith(".md") or "_pb2" in name or name == "tests/test_docs_references.py":
            continue   # its planted names are not the code's
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
        if top is None:
            raise RuntimeError(f"{name}: main([]) parsed no command line")
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
    for name in tracked("*.py"):   # `python -m pagedkv.healthcheck --tls-env ...`
        text = (ROOT / name).read_text()
        if name.split("/", 1)[0] in _PACKAGES and "__main__" in text and "add_argument" in text:
            module = ".".join(Path(name).with_suffix("").parts)
            light = "def main(" in text and not re.search(r"^(import|from) torch", text, re.MULTILINE)
            main = getattr(importlib.import_module(module), "main", None) if light else None   # torch: seconds
            module_parser = _capture_parser(main, []) if main is not None else None
            code.commands[f"-m {module}"] = (_options(module_parser) if module_parser is not None
                                             else _script_flags(ROOT / name))
    code.commands["pytest"] = _script_flags(ROOT / "conftest.py") | _script_flags(ROOT / "tests" / "conftest.py")
    _settings_env(code)
    _literal_env(code)
    return code
