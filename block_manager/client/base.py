"""State shared by the sync and async data-plane clients (they differ only in transport)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

from block_manager.client.retry import ClientStats, RetryPolicy
from block_manager.client.step import SequenceTracker
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT_S = 5.0
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class ClientBase:
    """Data plane of one block manager. Use as a context manager or call `close()`.

    `block_sizes` (pool id -> block size) lets the step helper answer in-block decode
    appends locally; pools registered through this client are learned automatically.
    """

    def __init__(
        self,
        target: str,
        channel: Any | None,
        new_channel: Callable[..., Any],
        *,
        timeout_s: float,
        retry: RetryPolicy | None,
        block_sizes: Mapping[str, int] | None,
        seed: int | None,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._own_channel = channel is None
        self._channel = channel if channel is not None else new_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.BlockManagerStub(self._channel)
        self._rng = random.Random(seed)
        self.stats = ClientStats()
        self.tracker = SequenceTracker(block_sizes)
