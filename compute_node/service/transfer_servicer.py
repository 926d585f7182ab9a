"""`ComputeNode/FetchBlocks`: serving granted prefix blocks to another node (docs/prefix_fetch.md).

Served only when every check passes, in this order:
1. the caller is authenticated as `node:<id>` (under TLS client certificates or bearer tokens,
   as every call of ours; `access.authorize`) — done here, because the edge guard wraps unary
   handlers only and this one streams;
2. a grant for `fetch_id` arrived with one of this node's steps (waited for up to
   `fetch_grant_wait_s`: the scheduler calls the source and the destination at once), has not
   expired, names exactly the requested blocks, and its destination is the caller (`<id>` =
   `dst_pool_id` = the grant's destination; without auth, the request's `dst_pool_id`).
Refusals: PERMISSION_DENIED (identity or destination), NOT_FOUND (no live grant),
INVALID_ARGUMENT (blocks differ from the grant), FAILED_PRECONDITION (no pool yet).

The blocks are read without the node's step lock: the block manager pinned them for the
transfer, so no step of this node writes, moves or reuses them until the destination's step is
reported. The grant is used up by a complete transfer.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from compute_node.service import access
from compute_node.service.node import ComputeNode
from compute_node.transfer import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, block_chunks, host_flags
from pagedkv.auth import Authenticator, Refusal
from pagedkv.v1 import compute_node_pb2 as pb

METHOD = f"{access.PREFIX}FetchBlocks"
AHEAD = 4   # chunks gathered ahead of the one being sent


async def serve_blocks(
    node: ComputeNode, auth: Authenticator | None, request: pb.FetchBlocksRequest, context: grpc.aio.ServicerContext,
) -> AsyncIterator[pb.KvChunk]:
    if auth is not None:
        found = auth.identify(context)
        if isinstance(found, Refusal):
            await context.abort(found.code, found.message)
        why = access.authorize(METHOD, found, request)  # type: ignore[arg-type]
        if why is None and found.name != request.dst_pool_id:  # type: ignore[union-attr]
            why = f"{found} may not pull blocks granted to node {request.dst_pool_id!r}"
        if why is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
    pool = node.pool
    if pool is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the node has no pool yet")
    grant = await asyncio.to_thread(node.grants.wait_for, request.fetch_id, node.config.fetch_grant_wait_s)
    if grant is None:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no live grant for fetch {request.fetch_id!r} on this node")
    if grant.dst_pool != request.dst_pool_id:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"fetch {request.fetch_id!r} is granted to {grant.dst_pool!r}, not {request.dst_pool_id!r}")
    if tuple(request.blocks) != grant.blocks or host_flags(request.host, len(request.blocks)) != grant.host:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"fetch {request.fetch_id!r}: the requested blocks are not the granted ones")
    chunk_bytes = min(request.max_chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
    pause = node.config.fetch_test_pause_file
    num_bytes = 0
    async for i, chunk in _produced(node, list(grant.blocks), list(grant.host), chunk_bytes):
        num_bytes += len(chunk.data)
        yield chunk
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
) -> AsyncIterator[tuple[int, pb.KvChunk]]:
    """The stream's chunks, gathered and checksummed on a worker thread while the event loop
    sends the ones before (a pipeline), at most `AHEAD` chunks
    ahead; a consumer that stops early (a broken stream) stops the producer too."""
    loop = asyncio.get_running_loop()
    ready: queue.Queue[pb.KvChunk | BaseException | None] = queue.Queue(maxsize=AHEAD)
    stop = threading.Event()
    pool = node.pool

    def put(item: pb.KvChunk | BaseException | None) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def take() -> pb.KvChunk | BaseException | None:
        while not stop.is_set():   # never blocks for good: a cancelled consumer sets `stop`
            try:
                return ready.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def produce() -> None:
        try:
            for chunk in block_chunks(pool, blocks, chunk_bytes, node.host_pool, host):   # type: ignore[arg-type]
                if not put(chunk):
                    return
            put(None)
        except BaseException as exc:   # noqa: BLE001 - handed to the event loop, raised there
            put(exc)

    producer = loop.run_in_executor(None, produce)
    try:
        i = 0
        while True:
            item = await loop.run_in_executor(None, take)
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            yield i, item
            i += 1
    finally:
        stop.set()
        await asyncio.shield(producer)


__all__ = ["serve_blocks"]
