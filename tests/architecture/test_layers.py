"""The house's floors (design §5), enforced on every import statement in the tree.

Imports only run downward:
1. `pagedkv/` (ground floor: generated stubs, settings, logging, server lifecycle, retry,
   stats) imports nothing of ours; its `__init__` may re-export entry points lazily, from
   inside a function, never at import time;
2. `kernels/` (numba, numpy, torch) and `block_manager/core/` (stdlib and numpy: its
   per-sequence and per-block state are arrays, issue 20);
3. `block_manager/{store,service,client,cli,trace}` and `compute_node/` — `compute_node`
   never imports `block_manager`, the client never imports the server side;
4. `engine/` (the scheduler side): nothing below imports it; within it, the OpenAI server
   (`engine/api/`) sits on top of the engine, which never imports it;
5. `demo/` (the demo, the synthetic serving driver, the local process stack): above the engine,
   and nothing of the product imports it.

Every import counts, including ones inside functions (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OURS = ("pagedkv", "kernels", "block_manager", "compute_node", "engine", "demo", "tools")
THIRD_PARTY_KERNELS = {"numba", "numpy", "torch", "llvmlite"}  # llvmlite is numba's own backend


def _modules(package: str) -> list[Path]:
    return sorted(p for p in (REPO / package).rglob("*.py") if "v1" not in p.relative_to(REPO).parts)


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module, at module level?) for every import in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found: list[tuple[int, str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:  # `from pkg import submodule` depends on the submodule
                sub = f"{node.module}.{alias.name}"
                is_module = (REPO / Path(*sub.split("."))).with_suffix(".py").exists()
                found.append((node.lineno, sub if is_module else node.module, id(node) in top_level))
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _root(module: str) -> str:
    return module.split(".")[0]


def _violations(package: str, allowed) -> list[str]:  # type: ignore[no-untyped-def]
    bad = []
    for path in _modules(package):
        rel = path.relative_to(REPO)
        for line, module, top in _imports(path):
            reason = allowed(str(rel), module, top)
            if reason:
                bad.append(f"{rel}:{line}: imports {module} ({reason})")
    return bad


def _ground_floor(rel: str, module: str, top: bool) -> str | None:
    if _root(module) in OURS and _root(module) != "pagedkv":
        if rel == "pagedkv/__init__.py" and not top:
            return None  # lazy re-export of a public entry point
        return "the ground floor imports nothing of ours"
    return None


def _kernels(rel: str, module: str, top: bool) -> str | None:
    root = _root(module)
    if root in OURS and root != "kernels":
        return "kernels import only numba, numpy, torch"
    if root not in sys.stdlib_module_names and root not in THIRD_PARTY_KERNELS and root not in OURS:
        return "kernels import only numba, numpy, torch"
    return None


def _core(rel: str, module: str, top: bool) -> str | None:
    if not rel.startswith("block_manager/core/"):
        return None
    if module.startswith("block_manager.core"):
        return None
    if _root(module) not in sys.stdlib_module_names and _root(module) != "numpy":
        return "the core imports only the standard library and numpy"
    return None


def _block_manager(rel: str, module: str, top: bool) -> str | None:
    root = _root(module)
    if root in ("compute_node", "engine", "demo", "tools"):
        return f"block_manager never imports {root}"
    if rel.startswith(("block_manager/client/", "block_manager/store/", "block_manager/trace/")) and (
        _within(module, "block_manager.service") or _within(module, "block_manager.cli")
    ):
        return "clients, store and trace tooling sit below the service and the CLI"
    return None


# The replayable state machine and its durability: what the journal records must not depend
# on the transport, so these modules never import grpc or the generated stubs.
TRANSPORT_FREE = tuple(
    f"block_manager/service/{name}.py"
    for name in ("state", "state_codec", "runtime", "journal_writer", "request_index", "errors")
)


def _transport_free(rel: str, module: str, top: bool) -> str | None:
    if rel.startswith(TRANSPORT_FREE) and (_root(module) == "grpc" or _within(module, "pagedkv.v1")):
        return "the state machine and its journal are transport-free"
    return None


def _compute_node(rel: str, module: str, top: bool) -> str | None:
    root = _root(module)
    if root in ("block_manager", "engine", "demo", "tools"):
        return f"compute_node never imports {root}"
    if not rel.startswith("compute_node/service/") and _within(module, "compute_node.service"):
        return "the node's domain sits below its service"
    return None


def _engine(rel: str, module: str, top: bool) -> str | None:
    if _root(module) == "tools":
        return "tools are dev-only"
    if _root(module) == "demo":
        return "the engine never imports the demo"
    if not rel.startswith("engine/api/") and _within(module, "engine.api"):
        return "the engine never imports its API server"
    return None


# The scheduler speaks plain data and typed errors to the nodes (`engine.node_api`): only the
# executors (`engine.executor`, `engine.local_node`) and the in-process block manager know the
# transport, and nothing of the scheduler pulls in torch.
SCHEDULER = tuple(
    f"engine/{name}.py"
    for name in ("llm_engine", "scheduler", "queues", "step_plan", "config", "pipeline", "swapping", "stats",
                 "sequence", "failure_policy", "node_api", "errors", "health", "bm_steps", "discovery", "params",
                 "async_engine")
)


def _scheduler(rel: str, module: str, top: bool) -> str | None:
    if rel not in SCHEDULER:
        return None
    if _root(module) in ("grpc", "torch", "compute_node") or _within(module, "pagedkv.v1"):
        return "the scheduler imports neither the transport nor the model stack"
    if _within(module, "engine.executor") or _within(module, "engine.local_node"):
        return "the scheduler reaches nodes through engine.node_api"
    return None


def _demo(rel: str, module: str, top: bool) -> str | None:
    return "tools are dev-only" if _root(module) == "tools" else None


@pytest.mark.parametrize(
    ("package", "rule"),
    [
        ("pagedkv", _ground_floor),
        ("kernels", _kernels),
        ("block_manager", _core),
        ("block_manager", _block_manager),
        ("block_manager", _transport_free),
        ("compute_node", _compute_node),
        ("engine", _engine),
        ("engine", _scheduler),
        ("demo", _demo),
    ],
    ids=[
        "ground-floor",
        "kernels",
        "core-stdlib-and-numpy-only",
        "block-manager",
        "transport-free-state",
        "compute-node",
        "engine",
        "scheduler-transport-free",
        "demo",
    ],
)
def test_imports_run_downward(package: str, rule) -> None:  # type: ignore[no-untyped-def]
    assert _violations(package, rule) == []


def test_nothing_imports_the_engine() -> None:
    bad = []
    for package in ("pagedkv", "kernels", "block_manager", "compute_node"):
        for path in _modules(package):
            rel = path.relative_to(REPO)
            for line, module, top in _imports(path):
                if _root(module) in ("engine", "demo") and not (str(rel) == "pagedkv/__init__.py" and not top):
                    bad.append(f"{rel}:{line}: imports {module}")
    assert bad == []


def test_the_checker_sees_lazy_imports(tmp_path: Path) -> None:
    """The rule must catch an upward import hidden inside a function."""
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from block_manager.core import BlockManager\n")
    assert (4, "block_manager.core", False) in _imports(module)
    assert _compute_node("compute_node/x.py", "block_manager.core", False)


def test_core_has_no_import_cycle() -> None:
    """Within the core, modules form a DAG (the manager depends on fsck/snapshot, never back)."""
    core = REPO / "block_manager" / "core"
    graph: dict[str, set[str]] = {}
    for path in core.glob("*.py"):
        name = path.stem
        deps = set()
        for _, module, _ in _imports(path):
            if module.startswith("block_manager.core."):
                deps.add(module.split(".")[2])
            elif module == "block_manager.core":
                deps.add("__init__")
        graph[name] = deps - {name}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack, node, dep]
            if dep not in state and (cycle := visit(dep, [*stack, node])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            pytest.fail(f"import cycle in block_manager/core: {' -> '.join(cycle)}")
