"""The node's host tier: K/V blocks in host memory under the device pool (docs/tiers.md).

Same block layout per layer as the device pool (`[host_num_blocks, num_kv_heads, block_size,
head_dim]` K and V tensors), pinned when the device is CUDA so transfers are asynchronous DMA.
The block manager decides every move; the node runs a step's moves before anything of the step
reads or writes the device pool: all device->host moves (swap-out, offload), then all
host->device moves (swap-in, onboard), then the step's copy ops, then the blocks it fetched from
another node (`apply_moves`, step by step for several steps). Moves are batched: one gather
and one transfer per layer and direction per step (`index_select` / `index_copy_`), never one
per block. On CUDA they run on a side stream: it waits for the work already queued on the
compute stream (the device blocks a swap-out reads were written there), and the compute stream
waits for it in turn before the step's kernels read the swapped-in blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from compute_node.pool import TORCH_DTYPES, KvPool, PoolGeometry


def host_blocks_for_budget(budget_bytes: int, geometry: PoolGeometry) -> int:
    """Whole host blocks that fit in `budget_bytes` (same bytes per block as the device pool)."""
    return max(0, budget_bytes // geometry.bytes_per_block)


class HostKvPool:
    """Per-layer host K/V tensors of one node's host tier, and the batched moves to and from
    the device pool."""

    def __init__(self, geometry: PoolGeometry, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(f"host tier needs >= 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.pinned = device.type == "cuda"
        shape = (num_blocks, geometry.num_kv_heads, geometry.block_size, geometry.head_dim)
        dtype = TORCH_DTYPES[geometry.dtype]
        self.key_caches = [torch.zeros(shape, dtype=dtype, pin_memory=self.pinned) for _ in range(geometry.num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=dtype, pin_memory=self.pinned)
                             for _ in range(geometry.num_layers)]
        self.stream: Any = torch.cuda.Stream(device=device) if self.pinned else None
        self.num_blocks_to_host = 0
        self.num_blocks_to_device = 0

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key_caches, *self.value_caches))

    def to_host(self, pool: KvPool, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks `src` into host blocks `dst` (every layer, K and V)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64)
        if self.stream is None:
            for dev, host in zip((*pool.key_caches, *pool.value_caches), (*self.key_caches, *self.value_caches)):
                host.index_copy_(0, dst, dev.index_select(0, src))
        else:
            src_dev = src.to(pool.device)
            self.stream.wait_stream(torch.cuda.current_stream(pool.device))
            staged = []
            with torch.cuda.stream(self.stream):
                for dev in (*pool.key_caches, *pool.value_caches):
                    gathered = dev.index_select(0, src_dev)
                    buf = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                    buf.copy_(gathered, non_blocking=True)
                    staged.append(buf)
            self.stream.synchronize()   # the host scatter below reads the pinned buffers
            for host, buf in zip((*self.key_caches, *self.value_caches), staged):
                host.index_copy_(0, dst, buf)
        self.num_blocks_to_host += len(pairs)

    def to_device(self, pool: KvPool, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host blocks `src` into device blocks `dst` (every layer, K and V)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64)
        if self.stream is None:
            for dev, host in zip((*pool.key_caches, *pool.value_caches), (*self.key_caches, *self.value_caches)):
                dev.index_copy_(0, dst, host.index_select(0, src))
        else:
            dst_dev = dst.to(pool.device)
            compute = torch.cuda.current_stream(pool.device)
            self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                for dev, host in zip((*pool.key_caches, *pool.value_caches), (*self.key_caches, *self.value_caches)):
                    gathered = host.index_select(0, src).pin_memory()
                    dev.index_copy_(0, dst_dev, gathered.to(pool.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(self.stream)
            compute.wait_event(done)   # the step's kernels read these blocks
        self.num_blocks_to_device += len(pairs)


def apply_moves(pool: KvPool, host: HostKvPool | None, staged: Any, disk: Any = None,
                landings: Sequence[tuple[tuple[int, int], Callable[[], None]]] = ()) -> None:
    """A Forward's staged tier moves and copy ops, in step order: for each step, its copies
    staged before it, then its host->disk moves (`disk`: compute_node.disk_tier.DiskKvStore),
    device->host moves, disk->host moves and host->device moves; the copies of the last steps
    after that.

    `landings`: prefix-fetched blocks to write into the pool, in step order, each as its step's
    mark (`StagedSteps.fetch_marks`) and the write. A fetch lands after its own step's moves and
    copies and before any later step's: its destination blocks may be ones its step (or an
    earlier one) still swaps out, offloads or copies from, freed in that very step, and a later
    step may move or copy the fetched blocks themselves (docs/prefix_fetch.md)."""
    pairs = staged.copy_pairs
    done = 0

    def copy_through(n: int) -> None:
        nonlocal done
        if n > done:
            pool.copy_blocks(pairs[done:n])
            done = n

    landed = 0

    def land_through(num_moves: int) -> None:
        """The landings of steps with at most `num_moves` tier_moves entries through them."""
        nonlocal landed
        while landed < len(landings) and landings[landed][0][1] <= num_moves:
            (num_copies, _), write = landings[landed]
            copy_through(num_copies)
            write()
            landed += 1

    disk_moves = getattr(staged, "disk_moves", None) or [((), ())] * len(staged.tier_moves)
    for j, ((offset, to_host, to_device), (to_disk, from_disk)) in enumerate(zip(staged.tier_moves, disk_moves)):
        land_through(j)   # fetches of the steps before this one
        copy_through(offset)
        if host is None:
            raise RuntimeError("internal: tier moves staged for a node without a host tier")
        if (to_disk or from_disk) and disk is None:
            raise RuntimeError("internal: disk moves staged for a node without a disk tier")
        if to_disk:
            disk.write(host, to_disk)
        host.to_host(pool, to_host)
        if from_disk:
            disk.read(host, from_disk)
        host.to_device(pool, to_device)
    land_through(len(staged.tier_moves))
    copy_through(len(pairs))


__all__ = ["HostKvPool", "apply_moves", "host_blocks_for_budget"]
