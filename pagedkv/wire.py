"""Protobuf's base-128 varint, for the few messages we write by hand.

Two hot paths build their messages without the protobuf runtime, to copy a payload once
(`compute_node.transfer`'s `KvChunk`, a MiB of KV per message) or to serialize one event for
many subscribers once (`block_manager.service.kv_events_codec`). Both need the varint encoding
of lengths and integers; it lives here, once.
"""

from __future__ import annotations


def varint(n: int) -> bytes:
    """The varint encoding of the non-negative integer `n` (7 bits per byte, low bits first)."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


__all__ = ["varint"]
