"""The pair as real processes, started from docker-compose.yml (see engine.localstack).

Two fixtures: `stack`, shared by the tests of a module that only drive it and leave it as they
found it (every sequence freed), and `fresh_stack`, a stack of its own for a test that kills or
restarts a service. So no test depends on another having run before it, or on its order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.localstack import LocalStack
from integration_tests.helpers import LEASE_TTL_S
from tests.fixtures.certs import dev_certs

__all__ = ["dev_certs"]

STACK_ENV = {"PAGEDKV_LEASE_TTL_S": str(LEASE_TTL_S), "PAGEDKV_CN_NUM_BLOCKS": "1024", "PAGEDKV_LOG_LEVEL": "WARNING"}


def _up(workdir: Path) -> LocalStack:
    stack = LocalStack(workdir, interp_env=STACK_ENV)
    try:
        stack.up()
    except BaseException:
        stack.down()
        raise
    return stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = _up(tmp_path_factory.mktemp("stack"))
    try:
        yield s
    finally:
        s.down()


@pytest.fixture
def fresh_stack(tmp_path: Path) -> Iterator[LocalStack]:
    s = _up(tmp_path / "stack")
    try:
        yield s
    finally:
        s.down()
