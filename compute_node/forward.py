"""One Forward, from request message to outputs, in pure steps and one that writes.

1. `parse_forward` turns the message into a `ForwardBatch` and checks everything that needs no
   block table (ids, counts, layers, tensor dtypes and shapes);
2. the node stages the Forward's block-manager steps (`tables.stage`: copy ops, table deltas);
3. `resolve_sequences` checks each sequence against its (staged) table: its new tokens must be
   written at exactly the tail the node holds (`context_len - n == num_tokens`: a sequence never
   writes below its tail, so never into tokens it may share) and the table must cover them; the
   slots follow from the table;
4. `plan_attention` splits the batch into a decode group (one new token) and a prefill group
   (several), with the index tensors the kernels take;
5. the node runs the steps' copy ops and commits their tables, then `execute` writes K/V into
   the slots and runs attention for every layer, scattering the groups' outputs into order
   (the decode group begun once for all layers: `KvPool.begin_decode`, CUDA graphs on a GPU;
   the writes and the prefill group bound once too: `prefill_path.StepKernels`, validated at
   the first layer and launched with pre-bound arguments after it on a GPU).

Only step 5 touches the pool, and it runs after steps 1–4 raised nothing, so a bad request
never leaves a half-written pool behind.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compute_node.decode_path import DecodeStep, StepShape
from compute_node.errors import InvalidForward
from compute_node.pool import KvPool, PoolGeometry
from compute_node.prefill_path import PrefillArgs, StepKernels
from compute_node.tables import NodeTable, SeqId, check_tail
from compute_node.wire import WireError, decode_tensor
from pagedkv.limits import seq_id_problem
from pagedkv.v1 import compute_node_pb2 as pb

QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The kernels take the softmax scale as a float32: it must be a normal float32.
_MIN_SCALE = float(np.finfo(np.float32).tiny)
_MAX_SCALE = float(np.finfo(np.float32).max)


@dataclass(slots=True)
class SeqStep:
    seq_id: SeqId
    num_new_tokens: int
    context_len: int
    row_start: int             # first row of its new tokens in the batch's token rows
    slot_mapping: np.ndarray | None = None   # int64 [num_new_tokens], from the table


@dataclass(slots=True)
class LayerStep:
    layer: int
    query: torch.Tensor        # [num_tokens, num_heads, head_dim]
    key: torch.Tensor          # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor


@dataclass(slots=True)
class ForwardBatch:
    request_id: str
    steps: list[Any]            # the block manager's PoolStep messages, in order
    seqs: list[SeqStep]
    layers: list[LayerStep]
    scale: float
    num_tokens: int
    slot_mapping: torch.Tensor | None = None  # int64 [num_tokens], in request order (resolve_sequences)


@dataclass(slots=True)
class AttentionPlan:
    decode_rows: torch.Tensor | None       # token rows of the decode group
    decode_tables: torch.Tensor | None     # int32 [n_decode, max_blocks]
    decode_lens: torch.Tensor | None       # int32 [n_decode]
    prefill_rows: torch.Tensor | None
    prefill_tables: torch.Tensor | None
    prefill_lens: torch.Tensor | None
    prefill_start_loc: torch.Tensor | None  # int32 [n_prefill + 1]
    kv_bytes_read: int


@dataclass(slots=True)
class ExecuteTimings:
    write_s: float
    attention_s: float


def parse_forward(request: pb.ForwardRequest, geometry: PoolGeometry, max_batch: int) -> ForwardBatch:
    """Decode and check everything that needs no block table; `InvalidForward` otherwise."""
    if not request.request_id:
        raise InvalidForward("request_id must be set")
    if len(request.sequences) > max_batch:
        raise InvalidForward(f"a forward takes at most {max_batch} sequences, got {len(request.sequences)}")
    if not request.sequences and not request.steps:
        raise InvalidForward("a forward needs sequences or steps")
    seqs = _parse_sequences(request, geometry)
    num_tokens = sum(s.num_new_tokens for s in seqs)
    layers = _parse_layers(request, geometry, num_tokens) if seqs else []
    scale = float(request.scale) if request.scale else 1.0 / math.sqrt(geometry.head_dim)
    if not math.isfinite(scale) or not _MIN_SCALE <= scale <= _MAX_SCALE:
        raise InvalidForward(f"scale must be a positive number a float32 holds, got {request.scale}")
    return ForwardBatch(request.request_id, list(request.steps), seqs, layers, scale, num_tokens)


def _parse_sequences(request: pb.ForwardRequest, geometry: PoolGeometry) -> list[SeqStep]:
    seqs: list[SeqStep] = []
    seen: set[str] = set()
    row = 0
    for i, s in enumerate(request.sequences):
        problem = seq_id_problem(s.seq_id)
        if problem is not None:
            raise InvalidForward(f"sequences[{i}].seq_id {problem}")
        if s.seq_id in seen:
            raise InvalidForward(f"sequence {s.seq_id!r} appears twice in the batch")
        seen.add(s.seq_id)
        n = int(s.num_new_tokens)
        if n < 1:
            raise InvalidForward(f"sequence {s.seq_id!r} has no new tokens")
        if s.context_len < n:
            raise InvalidForward(f"sequence {s.seq_id!r}: context_len {s.context_len} < {n} new tokens")
        if -(-s.context_len // geometry.block_size) > geometry.num_blocks:
            raise InvalidForward(f"sequence {s.seq_id!r}: context_len {s.context_len} exceeds the pool")
        seqs.append(SeqStep(SeqId(s.seq_id), n, int(s.context_len), row))
        row += n
    return seqs


def _parse_layers(request: pb.ForwardRequest, geometry: PoolGeometry, num_tokens: int) -> list[LayerStep]:
    if not 1 <= len(request.layers) <= geometry.num_layers:
        raise InvalidForward(f"a forward needs 1..{geometry.num_layers} layers, got {len(request.layers)}")
    layers: list[LayerStep] = []
    seen: set[int] = set()
    query_meta: tuple[torch.dtype, tuple[int, ...]] | None = None
    kv_shape = (num_tokens, geometry.num_kv_heads, geometry.head_dim)
    for msg in request.layers:
        if msg.layer >= geometry.num_layers:
            raise InvalidForward(f"layer {msg.layer} outside [0, {geometry.num_layers})")
        if msg.layer in seen:
            raise InvalidForward(f"layer {msg.layer} appears twice")
        seen.add(msg.layer)
        try:
            query = decode_tensor(msg.query, f"layers[{msg.layer}].query")
            key = decode_tensor(msg.key, f"layers[{msg.layer}].key")
            value = decode_tensor(msg.value, f"layers[{msg.layer}].value")
        except WireError as exc:
            raise InvalidForward(str(exc)) from None
        for name, t in (("key", key), ("value", value)):
            if str(t.dtype).removeprefix("torch.") != geometry.dtype:
                raise InvalidForward(
                    f"layer {msg.layer} {name} must be {geometry.dtype} (the pool's dtype), got {t.dtype}"
                )
            if tuple(t.shape) != kv_shape:
                raise InvalidForward(f"layer {msg.layer} {name} must have shape {list(kv_shape)}, got {list(t.shape)}")
        _check_query(msg.layer, query, geometry, num_tokens)
        if query_meta is None:
            query_meta = (query.dtype, tuple(query.shape))
        elif query_meta != (query.dtype, tuple(query.shape)):
            raise InvalidForward(f"layer {msg.layer} query dtype/shape differs from the first layer's")
        layers.append(LayerStep(int(msg.layer), query, key, value))
    return layers


def _check_query(layer: int, query: torch.Tensor, geometry: PoolGeometry, num_tokens: int) -> None:
    shape = tuple(query.shape)
    if len(shape) != 3 or shape[0] != num_tokens or shape[2] != geometry.head_dim:
        raise InvalidForward(
            f"layer {layer} query must have shape [{num_tokens}, num_heads, {geometry.head_dim}], got {list(shape)}"
        )
    if shape[1] < 1 or shape[1] % geometry.num_kv_heads:
        raise InvalidForward(
            f"layer {layer} query heads {shape[1]} must be a multiple of {geometry.num_kv_heads} KV heads"
        )


def resolve_sequences(
    batch: ForwardBatch, table_of: Any, block_size: int, cold: Any = ()
) -> dict[SeqId, NodeTable]:
    """Each sequence's table (from `table_of(seq_id)`, the staged view), the tail rule, the
    slots. `UnknownSequence` for a sequence the node has no table for; `InvalidForward` when
    the new tokens are not exactly at the tail the node holds or beyond the table. For a table
    fetched cold (`cold` ids) the block manager's count may lag tokens the scheduler wrote
    without telling it (in-block decode), so the tail may lie beyond it within the table."""
    tables: dict[SeqId, NodeTable] = {}
    for s in batch.seqs:
        start = s.context_len - s.num_new_tokens
        table = check_tail(s.seq_id, table_of(s.seq_id), start, s.context_len, block_size, lagging=s.seq_id in cold)
        positions = np.arange(start, s.context_len, dtype=np.int64)
        blocks = np.asarray(table.block_table, dtype=np.int64)[positions // block_size]
        s.slot_mapping = blocks * block_size + positions % block_size
        tables[s.seq_id] = table
    if batch.seqs:
        batch.slot_mapping = torch.from_numpy(np.concatenate([s.slot_mapping for s in batch.seqs]))
        if torch.unique(batch.slot_mapping).numel() != batch.num_tokens:
            raise InvalidForward("two new tokens of the batch map to the same slot (shared tails?)")
    return tables


def plan_attention(batch: ForwardBatch, tables: dict[SeqId, NodeTable], geometry: PoolGeometry) -> AttentionPlan:
    decode = [s for s in batch.seqs if s.num_new_tokens == 1]
    prefill = [s for s in batch.seqs if s.num_new_tokens > 1]
    bs = geometry.block_size
    d_rows = d_tables = d_lens = p_rows = p_tables = p_lens = p_start = None
    if decode:
        d_rows = torch.tensor([s.row_start for s in decode], dtype=torch.int64)
        d_tables, d_lens = _tables_tensor(decode, tables, bs)
    if prefill:
        p_rows = torch.cat([torch.arange(s.row_start, s.row_start + s.num_new_tokens) for s in prefill])
        p_tables, p_lens = _tables_tensor(prefill, tables, bs)
        counts = torch.tensor([0] + [s.num_new_tokens for s in prefill], dtype=torch.int32)
        p_start = torch.cumsum(counts, 0, dtype=torch.int32)
    context = sum(s.context_len for s in batch.seqs)
    kv_bytes = context * geometry.bytes_per_token * len(batch.layers)
    return AttentionPlan(d_rows, d_tables, d_lens, p_rows, p_tables, p_lens, p_start, kv_bytes)


def _tables_tensor(
    seqs: list[SeqStep], tables: dict[SeqId, NodeTable], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded int32 block tables (only the blocks each context uses) and int32 lengths."""
    used = [-(-s.context_len // block_size) for s in seqs]
    out = np.zeros((len(seqs), max(used)), dtype=np.int32)
    for i, (s, n) in enumerate(zip(seqs, used)):
        out[i, :n] = tables[s.seq_id].block_table[:n]
    lens = np.fromiter((s.context_len for s in seqs), dtype=np.int32, count=len(seqs))
    return torch.from_numpy(out), torch.from_numpy(lens)


def execute(pool: KvPool, batch: ForwardBatch, plan: AttentionPlan) -> tuple[list[torch.Tensor], ExecuteTimings]:
    """Write every layer's new K/V, then attend; outputs in request order, one per layer."""
    device = pool.device
    if batch.slot_mapping is None:
        return [], ExecuteTimings(0.0, 0.0)
    slots = batch.slot_mapping.to(device)
    t0 = time.perf_counter()
    prefill = None
    if plan.prefill_start_loc is not None:
        starts = _host(plan.prefill_start_loc)
        prefill = PrefillArgs(_dev(plan.prefill_tables, device), _dev(plan.prefill_lens, device),
                              _dev(plan.prefill_start_loc, device), batch.scale, int((starts[1:] - starts[:-1]).max()))
    kernels = StepKernels(pool, slots, prefill)
    for step in batch.layers:
        kernels.write(step.layer, step.key.to(device), step.value.to(device))
    _sync(device)
    t1 = time.perf_counter()
    decode = None
    if plan.decode_tables is not None:   # every layer's query has one dtype and shape (parse_forward)
        first = batch.layers[0].query
        shape = StepShape(int(first.shape[1]), first.dtype, batch.scale)
        # the lengths' host copy too: the decode graphs partition the step by it
        decode = pool.begin_decode(
            _dev(plan.decode_tables, device), _dev(plan.decode_lens, device), shape,
            host_seq_lens=_host(plan.decode_lens),
        )
    outputs = [_attend(kernels, step, plan, decode, device) for step in batch.layers]
    _sync(device)
    t2 = time.perf_counter()
    return outputs, ExecuteTimings(write_s=t1 - t0, attention_s=t2 - t1)


def _attend(
    kernels: StepKernels, step: LayerStep, plan: AttentionPlan, decode: DecodeStep | None, device: torch.device
) -> torch.Tensor:
    query = step.query.to(device)
    # A pure decode (or pure prefill) batch is already in request order: no gather/scatter.
    if plan.prefill_rows is None:
        return _decode(decode).run(step.layer, query)
    if plan.decode_rows is None:
        return kernels.prefill(step.layer, query)
    out = torch.empty_like(query)
    rows = plan.decode_rows.to(device)
    out[rows] = _decode(decode).run(step.layer, query[rows].contiguous())
    rows = plan.prefill_rows.to(device)
    out[rows] = kernels.prefill(step.layer, query[rows].contiguous())
    return out


def _sync(device: torch.device) -> None:
    """Make the phase timings honest on a GPU (kernels launch asynchronously)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _decode(step: DecodeStep | None) -> DecodeStep:
    if step is None:  # plan_attention made a decode group, so execute began it: a bug (INTERNAL)
        raise RuntimeError("missing decode step")
    return step


def _host(x: torch.Tensor | None) -> np.ndarray:
    """A host index tensor of the plan as NumPy (no copy: `plan_attention` builds them on the CPU)."""
    if x is None:  # the caller checked the group exists; reaching this is a bug (INTERNAL)
        raise RuntimeError("missing attention index tensor")
    return x.numpy()


def _dev(x: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if x is None:  # the caller checked the group exists; reaching this is a bug (INTERNAL)
        raise RuntimeError("missing attention index tensor")
    return x.to(device)
