import sys

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", default=False, help="run slow/long cases too")


def pytest_configure(config: pytest.Config) -> None:
    # The Numba CUDA simulator runs one OS thread per GPU thread; a short switch
    # interval makes those threads hand over quickly (several times faster).
    sys.setswitchinterval(5e-4)
    # gRPC AsyncIO keeps one process-wide poller thread, reference-counted by live aio
    # channels/servers; when the count drops to 0 (the garbage collector freeing the last
    # one, at any later moment) it shuts the completion queue down and joins the poller,
    # which blocks for good if a finished test left an operation pending on it. Tests
    # create and drop many event loops, channels and servers, so hold one reference for the
    # whole session: the poller then lives until the process exits, as in a server process.
    from grpc._cython import cygrpc

    cygrpc.init_grpc_aio()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
