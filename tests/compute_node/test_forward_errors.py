"""Bad requests to every RPC of the compute node: a typed status, and nothing changed (the K/V
caches and the node's tables are compared before and after each rejected Forward)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest
import torch

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
            setattr(r.sequences[0], k, v)

    return mutate


def _step(mutate_step: Callable[[object], None]) -> Mutator:
    def mutate(r: pb.ForwardRequest) -> None:
        mutate_step(r.steps[0])

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


def _drop_sequences_and_steps(r: pb.ForwardRequest) -> None:
    del r.sequences[:]
    del r.steps[:]


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
    "neither sequences nor steps": _drop_sequences_and_steps,
    "duplicate sequence": _dup_sequence,
    "empty seq id": _seq(seq_id=""),
    "no new tokens": _seq(num_new_tokens=0),
    "context shorter than new tokens": _seq(context_len=0),
    "context beyond the pool": _seq(context_len=NUM_BLOCKS * BLOCK_SIZE + 1),
    "writes below the tail": _seq(context_len=8),           # x holds 8 tokens: the new one is the 9th
    "writes past the tail": _seq(context_len=10),
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
    "step of another pool": _step(lambda m: setattr(m, "pool_id", "node-b")),
    "copy columns disagree": _step(lambda m: m.copy_src.append(3)),
    "delta columns disagree": _step(lambda m: m.delta_versions.append(99)),
    "appended blocks disagree with their counts": _step(lambda m: m.appended_blocks.append(7)),
    "replaced entries disagree with their counts": _step(lambda m: m.replaced_positions.append(0)),
    "copy of a block beyond the pool": _step(lambda m: (m.copy_src.append(NUM_BLOCKS), m.copy_dst.append(0),
                                                        m.copy_is_defrag.append(False))),
    "a table block beyond the pool": _step(lambda m: m.appended_blocks.__setitem__(0, NUM_BLOCKS)),
}


def _pool_state(cluster) -> tuple[torch.Tensor, dict, int]:  # type: ignore[no-untyped-def]
    """The pool's bytes and the node's tables: a rejected Forward changes neither."""
    node = cluster.node.node
    pool = node.pool
    tables = {sid: (list(t.block_table), t.version, t.num_tokens) for sid, t in node.tables._tables.items()}
    return torch.stack([*pool.key_caches, *pool.value_caches]).clone(), tables, node.tables.last_step_id


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


async def _prepared(cluster):  # type: ignore[no-untyped-def]
    """x holds 8 tokens (2 full blocks) and y 3; two steps pending: x's append (a new block)
    and z's admission."""
    s = cluster.sched
    await s.forward([await s.allocate("x", [1, 2, 3, 4, 5, 6, 7, 8])])
    await s.forward([await s.allocate("y", [9, 8, 7])])
    steps = await s.append(["x"])
    steps.append(await s.allocate("z", [4, 4]))
    assert len(s.pending) == 2
    return s, steps


async def test_invalid_requests_are_rejected_and_change_nothing(cluster) -> None:  # type: ignore[no-untyped-def]
    s, steps = await _prepared(cluster)
    before = _pool_state(cluster)
    for name, mutate in INVALID.items():
        request = s.request(steps)
        mutate(request)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.node.Forward(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {info.value.details()}"
        assert _same(_pool_state(cluster), before), f"{name}: pool or tables changed"
    # The untouched request still works afterwards.
    await s.forward(steps)


def _skip_first_step(r: pb.ForwardRequest) -> None:
    del r.steps[0]


def _repeat_step(r: pb.ForwardRequest) -> None:
    r.steps.append(r.steps[0])


async def test_step_and_table_errors(cluster) -> None:  # type: ignore[no-untyped-def]
    s, steps = await _prepared(cluster)
    before = _pool_state(cluster)
    cases: dict[str, tuple[Mutator, grpc.StatusCode]] = {
        "a step skipped": (_skip_first_step, grpc.StatusCode.FAILED_PRECONDITION),
        "a step twice": (_repeat_step, grpc.StatusCode.FAILED_PRECONDITION),
        "a step of an earlier registration": (
            _step(lambda m: setattr(m, "epoch", 0)), grpc.StatusCode.FAILED_PRECONDITION,
        ),
        "a delta on a table version the node does not hold": (
            _step(lambda m: m.delta_base_versions.__setitem__(0, 1 << 40)), grpc.StatusCode.ABORTED,
        ),
        "unknown sequence": (_seq(seq_id="nope"), grpc.StatusCode.NOT_FOUND),
    }
    for name, (mutate, code) in cases.items():
        request = s.request(steps)
        mutate(request)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.node.Forward(request)
        assert info.value.code() == code, f"{name}: {info.value.code().name} {info.value.details()}"
        assert _same(_pool_state(cluster), before), f"{name}: pool or tables changed"
    # More new tokens than x's table covers (2 blocks + the new one: 12 slots, 8 + 5 needed).
    request = s.request([s.new_step("x", 5), steps[1]])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.node.Forward(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "blocks" in info.value.details()
    assert _same(_pool_state(cluster), before)
    await s.forward(steps)


async def test_one_bad_sequence_fails_the_whole_batch(cluster) -> None:  # type: ignore[no-untyped-def]
    s, steps = await _prepared(cluster)
    before = _pool_state(cluster)
    good = s.request(steps)
    bad = s.request(steps)
    bad.sequences.append(pb.ForwardSequence(seq_id="ghost", num_new_tokens=1, context_len=1))
    for layer, src in zip(bad.layers, good.layers):   # one more token row per layer
        for name in ("query", "key", "value"):
            t = getattr(layer, name)
            per_token = len(getattr(src, name).data) // t.shape[0]
            t.shape[0] += 1
            t.data = getattr(src, name).data + b"\x00" * per_token
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await s.node.Forward(bad)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert _same(_pool_state(cluster), before)


async def test_a_retried_forward_is_answered_again(cluster) -> None:  # type: ignore[no-untyped-def]
    """The same request id twice (the answer was lost): the steps are not applied twice and
    the writes land at the same slots, so the outputs are identical."""
    s, steps = await _prepared(cluster)
    request = s.request(steps)
    first = await s.node.Forward(request)
    second = await s.node.Forward(request)
    assert [o.output.data for o in first.outputs] == [o.output.data for o in second.outputs]
    assert second.stats.last_step_id == first.stats.last_step_id == s.pending[-1].step_id
    s.delivered()
    for st in steps:
        s.commit_tokens(st)
    await s.forward(await s.append(["x", "y", "z"]))


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
            request_id="r", sequences=[pb.ForwardSequence(seq_id="x", num_new_tokens=1, context_len=1)]
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Forward(request)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await channel.close()
    finally:
        await server.stop(0)
