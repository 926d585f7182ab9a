"""pagedkv.endpoints: address lists, several DNS records, rotation on retry, retry budget."""

from __future__ import annotations

import pytest

from pagedkv.endpoints import Endpoints, split_targets, tls_for_name
from pagedkv.rpc import NO_RETRY, RetryPolicy
from pagedkv.tls import TlsSettings


def test_split_targets() -> None:
    assert split_targets("a:1") == ["a:1"]
    assert split_targets("a:1, b:2") == ["a:1", "b:2"]
    assert split_targets("dns:///bm:50051") == ["dns:///bm:50051"]
    for bad in ("", "a:1,", "a", "a:x", "a:1,,b:2"):
        with pytest.raises(ValueError):
            split_targets(bad)


def _fake_resolver(table: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    calls: list[str] = []

    def resolve(target: str) -> list[tuple[str, str | None]]:
        calls.append(target)
        ips = table.get(target, [])
        if len(ips) > 1:
            host, port = target.rsplit(":", 1)
            return [(f"{ip}:{port}", host) for ip in ips]
        return [(target, None)]

    return resolve, calls


def test_rotation_over_a_list_and_over_records() -> None:
    table = {"bm:50051": ["10.0.0.1", "10.0.0.2"]}
    resolve, calls = _fake_resolver(table)
    ep = Endpoints("bm:50051,other:1", None, [], aio=False, resolve=resolve)
    assert ep.num_addresses == 3
    seen = [ep.current]
    for _ in range(3):
        ep.advance()
        seen.append(ep.current)
    assert seen == ["10.0.0.1:50051", "10.0.0.2:50051", "other:1", "10.0.0.1:50051"]
    # A full round re-resolves: a pod that came back with a new IP is found.
    table["bm:50051"] = ["10.0.0.3", "10.0.0.4"]
    for _ in range(3):
        ep.advance()
    assert ep.current == "10.0.0.3:50051"
    assert calls.count("bm:50051") >= 3


def test_single_address_keeps_the_callers_retry_policy() -> None:
    resolve, _ = _fake_resolver({})
    ep = Endpoints("127.0.0.1:5", None, [], aio=False, resolve=resolve)
    policy = RetryPolicy()
    assert ep.retry_policy(policy) is policy
    ep.advance()
    assert ep.current == "127.0.0.1:5"


def test_several_addresses_stretch_the_retry_budget() -> None:
    resolve, _ = _fake_resolver({})
    ep = Endpoints("a:1,b:2", None, [], aio=False, resolve=resolve)
    policy = RetryPolicy(max_attempts=4, max_backoff_s=1.0, jitter=0.5)
    stretched = ep.retry_policy(policy, failover_s=10)
    shortest = sum(min(1.0, 0.05 * 2 ** (k - 1)) * 0.5 for k in range(1, stretched.max_attempts))
    assert shortest >= 10   # even the shortest backoffs cover the failover window
    assert stretched.max_attempts < 40
    assert ep.retry_policy(NO_RETRY).max_attempts >= 1


def test_resolved_addresses_verify_tls_against_the_name() -> None:
    tls = TlsSettings(enabled=True)
    assert tls_for_name(tls, "block-manager").server_name == "block-manager"   # type: ignore[union-attr]
    assert tls_for_name(tls, None) is tls
    assert tls_for_name(None, "block-manager") is None
    assert tls_for_name(TlsSettings(enabled=False), "bm") == TlsSettings(enabled=False)
    pinned = TlsSettings(enabled=True, server_name="pinned")
    assert tls_for_name(pinned, "block-manager") is pinned


def test_real_dns_name_with_one_address_is_left_to_grpc() -> None:
    ep = Endpoints("localhost:50051", None, [], aio=False)
    assert ep.num_addresses == 1 and ep.current == "localhost:50051"
