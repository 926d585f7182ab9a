"""Fixtures of the client tests: a block manager on a background loop (127.0.0.1:0)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.block_manager.client.server_thread import ServerThread


@pytest.fixture
def bm() -> Iterator[ServerThread]:
    st = ServerThread()
    yield st
    st.stop()


@pytest.fixture
def bm_token() -> Iterator[ServerThread]:
    st = ServerThread(admin_token="s3cret")
    yield st
    st.stop()
