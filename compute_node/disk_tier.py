"""The node's disk tier: prefix blocks in one slot file under its host tier (docs/tiers.md).

The block manager decides every move (`block_manager/core/disk_tier.py`): which host block
spills to which disk slot, which slot is onboarded into which host block. The node only moves
the bytes, inside the step that carries the move, and keeps with each block the identity the
block manager confirms a hit against (content hash, parent hash, salt, token ids), so after a
restart it can tell the block manager what it still holds.

Storage: one file, `<disk_kv_path>/kv.seg`, of fixed-size slots addressed by the block
manager's slot ids (it keeps the LRU; a slot is overwritten in place when it reuses it, so
the file never grows past `disk_kv_bytes` and needs no compaction):

    header   (4 KiB)  b"PKVDISK1", u32 version, u32 json length, json, u32 crc32 of all before
                      json = {"fingerprint": {model, dtype, num_layers, num_kv_heads, head_dim,
                              block_size}, "slot_bytes": N}
    slot i   (slot_bytes, 4 KiB aligned, at 4096 + i * slot_bytes)
             u32 magic b"PKVB", u32 crc32(meta + payload), u32 meta length, u64 write counter,
             meta (fixed area: hash, parent, salt, token ids), payload (K then V of every
             layer, the host tier's block layout)

No fsync (it is a cache): what a crash leaves half-written fails its checksum and is dropped.
At start every slot is checked — a header of another model or layout discards the whole file
(recreated empty), a slot whose checksum or identity does not hold is discarded alone, a file
cut short loses the slots past its end — each with a structlog warning; only what passes is
reported to the block manager. A slot whose bytes fail the checksum when read for an onboard
fails that step (the scheduler recomputes); it is never served.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from compute_node.errors import ComputeNodeError
from compute_node.pool import TORCH_DTYPES, PoolGeometry
from pagedkv.logging import get_logger
from pagedkv.v1 import common_pb2

FILE_NAME = "kv.seg"
MAGIC = b"PKVDISK1"
VERSION = 1
HEADER_BYTES = 4096
REC_MAGIC = 0x42564B50   # b"PKVB" little-endian
REC_HEAD = struct.Struct("<IIIQ")   # magic, crc32, meta length, write counter
REC_HEAD_BYTES = 32
HASH_BYTES = 32
MAX_SALT_BYTES = 4 * 1024   # 1024 characters (the block manager's limit), UTF-8
ALIGN = 4096

log = get_logger("compute_node.disk_tier")


class DiskTierInUse(ValueError):
    """Another node (process) holds the slot file: each node needs its own `disk_kv_path`."""


class DiskTierCorrupt(ComputeNodeError):
    """A disk slot read for an onboard failed its checksum: the step fails, nothing is served.
    The node then registers anew (a new epoch, whose disk index lacks that slot), so the step's
    sequences recompute — the code of a node that moved on."""

    code = grpc.StatusCode.FAILED_PRECONDITION


@dataclass(slots=True, frozen=True)
class DiskBlockMeta:
    """The identity stored with a block (what the block manager confirms a hit against)."""

    block_hash: bytes
    parent_hash: bytes | None
    salt: str | None
    token_ids: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class DiskRecord:
    slot: int
    meta: DiskBlockMeta
    last_used: int


def as_meta(block: Any) -> DiskBlockMeta:
    """A `DiskBlockMeta`, or the identity of a `common_pb2.DiskBlock` (a step's disk offload)."""
    if isinstance(block, DiskBlockMeta):
        return block
    return DiskBlockMeta(bytes(block.block_hash), bytes(block.parent_hash) or None,
                         block.salt if block.HasField("salt") else None, tuple(block.token_ids))


def model_identity(model_dir: str | Path) -> str:
    """A digest naming the model's weights: config.json, and per safetensors file its name,
    size, header and a 1 MiB sample from its start, middle and end (hashing whole checkpoints
    at every start would cost seconds per GB; a different checkpoint differs in these)."""
    root = Path(model_dir)
    h = hashlib.sha256()
    config = root / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + b"\0" + str(size).encode())
        with f.open("rb") as fh:
            for off in sorted({0, max(0, size // 2 - (1 << 19)), max(0, size - (1 << 20))}):
                fh.seek(off)
                h.update(fh.read(1 << 20))
    return h.hexdigest()


def fingerprint(model: str, g: PoolGeometry) -> dict[str, Any]:
    return {"model": model, "dtype": g.dtype, "num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim, "block_size": g.block_size}


def _encode_meta(m: DiskBlockMeta) -> bytes:
    salt = b"" if m.salt is None else m.salt.encode()
    return b"".join((
        m.block_hash, b"\1" if m.parent_hash is not None else b"\0", m.parent_hash or bytes(HASH_BYTES),
        struct.pack("<bH", -1 if m.salt is None else 1, len(salt)), salt,
        struct.pack("<I", len(m.token_ids)), struct.pack(f"<{len(m.token_ids)}I", *m.token_ids),
    ))


def _decode_meta(b: bytes) -> DiskBlockMeta:
    block_hash, has_parent, parent = b[:HASH_BYTES], b[HASH_BYTES], b[HASH_BYTES + 1: 2 * HASH_BYTES + 1]
    pos = 2 * HASH_BYTES + 1
    salt_flag, salt_len = struct.unpack_from("<bH", b, pos)
    pos += 3
    salt = b[pos: pos + salt_len].decode() if salt_flag > 0 else None
    pos += salt_len
    (n,) = struct.unpack_from("<I", b, pos)
    tokens = struct.unpack_from(f"<{n}I", b, pos + 4)
    return DiskBlockMeta(bytes(block_hash), bytes(parent) if has_parent else None, salt, tuple(tokens))


class DiskKvStore:
    """The slot file of one node's disk tier (see the module docstring)."""

    def __init__(self, path: str | Path, capacity_bytes: int, geometry: PoolGeometry, model: str) -> None:
        self.dir = Path(path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = self.dir / FILE_NAME
        self.geometry = geometry
        self.dtype = TORCH_DTYPES[geometry.dtype]
        self.block_shape = (geometry.num_kv_heads, geometry.block_size, geometry.head_dim)
        self.payload_bytes = geometry.num_layers * 2 * geometry.num_kv_heads * geometry.block_size * \
            geometry.head_dim * geometry.itemsize
        self.meta_cap = 2 * HASH_BYTES + 1 + 3 + MAX_SALT_BYTES + 4 + 4 * geometry.block_size
        self.slot_bytes = -(-(REC_HEAD_BYTES + self.meta_cap + self.payload_bytes) // ALIGN) * ALIGN
        self.num_blocks = max(0, (capacity_bytes - HEADER_BYTES) // self.slot_bytes)
        if self.num_blocks < 1:
            raise ValueError(f"disk_kv_bytes {capacity_bytes} holds no block ({self.slot_bytes} bytes a slot "
                             f"+ a {HEADER_BYTES}-byte header)")
        self.header = {"fingerprint": fingerprint(model, geometry), "slot_bytes": self.slot_bytes}
        self.index: dict[int, DiskRecord] = {}   # slot -> what it holds (checked)
        self.next_counter = 1
        self.num_written = 0
        self.num_read = 0
        self.num_discarded = 0
        self.fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:   # one node per file: another one writing the same slots would corrupt both
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DiskTierInUse(f"{self.file} is in use by another node (one disk_kv_path per node)") from None
            self._open()
        except BaseException:
            os.close(self.fd)
            raise

    # ---- start: validate what the file holds ----------------------------------------------
    def _header_bytes(self) -> bytes:
        body = json.dumps(self.header, sort_keys=True).encode()
        head = MAGIC + struct.pack("<II", VERSION, len(body)) + body
        return head + struct.pack("<I", zlib.crc32(head))

    def _open(self) -> None:
        want = self._header_bytes()
        have = os.pread(self.fd, len(want), 0)
        size = os.fstat(self.fd).st_size
        if have != want:
            if size:
                log.warning("disk_tier_discarded", path=str(self.file), reason=self._mismatch(have),
                            size=size)
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, want.ljust(HEADER_BYTES, b"\0"), 0)
        else:
            self._scan(size)
        os.ftruncate(self.fd, HEADER_BYTES + self.num_blocks * self.slot_bytes)

    def _mismatch(self, have: bytes) -> str:
        if not have.startswith(MAGIC):
            return "not a pagedkv disk tier file"
        try:
            version, n = struct.unpack_from("<II", have, len(MAGIC))
            body = json.loads(have[len(MAGIC) + 8: len(MAGIC) + 8 + n])
        except (struct.error, ValueError):
            return "corrupt header"
        if version != VERSION:
            return f"format version {version}, this node writes {VERSION}"
        if body.get("fingerprint") != self.header["fingerprint"]:
            return f"written for another model or layout: {body.get('fingerprint')}"
        return "layout (slot size) differs"

    def _scan(self, size: int) -> None:
        truncated = 0
        for slot in range(self.num_blocks):
            off = HEADER_BYTES + slot * self.slot_bytes
            head = os.pread(self.fd, REC_HEAD.size, off)
            if len(head) < REC_HEAD.size:
                break
            magic, crc, meta_len, counter = REC_HEAD.unpack(head)
            if magic != REC_MAGIC:
                continue   # never written
            if off + self.slot_bytes > size:
                truncated += 1
                continue
            rec = self._check(slot, off, crc, meta_len)
            if rec is None:
                self.num_discarded += 1
                log.warning("disk_block_discarded", path=str(self.file), slot=slot, reason="checksum or identity")
                os.pwrite(self.fd, bytes(REC_HEAD.size), off)
                continue
            self.index[slot] = DiskRecord(slot, rec, counter)
            self.next_counter = max(self.next_counter, counter + 1)
        if truncated:
            self.num_discarded += truncated
            log.warning("disk_tier_truncated", path=str(self.file), slots_lost=truncated, size=size)

    def _check(self, slot: int, off: int, crc: int, meta_len: int) -> DiskBlockMeta | None:
        if meta_len > self.meta_cap:
            return None
        data = os.pread(self.fd, self.meta_cap + self.payload_bytes, off + REC_HEAD_BYTES)
        if len(data) != self.meta_cap + self.payload_bytes:
            return None
        meta_b, payload = data[:meta_len], data[self.meta_cap:]
        if zlib.crc32(payload, zlib.crc32(meta_b)) != crc:
            return None
        try:
            meta = _decode_meta(meta_b)
        except (struct.error, UnicodeDecodeError, IndexError):
            return None
        if len(meta.token_ids) != self.geometry.block_size or len(meta.block_hash) != HASH_BYTES:
            return None
        return meta

    def _recheck(self) -> None:
        """Check every held slot again (after a read found one damaged while running)."""
        for slot in list(self.index):
            off = HEADER_BYTES + slot * self.slot_bytes
            head = os.pread(self.fd, REC_HEAD.size, off)
            rec = None
            if len(head) == REC_HEAD.size:
                magic, crc, meta_len, _ = REC_HEAD.unpack(head)
                rec = self._check(slot, off, crc, meta_len) if magic == REC_MAGIC else None
            if rec is None or rec != self.index[slot].meta:
                del self.index[slot]
                self.num_discarded += 1
                log.warning("disk_block_discarded", path=str(self.file), slot=slot, reason="checksum on recheck")

    def records(self) -> list[DiskRecord]:
        """What the file holds, checked (reported to the block manager at registration)."""
        return sorted(self.index.values(), key=lambda r: r.slot)

    def register_blocks(self) -> list[common_pb2.DiskBlock]:
        """`records()` as `RegisterNodeRequest.disk_blocks` (seeds the pool's disk index)."""
        out = []
        for r in self.records():
            b = common_pb2.DiskBlock(slot=r.slot, block_hash=r.meta.block_hash, parent_hash=r.meta.parent_hash or b"",
                                     token_ids=r.meta.token_ids, last_used=r.last_used)
            if r.meta.salt is not None:
                b.salt = r.meta.salt
            out.append(b)
        return out

    # ---- moves ---------------------------------------------------------------------------
    def write(self, host: Any, items: Sequence[tuple[int, int, Any]]) -> None:
        """Host blocks `h` into disk slots (every layer, K and V) with their identity (a
        `DiskBlockMeta` or a `DiskBlock` message). One gather per layer into one buffer, one
        positioned write per slot (no per-block tensor work)."""
        if not items:
            return
        idx = torch.tensor([h for h, _, _ in items], dtype=torch.int64)
        buf = self._gather(host, idx)
        for i, (_, slot, block) in enumerate(items):
            self._check_slot(slot)
            meta = as_meta(block)
            meta_b = _encode_meta(meta)
            if len(meta_b) > self.meta_cap:
                raise ValueError(f"disk block identity of {len(meta_b)} bytes exceeds {self.meta_cap}")
            payload = memoryview(buf[i])
            crc = zlib.crc32(payload, zlib.crc32(meta_b))
            counter = self.next_counter
            self.next_counter += 1
            off = HEADER_BYTES + slot * self.slot_bytes
            head = REC_HEAD.pack(REC_MAGIC, crc, len(meta_b), counter).ljust(REC_HEAD_BYTES, b"\0")
            os.pwritev(self.fd, [head + meta_b.ljust(self.meta_cap, b"\0"), payload], off)
            self.index[slot] = DiskRecord(slot, meta, counter)
        self.num_written += len(items)

    def _gather(self, host: Any, idx: torch.Tensor) -> np.ndarray:
        """`[n, payload_bytes]` bytes of host blocks `idx`: K then V of every layer."""
        n = len(idx)
        buf = np.empty((n, 2 * self.geometry.num_layers, self.payload_bytes // (2 * self.geometry.num_layers)),
                       dtype=np.uint8)
        for j, cache in enumerate(self._caches(host)):
            buf[:, j, :] = cache.index_select(0, idx).reshape(n, -1).view(torch.uint8).numpy()
        return buf.reshape(n, -1)

    @staticmethod
    def _caches(host: Any) -> list[torch.Tensor]:
        return [c for pair in zip(host.key_caches, host.value_caches) for c in pair]

    def read(self, host: Any, pairs: Sequence[tuple[int, int]]) -> None:
        """Disk slots into host blocks `h`, each checked against its checksum and identity
        before anything is written to host memory."""
        if not pairs:
            return
        n = len(pairs)
        buf = np.empty((n, self.payload_bytes), dtype=np.uint8)
        for i, (slot, _) in enumerate(pairs):
            self._check_slot(slot)
            off = HEADER_BYTES + slot * self.slot_bytes
            head = os.pread(self.fd, REC_HEAD_BYTES + self.meta_cap, off)
            got = os.preadv(self.fd, [memoryview(buf[i])], off + REC_HEAD_BYTES + self.meta_cap)
            held = self.index.get(slot)
            ok = False
            if held is not None and len(head) == REC_HEAD_BYTES + self.meta_cap and got == self.payload_bytes:
                magic, crc, meta_len, _ = REC_HEAD.unpack_from(head)
                meta_b = head[REC_HEAD_BYTES: REC_HEAD_BYTES + min(meta_len, self.meta_cap)]
                ok = (magic == REC_MAGIC and meta_len <= self.meta_cap
                      and zlib.crc32(memoryview(buf[i]), zlib.crc32(meta_b)) == crc
                      and meta_b[:HASH_BYTES] == held.meta.block_hash)
            if not ok:
                self.index.pop(slot, None)
                self.num_discarded += 1
                log.warning("disk_block_discarded", path=str(self.file), slot=slot, reason="checksum on read")
                self._recheck()   # the file changed under us: drop every other bad slot too, at once
                raise DiskTierCorrupt(f"disk tier slot {slot} failed its checksum: not served (recompute)")
        dst = torch.tensor([h for _, h in pairs], dtype=torch.int64)
        per = buf.reshape(n, 2 * self.geometry.num_layers, -1)
        for j, cache in enumerate(self._caches(host)):
            src = torch.from_numpy(np.ascontiguousarray(per[:, j, :])).view(self.dtype).reshape(n, *self.block_shape)
            cache.index_copy_(0, dst, src)
        self.num_read += len(pairs)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_blocks:
            raise DiskTierCorrupt(f"disk slot {slot} outside 0..{self.num_blocks - 1}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_disk_tier(path: str | Path, capacity_bytes: int, geometry: PoolGeometry, model_dir: str | Path) -> DiskKvStore:
    """The disk tier of a node serving `model_dir` (its fingerprint: the weights' identity and
    the pool's layout)."""
    return DiskKvStore(path, capacity_bytes, geometry, model_identity(model_dir))


__all__ = [
    "as_meta", "open_disk_tier", "DiskBlockMeta", "DiskTierInUse", "DiskKvStore", "DiskRecord", "DiskTierCorrupt",
    "fingerprint", "model_identity",
]
