"""Prefix fetch between nodes, the transfer (compute_node/transfer.py, transfer_servicer.py):
over a real gRPC server on 127.0.0.1, a granted transfer arrives bit-exact in other block ids;
nothing is served without a live grant naming exactly those blocks and that destination, nor to
a caller whose identity is not that node; a corrupt chunk, a layout that differs, or a stream
that breaks is a FetchFailed (the caller recomputes every position of the fetch), and no byte
of a chunk that fails its checksum reaches the pool."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch

from compute_node.host_pool import HostKvPool
from compute_node.pool import KvPool, PoolGeometry
from compute_node.service.config import ComputeNodeConfig
from compute_node.service.node import ComputeNode
from compute_node.service.server import edge_guard
from compute_node.service.servicer import ComputeNodeServicer
from compute_node.transfer import (
    BlockPuller,
    FetchFailed,
    GrantBook,
    block_chunks,
    checksum,
    chunks,
    encode_chunk,
    layout_of,
    pack_blocks,
    parse_chunk,
)
from pagedkv.lifecycle import bind, new_server
from pagedkv.v1 import compute_node_pb2 as pb
from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc
from tests.fixtures.certs import DevCerts

GEOM = PoolGeometry(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4, num_blocks=32)
TOKENS = {"node:a": "a" * 32, "node:b": "b" * 32, "scheduler": "s" * 32}


@dataclass(slots=True, frozen=True)
class _Serve:
    fetch_id: str
    dst_pool_id: str
    blocks: tuple[int, ...]
    host: tuple[bool, ...] = ()


@dataclass(slots=True, frozen=True)
class _Fetch:
    fetch_id: str
    src_pool_id: str
    src_address: str
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    src_host: tuple[bool, ...] = ()


def _random_pool(seed: int) -> KvPool:
    pool = KvPool(GEOM, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for t in (*pool.key_caches, *pool.value_caches):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return pool


class _Source:
    """A compute node (no model, no block manager) serving FetchBlocks on a background loop."""

    def __init__(self, *, auth: bool = False, node_id: str = "a", **cfg: Any) -> None:
        config = ComputeNodeConfig(node_id=node_id, block_manager_address="127.0.0.1:1",
                                   auth={"tokens": TOKENS} if auth else {}, **cfg)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(config), self.loop).result(30)
        self.address = f"127.0.0.1:{self.port}"

    async def _start(self, config: ComputeNodeConfig) -> int:
        self.node = ComputeNode(config)   # on the loop: its block manager channel is an aio one
        self.node.pool = _random_pool(1)
        self.server = new_server([edge_guard(config)])
        pb_grpc.add_ComputeNodeServicer_to_server(ComputeNodeServicer(self.node), self.server)
        port = bind(self.server, "127.0.0.1:0", config.tls)
        await self.server.start()
        return port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture
def source() -> Iterator[_Source]:
    s = _Source(fetch_grant_wait_s=0.3, fetch_chunk_bytes=4096)
    yield s
    s.stop()


def _same(src: KvPool, src_blocks: tuple[int, ...], dst: KvPool, dst_blocks: tuple[int, ...]) -> bool:
    s, d = list(src_blocks), list(dst_blocks)
    return all(torch.equal(a[s], b[d]) for a, b in zip((*src.key_caches, *src.value_caches),
                                                       (*dst.key_caches, *dst.value_caches)))


def test_a_granted_transfer_arrives_bit_exact_in_other_block_ids(source: _Source) -> None:
    dst = KvPool(GEOM, torch.device("cpu"))
    src_blocks, dst_blocks = (7, 3, 20, 11), (0, 30, 1, 5)
    source.node.grants.add([_Serve("f1", "b", src_blocks)])
    puller = BlockPuller("b", tls=None, token=None, timeout_s=30, chunk_bytes=4096)
    try:
        n = puller.pull(dst, _Fetch("f1", "a", source.address, src_blocks, dst_blocks))
        assert n == 4 * GEOM.bytes_per_block and n > 4096          # several chunks
        assert _same(source.node.pool, src_blocks, dst, dst_blocks)
        # a grant is good for one transfer
        with pytest.raises(FetchFailed, match="NOT_FOUND"):
            puller.pull(dst, _Fetch("f1", "a", source.address, src_blocks, dst_blocks))
    finally:
        puller.close()


def test_host_tier_blocks_are_served_from_the_host_pool(source: _Source) -> None:
    """A grant mixing device blocks and host-tier blocks (a source's prefix continuing on host):
    each comes from its tier, in order; asking for the same ids as device blocks is refused."""
    host = HostKvPool(GEOM, 8, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    for t in (*host.key_caches, *host.value_caches):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    source.node.host_pool = host
    dst = KvPool(GEOM, torch.device("cpu"))
    blocks, flags = (9, 10, 2, 5), (False, False, True, True)
    source.node.grants.add([_Serve("h", "b", blocks, flags)])
    puller = BlockPuller("b", tls=None, token=None, timeout_s=30, chunk_bytes=4096)
    try:
        with pytest.raises(FetchFailed, match="INVALID_ARGUMENT"):     # same ids, other tier
            puller.pull(dst, _Fetch("h", "a", source.address, blocks, (20, 21, 22, 23)))
        puller.pull(dst, _Fetch("h", "a", source.address, blocks, (20, 21, 22, 23), flags))
        assert _same(source.node.pool, (9, 10), dst, (20, 21))
        assert _same(host, (2, 5), dst, (22, 23))                       # type: ignore[arg-type]
    finally:
        puller.close()


def test_nothing_is_served_without_a_matching_live_grant(source: _Source) -> None:
    dst = KvPool(GEOM, torch.device("cpu"))
    puller = BlockPuller("b", tls=None, token=None, timeout_s=30)
    try:
        with pytest.raises(FetchFailed, match="NOT_FOUND"):          # never granted
            puller.pull(dst, _Fetch("nope", "a", source.address, (1,), (2,)))
        source.node.grants.add([_Serve("f2", "b", (1, 2))])
        with pytest.raises(FetchFailed, match="INVALID_ARGUMENT"):   # other blocks than granted
            puller.pull(dst, _Fetch("f2", "a", source.address, (1, 3), (2, 4)))
        source.node.grants.add([_Serve("f3", "c", (1, 2))])
        with pytest.raises(FetchFailed, match="PERMISSION_DENIED"):  # granted to another node
            puller.pull(dst, _Fetch("f3", "a", source.address, (1, 2), (2, 4)))
        now = [100.0]
        book = GrantBook(ttl_s=60, clock=lambda: now[0])
        book.add([_Serve("f4", "b", (1,))])
        assert book.wait_for("f4", 0) is not None
        now[0] += 60
        assert book.wait_for("f4", 0) is None                        # expired grants are not served
        assert torch.count_nonzero(dst.key_caches[0]) == 0           # nothing was written
    finally:
        puller.close()


def test_a_pull_waits_for_its_grant_to_arrive_with_the_sources_step() -> None:
    s = _Source(fetch_grant_wait_s=30)
    dst = KvPool(GEOM, torch.device("cpu"))
    puller = BlockPuller("b", tls=None, token=None, timeout_s=60)
    try:
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(
            puller.pull(dst, _Fetch("late", "a", s.address, (4, 5), (6, 7)))))
        t.start()
        # the grant comes after the pull began (the scheduler runs both nodes' steps at once)
        s.node.grants.add([_Serve("late", "b", (4, 5))])
        t.join(60)
        assert result and _same(s.node.pool, (4, 5), dst, (6, 7))
    finally:
        puller.close()
        s.stop()


def test_only_the_granted_node_may_pull_under_auth() -> None:
    s = _Source(auth=True, fetch_grant_wait_s=0.3)
    dst = KvPool(GEOM, torch.device("cpu"))
    s.node.grants.add([_Serve("g", "b", (1, 2))])
    pullers = {who: BlockPuller("b", tls=None, token=TOKENS[who] if who else None, timeout_s=30)
               for who in ("node:a", "scheduler", None, "node:b")}
    try:
        with pytest.raises(FetchFailed, match="PERMISSION_DENIED"):   # another node's identity
            pullers["node:a"].pull(dst, _Fetch("g", "a", s.address, (1, 2), (3, 4)))
        with pytest.raises(FetchFailed, match="PERMISSION_DENIED"):   # a scheduler is no node
            pullers["scheduler"].pull(dst, _Fetch("g", "a", s.address, (1, 2), (3, 4)))
        with pytest.raises(FetchFailed, match="UNAUTHENTICATED"):     # no credentials
            pullers[None].pull(dst, _Fetch("g", "a", s.address, (1, 2), (3, 4)))
        pullers["node:b"].pull(dst, _Fetch("g", "a", s.address, (1, 2), (3, 4)))
        assert _same(s.node.pool, (1, 2), dst, (3, 4))
    finally:
        for p in pullers.values():
            p.close()
        s.stop()


def test_under_mutual_tls_the_pulling_node_is_its_certificate(dev_certs: DevCerts, foreign_certs: DevCerts) -> None:
    """Node to node over mTLS, the identities of the certificates (node:<id> from the URI SAN):
    only node-0's own certificate pulls a grant for node-0; another node's certificate, a
    scheduler's, or a certificate of another CA are refused."""
    s = _Source(node_id="node-a", tls=dev_certs.server("compute-node-a"), fetch_grant_wait_s=0.3)
    dst = KvPool(GEOM, torch.device("cpu"))
    s.node.grants.add([_Serve("t", "node-0", (1, 2)), _Serve("u", "node-1", (1, 2))])
    pullers = {
        "node-0": BlockPuller("node-0", tls=dev_certs.client("compute-node-0"), token=None, timeout_s=30),
        "node-0 as node-1": BlockPuller("node-1", tls=dev_certs.client("compute-node-0"), token=None, timeout_s=30),
        "scheduler": BlockPuller("node-0", tls=dev_certs.client("scheduler"), token=None, timeout_s=30),
        "foreign": BlockPuller("node-0", tls=foreign_certs.client("compute-node-0"), token=None, timeout_s=30),
    }
    try:
        with pytest.raises(FetchFailed, match="PERMISSION_DENIED"):   # node-0 asking for node-1's grant
            pullers["node-0 as node-1"].pull(dst, _Fetch("u", "node-a", s.address, (1, 2), (3, 4)))
        with pytest.raises(FetchFailed, match="PERMISSION_DENIED"):
            pullers["scheduler"].pull(dst, _Fetch("t", "node-a", s.address, (1, 2), (3, 4)))
        with pytest.raises(FetchFailed, match="UNAVAILABLE"):         # the handshake fails
            pullers["foreign"].pull(dst, _Fetch("t", "node-a", s.address, (1, 2), (3, 4)))
        assert torch.count_nonzero(dst.key_caches[0]) == 0
        pullers["node-0"].pull(dst, _Fetch("t", "node-a", s.address, (1, 2), (3, 4)))
        assert _same(s.node.pool, (1, 2), dst, (3, 4))
    finally:
        for p in pullers.values():
            p.close()
        s.stop()


class _Corrupting(pb_grpc.ComputeNodeServicer):
    """A misbehaving source: flips a byte after computing a chunk's checksum, or lies about the
    layout, or ends the stream early."""

    def __init__(self, pool: KvPool, how: str) -> None:
        self.pool, self.how = pool, how

    async def FetchBlocks(self, request: pb.FetchBlocksRequest, context: Any):  # noqa: N802
        data = pack_blocks(self.pool, list(request.blocks))
        layout = "float32:1:1:1:1" if self.how == "layout" else layout_of(self.pool.geometry)
        for i, c in enumerate(chunks(data, 4096, self.pool.geometry.bytes_per_block, layout)):
            if self.how == "checksum" and i == 1:
                bad = bytearray(c.data)
                bad[10] ^= 0xFF
                c = pb.KvChunk(offset=c.offset, data=bytes(bad), checksum=c.checksum)
                assert checksum(bytes(bad)) != c.checksum
            if self.how == "short" and i == 1:
                return
            yield c


@pytest.mark.parametrize("how", ["checksum", "layout", "short"])
def test_corrupt_or_short_streams_fail_the_pull(how: str) -> None:
    async def run() -> None:
        src = _random_pool(2)
        server = grpc.aio.server()
        pb_grpc.add_ComputeNodeServicer_to_server(_Corrupting(src, how), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        dst = KvPool(GEOM, torch.device("cpu"))
        puller = BlockPuller("b", tls=None, token=None, timeout_s=30)
        try:
            with pytest.raises(FetchFailed, match={"checksum": "checksum", "layout": "layout", "short": "ended"}[how]):
                await asyncio.to_thread(puller.pull, dst, _Fetch("x", "a", f"127.0.0.1:{port}", (1, 2, 3), (4, 5, 6)))
            # whole blocks before the bad chunk may be written (they are the fetch's own
            # destination blocks, all recomputed by the caller); nothing of the bad chunk is
            assert all(torch.count_nonzero(t[6]) == 0 for t in (*dst.key_caches, *dst.value_caches))
        finally:
            puller.close()
            await server.stop(0)

    asyncio.run(run())


class _Runner:
    """What `Generator._check_fetches` reads of a model runner."""

    class geometry:   # noqa: N801
        block_size = 4

    class model_config:   # noqa: N801
        vocab_size = 100


def _op(**kw: Any) -> Any:
    base = dict(fetch_id="f", seq_id="s", first_token=4, token_ids=tuple(range(10, 18)), dst_blocks=(7, 8),
                src_blocks=(1, 2))
    base.update(kw)
    return type("Op", (), base)()


def test_a_fetch_must_sit_right_before_its_sequences_new_tokens_and_a_failed_one_is_recomputed() -> None:
    from compute_node.errors import InvalidForward, PeerFetchFailed
    from compute_node.generate import Generator
    from compute_node.model import SeqWork
    from compute_node.tables import TableCache

    gen = Generator(_Runner(), TableCache())   # type: ignore[arg-type]
    work = [SeqWork("s", [50, 51, 52], 12, [3, 7, 8, 9])]     # positions 0-3 local, 4-11 fetched, 12.. new
    assert gen._check_fetches([_op()], work) == {"f": work[0]}
    assert gen._check_fetches([_op(seq_id="other")], work) == {}   # pulled up front, no fallback
    with pytest.raises(PeerFetchFailed):
        gen._fetch_failed({}, _op(seq_id="other"), "source gone")   # no sequence to recompute it
    for bad in (dict(first_token=0), dict(dst_blocks=(8, 7)), dict(token_ids=(1,) * 7),
                dict(token_ids=(100,) * 8)):
        with pytest.raises(InvalidForward):
            gen._check_fetches([_op(**bad)], work)
    seen: list[str] = []
    gen.on_fetch_failed = lambda op, why: seen.append(why)
    gen._recompute(work[0], _op(), "source gone")
    assert work[0].token_ids == [*range(10, 18), 50, 51, 52] and work[0].num_computed_tokens == 4
    assert seen == ["source gone"]


def test_chunks_encoded_by_hand_are_exactly_kvchunk_messages() -> None:
    """The source serializes `KvChunk` itself (payload copied once) and the destination reads it
    in place: both must agree with the protobuf runtime, field for field, either way round."""
    payload = bytes(range(256)) * 300
    for offset, block_bytes, layout in ((0, 1536, "float16:3:4:2:16"), (1 << 40, 0, ""), (7, 0, "")):
        message = encode_chunk(offset, memoryview(payload), block_bytes, layout)
        ref = pb.KvChunk.FromString(message)
        assert (ref.offset, ref.data, ref.checksum, ref.block_bytes, ref.layout) == (
            offset, payload, checksum(payload), block_bytes, layout)
        view = parse_chunk(ref.SerializeToString())
        assert (view.offset, bytes(view.data), view.checksum, view.block_bytes, view.layout) == (
            offset, payload, checksum(payload), block_bytes, layout)
    # a field this reader does not know (a newer source) is skipped, not misread
    newer = pb.KvChunk(offset=5, data=b"abc", checksum=9).SerializeToString() + b"\xe8\x05\x01" + b"\xea\x05\x02hi"
    view = parse_chunk(newer)
    assert (view.offset, bytes(view.data), view.checksum) == (5, b"abc", 9)


@pytest.mark.parametrize("message", [b"\x08", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x12\x05abc",
                                     b"\x0b", b"\x2a\x02\xff\xfe", b"\x09\x00\x00"])
def test_a_malformed_chunk_is_a_fetch_failure(message: bytes) -> None:
    with pytest.raises(FetchFailed, match="malformed"):
        parse_chunk(message)


def test_runs_of_consecutive_blocks_and_scattered_ones_arrive_bit_exact(source: _Source) -> None:
    """Gather and scatter copy runs of consecutive ids whole and scattered ids one by one: a
    transfer is exact either way round."""
    dst = KvPool(GEOM, torch.device("cpu"))
    cases = [((2, 3, 4, 5, 6, 7, 8, 9), (20, 21, 22, 23, 24, 25, 26, 27)),      # runs both sides
             ((12, 13, 14, 15, 16, 17, 18, 19), (31, 1, 29, 3, 27, 5, 25, 7)),  # runs -> scattered
             ((30, 0, 28, 2, 26, 4, 24, 6), (8, 9, 10, 11, 12, 13, 14, 15))]    # scattered -> runs
    puller = BlockPuller("b", tls=None, token=None, timeout_s=30, chunk_bytes=4096)
    try:
        for i, (src_blocks, dst_blocks) in enumerate(cases):
            source.node.grants.add([_Serve(f"r{i}", "b", src_blocks)])
            puller.pull(dst, _Fetch(f"r{i}", "a", source.address, src_blocks, dst_blocks))
            assert _same(source.node.pool, src_blocks, dst, dst_blocks)
    finally:
        puller.close()


def test_blocks_larger_than_a_chunk_arrive_split_across_chunks() -> None:
    """A block of 12 KiB in 4 KiB chunks: each block arrives in three pieces, reassembled."""
    geom = PoolGeometry(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float32", block_size=16, num_blocks=8)
    s = _Source(fetch_grant_wait_s=0.3)
    src, dst = KvPool(geom, torch.device("cpu")), KvPool(geom, torch.device("cpu"))
    for t in (*src.key_caches, *src.value_caches):
        t.copy_(torch.randn(t.shape))
    s.node.pool = src
    s.node.grants.add([_Serve("big", "b", (5, 1, 2))])
    puller = BlockPuller("b", tls=None, token=None, timeout_s=30, chunk_bytes=4096)
    try:
        assert geom.bytes_per_block > 2 * 4096
        assert puller.pull(dst, _Fetch("big", "a", s.address, (5, 1, 2), (0, 6, 7))) == 3 * geom.bytes_per_block
        assert _same(src, (5, 1, 2), dst, (0, 6, 7))
    finally:
        puller.close()
        s.stop()


def test_a_puller_never_asks_for_chunks_beyond_its_own_message_limit() -> None:
    puller = BlockPuller("b", tls=None, token=None, timeout_s=1, chunk_bytes=4 << 20, max_message_bytes=1 << 20)
    try:
        assert 4096 <= puller.chunk_bytes < 1 << 20
    finally:
        puller.close()


def test_a_stream_starts_with_smaller_chunks_and_covers_every_byte_once() -> None:
    """The first chunks ramp up (1/8 of the chunk size, doubling) so the destination starts
    scattering early; every chunk is whole blocks, in order, within the chunk size."""
    pool = _random_pool(4)
    blocks = list(range(32))
    per_chunk = 16
    msgs = list(block_chunks(pool, blocks, per_chunk * GEOM.bytes_per_block))
    sizes = [len(m.data) // GEOM.bytes_per_block for m in msgs]
    assert sizes == [2, 4, 8, 16, 2]
    assert [m.offset for m in msgs] == [sum(sizes[:k]) * GEOM.bytes_per_block for k in range(len(sizes))]
    assert all(checksum(m.data) == m.checksum for m in msgs)
    assert b"".join(m.data for m in msgs) == bytes(pack_blocks(pool, blocks))
    assert (msgs[0].layout, msgs[0].block_bytes) == (layout_of(GEOM), GEOM.bytes_per_block)
    assert all(m.layout == "" and m.block_bytes == 0 for m in msgs[1:])
