"""Synchronous admin-plane client (`BlockManagerAdmin`).

Operators' calls are rare and read by humans or scripts, so answers come back as plain
JSON-shaped dicts (proto field names, every field present, 64-bit ints as numbers) —
exactly what `block-manager admin --json` prints. The bearer token, when given, rides on
every call as `authorization: Bearer <token>`. Reads are retried like data-plane reads;
mutating admin calls carry a request id reused on retry.
"""

from __future__ import annotations

import random
from collections.abc import Generator
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from block_manager.client.base import CHANNEL_OPTIONS, DEFAULT_TIMEOUT_S
from block_manager.client.errors import error_from_rpc
from block_manager.client.retry import ClientStats, RetryPolicy, new_request_id
from block_manager.client.types import SchedulerStatus
from pagedkv.auth import token_metadata
from pagedkv.endpoints import Endpoints, split_targets
from pagedkv.rpc import call_with_retry
from pagedkv.tls import TlsSettings, open_channel
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc


def message_dict(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(
        msg, always_print_fields_with_no_presence=True, preserving_proto_field_name=True, unquote_int64_if_possible=True
    )


class AdminClient:
    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        channel: grpc.Channel | None = None,
        tls: TlsSettings | None = None,
    ) -> None:
        """`token`: the admin bearer token; `tls`: the CA that verifies the server and, for
        mutual TLS, an admin client certificate (plaintext when not given)."""
        self.target = target
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._metadata = token_metadata(token)
        # Several addresses (or a name with several records): the admin plane of whichever
        # block manager serves, as for the data plane (`pagedkv.endpoints`).
        self._fixed_channel = channel
        self._endpoints = None if channel is not None else Endpoints(target, tls, CHANNEL_OPTIONS, aio=False)
        self._rng = random.Random()
        self.stats = ClientStats()

    @property
    def _stub(self) -> pb_grpc.BlockManagerAdminStub:
        channel = self._fixed_channel if self._endpoints is None else self._endpoints.channel()
        return pb_grpc.BlockManagerAdminStub(channel)

    def _on_attempt(self, method: str, retry: bool) -> None:
        if retry and self._endpoints is not None:
            self._endpoints.advance()
        self.stats.record_attempt(method, retry)

    def close(self) -> None:
        """Close the channels (if this client created them)."""
        if self._endpoints is not None:
            for channel in self._endpoints.close_all():
                channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Message) -> dict[str, Any]:
        return message_dict(self._call_message(method, request))

    def _call_message(self, method: str, request: Message) -> Any:
        policy = self.retry
        if self._endpoints is not None and policy.max_attempts > 1:
            policy = self._endpoints.retry_policy(policy)
        try:
            reply = call_with_retry(
                lambda: getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata),
                policy, self._rng, lambda retry: self._on_attempt(method, retry),
            )
        except grpc.RpcError as exc:
            self.stats.errors += 1
            raise error_from_rpc(exc, method) from exc
        return reply

    def status(self) -> dict[str, Any]:
        """The server's phase and every pool's counters (Status). With several addresses, a
        standby's answer ("standby") sends the question on to the next one, so the leader's
        status comes back when there is a leader (else the last standby's)."""
        reply = self._call("Status", pb.StatusRequest())
        endpoints = self._endpoints
        if endpoints is None:
            return reply
        for _ in range(endpoints.num_addresses - 1):
            if reply.get("state") != "standby":
                break
            endpoints.advance()
            reply = self._call("Status", pb.StatusRequest())
        return reply

    def list_nodes(self) -> dict[str, Any]:
        """Every registered node: epoch, lease, address, draining/fenced."""
        return self._call("ListNodes", pb.ListNodesRequest())

    def list_schedulers(self) -> list[SchedulerStatus]:
        """The fleet's live members (docs/block_manager_service.md, "Fleet mode"): what each
        owns, is asked to release, is pinned to, its load and how long until it lapses."""
        reply = self._call_message("ListSchedulers", pb.ListSchedulersRequest())
        return [
            SchedulerStatus(s.scheduler_id, s.address, tuple(s.pool_ids), tuple(s.release_pool_ids),
                            tuple(s.pin_pool_ids), int(s.num_running), int(s.num_waiting), float(s.remaining_s))
            for s in reply.schedulers
        ]

    def list_sequences(self, pool_id: str = "", limit: int = 0) -> dict[str, Any]:
        """Sequences (of one pool, or all), at most `limit` (0: all)."""
        return self._call("ListSequences", pb.ListSequencesRequest(pool_id=pool_id, limit=limit))

    def describe_sequence(self, seq_id: str) -> dict[str, Any]:
        """One sequence's table, length and version."""
        return self._call("DescribeSequence", pb.DescribeSequenceRequest(seq_id=seq_id))

    def drain_node(self, node_id: str, *, undrain: bool = False) -> dict[str, Any]:
        """Stop admitting new sequences on a node (or resume with `undrain`)."""
        return self._call(
            "DrainNode", pb.DrainNodeRequest(request_id=new_request_id(), node_id=node_id, undrain=undrain)
        )

    def fsck(self) -> dict[str, Any]:
        """The block manager's consistency check: `ok` and any problems found."""
        return self._call("Fsck", pb.FsckRequest())

    def reset_prefix_cache(self, pool_id: str = "") -> dict[str, Any]:
        """Forget every cached prefix block (of one pool, or all)."""
        return self._call("ResetPrefixCache", pb.ResetPrefixCacheRequest(request_id=new_request_id(), pool_id=pool_id))

    def trigger_defrag(self, pool_id: str = "", kind: str = "") -> dict[str, Any]:
        """Plan a defrag now ("compaction" default, or "contiguity"); its moves ride in the pool's next step."""
        return self._call(
            "TriggerDefrag", pb.TriggerDefragRequest(request_id=new_request_id(), pool_id=pool_id, kind=kind)
        )

    def kv_events(self, from_event_id: int = 0, *, live_only: bool = False) -> Generator[pb.KvEvent, None, None]:
        """The KV events stream (docs/kv_events.md), event by event, until the caller stops
        iterating or the server ends it (then the typed error). No retry: a caller that
        wants to go on resubscribes from the last id it applied."""
        channel = self._fixed_channel if self._endpoints is None else self._endpoints.channel()
        call = pb_grpc.BlockManagerStub(channel).SubscribeKvEvents(
            pb.SubscribeKvEventsRequest(from_event_id=from_event_id, live_only=live_only), metadata=self._metadata)
        try:
            for resp in call:
                yield from resp.events
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                return
            self.stats.errors += 1
            raise error_from_rpc(exc, "SubscribeKvEvents") from exc
        finally:
            call.cancel()


def served_services(
    target: str, timeout_s: float = DEFAULT_TIMEOUT_S, tls: TlsSettings | None = None
) -> list[str] | None:
    """The gRPC services `target` announces through server reflection (health and reflection
    left out), or None when it cannot say. For telling an operator what listens on a port that
    answered UNIMPLEMENTED to an admin call (e.g. a compute node's)."""
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    try:
        with open_channel(split_targets(target)[0], tls, CHANNEL_OPTIONS) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=timeout_s)))
    except (grpc.RpcError, StopIteration):
        return None
    skip = {health.SERVICE_NAME, "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"}
    return sorted(s.name for s in reply.list_services_response.service if s.name not in skip)


__all__ = ["AdminClient", "message_dict", "served_services"]
