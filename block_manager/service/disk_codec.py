"""The disk tier on the wire (docs/tiers.md): the blocks a node's segment file holds when it
registers (`RegisterNodeRequest.disk_blocks`, seeded into the pool's disk index) and the block
identity riding with each disk offload of a step (`PoolStep.disk_blocks`).

Payloads are journalled as JSON, so hashes travel as hex strings: a disk block is
`[slot, block_hash, parent_hash | None, salt | None, token_ids, last_used]`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from block_manager.core.disk_tier import SeedBlock, check_seeds
from block_manager.core.errors import InvalidRequest
from block_manager.core.hashing import HASH_BYTES
from block_manager.core.manager import MAX_POOL_BLOCKS
from block_manager.service.state_codec import check_count, check_optional_str
from pagedkv.v1 import common_pb2

MAX_SALT_CHARS = 1024   # as the Step's salts


def disk_register_payload(request: Any) -> dict[str, Any]:
    """The disk fields of a RegisterNodeRequest (none without a disk tier)."""
    if not request.disk_num_blocks and not request.disk_blocks:
        return {}
    return {
        "disk_num_blocks": request.disk_num_blocks,
        "disk_blocks": [[b.slot, b.block_hash.hex(), b.parent_hash.hex() if b.parent_hash else None,
                         b.salt if b.HasField("salt") else None, list(b.token_ids), b.last_used]
                        for b in request.disk_blocks],
    }


def decode_disk_seeds(p: Mapping[str, Any], block_size: int, host_num_blocks: int) -> tuple[int, list[SeedBlock]]:
    """`(disk_num_blocks, seeds)` of a register payload, every block checked (`InvalidRequest`
    before anything changes)."""
    n = check_count("disk_num_blocks", p.get("disk_num_blocks", 0), 0, MAX_POOL_BLOCKS)
    raw = p.get("disk_blocks", [])
    if not isinstance(raw, list) or len(raw) > n:
        raise InvalidRequest(f"disk_blocks: at most disk_num_blocks ({n}) blocks")
    if n and not host_num_blocks:
        raise InvalidRequest("a disk tier needs a host tier above it (host_num_blocks > 0)")
    seeds: list[SeedBlock] = []
    for i, item in enumerate(raw):
        try:
            slot, h, parent, salt, tokens, last_used = item
            block_hash = bytes.fromhex(h)
            parent_hash = None if parent is None else bytes.fromhex(parent)
        except (TypeError, ValueError):
            raise InvalidRequest(f"disk_blocks[{i}] is malformed") from None
        if len(block_hash) != HASH_BYTES:
            raise InvalidRequest(f"disk_blocks[{i}]: a block hash has {HASH_BYTES} bytes")
        check_optional_str(f"disk_blocks[{i}].salt", salt, MAX_SALT_CHARS)
        if not isinstance(tokens, list) or any(type(t) is not int or not 0 <= t < 1 << 32 for t in tokens):
            raise InvalidRequest(f"disk_blocks[{i}]: token ids must be unsigned 32-bit integers")
        seeds.append(SeedBlock(check_count(f"disk_blocks[{i}].slot", slot, 0, MAX_POOL_BLOCKS), block_hash,
                               parent_hash, salt, tuple(tokens), check_count("last_used", last_used, 0, 1 << 63)))
    check_seeds(seeds, n, block_size)
    return n, seeds


def disk_step_blocks(tier_ops: Iterable[Any]) -> list[list[Any]]:
    """The identity of each disk offload of a step, in op order (JSON, journalled)."""
    return [[op.dst, op.meta.block_hash.hex(), None if op.meta.parent_hash is None else op.meta.parent_hash.hex(),
             op.meta.salt, list(op.meta.token_ids)] for op in tier_ops if op.kind == "disk_offload"]


def fill_disk_blocks(msg: Any, blocks: Iterable[list[Any]]) -> None:
    """`PoolStep.disk_blocks` from `disk_step_blocks`."""
    for slot, h, parent, salt, tokens in blocks:
        b = common_pb2.DiskBlock(slot=slot, block_hash=bytes.fromhex(h), token_ids=tokens)
        if parent is not None:
            b.parent_hash = bytes.fromhex(parent)
        if salt is not None:
            b.salt = salt
        msg.disk_blocks.append(b)


__all__ = ["decode_disk_seeds", "disk_register_payload", "disk_step_blocks", "fill_disk_blocks"]
