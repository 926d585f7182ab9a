"""One Forward, from request message to outputs, in three pure steps and one that writes.

1. `parse_forward` turns the message into a `ForwardBatch` and checks everything that does not
   need block tables (ids, counts, layers, tensor dtypes and shapes, slot ranges);
2. `check_slots` checks each sequence's slots against its block table: the slots of its new
   tokens must be exactly where its table puts positions `context_len - n … context_len - 1`;
3. `plan_attention` splits the batch into a decode group (one new token) and a prefill group
   (several), with the index tensors the kernels take;
4. `execute` writes K/V into the slots and runs attention for every layer, scattering the two
   groups' outputs back into request order.

Only step 4 touches the pool, and it runs after steps 1–3 raised nothing, so a bad request
never leaves a half-written pool behind.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from compute_node.errors import InvalidForward, StaleTable
from compute_node.pool import KvPool, PoolGeometry
from compute_node.tables import CachedTable, SeqId
from compute_node.wire import WireError, decode_tensor
from pagedkv.v1 import compute_node_pb2 as pb

QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(slots=True)
class SeqStep:
    seq_id: SeqId
    version: int
    context_len: int
    slot_mapping: np.ndarray   # int64 [num_new_tokens]
    row_start: int             # first row of its new tokens in the batch's token rows

    @property
    def num_new_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass(slots=True)
class LayerStep:
    layer: int
    query: torch.Tensor        # [num_tokens, num_heads, head_dim]
    key: torch.Tensor          # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor


@dataclass(slots=True)
class ForwardBatch:
    request_id: str
    seqs: list[SeqStep]
    layers: list[LayerStep]
    freed_seq_ids: list[SeqId]
    scale: float
    num_tokens: int
    slot_mapping: torch.Tensor  # int64 [num_tokens], every sequence's slots in request order


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
    if not 1 <= len(request.sequences) <= max_batch:
        raise InvalidForward(f"a forward needs 1..{max_batch} sequences, got {len(request.sequences)}")
    seqs = _parse_sequences(request, geometry)
    num_tokens = sum(s.num_new_tokens for s in seqs)
    layers = _parse_layers(request, geometry, num_tokens)
    scale = float(request.scale) if request.scale else 1.0 / math.sqrt(geometry.head_dim)
    if not math.isfinite(scale) or scale <= 0:
        raise InvalidForward(f"scale must be a positive finite number, got {request.scale}")
    slot_mapping = torch.from_numpy(np.concatenate([s.slot_mapping for s in seqs]))
    if torch.unique(slot_mapping).numel() != num_tokens:
        raise InvalidForward("two new tokens of the batch have the same slot")
    freed = [SeqId(s) for s in request.freed_seq_ids]
    return ForwardBatch(request.request_id, seqs, layers, freed, scale, num_tokens, slot_mapping)


def _parse_sequences(request: pb.ForwardRequest, geometry: PoolGeometry) -> list[SeqStep]:
    seqs: list[SeqStep] = []
    seen: set[str] = set()
    row = 0
    for i, s in enumerate(request.sequences):
        if not s.seq_id:
            raise InvalidForward(f"sequences[{i}].seq_id is empty")
        if s.seq_id in seen:
            raise InvalidForward(f"sequence {s.seq_id!r} appears twice in the batch")
        seen.add(s.seq_id)
        if s.version < 1:
            raise InvalidForward(f"sequence {s.seq_id!r}: version must be >= 1")
        slots = np.asarray(s.slot_mapping, dtype=np.int64)
        n = int(slots.shape[0])
        if n < 1:
            raise InvalidForward(f"sequence {s.seq_id!r} has no new tokens (empty slot_mapping)")
        if s.context_len < n:
            raise InvalidForward(f"sequence {s.seq_id!r}: context_len {s.context_len} < {n} new tokens")
        if int(slots.min()) < 0 or int(slots.max()) >= geometry.num_slots:
            raise InvalidForward(
                f"sequence {s.seq_id!r}: slots must lie in [0, {geometry.num_slots}), got "
                f"{int(slots.min())} … {int(slots.max())}"
            )
        seqs.append(SeqStep(SeqId(s.seq_id), int(s.version), int(s.context_len), slots, row))
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


def check_slots(batch: ForwardBatch, tables: dict[SeqId, CachedTable], block_size: int) -> None:
    """Each sequence's slots must be where its table puts its newest positions.

    A mismatch against a table of exactly the requested version is the caller's bug
    (INVALID_ARGUMENT); against a newer table (a defrag commit moved the block since the
    caller got its slots) the caller must refresh its slot mapping (ABORTED).
    """
    for s in batch.seqs:
        table = tables[s.seq_id]
        error = StaleTable if table.version > s.version else InvalidForward
        num_blocks_needed = -(-s.context_len // block_size)
        if num_blocks_needed > len(table.block_table):
            raise error(
                f"sequence {s.seq_id!r}: context_len {s.context_len} needs {num_blocks_needed} blocks, "
                f"table version {table.version} has {len(table.block_table)}"
            )
        positions = np.arange(s.context_len - s.num_new_tokens, s.context_len, dtype=np.int64)
        blocks = np.asarray(table.block_table, dtype=np.int64)[positions // block_size]
        expected = blocks * block_size + positions % block_size
        if not np.array_equal(expected, s.slot_mapping):
            bad = int(np.flatnonzero(expected != s.slot_mapping)[0])
            raise error(
                f"sequence {s.seq_id!r}: slot {int(s.slot_mapping[bad])} of position {int(positions[bad])} "
                f"is not in its block table (version {table.version} expects {int(expected[bad])})"
            )


def plan_attention(batch: ForwardBatch, tables: dict[SeqId, CachedTable], geometry: PoolGeometry) -> AttentionPlan:
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
    seqs: list[SeqStep], tables: dict[SeqId, CachedTable], block_size: int
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
    slots = batch.slot_mapping.to(device)
    t0 = time.perf_counter()
    for step in batch.layers:
        pool.write(step.layer, step.key.to(device), step.value.to(device), slots)
    _sync(device)
    t1 = time.perf_counter()
    outputs = [_attend(pool, step, plan, batch.scale, device) for step in batch.layers]
    _sync(device)
    t2 = time.perf_counter()
    return outputs, ExecuteTimings(write_s=t1 - t0, attention_s=t2 - t1)


def _attend(pool: KvPool, step: LayerStep, plan: AttentionPlan, scale: float, device: torch.device) -> torch.Tensor:
    query = step.query.to(device)
    # A pure decode (or pure prefill) batch is already in request order: no gather/scatter.
    if plan.prefill_rows is None:
        return pool.decode(step.layer, query, _dev(plan.decode_tables, device), _dev(plan.decode_lens, device), scale)
    if plan.decode_rows is None:
        return pool.prefill(
            step.layer, query, _dev(plan.prefill_tables, device), _dev(plan.prefill_lens, device),
            _dev(plan.prefill_start_loc, device), scale,
        )
    out = torch.empty_like(query)
    rows = plan.decode_rows.to(device)
    out[rows] = pool.decode(
        step.layer, query[rows].contiguous(), _dev(plan.decode_tables, device), _dev(plan.decode_lens, device), scale
    )
    rows = plan.prefill_rows.to(device)
    out[rows] = pool.prefill(
        step.layer, query[rows].contiguous(), _dev(plan.prefill_tables, device), _dev(plan.prefill_lens, device),
        _dev(plan.prefill_start_loc, device), scale,
    )
    return out


def _sync(device: torch.device) -> None:
    """Make the phase timings honest on a GPU (kernels launch asynchronously)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _dev(x: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if x is None:  # the caller checked the group exists; reaching this is a bug (INTERNAL)
        raise RuntimeError("missing attention index tensor")
    return x.to(device)
