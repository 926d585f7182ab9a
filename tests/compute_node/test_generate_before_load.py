"""A Generate that reaches a node before its model is loaded (the node listens while it loads;
a node restarted in place at its old address gets calls meant for the old one) is refused as
UNAVAILABLE, which the engine treats as a node to probe back, not as a bad request that stops
it. A node started without a model still says it serves none."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from compute_node.errors import ComputeNodeError, InvalidForward, ModelLoading
from compute_node.service.node import ComputeNode
from engine.errors import NodeRefused, NodeUnreachable
from engine.executor import node_error
from pagedkv.v1 import compute_node_pb2 as pb
from tests.compute_node.harness import cn_config


async def _refusal(node: ComputeNode) -> ComputeNodeError:
    try:
        with pytest.raises(ComputeNodeError) as info:
            await node.generate(pb.GenerateRequest(request_id="early"))
    finally:
        await node.link.close()
    return info.value


async def test_a_generate_before_the_model_loaded_is_unavailable(tmp_path: Path) -> None:
    error = await _refusal(ComputeNode(cn_config("127.0.0.1:9", model=str(tmp_path))))
    assert isinstance(error, ModelLoading) and error.code is grpc.StatusCode.UNAVAILABLE
    assert isinstance(node_error("n", error.code, str(error)), NodeUnreachable)


async def test_a_node_without_a_model_refuses_generate_as_a_bad_request() -> None:
    error = await _refusal(ComputeNode(cn_config("127.0.0.1:9")))
    assert isinstance(error, InvalidForward) and error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(node_error("n", error.code, str(error)), NodeRefused)
