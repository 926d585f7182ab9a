"""`TierKind`: the numbers of `PoolStep.tier_kind` that the block manager writes, the compute
node runs and the engine counts."""

from __future__ import annotations

import json

import pytest

from pagedkv.tiers import TierKind

PROTO_NUMBERS = {"swap_out": 1, "swap_in": 2, "offload": 3, "onboard": 4, "disk_offload": 5, "disk_onboard": 6}


@pytest.mark.parametrize(("name", "number"), sorted(PROTO_NUMBERS.items()))
def test_each_kind_is_its_wire_number(name: str, number: int) -> None:
    kind = TierKind.of(name)
    assert kind == number and kind.value == number and TierKind(number) is kind
    assert json.dumps([kind]) == f"[{number}]"   # the journal writes the bare number


def test_directions() -> None:
    assert {k for k in TierKind if k.to_host} == {TierKind.SWAP_OUT, TierKind.OFFLOAD}
    assert {k for k in TierKind if k.to_device} == {TierKind.SWAP_IN, TierKind.ONBOARD}
    assert {k for k in TierKind if k.is_disk} == {TierKind.DISK_OFFLOAD, TierKind.DISK_ONBOARD}
    with pytest.raises(KeyError):
        TierKind.of("sideways")
    with pytest.raises(ValueError):
        TierKind(7)
