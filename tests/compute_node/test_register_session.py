"""The node registers in a block-manager session: a RegisterNode whose answer was lost is
resent on the next try and answered from the record (the same epoch; no second epoch is
started and fenced), over a real block manager behind a proxy that drops answers."""

from __future__ import annotations

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
