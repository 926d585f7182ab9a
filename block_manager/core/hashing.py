"""Content hashes of full blocks, chained through the prefix.

`H(parent, tokens, salt)` identifies a block by everything before it and in it, so two
prompts share a cached block only when they share the whole prefix up to and including
that block. The byte encoding is explicit (flag bytes, length prefixes, little-endian
int64 tokens) and hashed with BLAKE2b, so a hash is the same in every process and after
every restart: journal replay and snapshots depend on that. Python's `hash()` is salted
per process and must never be used here.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

from block_manager.core.errors import InvalidRequest

BlockHash = bytes
HASH_BYTES = 32

_BIG_ENDIAN = sys.byteorder == "big"
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"
_NO_SALT = b"\x00"
_PERSON = b"pagedkv-blk-v1"
_HAS_SALT = b"\x01"
# Every block hash starts from this state: copying it is cheaper than a new `blake2b(...)`
# with its keyword parameters (about 0.4 µs a block, most of a filled block's hash call).
# Never updated itself, so sharing it between threads is safe.
_BLAKE2B = hashlib.blake2b(digest_size=HASH_BYTES, person=_PERSON)


def _blake2b(data: bytes) -> BlockHash:
    h = _BLAKE2B.copy()
    h.update(data)
    return h.digest()


def token_array(token_ids: Sequence[int]) -> array:
    """Token ids as an int64 array; raises InvalidRequest for non-ints or out-of-range ids.

    Converting once up front both validates the input (before any state changes) and
    gives a buffer whose slices encode without a per-token Python loop.
    """
    try:
        return array("q", token_ids)
    except (TypeError, OverflowError, ValueError) as exc:
        raise InvalidRequest(f"token ids must be int64 integers: {exc}") from None


def salt_bytes(salt: str | None) -> bytes:
    """Length-prefixed UTF-8 salt; None and "" encode differently."""
    if salt is None:
        return _NO_SALT
    raw = salt.encode("utf-8")
    return _HAS_SALT + len(raw).to_bytes(4, "little") + raw


def hash_block_bytes(parent: BlockHash | None, tokens: array, salt_enc: bytes) -> BlockHash:
    """Hash of one block given its tokens as an int64 array and the encoded salt."""
    if _BIG_ENDIAN:
        tokens = array("q", tokens)
        tokens.byteswap()
    head = _NO_PARENT if parent is None else _HAS_PARENT + parent
    return _blake2b(b"".join((head, salt_enc, len(tokens).to_bytes(4, "little"), tokens.tobytes())))


def hash_encoded(parent: BlockHash | None, salt_enc: bytes, size: bytes, data: bytes) -> BlockHash:
    """The block hash from its encoded parts (`size`: the token count as 4 little-endian
    bytes; `data`: the tokens as little-endian int64 bytes)."""
    head = _NO_PARENT if parent is None else _HAS_PARENT + parent
    return _blake2b(b"".join((head, salt_enc, size, data)))


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None) -> BlockHash:
    """Public form of the block hash: `H(parent_hash, token_ids, salt)`."""
    return hash_block_bytes(parent, token_array(token_ids), salt_bytes(salt))


def hash_prefix(
    token_ids: Sequence[int] | array,
    block_size: int,
    salt: str | None = None,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is
    not hashed: its content is still changing)."""
    tokens = token_ids if isinstance(token_ids, array) else token_array(token_ids)
    num_full = len(tokens) // block_size
    if not num_full:
        return []
    if _BIG_ENDIAN:
        tokens = array("q", tokens[: num_full * block_size])
        tokens.byteswap()
    # One buffer for the whole prompt, sliced per block: the same bytes `hash_block_bytes`
    # hashes, without an array and a length encoding per block.
    data = tokens.tobytes()
    salt_enc = salt_bytes(salt)
    size = block_size.to_bytes(4, "little")
    width = 8 * block_size
    copy = _BLAKE2B.copy
    hashes: list[BlockHash] = []
    for start in range(0, num_full * width, width):
        head = _NO_PARENT if parent is None else _HAS_PARENT + parent
        h = copy()
        h.update(b"".join((head, salt_enc, size, data[start : start + width])))
        parent = h.digest()
        hashes.append(parent)
    return hashes
