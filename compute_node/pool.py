"""The node's KV memory: one K and one V tensor per layer, and the kernels that touch them.

Each layer's cache is a torch tensor `[num_blocks, num_kv_heads, block_size, head_dim]`. On a
GPU the tensors live in CUDA memory and the `kernels` dispatcher sends them to the Numba CUDA
kernels (zero copy through the CUDA array interface, on torch's current stream); on a host
without one they are CPU tensors and the Numba CPU kernels read the same memory. The pool is
the only object that holds those tensors, so every byte written to KV memory goes through the
methods below. Decode goes through `begin_decode`, once per step: on a GPU it may replay
CUDA graphs instead of launching per layer (`decode_path.py`). On the CPU backend a model step
goes through `begin_cpu_step` instead: one object per step, one kernel call per layer for the
K/V write and all of the layer's attention (`kernels/cpu/step.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

import kernels
from compute_node.decode_path import DEFAULT_GRAPH_CONTEXT, DecodePath, DecodeStep, StepShape
from compute_node.device_names import device_name_problem

if TYPE_CHECKING:
    from kernels.cpu.step import KvBits, StepAttention

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


class PoolAllocationError(MemoryError):
    """The device cannot hold a pool of this size (torch's own message is its allocator's)."""


@dataclass(slots=True, frozen=True)
class PoolGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    num_blocks: int

    @property
    def itemsize(self) -> int:
        return TORCH_DTYPES[self.dtype].itemsize

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer: what one block id costs in memory."""
        return self.num_layers * self.block_size * self.bytes_per_token

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def blocks_for_budget(
    budget_bytes: int, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, block_size: int
) -> int:
    """How many whole blocks fit in `budget_bytes` (at least 1 is required)."""
    probe = PoolGeometry(num_layers, num_kv_heads, head_dim, dtype, block_size, 1)
    return budget_bytes // probe.bytes_per_block


def resolve_device(device: str) -> torch.device:
    """'auto' picks the first CUDA device when torch sees one, else the CPU."""
    problem = device_name_problem(device)
    if problem is not None:
        raise ValueError(f"device: {problem}")
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but torch sees no CUDA device")
    return resolved


class KvPool:
    """Per-layer K/V caches of one device plus the kernel calls over them.

    `cuda_graphs`: decode steps may replay CUDA graphs (CUDA backend only; ignored on the CPU),
    holding contexts of up to `max_context` tokens (longer ones launch directly). `backend`
    defaults to the device's; Numba's CUDA simulator runs the CUDA kernels on CPU tensors, so
    simulator tests pass "cuda" with a CPU device.
    """

    def __init__(
        self, geometry: PoolGeometry, device: torch.device, *, cuda_graphs: bool = False,
        max_context: int = DEFAULT_GRAPH_CONTEXT, backend: kernels.Backend | None = None,
    ) -> None:
        self.geometry = geometry
        self.device = device
        self.backend: kernels.Backend = backend or ("cuda" if device.type == "cuda" else "cpu")
        shape = (geometry.num_blocks, geometry.num_kv_heads, geometry.block_size, geometry.head_dim)
        dtype = TORCH_DTYPES[geometry.dtype]
        # Zero-filled rather than empty: a block is never read before it is written, but a
        # deterministic pool makes a bug that breaks that rule visible instead of random.
        try:
            self.key_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(geometry.num_layers)]
            self.value_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(geometry.num_layers)]
        except RuntimeError as exc:      # torch.OutOfMemoryError (CUDA) is one too
            raise PoolAllocationError(
                f"cannot allocate the KV pool on {device}: {geometry.num_blocks} blocks take "
                f"{geometry.num_bytes / (1 << 30):.1f} GiB") from exc
        self.decode_path = DecodePath(self, cuda_graphs=cuda_graphs, max_context=max_context)
        self._kv_bits: KvBits | None = None   # the caches as the CPU kernels' views, made at first use

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Apply copy ops (src → dst) in order, in every layer."""
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64).reshape(len(pairs), 2)
        if self.backend == "cuda":
            mapping = mapping.to(self.device)
        kernels.copy_blocks(self.key_caches, self.value_caches, mapping, backend=self.backend)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new tokens' K/V `[num_tokens, num_kv_heads, head_dim]` at their slots."""
        kernels.write_slots(
            key, value, self.key_caches[layer], self.value_caches[layer], slot_mapping, backend=self.backend
        )

    def begin_decode(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, shape: StepShape,
        host_seq_lens: np.ndarray | None = None,
    ) -> DecodeStep:
        """The decode group of one step (tables int32 `[num_seqs, width]`, lengths int32
        `[num_seqs]`, on the pool's device); call once per step, then `run` it per layer.
        `host_seq_lens`: the lengths' host copy, which the CUDA graphs partition the step by
        (`decode_path.py`); pass it whenever the caller has it."""
        return self.decode_path.begin(block_tables, seq_lens, shape, host_seq_lens)

    def begin_cpu_step(
        self,
        *,
        num_heads: int,
        slot_mapping: torch.Tensor,
        num_decode_tokens: int,
        decode_block_tables: torch.Tensor | None,
        decode_seq_lens: torch.Tensor | None,
        prefill_block_tables: torch.Tensor | None,
        prefill_seq_lens: torch.Tensor | None,
        prefill_query_start_loc: torch.Tensor | None,
        scale: float,
    ) -> StepAttention:
        """CPU backend only: one step's attention, checked and prepared once; `run(layer, q,
        k, v, out)` per layer writes the K/V and attends (decode rows first, then prefill rows,
        as `write` + `decode` + `prefill` would, in one kernel call)."""
        if self.backend != "cpu":
            raise ValueError(f"begin_cpu_step needs the cpu backend, this pool runs {self.backend!r}")
        from kernels.cpu.step import KvBits, StepAttention

        if self._kv_bits is None:
            self._kv_bits = KvBits(self.key_caches, self.value_caches)
        return StepAttention(
            self._kv_bits, num_heads=num_heads, slot_mapping=slot_mapping, num_decode_tokens=num_decode_tokens,
            decode_block_tables=decode_block_tables, decode_seq_lens=decode_seq_lens,
            prefill_block_tables=prefill_block_tables, prefill_seq_lens=prefill_seq_lens,
            prefill_query_start_loc=prefill_query_start_loc, scale=scale,
        )

    def decode(
        self,
        layer: int,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        host_seq_lens: np.ndarray | None = None,
    ) -> torch.Tensor:
        """One query token per sequence over its whole paged context (into `out` when given):
        one direct launch (what a `DecodeStep` falls back to). `host_seq_lens`: the same
        lengths on the host, from which the CUDA kernels choose their split-K partitions
        (device lengths are not read back; without them every sequence counts as full)."""
        return kernels.paged_attention_decode(
            query, self.key_caches[layer], self.value_caches[layer], block_tables, seq_lens, scale,
            out=out, backend=self.backend, host_seq_lens=host_seq_lens,
        )

    def prefill(
        self,
        layer: int,
        query: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        max_query_len: int | None = None,
    ) -> torch.Tensor:
        """Many query tokens per sequence, causal over the paged prefix plus themselves (into
        `out` when given). `max_query_len`: the longest chunk, known on the host (the CUDA
        grid is sized from it)."""
        return kernels.paged_prefill_attention(
            query, self.key_caches[layer], self.value_caches[layer], block_tables, seq_lens,
            query_start_loc, scale, out=out, backend=self.backend, max_query_len=max_query_len,
        )

    def read_tokens(self, layer: int, slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """K and V `[n, num_kv_heads, head_dim]` stored at `slots` (float32 host copies; tests
        and diagnostics only, never on the hot path)."""
        bs = self.geometry.block_size
        idx = torch.tensor(list(slots), dtype=torch.int64)
        blocks, offsets = idx // bs, idx % bs
        k = self.key_caches[layer][blocks, :, offsets].float().cpu().numpy()
        v = self.value_caches[layer][blocks, :, offsets].float().cpu().numpy()
        return k, v
