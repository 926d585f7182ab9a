"""When `LLM` turns async scheduling on by itself.

Async scheduling (`engine.pipeline`) plans and commits step N+1, and hands out step N's
outputs, while the nodes compute step N. That pays when the node's compute does not need this
host's CPU: a GPU node (the CPU only launches work), or a CPU node on another host. It costs
when a CPU node computes on this host's cores: the engine's work meanwhile takes a core (and
the GIL) from the model's threads. Measured on a 2-core host with the node as a local
process: 4-16% fewer tokens/s with overlap (BENCHMARKS.md, "Engine modes side by side"; then
10-13% more steps also ran, a sequence whose next token started or filled a KV block sitting a
step out, which late ids removed).

So, unless told (`LLM(async_scheduling=...)`, else `PAGEDKV_ASYNC_SCHEDULING`), overlap is on
only when EVERY node either runs on a GPU or is a CPU node whose address is not this host: an
in-process node, a loopback address (127.0.0.0/8, ::1, localhost, a Unix socket), an
unspecified one (0.0.0.0) or this host's own name all count as sharing this host's cores.
A CPU node behind another name on this same host (a container on it, say) is not recognised:
set `PAGEDKV_ASYNC_SCHEDULING=0` there.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable

from engine.node_api import NodeInfo

ASYNC_SCHEDULING_ENV = "PAGEDKV_ASYNC_SCHEDULING"   # "0": plan each step after the previous one ran
_OFF = ("0", "false", "off", "no")


def async_scheduling_from_env() -> bool | None:
    """`PAGEDKV_ASYNC_SCHEDULING` as a bool (0/false/off/no: off, anything else: on); None when unset."""
    value = os.environ.get(ASYNC_SCHEDULING_ENV)
    if value is None:
        return None
    return value.strip().lower() not in _OFF


def address_host(address: str) -> str:
    """The host part of a gRPC target (`host:port`, `[v6]:port`, `dns:///host:port`,
    `ipv4:a.b.c.d:port`); "localhost" for a Unix socket."""
    target = address.strip()
    if target.startswith(("unix:", "unix-abstract:")):
        return "localhost"
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    if target.startswith("["):
        return target[1:target.find("]")] if "]" in target else target[1:]
    if target.count(":") == 1:
        return target.rsplit(":", 1)[0]
    return target   # no port, or a bare IPv6 address


def on_this_host(address: str | None) -> bool:
    """Whether a node at `address` computes on this host's cores (None: in this process)."""
    if address is None:
        return True
    host = address_host(address).lower()
    if host in ("", "localhost", "localhost.localdomain") or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == socket.gethostname().lower()   # no DNS lookup: this runs at start-up
    return ip.is_loopback or ip.is_unspecified


def overlap_pays(infos: Iterable[NodeInfo]) -> bool:
    """True when no node computes on this host's CPU (each is on a GPU or on another host)."""
    return all(info.device.startswith("cuda") or not on_this_host(info.address) for info in infos)


def choose_async_scheduling(requested: bool | None, infos: Iterable[NodeInfo]) -> bool:
    """`requested` when given, else the environment variable when set, else `overlap_pays`."""
    if requested is not None:
        return requested
    from_env = async_scheduling_from_env()
    return overlap_pays(infos) if from_env is None else from_env


__all__ = ["ASYNC_SCHEDULING_ENV", "address_host", "async_scheduling_from_env", "choose_async_scheduling",
           "on_this_host", "overlap_pays"]
