"""CPU decode attention: one parallel work item per (sequence, KV head).

Each work item walks the sequence's block table once and scores every query head of its GQA
group against each K/V tile, so K/V bytes are read once per KV head. When there are too few
(sequence, KV head) items to keep every core busy and the context is long, the wrapper
attends in partitions of the context instead and merges them (split-K: `decode_split.py`).
The work items (`attend.decode_item`, `decode_split.partition_item`) and the loop that runs
them are `attend.py`'s, shared with prefill and the model step.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from kernels.cpu import _host, _parallel
from kernels.cpu.attend import attend_decode
from kernels.cpu.decode_split import num_partitions


def use_split(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_size: int) -> bool:
    """Dispatch rule: split the context when (sequence, KV head) items cannot fill the cores.

    With fewer than two items per thread one long sequence leaves cores idle (and static
    scheduling makes ragged lengths worse); splitting pays once there are at least two
    partitions per sequence to spread.
    """
    num_items = num_seqs * num_kv_heads
    return num_items < 2 * numba.get_num_threads() and (
        num_partitions(max_seq_len, block_size) >= 2
    )


def paged_attention_decode(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    scale: float,
    out: Any | None = None,
    split: bool | None = None,
) -> Any:
    """Validated-argument entry point (see `kernels.paged_attention_decode`).

    `split` forces the single-pass (False) or split-K (True) kernel; None applies `use_split`.
    """
    if out is None:
        out = _host.new_like(query)
    q = _host.query_f32(query)
    kc, kv_kind = _host.kv_bits(key_cache)
    vc, _ = _host.kv_bits(value_cache)
    tables = _host.index_array(block_tables, np.int32)
    lens = _host.index_array(seq_lens, np.int32)
    if q.shape[0] == 0:
        return out
    serial = int(lens.astype(np.int64).sum()) * q.shape[1] <= _parallel.SERIAL_MAX_ATTENTION_WORK
    if split is None:  # splitting only pays when more than one thread runs
        split = not serial and use_split(q.shape[0], kc.shape[1], int(lens.max()), kc.shape[2])
    target = _host.f32_target(out)
    result = target if target is not None else np.empty(q.shape, np.float32)
    with _parallel.parallel_section(serial):
        attend_decode(serial, split, q, kc, vc, kv_kind, tables, lens, np.float32(scale), result)
    if target is None:
        _host.store(out, result)
    return out
