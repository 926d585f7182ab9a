"""Malformed Forwards: every answer is a definite status, never UNKNOWN or INTERNAL, and no
status detail names a Python class (issue 10: 28 UNKNOWN and 2 INTERNAL out of 248).

Self-contained on purpose: the mutators below know the Forward message's fields, so when the
protocol changes only `_STRUCTURED` and `_valid_request` need to follow. Seeded, a few hundred
requests, a few seconds on a 2-core machine.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import grpc
import numpy as np
import pytest

from pagedkv.v1 import compute_node_pb2 as pb

FORWARD = "/pagedkv.v1.ComputeNode/Forward"
GET_NODE_INFO = "/pagedkv.v1.ComputeNode/GetNodeInfo"
NUM_CASES = 260
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

Mutator = Callable[[pb.ForwardRequest, random.Random], None]


def _any_tensor(r: pb.ForwardRequest, rng: random.Random) -> pb.Tensor:
    if not r.layers:
        r.layers.add(layer=0)
    layer = r.layers[rng.randrange(len(r.layers))]
    return getattr(layer, rng.choice(("query", "key", "value")))


def _set_shape(t: pb.Tensor, shape: list[int]) -> None:
    del t.shape[:]
    t.shape.extend(shape)


def _overflowing_shape(r: pb.ForwardRequest, rng: random.Random) -> None:
    t = _any_tensor(r, rng)
    shape, data = rng.choice([([65536] * 4, b""), ([4, 5, 5581, 8681, 49477, 384773], b"\x00" * 16)])
    _set_shape(t, shape)
    t.data = data


def _random_shape(r: pb.ForwardRequest, rng: random.Random) -> None:
    t = _any_tensor(r, rng)
    _set_shape(t, [rng.choice((0, 1, 2, 3, 4, 32, 4096, 2**31, 2**32 - 1)) for _ in range(rng.randrange(0, 12))])
    if rng.random() < 0.5:
        t.data = t.data[: rng.randrange(len(t.data) + 1)]


def _random_dtype(r: pb.ForwardRequest, rng: random.Random) -> None:
    _any_tensor(r, rng).dtype = rng.choice(("", "int8", "float64", "FLOAT16", "bfloat16", "float16", "\u00e9"))


def _random_data(r: pb.ForwardRequest, rng: random.Random) -> None:
    t = _any_tensor(r, rng)
    t.data = rng.randbytes(rng.choice((0, 1, 3, len(t.data) - 1, len(t.data), len(t.data) + 2)))


def _non_finite_values(r: pb.ForwardRequest, rng: random.Random) -> None:
    t = _any_tensor(r, rng)
    arr = np.frombuffer(t.data[: len(t.data) // 4 * 4], dtype=np.float32).copy()
    if not len(arr):
        return
    arr[rng.randrange(len(arr))] = rng.choice((np.nan, np.inf, -np.inf, 3e38))
    t.data = arr.tobytes()


def _sequence_field(r: pb.ForwardRequest, rng: random.Random) -> None:
    if not r.sequences:
        r.sequences.add()
    s = r.sequences[rng.randrange(len(r.sequences))]
    field = rng.choice(("seq_id", "num_new_tokens", "context_len"))
    if field == "seq_id":
        s.seq_id = rng.choice(("", "x" * 20_000, "\u00e9\u6f22", "nope", "y"))
    elif field == "num_new_tokens":
        s.num_new_tokens = rng.choice((0, 2, 300, 2**31, 2**32 - 1))
    else:
        s.context_len = rng.choice((0, 1, 5, 40, 2**31, 2**32 - 1))


_BIG = (0, 1, 63, 64, 255, 2**31, 2**32 - 1)


def _step_field(r: pb.ForwardRequest, rng: random.Random) -> None:
    """A PoolStep the block manager would never send: block ids beyond the pool, skewed
    columns, foreign pools, steps out of order."""
    if not r.steps:
        r.steps.add(pool_id="node-a", epoch=1, step_id=1)
    m = r.steps[rng.randrange(len(r.steps))]
    field = rng.choice(("ids", "copy", "appended", "replaced", "columns", "dropped", "dup"))
    if field == "ids":
        name = rng.choice(("pool_id", "epoch", "step_id", "base_step_id"))
        setattr(m, name, rng.choice(("", "node-b", "\u00e9")) if name == "pool_id" else rng.choice(_BIG))
    elif field == "copy":
        m.copy_src.append(rng.choice(_BIG))
        m.copy_dst.append(rng.choice(_BIG))
        m.copy_is_defrag.append(rng.random() < 0.5)
    elif field == "appended":
        if m.delta_num_appended:
            m.appended_blocks[rng.randrange(len(m.appended_blocks))] = rng.choice(_BIG)
        else:
            m.delta_seq_ids.append("w")
            m.delta_base_versions.append(0)
            m.delta_versions.append(rng.choice(_BIG))
            m.delta_num_tokens.append(rng.choice(_BIG))
            m.delta_num_replaced.append(0)
            m.delta_num_appended.append(1)
            m.appended_blocks.append(rng.choice(_BIG))
    elif field == "replaced":
        m.delta_seq_ids.append(rng.choice(("x", "y")))
        m.delta_base_versions.append(rng.choice((1, 2, 3, 2**40)))
        m.delta_versions.append(2**41)
        m.delta_num_tokens.append(0)
        m.delta_num_replaced.append(1)
        m.replaced_positions.append(rng.choice(_BIG))
        m.replaced_blocks.append(rng.choice(_BIG))
        m.delta_num_appended.append(0)
    elif field == "columns":
        getattr(m, rng.choice(("delta_versions", "delta_num_tokens", "copy_is_defrag", "replaced_blocks"))).append(1)
    elif field == "dropped":
        m.dropped_seq_ids.extend(rng.choice((["x"], [""], ["z" * 10_000] * 3)))
    else:
        r.steps.append(m)


def _layer_field(r: pb.ForwardRequest, rng: random.Random) -> None:
    if not r.layers:
        r.layers.add()
    layer = r.layers[rng.randrange(len(r.layers))]
    layer.layer = rng.choice((0, 1, 2, 7, 2**32 - 1))


def _request_field(r: pb.ForwardRequest, rng: random.Random) -> None:
    field = rng.choice(("request_id", "scale", "drop", "duplicate"))
    if field == "request_id":
        r.request_id = rng.choice(("", "r" * 50_000))
    elif field == "scale":
        r.scale = rng.choice((float("nan"), float("inf"), -1.0, 1e308, 5e-324))
    elif field == "drop":
        del (r.layers if rng.random() < 0.5 else r.sequences)[:]
    elif r.sequences:
        r.sequences.append(r.sequences[0])


_STRUCTURED: list[Mutator] = [
    _overflowing_shape, _random_shape, _random_dtype, _random_data, _non_finite_values,
    _sequence_field, _layer_field, _request_field, _step_field, _step_field,
]


def _invalid_utf8_string_field(valid: bytes, rng: random.Random) -> bytes:
    # field 1 (request_id), wire type 2: proto3 strings must be UTF-8
    bad = rng.choice((b"\xff\xfe", b"\xc3", b"\xed\xa0\x80"))
    return bytes([0x0A, len(bad)]) + bad + valid


def _wrong_wire_type(valid: bytes, rng: random.Random) -> bytes:
    # field 2 (sequences) as a varint, field 5 (scale) as a length-delimited blob
    return rng.choice((bytes([0x10, 0x01]), bytes([0x2A, 0x02, 0x00, 0x00]))) + valid


_RAW: list[Callable[[bytes, random.Random], bytes]] = [
    lambda valid, rng: b"\xff\xff",
    lambda valid, rng: rng.randbytes(rng.randrange(1, 64)),
    lambda valid, rng: valid[: rng.randrange(1, len(valid))],                       # truncated
    lambda valid, rng: bytes(b ^ (0xFF if rng.random() < 0.01 else 0) for b in valid),  # bit flips
    _invalid_utf8_string_field,
    _wrong_wire_type,
]


def _cases(valid: pb.ForwardRequest, rng: random.Random) -> list[bytes]:
    data = valid.SerializeToString()
    cases: list[bytes] = []
    for i in range(NUM_CASES):
        if i % 3 == 0:
            cases.append(_RAW[(i // 3) % len(_RAW)](data, rng))
            continue
        request = pb.ForwardRequest()
        request.CopyFrom(valid)
        for _ in range(rng.choice((1, 1, 2, 3))):
            rng.choice(_STRUCTURED)(request, rng)
        cases.append(request.SerializeToString())
    return cases


async def _valid_request(cluster) -> pb.ForwardRequest:  # type: ignore[no-untyped-def]
    s = cluster.sched
    await s.forward([await s.allocate("x", [1, 2, 3, 4, 5])])
    await s.forward([await s.allocate("y", [9, 8, 7])])
    steps = await s.append(["x", "y"])
    steps.append(await s.allocate("z", [4, 4, 4, 4, 4]))   # the request carries its PoolStep
    return s.request(steps)


async def _raw_call(channel: grpc.aio.Channel, method: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    call = channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        await call(data, timeout=30)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.timeout(120)
async def test_malformed_forwards_get_definite_statuses(cluster) -> None:  # type: ignore[no-untyped-def]
    valid = await _valid_request(cluster)
    channel = cluster.sched.node_channel
    codes: Counter[str] = Counter()
    bad: list[str] = []
    for i, data in enumerate(_cases(valid, random.Random(10))):
        code, details = await _raw_call(channel, FORWARD, data)
        codes[code.name] += 1
        if code in BAD_CODES or "<class" in details or len(details) > 1024:
            bad.append(f"case {i}: {code.name} {details[:200]!r}")
    assert not bad, f"{len(bad)} bad answers ({dict(codes)}): {bad[:5]}"
    assert codes["INVALID_ARGUMENT"] > NUM_CASES // 2, dict(codes)
    # The node is unharmed: GetNodeInfo answers, a well-formed Forward for a fresh step works.
    info = await cluster.sched.node.GetNodeInfo(pb.GetNodeInfoRequest())
    assert info.registered


async def test_undecodable_requests_are_invalid_argument(cluster) -> None:  # type: ignore[no-untyped-def]
    channel = cluster.sched.node_channel
    for method in (FORWARD, GET_NODE_INFO):
        code, details = await _raw_call(channel, method, b"\xff\xff")
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
        assert "<class" not in details and "DecodeError" not in details


async def test_overflowing_tensor_shapes_are_invalid_argument(cluster) -> None:  # type: ignore[no-untyped-def]
    valid = await _valid_request(cluster)
    for shape, data in (([65536] * 4, b""), ([4, 5, 5581, 8681, 49477, 384773], b"\x00" * 16)):
        request = pb.ForwardRequest()
        request.CopyFrom(valid)
        _set_shape(request.layers[0].key, shape)
        request.layers[0].key.data = data
        code, details = await _raw_call(cluster.sched.node_channel, FORWARD, request.SerializeToString())
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (shape, code, details)


async def test_details_echoing_huge_ids_are_clipped(cluster) -> None:  # type: ignore[no-untyped-def]
    request = await _valid_request(cluster)
    for seq in request.sequences:
        seq.seq_id = "x" * 20_000   # over the id limit: refused by the node with a short message
    code, details = await _raw_call(cluster.sched.node_channel, FORWARD, request.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details[:200])
    assert "has 20000 characters (at most 256)" in details and len(details) <= 1024
    for seq in request.sequences:
        seq.seq_id = "x" * 256      # the longest id, twice: the node's own message echoes it
    code, details = await _raw_call(cluster.sched.node_channel, FORWARD, request.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details[:200])
    assert "appears twice" in details and len(details) <= 1024
