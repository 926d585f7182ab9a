"""The pair as real processes, started from docker-compose.yml (see engine.localstack)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.localstack import LocalStack
from integration_tests.helpers import LEASE_TTL_S


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    workdir = tmp_path_factory.mktemp("stack")
    env = {"PAGEDKV_LEASE_TTL_S": str(LEASE_TTL_S), "PAGEDKV_CN_NUM_BLOCKS": "1024", "PAGEDKV_LOG_LEVEL": "WARNING"}
    with LocalStack(Path(workdir), interp_env=env) as s:
        s.up()
        yield s
