"""Bad requests to every RPC of the compute node: a typed status, and not one byte of the pool
changed (the K/V caches are compared before and after each rejected Forward)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest
import torch

from compute_node.errors import InvalidForward, StaleTable
from compute_node.forward import SeqStep, check_slots
from compute_node.tables import CachedTable, SeqId
from pagedkv.v1 import compute_node_pb2 as pb
from tests.compute_node.harness import BLOCK_SIZE, NUM_BLOCKS

Mutator = Callable[[pb.ForwardRequest], None]


def _set(field: str, value: object) -> Mutator:
    def mutate(r: pb.ForwardRequest) -> None:
        setattr(r, field, value)

    return mutate


def _seq(**kw: object) -> Mutator:
    def mutate(r: pb.ForwardRequest) -> None:
        for k, v in kw.items():
            if k == "slot_mapping":
                del r.sequences[0].slot_mapping[:]
                r.sequences[0].slot_mapping.extend(v)  # type: ignore[arg-type]
            else:
                setattr(r.sequences[0], k, v)

    return mutate


def _tensor(which: str, **kw: object) -> Mutator:
    def mutate(r: pb.ForwardRequest) -> None:
        t = getattr(r.layers[0], which)
        for k, v in kw.items():
            if k == "shape":
                del t.shape[:]
                t.shape.extend(v)  # type: ignore[arg-type]
            else:
                setattr(t, k, v)

    return mutate


def _dup_sequence(r: pb.ForwardRequest) -> None:
    r.sequences.append(r.sequences[0])


def _drop_sequences(r: pb.ForwardRequest) -> None:
    del r.sequences[:]


def _drop_layers(r: pb.ForwardRequest) -> None:
    del r.layers[:]


def _dup_layer(r: pb.ForwardRequest) -> None:
    r.layers[1].layer = r.layers[0].layer


def _key_as_f16(r: pb.ForwardRequest) -> None:
    k = r.layers[0].key
    arr = np.frombuffer(k.data, dtype=np.float32).astype(np.float16)
    k.dtype, k.data = "float16", arr.tobytes()


def _query_heads_3(r: pb.ForwardRequest) -> None:
    q = r.layers[0].query
    n, _, d = q.shape
    del q.shape[:]
    q.shape.extend([n, 3, d])
    q.data = np.zeros((n, 3, d), np.float32).tobytes()


def _second_layer_query_f16(r: pb.ForwardRequest) -> None:
    q = r.layers[1].query
    q.dtype, q.data = "float16", np.frombuffer(q.data, dtype=np.float32).astype(np.float16).tobytes()


INVALID: dict[str, Mutator] = {
    "empty request id": _set("request_id", ""),
    "no sequences": _drop_sequences,
    "duplicate sequence": _dup_sequence,
    "empty seq id": _seq(seq_id=""),
    "version 0": _seq(version=0),
    "no new tokens": _seq(slot_mapping=[]),
    "context shorter than new tokens": _seq(context_len=0),
    "slot outside the pool": _seq(slot_mapping=[NUM_BLOCKS * BLOCK_SIZE]),
    "negative slot": _seq(slot_mapping=[-1]),
    "no layers": _drop_layers,
    "layer out of range": lambda r: setattr(r.layers[0], "layer", 7),
    "duplicate layer": _dup_layer,
    "key dtype is not the pool's": _key_as_f16,
    "unknown dtype": _tensor("value", dtype="int8"),
    "byte length mismatch": _tensor("query", data=b"\x00" * 12),
    "key shape mismatch": _tensor("key", shape=[1, 1, 64]),
    "query heads not a multiple of kv heads": _query_heads_3,
    "layers disagree on query dtype": _second_layer_query_f16,
    "negative scale": _set("scale", -1.0),
    "nan scale": _set("scale", float("nan")),
}


def _pool_state(cluster) -> torch.Tensor:  # type: ignore[no-untyped-def]
    pool = cluster.node.node.pool
    return torch.stack([*pool.key_caches, *pool.value_caches]).clone()


async def _prepared(cluster):  # type: ignore[no-untyped-def]
    s = cluster.sched
    await s.forward([await s.allocate("x", [1, 2, 3, 4, 5])])
    await s.forward([await s.allocate("y", [9, 8, 7])])
    steps = await s.append(["x"])
    return s, steps


async def test_invalid_requests_are_rejected_and_write_nothing(cluster) -> None:  # type: ignore[no-untyped-def]
    s, steps = await _prepared(cluster)
    before = _pool_state(cluster)
    for name, mutate in INVALID.items():
        request = s.request(steps)
        mutate(request)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.node.Forward(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert torch.equal(_pool_state(cluster), before), f"{name}: pool changed"
    # The untouched request still works afterwards.
    await s.forward(steps)


async def test_table_dependent_errors(cluster) -> None:  # type: ignore[no-untyped-def]
    s, steps = await _prepared(cluster)
    before = _pool_state(cluster)
    y_slot = (await s.append(["y"]))[0].slot_mapping[0]
    cases: dict[str, tuple[Mutator, grpc.StatusCode]] = {
        # A slot of another sequence's block: in the pool, but not in x's table at its position.
        "slot of another sequence": (_seq(slot_mapping=[y_slot]), grpc.StatusCode.INVALID_ARGUMENT),
        "context beyond the table": (_seq(context_len=40), grpc.StatusCode.INVALID_ARGUMENT),
        "unknown sequence": (_seq(seq_id="nope"), grpc.StatusCode.NOT_FOUND),
        "version the block manager does not have": (_seq(version=1 << 40), grpc.StatusCode.ABORTED),
    }
    for name, (mutate, code) in cases.items():
        request = s.request(steps)
        mutate(request)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.node.Forward(request)
        assert info.value.code() == code, name
        assert torch.equal(_pool_state(cluster), before), f"{name}: pool changed"


async def test_one_bad_sequence_fails_the_whole_batch(cluster) -> None:  # type: ignore[no-untyped-def]
    s, steps = await _prepared(cluster)
    before = _pool_state(cluster)
    good = s.request(steps)
    bad = s.request(steps)
    bad.sequences.append(pb.ForwardSequence(seq_id="ghost", version=1, context_len=1, slot_mapping=[200]))
    for layer, src in zip(bad.layers, good.layers):   # one more token row per layer
        for name in ("query", "key", "value"):
            t = getattr(layer, name)
            per_token = len(getattr(src, name).data) // t.shape[0]
            t.shape[0] += 1
            t.data = getattr(src, name).data + b"\x00" * per_token
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.node.Forward(bad)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert torch.equal(_pool_state(cluster), before)


async def test_get_node_info(cluster) -> None:  # type: ignore[no-untyped-def]
    info = await cluster.sched.node.GetNodeInfo(pb.GetNodeInfoRequest())
    assert info.registered and info.epoch == 1 and info.node_id == "node-a"
    assert (info.block_size, info.num_blocks, info.num_kv_heads, info.dtype) == (BLOCK_SIZE, NUM_BLOCKS, 2, "float32")


async def test_unregistered_node_answers_unavailable() -> None:
    # Nothing listens on port 9 of 127.0.0.1: registration keeps failing and retrying.
    from compute_node.service.server import ComputeNodeServer
    from tests.compute_node.harness import cn_config

    server = ComputeNodeServer(cn_config("127.0.0.1:9"))
    await server.start()
    try:
        channel = grpc.aio.insecure_channel(server.address)
        from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc

        stub = pb_grpc.ComputeNodeStub(channel)
        info = await stub.GetNodeInfo(pb.GetNodeInfoRequest())
        assert not info.registered and info.epoch == 0
        request = pb.ForwardRequest(
            request_id="r", sequences=[pb.ForwardSequence(seq_id="x", version=1, context_len=1, slot_mapping=[0])]
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Forward(request)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await channel.close()
    finally:
        await server.stop(0)


def test_check_slots_distinguishes_caller_bug_from_moved_table() -> None:
    step = SeqStep(SeqId("s"), version=3, context_len=6, slot_mapping=np.array([21], np.int64), row_start=0)

    class Batch:
        seqs = [step]

    same_version = {SeqId("s"): CachedTable(SeqId("s"), (7, 5), 3)}
    check_slots(Batch, same_version, 4)  # type: ignore[arg-type]   # position 5 -> block 5, slot 21
    moved = {SeqId("s"): CachedTable(SeqId("s"), (7, 9), 4)}   # defrag moved block 5 -> 9
    with pytest.raises(StaleTable):
        check_slots(Batch, moved, 4)  # type: ignore[arg-type]
    wrong = {SeqId("s"): CachedTable(SeqId("s"), (7, 9), 3)}
    with pytest.raises(InvalidForward):
        check_slots(Batch, wrong, 4)  # type: ignore[arg-type]
