"""The one block manager test configuration: an in-process server on an ephemeral port with a
memory store, no watermark and no background defrag (tests that want those say so)."""

from __future__ import annotations

from typing import Any

from block_manager.service.config import BlockManagerConfig, load_config


def bm_test_config(**overrides: Any) -> BlockManagerConfig:
    """Test defaults, then `overrides` (block size 4 unless a test says otherwise)."""
    base: dict[str, Any] = {
        "listen_address": "127.0.0.1:0",
        "database_url": "memory://",
        "block_size": 4,
        "lease_ttl_s": 30.0,
        "watermark": 0.0,
        "shutdown_grace_s": 0.2,
        "defrag": {"enabled": False},
    }
    base.update(overrides)
    return load_config(**base)


__all__ = ["bm_test_config"]
