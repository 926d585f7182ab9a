import sys

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", default=False, help="run slow/long cases too")


def pytest_configure(config: pytest.Config) -> None:
    # The Numba CUDA simulator runs one OS thread per GPU thread; a short switch
    # interval makes those threads hand over quickly (several times faster).
    sys.setswitchinterval(5e-4)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
