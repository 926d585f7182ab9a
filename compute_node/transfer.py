"""Prefix fetch between nodes, the node's half (docs/prefix_fetch.md): the grants a source node
serves, the byte layout of blocks on the wire, and the destination's pull.

The block manager plans a fetch (its source blocks pinned on the source pool); the scheduler
hands the source its grant in the source's step (`PoolStep.serves`) and the destination its
fetch op in the destination's step (`PoolStep.fetches`). The destination pulls inside that
step (`ComputeNode.FetchBlocks`, a server stream) and writes the blocks into its destination
blocks after the step's tier moves and copy ops, which may still read those blocks, and before
its writes and attention: straight into the pool once they have run (`pull`), or into a host
buffer first (`pull_staged`) where the pull must come before anything of the step is applied
or a later step of the same call still moves or copies blocks (docs/prefix_fetch.md). Anything
that goes wrong — the source unreachable or dead mid-stream, no grant before the wait ends, a
checksum mismatch, a layout that differs, a timeout — is a `FetchFailed`, and the caller
recomputes those positions in the same step instead (or fails the step whole, where it cannot).

Wire layout: the blocks in request order, each block every layer's K then V
(`[num_kv_heads, block_size, head_dim]` each, the pool's dtype, C order) — `block_bytes` per
block; the stream is cut into chunks of at most `chunk_bytes`, each with its XXH3-64 checksum
(~10x cheaper than zlib's CRC-32, which was half the transfer's CPU on a CPU node).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch
import xxhash

from compute_node.host_pool import HostKvPool
from compute_node.pool import TORCH_DTYPES, KvPool, PoolGeometry
from pagedkv.auth import token_metadata
from pagedkv.tls import TlsSettings, open_channel
from pagedkv.v1 import compute_node_pb2 as pb
from pagedkv.wire import varint

_CPU = torch.device("cpu")
# 4 MiB: per-chunk costs (a thread hop each side, a message) dominate smaller chunks on a busy
# host (measured, BENCHMARKS.md "round 2"); the serialized message is a few bytes more, under
# every message limit of ours (a puller asks for no more than its own receive limit allows)
DEFAULT_CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 4 << 20
_MESSAGE_SLACK = 1 << 10   # a chunk message's bytes beyond its payload, at most
RAMP = 8   # a stream's first chunk is 1/RAMP of the chunk size (then doubling)
FETCH_BLOCKS_METHOD = "/pagedkv.v1.ComputeNode/FetchBlocks"


class FetchFailed(Exception):
    """A pull that did not deliver every block intact; the caller recomputes instead."""


def host_flags(host: Sequence[bool], n: int) -> tuple[bool, ...]:
    """Per-block host flags, an empty list meaning "all device blocks"."""
    return tuple(bool(h) for h in host) if len(host) else (False,) * n


def checksum(data: bytes | memoryview) -> int:
    """A chunk's checksum (XXH3-64)."""
    return xxhash.xxh3_64_intdigest(data)


def layout_of(g: PoolGeometry) -> str:
    """What must agree between the two pools for their blocks' bytes to mean the same."""
    return f"{g.dtype}:{g.num_layers}:{g.block_size}:{g.num_kv_heads}:{g.head_dim}"


# ---- grants (source side) -----------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Grant:
    fetch_id: str
    dst_pool: str
    blocks: tuple[int, ...]
    host: tuple[bool, ...]   # per block: a host-tier block
    expires_at: float   # GrantBook.clock() time


class GrantBook:
    """The grants this node's steps gave it, by fetch id, until served or expired. Written by
    the step (on the worker thread that applies it), read by the FetchBlocks handler, which may
    wait for a grant whose step is still on its way (the scheduler calls both nodes at once)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._grants: dict[str, Grant] = {}
        self._cond = threading.Condition()

    def add(self, serves: Sequence[Any]) -> None:
        now = self.clock()
        with self._cond:
            for fid in [f for f, g in self._grants.items() if g.expires_at <= now]:
                del self._grants[fid]
            for s in serves:
                self._grants[s.fetch_id] = Grant(s.fetch_id, s.dst_pool_id, tuple(s.blocks),
                                                 host_flags(s.host, len(s.blocks)), now + self.ttl_s)
            self._cond.notify_all()

    def get(self, fetch_id: str) -> Grant | None:
        """The live grant for `fetch_id` now, without waiting."""
        with self._cond:
            g = self._grants.get(fetch_id)
            return g if g is not None and g.expires_at > self.clock() else None

    def wait_for(self, fetch_id: str, timeout_s: float) -> Grant | None:
        """The live grant for `fetch_id`, waiting up to `timeout_s` for it to arrive."""
        deadline = self.clock() + timeout_s
        with self._cond:
            while True:
                g = self._grants.get(fetch_id)
                now = self.clock()
                if g is not None and g.expires_at > now:
                    return g
                if now >= deadline:
                    return None
                self._cond.wait(deadline - now)

    def take(self, fetch_id: str) -> None:
        """Served: a grant is good for one transfer."""
        with self._cond:
            self._grants.pop(fetch_id, None)

    def clear(self) -> None:
        """A new registration: the old epoch's grants name blocks of a pool that is gone."""
        with self._cond:
            self._grants.clear()

    def __len__(self) -> int:
        with self._cond:
            return len(self._grants)


# ---- bytes of blocks ------------------------------------------------------------------------------
def _byte_views(caches: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Each CPU cache as a `[num_blocks, bytes per block]` uint8 numpy view (no copy)."""
    return [t.view(torch.uint8).numpy().reshape(t.shape[0], -1) for t in caches]


def _runs(blocks: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """`blocks` as `(position, first block, count)` runs of consecutive ids, when they are few
    (a fresh allocation or a prefix usually is a handful of runs): a run is one plain copy per
    layer, where a fancy-indexed copy goes block by block. None when the ids are scattered."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(blocks):
        if runs and runs[-1][1] + runs[-1][2] == b:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((pos, b, 1))
    return runs if len(runs) * 4 <= len(blocks) else None


def pack_blocks(pool: Any, blocks: Sequence[int], buf: np.ndarray | None = None) -> memoryview:
    """The blocks' K/V as one contiguous host buffer, in wire layout. On the CPU through numpy:
    a single-threaded gather (torch's intra-op threads only contend on a busy host; measured
    5 ms vs 115 ms for 6 MB at load 9 on 2 cores), into `buf` (uint8, at least as large) when
    given: a stream reuses one buffer for all its chunks. `pool`: the device `KvPool` or the
    `HostKvPool` (CPU tensors, same layout)."""
    n, num_layers = len(blocks), len(pool.key_caches)
    if getattr(pool, "device", _CPU).type == "cpu" or isinstance(pool, HostKvPool):
        idx = np.asarray(blocks, dtype=np.int64)
        keys, values = _byte_views(pool.key_caches), _byte_views(pool.value_caches)
        shape = (n, num_layers, 2, keys[0].shape[1])
        size = n * num_layers * 2 * keys[0].shape[1]
        out = np.empty(shape, dtype=np.uint8) if buf is None else buf[:size].reshape(shape)
        runs = _runs(blocks)
        for layer in range(num_layers):
            if runs is None:
                np.take(keys[layer], idx, axis=0, out=out[:, layer, 0])
                np.take(values[layer], idx, axis=0, out=out[:, layer, 1])
                continue
            for pos, first, count in runs:
                out[pos:pos + count, layer, 0] = keys[layer][first:first + count]
                out[pos:pos + count, layer, 1] = values[layer][first:first + count]
        return out.data.cast("B")   # the array's own buffer (`data`: numpy's memoryview of it)
    tidx = torch.tensor(list(blocks), dtype=torch.int64, device=pool.device)
    parts = [torch.stack((k.index_select(0, tidx), v.index_select(0, tidx)))   # [2, n, H, B, D]
             for k, v in zip(pool.key_caches, pool.value_caches)]
    t = torch.stack(parts).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()   # [n, L, 2, H, B, D]
    return t.view(torch.uint8).numpy().data.cast("B")


def unpack_into(pool: KvPool, blocks: Sequence[int], data: bytes | bytearray | memoryview) -> None:
    """Write wire-layout `data` (whole blocks) into `blocks` of the pool (every layer, K and V)."""
    g = pool.geometry
    n = len(blocks)
    if pool.device.type == "cpu":
        src = np.frombuffer(data, dtype=np.uint8).reshape(n, g.num_layers, 2, -1)
        idx = np.asarray(blocks, dtype=np.int64)
        runs = _runs(blocks)
        for layer, (kb, vb) in enumerate(zip(_byte_views(pool.key_caches), _byte_views(pool.value_caches))):
            if runs is None:
                kb[idx] = src[:, layer, 0]
                vb[idx] = src[:, layer, 1]
                continue
            for pos, first, count in runs:
                kb[first:first + count] = src[pos:pos + count, layer, 0]
                vb[first:first + count] = src[pos:pos + count, layer, 1]
        return
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(TORCH_DTYPES[g.dtype])
    t = t.reshape(n, g.num_layers, 2, g.num_kv_heads, g.block_size, g.head_dim).to(pool.device)
    tidx = torch.tensor(list(blocks), dtype=torch.int64, device=pool.device)
    for layer, (k, v) in enumerate(zip(pool.key_caches, pool.value_caches)):
        k.index_copy_(0, tidx, t[:, layer, 0])
        v.index_copy_(0, tidx, t[:, layer, 1])


def chunks(data: memoryview, chunk_bytes: int, block_bytes: int, layout: str, offset: int = 0) -> Iterator[pb.KvChunk]:
    """The stream's messages for `data` (at stream `offset`) as protobuf objects: `chunk_bytes`
    at most each, with their checksum; the stream's first message says the layout and the bytes
    per block. (The server sends `encoded_chunks` instead: the same messages, serialized without
    the protobuf copies; this form is for tests and tools.)"""
    for off in range(0, len(data), chunk_bytes):
        part = bytes(data[off:off + chunk_bytes])
        first = offset + off == 0
        yield pb.KvChunk(offset=offset + off, data=part, checksum=checksum(part),
                         block_bytes=block_bytes if first else 0, layout=layout if first else "")


# ---- KvChunk on the wire, by hand --------------------------------------------------------------
# A chunk is ~1 MiB of payload and a handful of small fields. Through the protobuf runtime the
# payload is copied three times on the source (slice, message field, serialization) and twice on
# the destination (parse, field access): measured as much as the rest of the transfer. These
# helpers write and read exactly the `KvChunk` encoding (proto3: zero fields omitted; a parser
# accepts fields in any order and skips unknown ones), so the payload is copied once into the
# outgoing message and read in place from the incoming one.
_TAG_OFFSET, _TAG_DATA, _TAG_CHECKSUM, _TAG_BLOCK_BYTES, _TAG_LAYOUT = 0x08, 0x12, 0x18, 0x20, 0x2A


def encode_chunk(offset: int, data: memoryview | bytes, block_bytes: int = 0, layout: str = "") -> bytes:
    """The serialized `KvChunk` for `data` at stream `offset`, its checksum taken over `data`
    itself (the very bytes copied into the message)."""
    head = b"".join((_TAG_OFFSET.to_bytes(1, "little") + varint(offset) if offset else b"",
                     _TAG_CHECKSUM.to_bytes(1, "little") + varint(checksum(data)),
                     _TAG_BLOCK_BYTES.to_bytes(1, "little") + varint(block_bytes) if block_bytes else b"",
                     _layout_field(layout),
                     _TAG_DATA.to_bytes(1, "little") + varint(len(data))))
    return b"".join((head, data))


def _layout_field(layout: str) -> bytes:
    if not layout:
        return b""
    raw = layout.encode()
    return _TAG_LAYOUT.to_bytes(1, "little") + varint(len(raw)) + raw


@dataclass(slots=True)
class ChunkView:
    """A received `KvChunk`, its `data` a view into the received message (no copy)."""

    offset: int = 0
    data: memoryview = memoryview(b"")
    checksum: int = 0
    block_bytes: int = 0
    layout: str = ""


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise FetchFailed("a malformed chunk (truncated or overlong varint)")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def parse_chunk(buf: bytes) -> ChunkView:
    """A serialized `KvChunk` read in place; `FetchFailed` when it is not well-formed."""
    view = memoryview(buf)
    out = ChunkView()
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            if field == 1:
                out.offset = value
            elif field == 3:
                out.checksum = value
            elif field == 4:
                out.block_bytes = value
        elif wire == 2:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise FetchFailed(f"a malformed chunk (field {field} runs past the message)")
            if field == 2:
                out.data = view[pos:pos + size]
            elif field == 5:
                try:
                    out.layout = str(view[pos:pos + size], "utf-8")
                except UnicodeDecodeError:
                    raise FetchFailed("a malformed chunk (layout is not UTF-8)") from None
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            if pos > len(buf):
                raise FetchFailed(f"a malformed chunk (field {field} runs past the message)")
        else:
            raise FetchFailed(f"a malformed chunk (wire type {wire} in field {field})")
    return out


def encoded_chunks(pool: KvPool, blocks: Sequence[int], chunk_bytes: int, host_pool: Any = None,
                   host: Sequence[bool] = ()) -> Iterator[bytes]:
    """The whole stream for `blocks` (those flagged in `host` from `host_pool`) as serialized
    `KvChunk` messages, gathered a chunk's worth of whole blocks of one tier at a time into one
    reused buffer (so the first chunk leaves before the last block is gathered, and no
    full-size copy is held); each message is that buffer's bytes copied once, behind its fields."""
    g = pool.geometry
    block_bytes = g.bytes_per_block
    per_chunk = max(1, chunk_bytes // block_bytes)
    layout = layout_of(g)
    flags = host_flags(host, len(blocks))
    if any(flags) and host_pool is None:
        raise FetchFailed("host-tier blocks granted on a node without a host tier")
    buf = np.empty(min(per_chunk, len(blocks)) * block_bytes, dtype=np.uint8)
    # the first chunks are smaller (1/8 of the size, doubling): the first byte leaves sooner
    # and the destination starts scattering while the source gathers the next, larger chunks
    limit = max(1, per_chunk // RAMP)
    i = 0
    while i < len(blocks):
        j = i + 1
        while j < len(blocks) and j - i < limit and flags[j] == flags[i]:
            j += 1
        limit = min(per_chunk, 2 * limit)
        src, base = host_pool if flags[i] else pool, i * block_bytes
        data = pack_blocks(src, blocks[i:j], buf)
        for off in range(0, len(data), chunk_bytes):
            first = base + off == 0
            yield encode_chunk(base + off, data[off:off + chunk_bytes],
                               block_bytes if first else 0, layout if first else "")
        i = j


def block_chunks(pool: KvPool, blocks: Sequence[int], chunk_bytes: int, host_pool: Any = None,
                 host: Sequence[bool] = ()) -> Iterator[pb.KvChunk]:
    """`encoded_chunks` as protobuf objects (tests and tools)."""
    for message in encoded_chunks(pool, blocks, chunk_bytes, host_pool, host):
        yield pb.KvChunk.FromString(message)


# ---- the pull (destination side) -----------------------------------------------------------------
@dataclass(slots=True)
class PullStats:
    fetched_blocks: int = 0
    recomputed_tokens: int = 0
    seconds: float = 0.0
    num_bytes: int = 0


@dataclass(slots=True)
class StagedFetch:
    """A fetch op's verified blocks held on the host (`BlockPuller.pull_staged`), in wire
    layout, until its step's turn to write them into the destination blocks."""

    op: Any
    data: bytearray

    @property
    def num_bytes(self) -> int:
        return len(self.data)

    def land(self, pool: KvPool) -> None:
        """Write the blocks into the op's destination blocks of `pool`."""
        unpack_into(pool, list(self.op.dst_blocks), memoryview(self.data))


class BlockPuller:
    """Pulls granted blocks from other nodes: one channel per source address (TLS and this
    node's identity as on every channel: its certificate under mTLS, else `token`)."""

    def __init__(self, node_id: str, *, tls: TlsSettings | None, token: str | None, timeout_s: float,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_message_bytes: int = 64 << 20) -> None:
        self.node_id = node_id
        self.tls = tls
        self.metadata = token_metadata(token)
        self.timeout_s = timeout_s
        self.chunk_bytes = max(1 << 12, min(chunk_bytes, max_message_bytes - _MESSAGE_SLACK))
        self.max_message_bytes = max_message_bytes
        self._stubs: dict[str, tuple[grpc.Channel, grpc.UnaryStreamMultiCallable]] = {}
        self._lock = threading.Lock()
        self._scatter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fetch-scatter")

    def _fetch_blocks(self, address: str) -> grpc.UnaryStreamMultiCallable:
        """`ComputeNode/FetchBlocks` on `address`, answering each `KvChunk` as its serialized
        bytes (read in place by `parse_chunk`, not copied by the protobuf runtime)."""
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                ch = open_channel(address, self.tls, [("grpc.max_receive_message_length", self.max_message_bytes)])
                call = ch.unary_stream(FETCH_BLOCKS_METHOD, request_serializer=pb.FetchBlocksRequest.SerializeToString,
                                       response_deserializer=None)
                entry = self._stubs[address] = (ch, call)
            return entry[1]

    def pull(self, pool: KvPool, op: Any) -> int:
        """Pull one fetch op's blocks straight into its destination blocks; the bytes moved.
        `FetchFailed` when anything is missing, late or corrupt (nothing is trusted then: the
        caller recomputes every position of the op). Only where nothing of the step still to
        run reads or writes those blocks: otherwise `pull_staged`, landed in step order."""
        block_bytes = pool.geometry.bytes_per_block
        # a verified chunk's blocks are written on the scatter thread while the next chunk is
        # received (one write in flight); every write has finished before this returns or raises
        pending: Future[None] | None = None
        try:
            for first, data in self._verified_blocks(pool.geometry, op):
                if pending is not None:
                    pending.result()
                blocks = list(op.dst_blocks[first:first + len(data) // block_bytes])
                pending = self._scatter.submit(unpack_into, pool, blocks, data)
            if pending is not None:
                pending.result()
        finally:
            if pending is not None:
                wait([pending])
        return len(op.dst_blocks) * block_bytes

    def pull_staged(self, geometry: PoolGeometry, op: Any) -> StagedFetch:
        """Pull one fetch op's blocks into a host buffer, not into the pool: the caller lands
        them (`StagedFetch.land`) once the step's tier moves and copies that still read or write
        the destination blocks have run. `FetchFailed` as `pull`, before any block of the pool
        changed (so a failed pull can still fail its step whole)."""
        block_bytes = geometry.bytes_per_block
        buf = bytearray(len(op.dst_blocks) * block_bytes)
        for first, data in self._verified_blocks(geometry, op):
            buf[first * block_bytes:first * block_bytes + len(data)] = data
        return StagedFetch(op, buf)

    def _verified_blocks(self, geometry: PoolGeometry, op: Any) -> Iterator[tuple[int, memoryview]]:
        """The op's stream as `(index of the first destination block, whole blocks' bytes)`,
        each chunk's layout, offset, size and checksum checked before its bytes are handed on;
        `FetchFailed` for anything wrong, the stream's end included (short of every block)."""
        if not op.src_address:
            raise FetchFailed(f"fetch {op.fetch_id}: the source {op.src_pool_id!r} has no address")
        layout = layout_of(geometry)
        block_bytes = geometry.bytes_per_block
        n = len(op.dst_blocks)
        if n != len(op.src_blocks) or n == 0:
            raise FetchFailed(f"fetch {op.fetch_id}: {len(op.src_blocks)} source blocks for {n} destinations")
        total = n * block_bytes
        got = 0
        done = 0                  # destination blocks handed on so far
        carry: bytes | memoryview = b""   # the start of a block split across chunks
        req = pb.FetchBlocksRequest(fetch_id=op.fetch_id, dst_pool_id=self.node_id, blocks=op.src_blocks,
                                    max_chunk_bytes=self.chunk_bytes, host=getattr(op, "src_host", ()))
        try:
            stream = self._fetch_blocks(op.src_address)(req, timeout=self.timeout_s, metadata=self.metadata)
            for message in stream:
                chunk = parse_chunk(message)
                if chunk.offset == 0 and (chunk.layout != layout or chunk.block_bytes != block_bytes):
                    raise FetchFailed(f"fetch {op.fetch_id}: source layout {chunk.layout!r} x {chunk.block_bytes} "
                                      f"bytes, this pool {layout!r} x {block_bytes}")
                size = len(chunk.data)
                if chunk.offset != got or got + size > total:
                    raise FetchFailed(f"fetch {op.fetch_id}: chunk at {chunk.offset} (+{size}) after {got} bytes")
                if checksum(chunk.data) != chunk.checksum:
                    raise FetchFailed(f"fetch {op.fetch_id}: checksum mismatch in the chunk at {chunk.offset}")
                got += size
                # whole blocks are handed on as they arrive (the destination blocks are this
                # sequence's alone: a pull that fails later is recomputed over all of them)
                data = bytes(carry) + chunk.data if carry else chunk.data
                whole = len(data) // block_bytes
                if whole:
                    yield done, memoryview(data)[:whole * block_bytes]
                    done += whole
                carry = data[whole * block_bytes:]
        except grpc.RpcError as exc:
            raise FetchFailed(
                f"fetch {op.fetch_id} from {op.src_pool_id!r}: {exc.code().name}: {exc.details()}") from None
        if got != total or done != n:
            raise FetchFailed(f"fetch {op.fetch_id}: the stream ended after {got} of {total} bytes")

    def close(self) -> None:
        with self._lock:
            for ch, _ in self._stubs.values():
                ch.close()
            self._stubs.clear()
        self._scatter.shutdown(wait=True)


def pull_all(puller: BlockPuller | None, pool: KvPool, ops: Sequence[Any],
             on_failure: Callable[[Any, str], None]) -> PullStats:
    """Every fetch op of a step, in order; a failed one is handed to `on_failure` (recompute)."""
    stats = PullStats()
    t0 = time.perf_counter()
    for op in ops:
        try:
            if puller is None:
                raise FetchFailed(f"fetch {op.fetch_id}: this node cannot pull from other nodes (embedded)")
            stats.num_bytes += puller.pull(pool, op)
            stats.fetched_blocks += len(op.dst_blocks)
        except FetchFailed as exc:
            on_failure(op, str(exc))
            stats.recomputed_tokens += len(op.token_ids)
    stats.seconds = time.perf_counter() - t0
    return stats



def pull_all_staged(puller: BlockPuller | None, geometry: PoolGeometry, ops: Sequence[Any],
                    on_failure: Callable[[Any, str], None]) -> tuple[PullStats, list[StagedFetch]]:
    """`pull_all` into host buffers (`BlockPuller.pull_staged`): the pool is not touched; the
    caller lands the staged blocks in step order. A failed op is handed to `on_failure` and has
    no staged blocks."""
    stats = PullStats()
    staged: list[StagedFetch] = []
    t0 = time.perf_counter()
    for op in ops:
        try:
            if puller is None:
                raise FetchFailed(f"fetch {op.fetch_id}: this node cannot pull from other nodes (embedded)")
            got = puller.pull_staged(geometry, op)
        except FetchFailed as exc:
            on_failure(op, str(exc))
            stats.recomputed_tokens += len(op.token_ids)
            continue
        staged.append(got)
        stats.num_bytes += got.num_bytes
        stats.fetched_blocks += len(op.dst_blocks)
    stats.seconds = time.perf_counter() - t0
    return stats, staged


__all__ = ["BlockPuller", "ChunkView", "FetchFailed", "Grant", "GrantBook", "PullStats", "StagedFetch", "block_chunks",
           "chunks", "encode_chunk", "encoded_chunks", "layout_of", "pack_blocks", "parse_chunk", "pull_all",
           "pull_all_staged", "unpack_into"]
