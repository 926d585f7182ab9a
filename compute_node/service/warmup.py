"""Compile the CPU kernels before the node registers.

Numba compiles a kernel on its first call and holds the GIL while it does (tens of seconds
on a cold cache, on a busy 2-core host even more). If that first call were a real Forward,
the node's event loop could not heartbeat meanwhile and the block manager would fence it for
an expired lease. So the server runs one tiny call of every CPU kernel (decode single-pass
and split-K, prefill, write_slots, copy_blocks, and the model step's fused kernel on one thread
and on all, with its flash-prefill and cascade-decode paths where the CPU takes them) in a
worker thread before it starts registering; health stays NOT_SERVING until then. With Numba's
on-disk cache warm this takes well under a second. CUDA kernels are built per (head_dim,
block_size, group, dtype) variant and compile in about a second each on the device, so the GPU
path skips this.
"""

from __future__ import annotations

import time

import torch

import kernels
from compute_node.pool import TORCH_DTYPES
from kernels.cpu import prefill_flash
from kernels.cpu.decode import paged_attention_decode as cpu_decode
from kernels.cpu.step import KvBits, StepAttention
from pagedkv.logging import get_logger

log = get_logger(__name__)


def warm_up_cpu_kernels(num_kv_heads: int, head_dim: int, dtype: str, block_size: int = 16) -> float:
    """Run every CPU kernel once on a two-block pool; returns the seconds it took."""
    start = time.perf_counter()
    kv_dtype = TORCH_DTYPES[dtype]
    # [num_blocks, num_kv_heads, block_size, head_dim]
    key_cache = torch.zeros(2, num_kv_heads, block_size, head_dim, dtype=kv_dtype)
    value_cache = torch.zeros_like(key_cache)
    key = torch.ones(2, num_kv_heads, head_dim, dtype=kv_dtype)
    kernels.write_slots(key, key, key_cache, value_cache, torch.tensor([0, 1], dtype=torch.int64), backend="cpu")
    kernels.copy_blocks([key_cache], [value_cache], torch.tensor([[0, 1]], dtype=torch.int64), backend="cpu")
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([2], dtype=torch.int32)
    query = torch.ones(1, num_kv_heads, head_dim, dtype=torch.float32)
    for split in (False, True):
        cpu_decode(query, key_cache, value_cache, tables, lens, 1.0, split=split)
    kernels.paged_prefill_attention(
        torch.ones(2, num_kv_heads, head_dim, dtype=torch.float32), key_cache, value_cache, tables, lens,
        torch.tensor([0, 2], dtype=torch.int32), 1.0, backend="cpu",
    )
    # The model path's per-step kernel (compute_node/model/attention.py): one decode and one
    # prefill row, each variant.
    caches = KvBits([key_cache], [value_cache])
    for serial in (True, False):
        step = StepAttention(
            caches, num_heads=num_kv_heads, slot_mapping=torch.tensor([1, 2], dtype=torch.int64), num_decode_tokens=1,
            decode_block_tables=tables, decode_seq_lens=lens, prefill_block_tables=tables,
            prefill_seq_lens=torch.tensor([3], dtype=torch.int32),
            prefill_query_start_loc=torch.tensor([0, 1], dtype=torch.int32), scale=1.0, serial=serial,
        )
        step.run(0, torch.ones(2, num_kv_heads, head_dim, dtype=kv_dtype), key, key)
    # Where the step takes the flash tiles (float32 caches of whole 16-wide tiles on a CPU that
    # prefers them, `prefill_flash.preferred`): a prefill row and two decode rows sharing their
    # first block (the cascade), each variant; elsewhere this step runs the kernels above again.
    if kv_dtype == torch.float32 and prefill_flash.usable(head_dim, block_size):
        key_cache = torch.zeros(3, num_kv_heads, block_size, head_dim, dtype=kv_dtype)
        caches = KvBits([key_cache], [torch.zeros_like(key_cache)])
        shared = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)
        rows = torch.ones(3, num_kv_heads, head_dim, dtype=kv_dtype)
        for serial in (True, False):
            step = StepAttention(
                caches, num_heads=num_kv_heads, num_decode_tokens=2,
                slot_mapping=torch.tensor([block_size, 2 * block_size, block_size + 1], dtype=torch.int64),
                decode_block_tables=shared, decode_seq_lens=torch.tensor([block_size + 1] * 2, dtype=torch.int32),
                prefill_block_tables=shared[:1], prefill_seq_lens=torch.tensor([block_size + 2], dtype=torch.int32),
                prefill_query_start_loc=torch.tensor([0, 1], dtype=torch.int32), scale=1.0, serial=serial,
            )
            step.run(0, rows, rows, rows)
    seconds = time.perf_counter() - start
    log.info("kernels warm", seconds=round(seconds, 3), dtype=dtype)
    return seconds
