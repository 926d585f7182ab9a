"""A step's batch: what the scheduler asks for (`SeqWork`), what it gets back (`SeqOutput`), and
the checked, flattened inputs the model runs on (`StepInputs`).

`prepare_step` is pure host work and raises `InvalidBatch` for anything that would make a
kernel fail or write where it must not, before a single K/V byte is stored: a bad batch never
leaves a half-written pool behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from compute_node.model.attention import AttentionMetadata
from compute_node.model.errors import ContextTooLong, InvalidBatch
from compute_node.model.sampling import MAX_LOGPROBS, SamplingParams
from compute_node.pool import PoolGeometry


@dataclass(slots=True)
class SeqWork:
    """One sequence's share of a step.

    `token_ids` are the tokens to compute now, at positions `num_computed_tokens …` (the tokens
    before them are already in the KV cache, written by earlier steps or shared prefix blocks).
    `block_table` maps logical block i to a block id and must cover every position up to the
    new ones. `sample` None computes K/V only (a middle chunk of a chunked prefill);
    otherwise the token after the last new one is sampled, as the sequence's output number
    `num_output_tokens` (the counter a seeded draw uses). `prompt_logprobs` scores prompt
    tokens from this step's own rows (`PromptLogprobsRequest`); None computes no extra logits.
    """

    seq_id: str
    token_ids: Sequence[int]
    num_computed_tokens: int
    block_table: Sequence[int]
    sample: SamplingParams | None = None
    num_output_tokens: int = 0
    prompt_logprobs: PromptLogprobsRequest | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True, frozen=True)
class PromptLogprobsRequest:
    """Score the tokens that follow positions `first_position …` of a sequence: the row at
    position `first_position + i` predicts `target_token_ids[i]`.

    Why positions and not row indices: a node may prepend tokens to a sequence's work after the
    scheduler sent it (a failed prefix fetch is recomputed in the same step), so the rows are
    found by position. Every scored position must be one this step computes."""

    first_position: int
    target_token_ids: tuple[int, ...]
    num_top: int = 0


@dataclass(slots=True)
class PromptLogprobs:
    """The answer to a `PromptLogprobsRequest`: per target, its raw log-probability (float32
    log-softmax of the logits), its rank among the vocabulary (1: the most likely) and the
    `num_top` most likely (token id, log-probability) pairs, most likely first."""

    seq_id: str
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


@dataclass(slots=True)
class SeqOutput:
    seq_id: str
    token_id: int
    logprob: float | None = None                        # raw logprob of token_id (when asked)
    top_logprobs: list[tuple[int, float]] | None = None   # (token id, logprob), most likely first


@dataclass(slots=True)
class StepResult:
    """One step's answers: one `SeqOutput` per batch item that samples (None elsewhere), and
    the prompt log-probabilities of the items that asked, in batch order."""

    outputs: list[SeqOutput | None]
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor        # int64 [num_tokens], in row order (decodes first)
    positions: torch.Tensor        # int64 [num_tokens]
    meta: AttentionMetadata
    sample_rows: torch.Tensor      # int64 [num_sampled]: row of each sampled sequence's last token
    sample_seqs: list[int]         # batch index of each sampled sequence, aligned with sample_rows
    row_order: list[int]           # batch index of the sequence of each row group, in row order
    row_starts: np.ndarray         # int64 [num_seqs + 1]: first row of each sequence (row order)
    # int32 [num_decode_seqs]: meta.decode_seq_lens on the host, from which the decode graphs
    # partition the step (KvPool.begin_decode); None without decode sequences
    decode_seq_lens_host: np.ndarray | None = None


def prepare_step(
    batch: Sequence[SeqWork], geometry: PoolGeometry, *, vocab_size: int, max_model_len: int, head_dim: int,
    device: torch.device,
) -> StepInputs:
    """Check `batch` and build the model's flat inputs. Decode sequences (one new token) come
    first, then prefill sequences, so attention splits into two contiguous row ranges."""
    _check_fields(batch, max_model_len, vocab_size)
    bs = geometry.block_size
    decodes = [i for i, s in enumerate(batch) if len(s.token_ids) == 1]
    prefills = [i for i, s in enumerate(batch) if len(s.token_ids) > 1]
    order = decodes + prefills
    seqs = [batch[i] for i in order]
    num_new = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
    computed = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
    seq_lens = computed + num_new
    num_used_blocks = (seq_lens + bs - 1) // bs
    tables = _padded_tables(seqs, num_used_blocks, geometry.num_blocks)   # int32 [num_seqs, max_used]

    input_ids = _token_ids(seqs)
    if input_ids.min() < 0 or input_ids.max() >= vocab_size:
        row = int(np.flatnonzero((input_ids < 0) | (input_ids >= vocab_size))[0])
        seq = seqs[int(np.searchsorted(np.cumsum(num_new), row, side="right"))]
        raise InvalidBatch(
            f"sequence {seq.seq_id!r}: token id {int(input_ids[row])} outside the vocabulary [0, {vocab_size})"
        )
    row_starts = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(num_new, out=row_starts[1:])
    seq_of_row = np.repeat(np.arange(len(seqs)), num_new)
    positions = computed[seq_of_row] + (np.arange(len(input_ids)) - row_starts[seq_of_row])
    slot_mapping = tables[seq_of_row, positions // bs].astype(np.int64) * bs + positions % bs
    _check_writes(seqs, seq_of_row, slot_mapping, tables, num_used_blocks, computed, num_new, bs)

    num_dec = len(decodes)
    lens32 = seq_lens.astype(np.int32)
    dec_tables = dec_lens = pre_tables = pre_lens = pre_starts = None
    if num_dec:
        dec_tables = _to(np.ascontiguousarray(tables[:num_dec, : int(num_used_blocks[:num_dec].max())]), device)
        dec_lens = _to(lens32[:num_dec], device)
    if prefills:
        pre_tables = _to(np.ascontiguousarray(tables[num_dec:, : int(num_used_blocks[num_dec:].max())]), device)
        pre_lens = _to(lens32[num_dec:], device)
        pre_starts = _to((row_starts[num_dec:] - row_starts[num_dec]).astype(np.int32), device)
    meta = AttentionMetadata(
        slot_mapping=_to(slot_mapping, device),
        num_decode_tokens=num_dec,
        decode_block_tables=dec_tables,
        decode_seq_lens=dec_lens,
        prefill_block_tables=pre_tables,
        prefill_seq_lens=pre_lens,
        prefill_query_start_loc=pre_starts,
        scale=head_dim**-0.5,
        # The longest chunk, from the host: the prefill kernel's grid is sized by it (the
        # starts above are already on the device, and reading them back would stall).
        prefill_max_query_len=int(num_new[num_dec:].max()) if prefills else None,
    )
    sampled = [j for j, s in enumerate(seqs) if s.sample is not None]
    return StepInputs(
        input_ids=_to(input_ids, device),
        positions=_to(positions, device),
        meta=meta,
        sample_rows=_to(row_starts[1:][sampled] - 1, device),
        sample_seqs=[order[j] for j in sampled],
        row_order=order,
        row_starts=row_starts,
        decode_seq_lens_host=lens32[:num_dec] if num_dec else None,
    )


def _check_fields(batch: Sequence[SeqWork], max_model_len: int, vocab_size: int) -> None:
    seen: set[str] = set()
    for s in batch:
        if s.seq_id in seen:
            raise InvalidBatch(f"sequence {s.seq_id!r} appears twice in the batch")
        seen.add(s.seq_id)
        if len(s.token_ids) == 0:
            raise InvalidBatch(f"sequence {s.seq_id!r} has no new tokens")
        if not _is_int(s.num_computed_tokens) or s.num_computed_tokens < 0:
            raise InvalidBatch(f"sequence {s.seq_id!r}: num_computed_tokens must be an integer >= 0, "
                               f"got {s.num_computed_tokens!r}")
        if not _is_int(s.num_output_tokens) or s.num_output_tokens < 0:
            raise InvalidBatch(f"sequence {s.seq_id!r}: num_output_tokens must be an integer >= 0, "
                               f"got {s.num_output_tokens!r}")
        if s.sample is not None and not isinstance(s.sample, SamplingParams):
            raise InvalidBatch(f"sequence {s.seq_id!r}: sample must be SamplingParams or None")
        if s.prompt_logprobs is not None:
            _check_prompt_logprobs(s, vocab_size)
        end = s.num_computed_tokens + len(s.token_ids)
        if end > max_model_len:
            raise ContextTooLong(f"sequence {s.seq_id!r}: positions up to {end - 1} exceed the maximum context "
                                 f"length {max_model_len}")


def _check_prompt_logprobs(s: SeqWork, vocab_size: int) -> None:
    """The scored positions lie within the step's new tokens, the targets in the vocabulary, the
    counts within the limits."""
    req = s.prompt_logprobs
    if not isinstance(req, PromptLogprobsRequest):
        raise InvalidBatch(f"sequence {s.seq_id!r}: prompt_logprobs must be PromptLogprobsRequest or None")
    first, n = req.first_position, len(req.target_token_ids)
    end = s.num_computed_tokens + len(s.token_ids)
    if not _is_int(first) or first < s.num_computed_tokens or first + n > end or n == 0:
        raise InvalidBatch(f"sequence {s.seq_id!r}: prompt log-probabilities of positions [{first}, {first + n}) "
                           f"must be a non-empty part of the step's new positions [{s.num_computed_tokens}, {end})")
    if not _is_int(req.num_top) or not 0 <= req.num_top <= MAX_LOGPROBS:
        raise InvalidBatch(f"sequence {s.seq_id!r}: prompt log-probabilities num_top must be in [0, {MAX_LOGPROBS}], "
                           f"got {req.num_top!r}")
    if not all(_is_int(t) and 0 <= t < vocab_size for t in req.target_token_ids):
        raise InvalidBatch(f"sequence {s.seq_id!r}: prompt log-probability targets must be token ids in "
                           f"[0, {vocab_size})")


def _token_ids(seqs: list[SeqWork]) -> np.ndarray:
    """Every sequence's new tokens, concatenated as int64; anything but integers is refused
    (NumPy would silently truncate a float or parse a string)."""
    arrays = [np.asarray(s.token_ids) for s in seqs]
    for s, ids in zip(seqs, arrays):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InvalidBatch(f"sequence {s.seq_id!r}: token_ids must be a flat sequence of integers")
    return np.concatenate(arrays).astype(np.int64, copy=False)


def _padded_tables(seqs: list[SeqWork], num_used_blocks: np.ndarray, num_blocks: int) -> np.ndarray:
    """int32 `[num_seqs, max_used]` of each sequence's used blocks (padding 0, never read)."""
    tables = np.zeros((len(seqs), int(num_used_blocks.max())), dtype=np.int32)
    for j, (s, used) in enumerate(zip(seqs, num_used_blocks.tolist())):
        if len(s.block_table) < used:
            raise InvalidBatch(f"sequence {s.seq_id!r}: {s.num_computed_tokens + len(s.token_ids)} tokens need "
                               f"{used} blocks, its block table has {len(s.block_table)}")
        row = np.asarray(s.block_table[:used])
        if row.ndim != 1 or row.dtype.kind not in "iu":
            raise InvalidBatch(f"sequence {s.seq_id!r}: block_table must be a flat sequence of integers")
        if row.min() < 0 or row.max() >= num_blocks:
            bad = int(row[(row < 0) | (row >= num_blocks)][0])
            raise InvalidBatch(f"sequence {s.seq_id!r}: block id {bad} outside the pool [0, {num_blocks})")
        tables[j, :used] = row
    return tables


def _check_writes(
    seqs: list[SeqWork], seq_of_row: np.ndarray, slot_mapping: np.ndarray, tables: np.ndarray,
    num_used_blocks: np.ndarray, computed: np.ndarray, num_new: np.ndarray, block_size: int,
) -> None:
    """No slot is written twice, no block is written by two sequences, and a block written
    this step is read by another sequence of the batch only as a prefix share: a block full in
    both sequences after the step, entirely inside the reader's computed prefix, at the same
    logical index in both tables (the same token positions). That is two prompts with one
    prefix admitted in the same step, the second reading the blocks the first fills (a layer's
    K/V writes run before its attention); any other read of a block another sequence writes
    is a shared block written without copy-on-write, and is refused."""
    if np.unique(slot_mapping).size != slot_mapping.size:
        raise InvalidBatch("two new tokens of the batch map to the same KV slot")
    if len(seqs) == 1:
        return
    written = slot_mapping // block_size
    writes = np.unique(np.stack([written, seq_of_row]), axis=1)   # (block, writer) pairs
    if np.unique(writes[0]).size != writes.shape[1]:
        block = int(writes[0][np.flatnonzero(np.diff(writes[0]) == 0)[0]])
        raise InvalidBatch(f"block {block} is written by two sequences in the same step")
    writer = np.full(int(max(tables.max(), written.max())) + 1, -1, dtype=np.int64)
    writer[written] = seq_of_row
    used = np.arange(tables.shape[1])[None, :] < num_used_blocks[:, None]
    readers, logical = np.nonzero(used)
    blocks = tables[readers, logical]
    owners = writer[blocks]
    clash = (owners >= 0) & (owners != readers)
    owner_rows = np.maximum(owners, 0)
    end = (logical + 1) * block_size   # the block is full in both, at the same positions
    shared = (end <= computed[readers]) & (end <= computed[owner_rows] + num_new[owner_rows])
    shared &= tables[owner_rows, logical] == blocks
    bad = clash & ~shared
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise InvalidBatch(f"block {int(blocks[k])} is written by sequence {seqs[int(owners[k])].seq_id!r} and read by "
                           f"sequence {seqs[int(readers[k])].seq_id!r} in the same step (shared without copy-on-write)")


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
