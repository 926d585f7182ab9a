"""A refused cold-table fetch keeps the block manager's meaning in the Forward's status
(UNAVAILABLE only when the block manager cannot be reached: schedulers retry that one), and the
node refuses ids the block manager would refuse, itself, before asking anyone.

Real block manager and compute node over real sockets (the `cluster` fixture)."""

from __future__ import annotations

import grpc
import pytest

from compute_node.client import build_request
from compute_node.errors import (
    BlockManagerRefused,
    BlockManagerUnavailable,
    InvalidForward,
    NodeFenced,
    StaleTable,
    UnknownSequence,
)
from compute_node.service.bm_link import LinkFenced, LinkNotFound, LinkRejected, LinkUnavailable
from compute_node.service.node import cold_fetch_error
from pagedkv.limits import MAX_SEQ_ID_LEN
from tests.compute_node.harness import BLOCK_SIZE, NUM_BLOCKS, NUM_LAYERS, Scheduler
from tests.compute_node.test_forward_errors import _pool_state, _same


def _get_tables_calls(cluster) -> float:  # type: ignore[no-untyped-def]
    return cluster.node.node.metrics.bm_rpcs.labels("GetTables")._value.get()


async def test_forward_naming_a_sequence_of_another_pool_is_invalid_argument(cluster) -> None:  # type: ignore[no-untyped-def]
    """`w` lives on pool node-b; a Forward to node-a naming it makes node-a fetch its table,
    which the block manager refuses with INVALID_ARGUMENT: the Forward says so (it used to
    answer UNAVAILABLE, which a scheduler would retry forever)."""
    other = Scheduler(cluster.bm.address, cluster.node.address, "node-b")
    try:
        await other.client.register_node("node-b", NUM_BLOCKS, block_size=BLOCK_SIZE)
        step = await other.allocate("w", [1, 2, 3])
        before = _pool_state(cluster)
        request = build_request([other.seq_input(step)], list(range(NUM_LAYERS)), steps=[])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await cluster.sched.node.Forward(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "'w' is on pool 'node-b', not 'node-a'" in info.value.details()
        assert _same(_pool_state(cluster), before)
    finally:
        await other.close()


async def test_overlong_seq_id_is_refused_by_the_node_itself(cluster) -> None:  # type: ignore[no-untyped-def]
    s = cluster.sched
    await s.forward([await s.allocate("x", [1, 2, 3])])
    before, calls = _pool_state(cluster), _get_tables_calls(cluster)
    step = s.new_step("x", 1)
    request = s.request([step])
    request.sequences[0].seq_id = "s" * 300
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.node.Forward(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"has 300 characters (at most {MAX_SEQ_ID_LEN})" in info.value.details()
    assert _get_tables_calls(cluster) == calls   # the block manager was not asked
    assert _same(_pool_state(cluster), before)
    # the limit itself is accepted (the node then asks the block manager, which knows no such id)
    request.sequences[0].seq_id = "s" * MAX_SEQ_ID_LEN
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.node.Forward(request)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()


@pytest.mark.parametrize(
    ("link_error", "expected", "code"),
    [
        (LinkUnavailable(grpc.StatusCode.UNAVAILABLE, "connection refused"), BlockManagerUnavailable,
         grpc.StatusCode.UNAVAILABLE),
        (LinkUnavailable(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"), BlockManagerUnavailable,
         grpc.StatusCode.UNAVAILABLE),
        (LinkNotFound(grpc.StatusCode.NOT_FOUND, "unknown sequence 'x'"), UnknownSequence, grpc.StatusCode.NOT_FOUND),
        (LinkFenced(grpc.StatusCode.FAILED_PRECONDITION, "stale epoch"), NodeFenced,
         grpc.StatusCode.FAILED_PRECONDITION),
        (LinkRejected(grpc.StatusCode.INVALID_ARGUMENT, "bad id"), InvalidForward, grpc.StatusCode.INVALID_ARGUMENT),
        (LinkRejected(grpc.StatusCode.ABORTED, "newer version"), StaleTable, grpc.StatusCode.ABORTED),
        (LinkRejected(grpc.StatusCode.PERMISSION_DENIED, "not you"), BlockManagerRefused, grpc.StatusCode.INTERNAL),
        (LinkRejected(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many calls"), BlockManagerRefused,
         grpc.StatusCode.RESOURCE_EXHAUSTED),
        (LinkRejected(grpc.StatusCode.INTERNAL, "bug"), BlockManagerRefused, grpc.StatusCode.INTERNAL),
    ],
)
def test_cold_fetch_error_keeps_the_block_managers_status(link_error, expected, code) -> None:  # type: ignore[no-untyped-def]
    err = cold_fetch_error(link_error)
    assert type(err) is expected
    assert err.code == code
    assert link_error.details in str(err)
