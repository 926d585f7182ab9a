import resource
import time

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


# The longest single tests (each simulator group runs minutes in its own process) are handed
# out first, one to each worker: the workers then share the many short modules, instead of one
# long group starting last and running alone at the end. pytest-xdist's loadscope would
# otherwise hand out the scopes with the most tests first (these are one test each), so its
# reordering is switched off in `pytest_configure`: the queue follows the collection order.
START_FIRST = ("tests/kernels/test_cuda_simulator.py::",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda i: not i.nodeid.startswith(START_FIRST))   # stable: else unchanged
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


_WORKER_CPU_S: list[float] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:            # an xdist worker: hand its CPU time to the controller
        workeroutput["cpu_s"] = _cpu_s(resource.RUSAGE_SELF) + _cpu_s(resource.RUSAGE_CHILDREN)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    _WORKER_CPU_S.append(float(getattr(node, "workeroutput", {}).get("cpu_s", 0.0)))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """The suite's cost, printed (never asserted): wall time and the CPU seconds of this process,
    its xdist workers and every process they waited for (the services tests start). The CPU
    figure is what a shared 2-core machine notices; compare runs by it, not by wall time alone."""
    if hasattr(config, "workerinput"):
        return
    children = max(_cpu_s(resource.RUSAGE_CHILDREN), sum(_WORKER_CPU_S))
    cpu = _cpu_s(resource.RUSAGE_SELF) + children
    workers = len(_WORKER_CPU_S)
    terminalreporter.write_sep("-", f"suite cost: {time.monotonic() - _STARTED:.0f} s wall, {cpu:.0f} CPU-s "
                                    f"(with {workers or 'no'} xdist workers and the processes the tests started)")
