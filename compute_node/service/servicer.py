"""Protocol ↔ domain translation for `pagedkv.v1.ComputeNode`.

The servicer decodes a request into a `ForwardBatch`, hands it to the `ComputeNode` and encodes
the outputs; typed `ComputeNodeError`s become their gRPC status, anything else becomes INTERNAL
with a generic message (the exception is logged with the request id, never sent to the caller).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog

from compute_node.errors import ComputeNodeError, InvalidForward, NotRegistered
from compute_node.forward import parse_forward
from compute_node.generate import ModelInfoFields, node_info_fields
from compute_node.model import ModelError
from compute_node.service.node import ComputeNode
from compute_node.service.transfer_servicer import serve_blocks
from compute_node.wire import encode_tensor
from pagedkv.v1 import compute_node_pb2 as pb
from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc

# A scheduler sends a node the pool steps it has not forwarded yet, and the block manager lets
# at most 64 steps of a pool await their Forward's report (`max_unsettled_steps` <= 64).
MAX_STEPS_PER_FORWARD = 64


class ComputeNodeServicer(pb_grpc.ComputeNodeServicer):
    def __init__(self, node: ComputeNode) -> None:
        self.node = node   # who may call what (FetchBlocks: the grant's node only) is the edge guard's

    async def FetchBlocks(  # type: ignore[override]  # it yields each KvChunk pre-serialized, as bytes
        self, request: pb.FetchBlocksRequest, context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[bytes]:
        """Prefix fetch: serve granted blocks to another node (transfer_servicer.py), as
        serialized `KvChunk` messages (the edge guard's stream wrapper sends bytes as they are)."""
        async for message in serve_blocks(self.node, request, context):
            yield message

    async def Forward(self, request: pb.ForwardRequest, context: grpc.aio.ServicerContext) -> pb.ForwardResponse:
        node = self.node
        structlog.contextvars.bind_contextvars(request_id=request.request_id, rpc="Forward")
        try:
            if len(request.steps) > MAX_STEPS_PER_FORWARD:
                raise InvalidForward(
                    f"a forward carries at most {MAX_STEPS_PER_FORWARD} pool steps, got {len(request.steps)}"
                )
            geometry = node.geometry
            if geometry is None:
                raise NotRegistered("the node has not registered its pool yet")
            batch = parse_forward(request, geometry, node.config.max_batch)
            result = await node.forward(batch)
        except ComputeNodeError as exc:
            node.metrics.forwards.labels(exc.code.name).inc()
            node.log.info("forward_rejected", code=exc.code.name, error=str(exc))
            await context.abort(exc.code, str(exc))
        except Exception:
            node.metrics.forwards.labels("INTERNAL").inc()
            node.log.exception("forward_failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged on the compute node)")
        finally:
            structlog.contextvars.unbind_contextvars("request_id", "rpc")
        node.metrics.forwards.labels("OK").inc()
        s = result.stats
        return pb.ForwardResponse(
            outputs=[pb.LayerOutput(layer=layer, output=encode_tensor(out)) for layer, out in result.outputs],
            stats=pb.ForwardStats(
                table_fetch_s=s.table_fetch_s, copy_ops_s=s.copy_ops_s, write_s=s.write_s,
                attention_s=s.attention_s, total_s=s.total_s, num_block_manager_rpcs=s.num_block_manager_rpcs,
                num_copy_ops=s.num_copy_ops, kv_bytes_read=s.kv_bytes_read, last_step_id=s.last_step_id,
            ),
        )

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        node = self.node
        structlog.contextvars.bind_contextvars(request_id=request.request_id, rpc="Generate")
        try:
            resp = await node.generate(request)
        except ComputeNodeError as exc:
            node.metrics.forwards.labels(exc.code.name).inc()
            node.log.info("generate_rejected", code=exc.code.name, error=str(exc))
            await context.abort(exc.code, str(exc))
        except ModelError as exc:   # the runner refused the batch (its own checks): nothing written
            node.metrics.forwards.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception:
            node.metrics.forwards.labels("INTERNAL").inc()
            node.log.exception("generate_failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged on the compute node)")
        finally:
            structlog.contextvars.unbind_contextvars("request_id", "rpc")
        node.metrics.forwards.labels("OK").inc()
        return resp

    async def GetNodeInfo(
        self, request: pb.GetNodeInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetNodeInfoResponse:
        node = self.node
        geometry = node.geometry
        g = geometry or node.config.geometry
        model: ModelInfoFields = {} if node.runner is None else node_info_fields(node.runner, node.model_name)
        return pb.GetNodeInfoResponse(
            node_id=node.config.node_id,
            epoch=node.epoch,
            registered=node.registration is not None,
            num_layers=g.num_layers,
            num_kv_heads=g.num_kv_heads,
            head_dim=g.head_dim,
            dtype=g.dtype,
            device=str(node.device),
            block_size=0 if geometry is None else geometry.block_size,
            num_blocks=0 if geometry is None else geometry.num_blocks,
            last_step_id=node.tables.last_step_id,
            num_cached_tables=len(node.tables),
            **model,
        )
