"""Who may call what on a compute node (the rule `pagedkv.guard.EdgeGuard` applies).

| method | principal |
|---|---|
| `ComputeNode/Forward` | `scheduler` / `scheduler:<id>`: a Forward writes into the node's KV memory |
| `ComputeNode/Generate` | `scheduler` / `scheduler:<id>`: the model-level step writes KV memory too |
| `ComputeNode/GetNodeInfo` | `scheduler`, `admin` |
| `ComputeNode/FetchBlocks` | `node:<id>`: a node pulling prefix blocks granted to it (`<id>` = the grant's) |
| anything else of ours | nobody (a new RPC must be given its rule here) |

Nodes call each other only to pull granted prefix blocks (docs/prefix_fetch.md), and the block
manager never calls a node: a `node:*` principal (another node's certificate from the same CA)
is refused everything else.
"""

from __future__ import annotations

from typing import Any

from pagedkv.auth import Principal

PREFIX = "/pagedkv.v1.ComputeNode/"
_ALLOWED = {
    "Forward": frozenset({"scheduler"}),
    "Generate": frozenset({"scheduler"}),
    "GetNodeInfo": frozenset({"scheduler", "admin"}),
    "FetchBlocks": frozenset({"node"}),
}


def authorize(method: str, principal: Principal, request: Any) -> str | None:
    """Why `principal` may not call `method`; None when it may."""
    roles = _ALLOWED.get(method.rsplit("/", 1)[-1]) if method.startswith(PREFIX) else None
    if roles is None:
        return f"{principal} may not call {method}"
    name = method.rsplit("/", 1)[-1]
    if principal.role not in roles:
        return f"{name} is for {' and '.join(sorted(roles))} principals; {principal} is not one"
    if name == "FetchBlocks" and principal.name != request.dst_pool_id:
        # a node pulls only what was granted to it: the grant's destination is checked against
        # the request's `dst_pool_id` by the handler, and that against the caller here
        return f"{principal} may not pull blocks granted to node {request.dst_pool_id!r}"
    return None


__all__ = ["PREFIX", "authorize"]
