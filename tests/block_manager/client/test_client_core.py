"""One client core under two faces: the sync and async clients run the same operations
(`ClientBase`), so the same replies give the same calls, the same session handling and the
same results; and the step helper reaches the client only through its public `commit` /
`resend`."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from block_manager.client import AsyncBlockManagerClient, BlockManagerClient
from block_manager.client.errors import BlockManagerError, UnavailableError, error_for
from pagedkv.v1 import block_manager_pb2 as pb

CLIENT_DIR = Path(__file__).resolve().parents[3] / "block_manager" / "client"
Reply = Callable[[str, Any], Any]


def _server() -> tuple[list[tuple[str, Any]], Reply]:
    """A scripted block manager: no sessions (UNIMPLEMENTED), the first Step lost
    (UNAVAILABLE), every later one answered with a lease and one allocation."""
    calls: list[tuple[str, Any]] = []

    def reply(method: str, request: Any) -> Any:
        copy = type(request)()
        copy.CopyFrom(request)
        calls.append((method, copy))
        if method == "OpenSession":
            raise error_for(grpc.StatusCode.UNIMPLEMENTED, "no sessions here", method=method)
        if sum(m == "Step" for m, _ in calls) == 1:
            raise error_for(grpc.StatusCode.UNAVAILABLE, "leader gone", method=method)
        resp = pb.StepResponse(alloc_num_cached_tokens=[0], alloc_num_tokens=[4], alloc_pool_ids=["n1"])
        resp.lease_epochs["n1"] = 1
        return resp

    return calls, reply


class _SyncClient(BlockManagerClient):
    def __init__(self, reply: Reply) -> None:
        super().__init__("scripted", channel=object(), scheduler_id="sched", block_sizes={"n1": 4})
        self._reply = reply

    def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        return self._reply(method, request)


class _AsyncClient(AsyncBlockManagerClient):
    def __init__(self, reply: Reply) -> None:
        super().__init__("scripted", channel=object(), scheduler_id="sched", block_sizes={"n1": 4})
        self._reply = reply

    async def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        await asyncio.sleep(0)
        return self._reply(method, request)


def _sync_run() -> tuple[list[tuple[str, Any]], Any, Any]:
    calls, reply = _server()
    client = _SyncClient(reply)
    step = client.step()
    step.allocate("a", "n1", [1, 2, 3, 4])
    try:
        step.commit(request_id="rid-1")
        raise AssertionError("the first Step is lost")
    except UnavailableError:
        pass
    return calls, step.resend(), client


async def _async_run() -> tuple[list[tuple[str, Any]], Any, Any]:
    calls, reply = _server()
    client = _AsyncClient(reply)
    step = client.step()
    step.allocate("a", "n1", [1, 2, 3, 4])
    try:
        await step.commit(request_id="rid-1")
        raise AssertionError("the first Step is lost")
    except UnavailableError:
        pass
    return calls, await step.resend(), client


def test_both_faces_make_the_same_calls_and_get_the_same_result() -> None:
    sync_calls, sync_result, sync_client = _sync_run()
    async_calls, async_result, async_client = asyncio.run(_async_run())
    # the session probe turned sessions off; the lost Step went again verbatim (same request id)
    assert [m for m, _ in sync_calls] == ["OpenSession", "Step", "Step"]
    assert sync_calls[1][1] == sync_calls[2][1] and sync_calls[1][1].request_id == "rid-1"
    assert not sync_calls[1][1].HasField("session")
    assert sync_calls == async_calls
    for result, client in ((sync_result, sync_client), (async_result, async_client)):
        assert result.allocations["a"].pool_id == "n1" and result.allocations["a"].num_tokens == 4
        assert not client.session.enabled and client.held_pools == {"n1"}


def test_a_definite_refusal_reaches_the_caller_unchanged() -> None:
    def refuse(method: str, request: Any) -> Any:
        if method == "OpenSession":
            raise error_for(grpc.StatusCode.UNIMPLEMENTED, "no sessions", method=method)
        raise error_for(grpc.StatusCode.INVALID_ARGUMENT, "bad step", method=method)

    client = _SyncClient(refuse)
    step = client.step()
    step.free(["x"])
    try:
        client.commit(step)
        raise AssertionError("refused")
    except BlockManagerError as exc:
        assert exc.message == "bad step" and exc.code == grpc.StatusCode.INVALID_ARGUMENT
    assert step.unanswered().free_seq_ids == ["x"]   # kept for a resend


def _private_client_uses(path: Path) -> list[str]:
    """`x._name` where `x` is the step's client, inside the step classes of `path`."""
    found = []
    for cls in ast.walk(ast.parse(path.read_text())):
        if not isinstance(cls, ast.ClassDef) or not any(
                isinstance(b, ast.Name) and b.id == "StepBatch" for b in cls.bases):
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                if (isinstance(owner, ast.Attribute) and owner.attr == "_client") or (
                        isinstance(owner, ast.Name) and owner.id == "client"):
                    found.append(f"{path.name}:{node.lineno} {cls.name} uses client.{node.attr}")
    return found


def test_the_step_classes_use_only_the_clients_public_methods() -> None:
    assert _private_client_uses(CLIENT_DIR / "sync_client.py") == []
    assert _private_client_uses(CLIENT_DIR / "async_client.py") == []
