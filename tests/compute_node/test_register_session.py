"""The node registers in a block-manager session: a RegisterNode whose answer was lost is
resent on the next try and answered from the record (the same epoch; no second epoch is
started and fenced), over a real block manager behind a proxy that drops answers."""

from __future__ import annotations

import asyncio

import pytest

from compute_node.service.bm_link import BlockManagerLink, LinkUnavailable
from tests.block_manager.client.server_thread import FaultProxy
from tests.compute_node.harness import start_bm

GEOMETRY = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32", "device": "cpu"}


async def test_a_registration_whose_answer_was_lost_is_resent_not_repeated() -> None:
    bm = await start_bm()
    proxy = FaultProxy(bm.address)
    await proxy.start()
    link = BlockManagerLink(f"127.0.0.1:{proxy.port}", "node-x", 5.0)
    try:
        proxy.fail_after_forward("RegisterNode")
        with pytest.raises(LinkUnavailable):
            await link.register(block_size=4, num_blocks=16, address="127.0.0.1:1", **GEOMETRY)
        registry = bm.runtime.state.registry   # type: ignore[union-attr]
        assert registry.get("node-x").epoch == 1          # the lost call was applied
        reg = await link.register(block_size=4, num_blocks=16, address="127.0.0.1:1", **GEOMETRY)
        assert reg.epoch == 1 and registry.get("node-x").epoch == 1   # answered from the record
        assert proxy.calls.count("OpenSession") == 1 and proxy.calls.count("RegisterNode") == 2
        # a new registration (nothing pending) is a new epoch, as before
        reg = await link.register(block_size=4, num_blocks=16, address="127.0.0.1:1", **GEOMETRY)
        assert reg.epoch == 2
    finally:
        await link.close()
        await proxy.stop()
        await bm.stop(0)


async def test_a_node_whose_session_went_idle_opens_a_new_one() -> None:
    """A node registers rarely: by its next registration its session may have expired. It
    opens a new one after half the TTL instead of being refused."""
    bm = await start_bm(session_window_s=0.2, session_ttl_s=0.4)
    proxy = FaultProxy(bm.address)
    await proxy.start()
    link = BlockManagerLink(f"127.0.0.1:{proxy.port}", "node-y", 5.0)
    try:
        assert (await link.register(block_size=4, num_blocks=16, address="127.0.0.1:1", **GEOMETRY)).epoch == 1
        await asyncio.sleep(0.5)
        assert (await link.register(block_size=4, num_blocks=16, address="127.0.0.1:1", **GEOMETRY)).epoch == 2
        assert proxy.calls.count("OpenSession") == 2
    finally:
        await link.close()
        await proxy.stop()
        await bm.stop(0)
