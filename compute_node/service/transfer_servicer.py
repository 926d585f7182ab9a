"""`ComputeNode/FetchBlocks`: serving granted prefix blocks to another node (docs/prefix_fetch.md).

Served only when every check passes, in this order:
1. the caller is authenticated as `node:<id>` with `<id>` = the request's `dst_pool_id` (under
   TLS client certificates or bearer tokens, by the edge guard before the first message, as
   every call of ours: `access.authorize`);
2. a grant for `fetch_id` arrived with one of this node's steps (waited for up to
   `fetch_grant_wait_s`: the scheduler calls the source and the destination at once), has not
   expired, names exactly the requested blocks, and its destination is the caller (`<id>` =
   `dst_pool_id` = the grant's destination; without auth, the request's `dst_pool_id`).
Refusals: PERMISSION_DENIED (identity or destination), NOT_FOUND (no live grant),
INVALID_ARGUMENT (blocks differ from the grant), FAILED_PRECONDITION (no pool yet).

The blocks are read without the node's step lock: the block manager pinned them for the
transfer, so no step of this node writes, moves or reuses them until the destination's step is
reported. The grant is used up by a complete transfer.

The chunks are yielded already serialized (`transfer.encoded_chunks`: the payload copied once,
not three times through the protobuf runtime); the edge guard's stream wrapper
(`pagedkv.rpc.wrap_unary_stream_handler`) sends `bytes` responses as they are.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from compute_node.service import access
from compute_node.service.node import ComputeNode
from compute_node.transfer import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, encoded_chunks, host_flags
from pagedkv.v1 import compute_node_pb2 as pb

METHOD = f"{access.PREFIX}FetchBlocks"
AHEAD = 4   # chunks gathered ahead of the one being sent


async def serve_blocks(
    node: ComputeNode, request: pb.FetchBlocksRequest, context: grpc.aio.ServicerContext,
) -> AsyncIterator[bytes]:
    """The granted blocks as serialized `KvChunk` messages, once every check passed."""
    pool = node.pool
    if pool is None:   # `abort` raises; the returns say so to the type checker
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the node has no pool yet")
        return
    grant = node.grants.get(request.fetch_id)   # usually there already: no thread hop then
    if grant is None:
        grant = await asyncio.to_thread(node.grants.wait_for, request.fetch_id, node.config.fetch_grant_wait_s)
    if grant is None:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no live grant for fetch {request.fetch_id!r} on this node")
        return
    if grant.dst_pool != request.dst_pool_id:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"fetch {request.fetch_id!r} is granted to {grant.dst_pool!r}, not {request.dst_pool_id!r}")
    if tuple(request.blocks) != grant.blocks or host_flags(request.host, len(request.blocks)) != grant.host:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"fetch {request.fetch_id!r}: the requested blocks are not the granted ones")
    chunk_bytes = min(request.max_chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
    pause = node.config.fetch_test_pause_file
    num_bytes = len(grant.blocks) * pool.geometry.bytes_per_block
    async for i, message in _produced(node, list(grant.blocks), list(grant.host), chunk_bytes):
        yield message
        if pause and i == 0:
            # TEST HOOK (config `fetch_test_pause_file`): hold the stream after the first chunk
            Path(pause).write_text(request.fetch_id)
            await asyncio.Event().wait()
    node.grants.take(request.fetch_id)
    node.metrics.served_blocks.inc(len(grant.blocks))
    node.log.info("prefix_blocks_served", fetch_id=request.fetch_id, dst=request.dst_pool_id,
                  num_blocks=len(grant.blocks), num_bytes=num_bytes)


async def _produced(
    node: ComputeNode, blocks: list[int], host: list[bool], chunk_bytes: int,
) -> AsyncIterator[tuple[int, bytes]]:
    """The stream's messages, gathered, checksummed and encoded on a worker thread while the
    event loop sends the ones before (a pipeline), at most `AHEAD` messages ahead. One thread
    hop per message: the worker hands each straight to the loop (`call_soon_threadsafe`); on a
    loaded host every extra wake-up of another thread costs a scheduling delay per chunk. A
    consumer that stops early (a broken stream) stops the producer too."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
    room = threading.Semaphore(AHEAD)
    stop = threading.Event()
    pool = node.pool

    def hand(item: bytes | BaseException | None) -> None:
        loop.call_soon_threadsafe(ready.put_nowait, item)

    def produce() -> None:
        try:
            for message in encoded_chunks(pool, blocks, chunk_bytes, node.host_pool, host):   # type: ignore[arg-type]  # serve_blocks checked the pool
                while not room.acquire(timeout=0.1):   # never blocks for good: a cancelled consumer sets `stop`
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                hand(message)
            hand(None)
        except BaseException as exc:   # noqa: BLE001 - handed to the event loop, raised there
            hand(exc)

    producer = loop.run_in_executor(None, produce)
    try:
        i = 0
        while True:
            item = await ready.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            room.release()
            yield i, item
            i += 1
    finally:
        stop.set()
        await asyncio.shield(producer)


__all__ = ["serve_blocks"]
