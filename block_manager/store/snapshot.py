"""Snapshot encoding: canonical JSON, zlib-compressed.

A 100k-block service state is a few MB of JSON that compresses several-fold (block ids
and counts are repetitive); level 1 keeps the write cheap. The `encoding` column names the
format so a later version can change it without guessing.
"""

from __future__ import annotations

import zlib

from block_manager.store.errors import InvalidSnapshot, StoreError
from block_manager.store.records import canonical_json, decode_json

ENCODING_JSON_ZLIB = "json+zlib"


def encode_snapshot(state: dict, level: int) -> bytes:
    if not isinstance(state, dict):
        raise InvalidSnapshot(f"snapshot state must be a dict, got {type(state).__name__}")
    return zlib.compress(canonical_json(state).encode("utf-8"), level)


def decode_snapshot(encoding: str, blob: bytes) -> dict:
    if encoding != ENCODING_JSON_ZLIB:
        raise StoreError(f"unknown snapshot encoding {encoding!r}")
    try:
        state = decode_json(zlib.decompress(blob))
    except (zlib.error, ValueError) as exc:
        raise StoreError(f"snapshot is unreadable: {exc}") from exc
    if not isinstance(state, dict):
        raise StoreError("snapshot is not a JSON object")
    return state


def check_snapshot_seq_no(seq_no: int, snapshot_seq_no: int, last_seq_no: int) -> None:
    """A snapshot must cover a journaled prefix and must not go back in time."""
    if isinstance(seq_no, bool) or not isinstance(seq_no, int):
        raise InvalidSnapshot(f"snapshot seq_no must be an int, got {type(seq_no).__name__}")
    if seq_no > last_seq_no:
        raise InvalidSnapshot(f"snapshot seq_no {seq_no} is beyond the journal ({last_seq_no})")
    if seq_no < snapshot_seq_no:
        raise InvalidSnapshot(
            f"snapshot seq_no {seq_no} is older than the current snapshot ({snapshot_seq_no})"
        )
