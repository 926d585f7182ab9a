"""Several addresses of one replicated service (active/standby block managers): calls go to the
current one; a retry moves to the next.

A target is one `host:port`, or several separated by commas (`bm-0:50051,bm-1:50051`). A host
name that resolves to several addresses of one family (a Kubernetes headless Service listing
every block-manager pod) counts as that many addresses, re-resolved each time the list has
been gone round once (pods come back with new IPs); a name with one address is left to gRPC's
own resolver, so a single-address target behaves exactly as a plain channel.

Why rotate on a retry rather than balance: exactly one replica serves; the others answer
UNAVAILABLE ("standby") at once, and a dead or paused leader answers UNAVAILABLE or
DEADLINE_EXCEEDED — the very codes that are retried. Resending a mutating call under its
request id to the next address is safe: the new leader recovered the journal, so a call the
old one committed is answered from its record, and one it never committed is applied once.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Iterable
from typing import Any

from pagedkv.rpc import RetryPolicy
from pagedkv.tls import TlsSettings, open_channel

# With several addresses a call keeps trying this long (a takeover after a paused leader takes
# its lease, 5 s by default, plus recovery).
DEFAULT_FAILOVER_S = 20.0


def split_targets(target: str) -> list[str]:
    """`"a:1, b:2"` -> `["a:1", "b:2"]`; ValueError for an empty entry or a missing port."""
    parts = [p.strip() for p in target.split(",")]
    if not parts or any(not p for p in parts):
        raise ValueError(f"bad address list {target!r}: empty entry")
    for p in parts:
        if "://" not in p and (":" not in p or not p.rsplit(":", 1)[1].isdigit()):
            where = f" in {target!r}" if len(parts) > 1 else ""
            raise ValueError(f"bad address {p!r}{where}: expected HOST:PORT")
    return parts


def _resolve(target: str) -> list[tuple[str, str | None]]:
    """`(address, tls name)` pairs: several for a name with several addresses, else itself."""
    if "://" in target:
        return [(target, None)]
    host, port = target.rsplit(":", 1)
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return [(target, None)]
    for family in (socket.AF_INET, socket.AF_INET6):
        ips = sorted({str(i[4][0]) for i in infos if i[0] == family})
        if len(ips) > 1:
            return [(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}", host) for ip in ips]
    return [(target, None)]


def tls_for_name(tls: TlsSettings | None, name: str | None) -> TlsSettings | None:
    """An address found by resolving `name` is verified against `name` (the certificate names
    the service, not each pod IP), unless the settings already say which name to expect."""
    if name is None or tls is None or not tls.active or tls.server_name:
        return tls
    return tls.model_copy(update={"server_name": name})


class Endpoints:
    """Channels to every address of a target, one of them current. Not thread-safe beyond
    what its callers already serialise (one client, one event loop or one calling thread)."""

    def __init__(
        self,
        target: str,
        tls: TlsSettings | None,
        options: Iterable[tuple[str, Any]],
        *,
        aio: bool,
        resolve: Callable[[str], list[tuple[str, str | None]]] = _resolve,
    ) -> None:
        self.target = target
        self._specs = split_targets(target)
        self._tls = tls
        self._options = list(options)
        self._aio = aio
        self._resolve = resolve
        self._channels: dict[str, Any] = {}
        self._addresses: list[tuple[str, str | None]] = []
        self._index = 0
        self._refresh()
        self.channel()   # now, so bad TLS files are reported by the constructor, not mid-call

    def _refresh(self) -> None:
        addresses: list[tuple[str, str | None]] = []
        for spec in self._specs:
            addresses.extend(self._resolve(spec))
        self._addresses = addresses or [(s, None) for s in self._specs]

    @property
    def num_addresses(self) -> int:
        return len(self._addresses)

    @property
    def current(self) -> str:
        return self._addresses[self._index % len(self._addresses)][0]

    def channel(self) -> Any:
        address, tls_name = self._addresses[self._index % len(self._addresses)]
        ch = self._channels.get(address)
        if ch is None:
            tls = tls_for_name(self._tls, tls_name)
            ch = self._channels[address] = open_channel(address, tls, self._options, aio=self._aio)
        return ch

    def advance(self) -> None:
        """Move to the next address (after a failed attempt); re-resolve after a full round."""
        if len(self._addresses) == 1 and len(self._specs) == 1:
            # A single name may have grown into several (a standby was added): look again.
            self._refresh()
            self._index = 0
            return
        self._index += 1
        if self._index >= len(self._addresses):
            self._index = 0
            self._refresh()

    def retry_policy(self, policy: RetryPolicy, failover_s: float = DEFAULT_FAILOVER_S) -> RetryPolicy:
        """`policy` stretched to keep trying for `failover_s` when there are several addresses."""
        if len(self._addresses) < 2 and len(self._specs) < 2:
            return policy
        # Enough attempts that even the shortest backoffs (jitter at its largest) add up to
        # `failover_s`: a takeover that takes that long is ridden out, not reported.
        attempts, waited = 1, 0.0
        while waited < failover_s and attempts < 10_000:
            base = min(policy.max_backoff_s, policy.initial_backoff_s * policy.multiplier ** (attempts - 1))
            waited += max(base, 0.001) * (1.0 - policy.jitter)
            attempts += 1
        return dataclasses.replace(policy, max_attempts=max(policy.max_attempts, attempts))

    def channels(self) -> list[Any]:
        return list(self._channels.values())

    def close_all(self) -> list[Any]:
        """Forget every channel; returns them for the caller to close (sync or async)."""
        channels = list(self._channels.values())
        self._channels.clear()
        return channels


__all__ = ["DEFAULT_FAILOVER_S", "Endpoints", "split_targets", "tls_for_name"]
