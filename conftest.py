import gc
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_STARTED = time.monotonic()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", default=False, help="run slow/long cases too")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):   # pytest-xdist: see START_FIRST
        config.option.loadscopereorder = False
    # gRPC AsyncIO keeps one process-wide poller thread, reference-counted by live aio
    # channels/servers; when the count drops to 0 (the garbage collector freeing the last
    # one, at any later moment) it shuts the completion queue down and joins the poller,
    # which blocks for good if a finished test left an operation pending on it. Tests
    # create and drop many event loops, channels and servers, so hold one reference for the
    # whole session: the poller then lives until the process exits, as in a server process.
    from grpc._cython import cygrpc

    cygrpc.init_grpc_aio()
    # Which kinds of checks ran, by outcome (a kind whose tests all skipped at run time fails CI).
    from tests.fixtures.suite_kinds import KINDS, KindOutcomes

    config.pluginmanager.register(KindOutcomes(KINDS), "pagedkv-kind-outcomes")
    _start_kernel_cache_warm_up(config)
    _use_fork_server(config)


# Service processes (block manager, compute nodes, API server) started through
# demo.localstack.start_process are forked from an interpreter that has torch & co. imported,
# instead of each paying Python's start-up (tests/support/fork_server.py). In an xdist run the
# controller starts that interpreter while the workers start and collect, and both workers use
# it (one per worker cost ~3.5 CPU-s more); a serial run starts its own on first use.
# PAGEDKV_TEST_FORK_SERVER=0: plain subprocess.Popen; so on macOS, where fork() without exec
# is unsafe once system frameworks are loaded.
def _use_fork_server(config: pytest.Config) -> None:
    if os.environ.get("PAGEDKV_TEST_FORK_SERVER") == "0" or sys.platform != "linux":
        return
    from tests.support import fork_server

    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        fork_server.start_shared()
        return
    import demo.localstack

    demo.localstack.start_process = fork_server.shared().popen


# Numba compiles the CPU kernels on first use (~20 CPU-s for all of them) and keeps them in
# its on-disk cache (kernels/cpu/__pycache__), empty in a fresh clone. Every process that
# needs a kernel before the cache holds it compiles it again: in an xdist run the workers and
# the compute-node processes they start did so side by side (one admin-CLI test alone paid a
# node's 20 s cold start). So the controller of an xdist run compiles them once, in a
# subprocess, while the workers start and run the simulator groups (which do not use them);
# with a warm cache this costs a process start (~3 CPU-s). Its failure changes nothing: each
# process then compiles what it needs, as before.
#
# The workers wait for it (`_wait_for_kernel_cache`) before their first test outside
# START_FIRST: those (~45 s of work on each worker) use no CPU kernel and overlap the cold
# compile, and a node process started before the cache holds its kernels compiled them again
# (the admin CLI's compute-node test paid 10.5 instead of 3 CPU-s for starting ahead of it). The warm-up writes
# a marker when it ends, whether it compiled or failed, so the wait is bounded either way.
_WARM_UP = ("import sys\n"
            "try:\n"
            "    from compute_node.service.warmup import warm_up_cpu_kernels\n"
            "    warm_up_cpu_kernels(num_kv_heads=2, head_dim=64, dtype='float16')\n"
            "finally:\n"
            "    open(sys.argv[1], 'w').close()\n")
_WARM_UP_DONE_ENV = "PAGEDKV_TEST_KERNEL_CACHE_DONE"
_WARM_UP_WAIT_S = 120.0
_warm_up: subprocess.Popen[bytes] | None = None
_waited_for_warm_up = False


def _start_kernel_cache_warm_up(config: pytest.Config) -> None:
    global _warm_up
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return                                  # a worker, or not an xdist run
    root = str(config.rootpath)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = Path(tempfile.mkdtemp(prefix="pagedkv-kernel-cache-")) / "done"
    _warm_up = subprocess.Popen([sys.executable, "-c", _WARM_UP, str(done)], cwd=root, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ[_WARM_UP_DONE_ENV] = str(done)     # inherited by the workers, started after this


def _wait_for_kernel_cache(item: pytest.Item) -> None:
    global _waited_for_warm_up
    done = os.environ.get(_WARM_UP_DONE_ENV)
    if _waited_for_warm_up or not done or item.nodeid.startswith(START_FIRST):
        return
    _waited_for_warm_up = True
    deadline = time.monotonic() + _WARM_UP_WAIT_S
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.2)


# Outside pytest-timeout's per-test timer (its wrapper runs inside this one), so a test with a
# short timeout is not charged for the wait; nor does the wait show in its --durations.
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _wait_for_kernel_cache(item)
    yield


def _reap_kernel_cache_warm_up() -> None:
    if _warm_up is not None and _warm_up.poll() is None:
        try:
            _warm_up.wait(timeout=300)
        except subprocess.TimeoutExpired:
            _warm_up.kill()
            _warm_up.wait()
    done = os.environ.pop(_WARM_UP_DONE_ENV, None)
    if _warm_up is not None and done:
        shutil.rmtree(Path(done).parent, ignore_errors=True)


# The CUDA-side kernel checks are handed out first: the simulator (~25 s in one process) and the
# sm_90 compiles (PTX, then SASS: ~10 and ~17 s), split between the two workers. None of them
# uses a CPU kernel, so they run while the kernel-cache warm-up compiles (above), instead of a
# worker waiting for it. pytest-xdist's loadscope would otherwise hand out the scopes with the
# most tests first, so its reordering is switched off in `pytest_configure`: the queue follows
# the collection order (these three, in that order, then HEAVY_FIRST).
START_FIRST = ("tests/kernels/test_cuda_simulator.py::", "tests/kernels/test_cuda_compile_ptx.py::",
               "tests/kernels/test_kernel_sass.py::")

# Then the modules that take >= ~10 s of wall in all (service stacks, subprocess suites),
# longest first, so the many short modules fill in at the end (longest-processing-time-first).
# In collection order integration_tests/ came last: one worker ran test_stack.py and the defrag
# stress (~80 s) at the end while the other sat idle for ~70 s (a fresh clone's run, 2 workers).
# From the wall column of `python -m tools.suite_cpu DIR --files 20`; an entry that is out of
# date costs only balance, and tests/test_suite_kinds.py checks that each still names a file.
HEAVY_FIRST = (
    "integration_tests/test_stack.py", "integration_tests/test_fleet.py", "integration_tests/test_defrag_stress.py",
    "tests/test_readme.py", "tests/engine/test_fleet.py",
    "tests/engine/test_prefix_fetch.py", "tests/engine/test_engine_remote.py", "tests/engine/test_api_server.py",
    "integration_tests/test_stack_mtls.py", "integration_tests/test_api_stack.py",
    "tests/block_manager/service/test_service_sessions.py",
    "tests/test_demo_attention_swaps.py", "tests/engine/test_disk_tier_process.py", "tests/test_cli_errors.py",
    "tests/test_service_processes.py", "tests/engine/test_llm.py",
)
_HEAVY_RANK = {path: rank for rank, path in enumerate(HEAVY_FIRST, start=1)}


def _schedule_rank(item: pytest.Item) -> int:
    for rank, prefix in enumerate(START_FIRST):
        if item.nodeid.startswith(prefix):
            return rank - len(START_FIRST)
    return _HEAVY_RANK.get(item.nodeid.split("::", 1)[0], len(HEAVY_FIRST) + 1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_schedule_rank)   # stable: within a rank, the collection order
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# A test process holds ~1 million objects once collected (torch, transformers, numba, the test
# modules), and every full collection walks them all: ~15 per worker in a run, ~5 CPU-s each
# worker. Nearly all of them live until the process exits, so after collection they are moved
# out of the collector's sight (`gc.freeze`); what the tests create is collected as usual.
def pytest_collection_finish(session: pytest.Session) -> None:
    global _collect_cpu_s
    gc.collect()
    gc.freeze()
    _collect_cpu_s = _cpu_s(resource.RUSAGE_SELF) + _cpu_s(resource.RUSAGE_CHILDREN)


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


# The CPU of the children this process had reaped before pytest loaded this file: `scripts/run.sh
# test` execs pytest from the shell that built the venv, and the counter survives exec. Without
# it a fresh clone's suite-cost line counted pip's CPU as the suite's. (The shell's own CPU, in
# RUSAGE_SELF, is a few ms.)
_CHILDREN_CPU_AT_START = _cpu_s(resource.RUSAGE_CHILDREN)


_WORKER_CPU_S: list[float] = []
_WORKER_COLLECT_CPU_S: list[float] = []
_PARTS_CPU_S: dict[str, float] = {}      # the controller's: processes it reaped itself
_collect_cpu_s = 0.0
_FORKED: list[int] = []                     # service starts through the fork server, per test process
_ENV_MISMATCHES: dict[str, int] = {}        # ... and those run by plain exec: variable -> times


def _reaped(part: str, reap: Callable[[], None]) -> None:
    before = _cpu_s(resource.RUSAGE_CHILDREN)
    reap()
    _PARTS_CPU_S[part] = _cpu_s(resource.RUSAGE_CHILDREN) - before


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.support import fork_server

    # Before the suite-cost line, which counts the warm-up's CPU and the fork server's, with its
    # children's (the services the tests started through it).
    _reaped("kernel warm-up", _reap_kernel_cache_warm_up)
    server = fork_server.shared()
    _reaped("fork server + its services", server.close)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:            # an xdist worker: hand its CPU time to the controller
        workeroutput["cpu_s"] = _cpu_s(resource.RUSAGE_SELF) + _cpu_s(resource.RUSAGE_CHILDREN)
        workeroutput["collect_cpu_s"] = _collect_cpu_s
        workeroutput["forked"] = server.num_forked
        workeroutput["env_mismatches"] = dict(server.env_mismatches)
    elif server.num_forked or server.env_mismatches:
        _count_fork_server_starts(server.num_forked, server.env_mismatches)


def _count_fork_server_starts(num_forked: int, env_mismatches: dict[str, int]) -> None:
    _FORKED.append(num_forked)
    for key, times in env_mismatches.items():
        _ENV_MISMATCHES[key] = _ENV_MISMATCHES.get(key, 0) + times


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    output = getattr(node, "workeroutput", {})
    _WORKER_CPU_S.append(float(output.get("cpu_s", 0.0)))
    _WORKER_COLLECT_CPU_S.append(float(output.get("collect_cpu_s", 0.0)))
    _count_fork_server_starts(int(output.get("forked", 0)), dict(output.get("env_mismatches", {})))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """The suite's cost, printed (never asserted): wall time and the CPU seconds of this process,
    its xdist workers and every process they waited for (the services tests start), then where
    they went. The CPU figure is what a shared 2-core machine notices; compare runs by it, not by
    wall time alone (and side by side: it moves with the host's load)."""
    if hasattr(config, "workerinput"):
        return
    children = max(_cpu_s(resource.RUSAGE_CHILDREN) - _CHILDREN_CPU_AT_START, sum(_WORKER_CPU_S))
    own = _cpu_s(resource.RUSAGE_SELF)
    cpu = own + children
    workers = len(_WORKER_CPU_S)
    terminalreporter.write_sep("-", f"suite cost: {time.monotonic() - _STARTED:.0f} s wall, {cpu:.0f} CPU-s "
                                    f"(with {workers or 'no'} xdist workers and the processes the tests started)")
    if workers:
        parts = [f"workers {' + '.join(f'{c:.0f}' for c in _WORKER_CPU_S)} (collection "
                 f"{' + '.join(f'{c:.0f}' for c in _WORKER_COLLECT_CPU_S)}; the rest: tests and the processes "
                 f"they waited for)"]
        parts += [f"{name} {c:.0f}" for name, c in _PARTS_CPU_S.items() if c >= 0.5]
        parts.append(f"controller {own:.0f}")
        terminalreporter.write_line("suite cost by process: " + ", ".join(parts))
    if sum(_FORKED) or _ENV_MISMATCHES:
        line = f"services started by the fork server: {sum(_FORKED)}"
        if _ENV_MISMATCHES:
            line += ("; by plain exec instead, the environment differing from the fork server's: "
                     + ", ".join(f"{k} ({n}x)" for k, n in sorted(_ENV_MISMATCHES.items()))
                     + " (a test that leaves the environment changed?)")
        terminalreporter.write_line(line)
