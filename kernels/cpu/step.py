"""CPU attention of one model step: per layer, one compiled call writes the step's new K/V and
attends every decode and prefill query.

Why a step object: a model step runs attention once per layer (30 times for a SmolLM-135M
shape) with the same block tables, lengths and slots. Through the generic entry points
(`kernels.write_slots`, `paged_attention_decode`, `paged_prefill_attention`) every layer paid,
three calls over, for validating those index arrays, converting tensors to NumPy views,
cutting prefill queries into tiles in Python and setting Numba's thread count: ~0.45 ms per
layer at batch 1 (measured), some 20x the decode math. `StepAttention` does all of it once per
step — the same `_validate` checks, the indices as contiguous NumPy, the tiles in their
heaviest-first order, one serial-or-parallel choice — and `run(layer, ...)` is one call:
scatter the new K/V into the layer's cache, then attend every prefill tile and decode item.

The compiled loop is `attend.py`'s, which the generic decode and prefill entry points run
too. Serial and parallel are two compilations of it (`attend_serial`, `attend_parallel`): a
small step runs on the calling thread without touching Numba's thread settings (why that
matters: `_parallel.py`); a large one hands items out dynamically to every thread. When
(decode sequence, KV head) items are too few for the threads and contexts are long
(`decode.use_split`), the decode sequences are attended in partitions by the same call, after
it has written the K/V, and merged by the split-K reduce (`decode_split.py`).

Arithmetic is the generic kernels' (the same items, `attend.decode_item` and
`attend.prefill_tile`), so results are the same bits as `write_slots` followed by the two
attention calls.

float32 caches on a CPU with AVX2 and no AVX-512 (`prefill_flash.preferred`) take two more
paths after the fused call, which then only writes the K/V (and attends what is left): prefill
rows of contexts up to 1,024 tokens through the flash kernel's FMA tiles (`prefill_flash.py`;
longer ones through SDPA), and, when decode sequences share leading blocks (prefix caching),
every decode row through the cascade (`decode_cascade.py`), which reads a shared block once for
all of them. Both are planned here once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels import _validate
from kernels._validate import KernelInputError
from kernels.cpu import _host, _parallel, decode_cascade, prefill_flash
from kernels.cpu._dense import f32_view
from kernels.cpu.attend import NO_INDEX, NO_STARTS, NO_TABLES, attend_parallel, attend_serial
from kernels.cpu.decode import use_split
from kernels.cpu.decode_split import NO_PARTIALS, Partials
from kernels.cpu.prefill import prefill_work, query_tiles
from kernels.cpu.prefill_sdpa import SdpaPrefill


@dataclass(frozen=True, slots=True)
class F32Views:
    """Every layer's float32 K and V cache as float32 torch tensors over the same memory: what
    the SDPA prefill path reads (made once per pool, like the uint16 views)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class KvBits:
    """Every layer's K and V cache as the uint16 views the kernels take, made once per pool
    (each view costs a few µs of torch calls; a step would make 2 per layer)."""

    def __init__(self, key_caches: Sequence[Any], value_caches: Sequence[Any]) -> None:
        if not key_caches or len(key_caches) != len(value_caches):
            raise KernelInputError(
                f"need one value cache per key cache, got {len(key_caches)} and {len(value_caches)}")
        first = _validate._check_caches(key_caches[0], value_caches[0])
        self.dtype = _validate.dtype_name(key_caches[0])
        for layer, (kc, vc) in enumerate(zip(key_caches, value_caches)):
            if _validate._check_caches(kc, vc) != first or _validate.dtype_name(kc) != self.dtype:
                raise KernelInputError(f"layer {layer}'s caches differ from layer 0's in shape or dtype")
            if _validate.is_device_array(kc) or _validate.is_device_array(vc):
                raise KernelInputError("the CPU step kernel was given GPU-resident caches")
        self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim = first
        self.keys = [_host.kv_bits(kc)[0] for kc in key_caches]
        self.values = [_host.kv_bits(vc)[0] for vc in value_caches]
        self.kv_kind = _host.kv_bits(key_caches[0])[1]
        # float32 caches as float32 torch views of the same memory, for the SDPA prefill path
        self.f32_views: F32Views | None = None
        if self.kv_kind == _host.KIND_F32:
            self.f32_views = F32Views([torch.from_numpy(k.view(np.float32)) for k in self.keys],
                                      [torch.from_numpy(v.view(np.float32)) for v in self.values])

    @property
    def num_layers(self) -> int:
        return len(self.keys)


class StepAttention:
    """One step's attention on the CPU, validated and prepared once, run once per layer.

    Rows `[0, num_decode_tokens)` are decode sequences (one query token each, sequence i on
    row i); the rest are prefill rows, sequence s owning rows `num_decode_tokens +
    prefill_query_start_loc[s] …` (the layout of `compute_node.model.attention`). Index
    arrays are host NumPy arrays or CPU tensors (read once here; not kept as tensors).
    Raises `KernelInputError` for anything a kernel would read or write out of bounds with.
    `serial` forces the one-thread (True) or all-threads (False) kernel; None decides by the
    step's attention work (`_parallel.SERIAL_MAX_ATTENTION_WORK`). `sdpa_prefill`: prefill rows
    through torch's SDPA (`prefill_sdpa.py`, float32 caches) rather than the Numba tiles; None
    takes it wherever the caches are float32 and the flash kernel is not chosen. `flash_prefill`:
    prefill rows through the AVX2 register-tile kernel (`prefill_flash.py`, float32 caches,
    head_dim and block size multiples of 16); None takes it where those fit, the CPU prefers it
    (`prefill_flash.preferred`: AVX2 without AVX-512) and `sdpa_prefill` is not True.
    `cascade_decode`: decode rows through `decode_cascade.py` (float32 caches, the same shapes),
    which reads blocks that several decode sequences share once for all of them; None takes it
    where those fit, the CPU prefers the flash tiles and two decode sequences share a block.
    """

    def __init__(
        self,
        caches: KvBits,
        *,
        num_heads: int,
        slot_mapping: Any,
        num_decode_tokens: int,
        decode_block_tables: Any | None,
        decode_seq_lens: Any | None,
        prefill_block_tables: Any | None,
        prefill_seq_lens: Any | None,
        prefill_query_start_loc: Any | None,
        scale: float,
        serial: bool | None = None,
        sdpa_prefill: bool | None = None,
        flash_prefill: bool | None = None,
        cascade_decode: bool | None = None,
    ) -> None:
        self.caches = caches
        self.scale = np.float32(_validate.require_scale(scale))
        _validate._check_heads(num_heads, caches.head_dim, caches.num_kv_heads, caches.head_dim)
        self.slot_mapping = self._check_slots(slot_mapping)
        num_tokens = self.slot_mapping.shape[0]
        if not isinstance(num_decode_tokens, (int, np.integer)) or not 0 <= num_decode_tokens <= num_tokens:
            raise KernelInputError(f"num_decode_tokens must be in [0, {num_tokens}], got {num_decode_tokens!r}")
        num_dec = int(num_decode_tokens)
        self.q_shape = (num_tokens, num_heads, caches.head_dim)
        self.kv_shape = (num_tokens, caches.num_kv_heads, caches.head_dim)

        self.dec_tables, self.dec_lens = NO_TABLES, NO_INDEX
        if num_dec:
            if decode_block_tables is None or decode_seq_lens is None:
                raise KernelInputError(f"{num_dec} decode rows but no decode block tables or lengths")
            self.dec_tables, self.dec_lens = self._check_tables(decode_block_tables, decode_seq_lens, num_dec)
        num_prefill_rows = num_tokens - num_dec
        self.pre_tables, self.pre_lens, pre_starts = NO_TABLES, NO_INDEX, NO_STARTS
        if num_prefill_rows:
            if prefill_block_tables is None or prefill_seq_lens is None or prefill_query_start_loc is None:
                raise KernelInputError(f"{num_prefill_rows} prefill rows but no prefill tables, lengths or starts")
            num_seqs = _validate.require("prefill_block_tables", prefill_block_tables, ndim=2,
                                         dtypes=("int32",))[0]
            self.pre_tables, self.pre_lens = self._check_tables(prefill_block_tables, prefill_seq_lens, num_seqs)
            pre_starts = self._check_starts(prefill_query_start_loc, num_seqs, num_prefill_rows)
        # Prefill rows numbered in the whole step, as the kernel reads them.
        self.pre_starts = np.ascontiguousarray(pre_starts + np.int32(num_dec))
        work = int(self.dec_lens.astype(np.int64).sum()) * num_heads
        f32 = caches.f32_views
        if sdpa_prefill and f32 is None:
            raise KernelInputError(f"the SDPA prefill path takes float32 caches, not {caches.dtype}")
        fits = prefill_flash.usable(caches.head_dim, caches.block_size)
        if flash_prefill and (f32 is None or not fits):
            raise KernelInputError(f"the flash prefill path takes float32 caches with head_dim and block size "
                                   f"multiples of 16, not {caches.dtype}, {caches.head_dim}, {caches.block_size}")
        if flash_prefill and sdpa_prefill:
            raise KernelInputError("choose one of the SDPA and flash prefill paths, not both")
        # the flash path: asked for, or by default on a CPU that prefers it unless SDPA is asked for
        # by default only sequences of short context (the longer ones: SDPA, prefill_flash.py says why)
        self.flash_items: np.ndarray | None = None
        long_seqs: np.ndarray | None = None
        if num_prefill_rows and f32 is not None and fits and flash_prefill is not False and (
                flash_prefill or (sdpa_prefill is None and prefill_flash.preferred())):
            short = None if flash_prefill else prefill_flash.short_contexts(self.pre_lens)
            self.flash_items = prefill_flash.flash_items(self.pre_starts, self.pre_lens, caches.num_kv_heads,
                                                         num_heads // caches.num_kv_heads, short)
            work += prefill_work(self.pre_starts, self.pre_lens, num_heads)
            long_seqs = None if short is None or short.all() else ~short
        # the SDPA path with the float32 views it reads: asked for, by default where they exist,
        # or for the long sequences of a flash step
        self.sdpa: tuple[SdpaPrefill, F32Views] | None = None
        if self.flash_items is not None:
            self.tile_seq = self.tile_row = self.tile_len = NO_INDEX
            if long_seqs is not None and f32 is not None:
                self.sdpa = (SdpaPrefill(self.pre_tables, self.pre_lens, self.pre_starts, caches.block_size, scale,
                                         long_seqs), f32)
        elif num_prefill_rows and f32 is not None and sdpa_prefill is not False:
            # prefill rows by torch's SDPA after the Numba call (which writes the K/V, decodes)
            prefill = SdpaPrefill(self.pre_tables, self.pre_lens, self.pre_starts, caches.block_size, scale)
            self.sdpa = (prefill, f32)
            self.tile_seq = self.tile_row = self.tile_len = NO_INDEX
        else:
            self.tile_seq, self.tile_row, self.tile_len = query_tiles(self.pre_starts, self.pre_lens)
            work += prefill_work(self.pre_starts, self.pre_lens, num_heads)
        self.serial = work <= _parallel.SERIAL_MAX_ATTENTION_WORK if serial is None else serial
        if cascade_decode and (f32 is None or not fits):
            raise KernelInputError(f"the cascade decode path takes float32 caches with head_dim and block size "
                                   f"multiples of 16, not {caches.dtype}, {caches.head_dim}, {caches.block_size}")
        # decode sequences sharing prefix blocks: attended by the cascade after the fused call
        self.cascade: tuple[np.ndarray, np.ndarray] | None = None
        if num_dec and f32 is not None and fits and cascade_decode is not False and (
                cascade_decode or prefill_flash.preferred()):
            self.cascade = decode_cascade.cascade_plan(self.dec_tables, self.dec_lens, caches.block_size,
                                                       num_heads // caches.num_kv_heads, caches.num_kv_heads)
        self.split = bool(num_dec) and self.cascade is None and not self.serial and use_split(
            num_dec, caches.num_kv_heads, int(self.dec_lens.max()), caches.block_size)
        self.num_decode_tokens = num_dec
        # Sequences the fused call attends in one item per KV head; split ones in partitions
        # (the same call), merged after it. One set of partials serves every layer.
        self._fused_dec_seqs = 0 if self.split or self.cascade is not None else num_dec
        # nothing for the fused call to attend: its K/V writes run on the calling thread
        self._writes_only = not self._fused_dec_seqs and not self.split and len(self.tile_seq) == 0
        self.partials = NO_PARTIALS
        if self.split:
            self.partials = Partials.new(num_dec, num_heads, caches.head_dim, int(self.dec_lens.max()),
                                         caches.block_size)

    def run(self, layer: int, query: Any, key: Any, value: Any, out: Any | None = None) -> Any:
        """Write `key`/`value` `[num_tokens, num_kv_heads, head_dim]` (the caches' dtype) into
        `layer`'s cache at the step's slots, then attend every query `[num_tokens, num_heads,
        head_dim]`; returns `out` (a new array of the query's type and dtype when None)."""
        caches = self.caches
        if not 0 <= layer < caches.num_layers:
            raise KernelInputError(f"layer {layer} outside [0, {caches.num_layers})")
        if out is None:
            out = _host.new_like(query)
        # float32 host rows (a CPU float32 model's step) are viewed with a few attribute reads;
        # anything else is checked and converted the general way (~20 us a call more)
        q, result, k, v = f32_view(query), f32_view(out), None, None
        if caches.kv_kind == _host.KIND_F32:
            k, v = f32_view(key), f32_view(value)
        if (q is None or result is None or k is None or v is None or q.shape != self.q_shape
                or result.shape != self.q_shape or k.shape != self.kv_shape or v.shape != self.kv_shape):
            k, v = self._kv_rows("key", key), self._kv_rows("value", value)
            q = self._host_rows("query", query, self.q_shape)
            if q.dtype != np.float32:
                q = q.astype(np.float32)
            result = self._host_rows("out", out, self.q_shape)
            if result.dtype != np.float32:
                result = np.empty(self.q_shape, np.float32)
        else:
            k, v = k.view(np.uint16), v.view(np.uint16)
        kc, vc = caches.keys[layer], caches.values[layer]
        args = (q, k, v, kc, vc, caches.kv_kind, self.slot_mapping, self.dec_tables, self.dec_lens,
                self._fused_dec_seqs, self.pre_tables, self.pre_lens, self.pre_starts, self.tile_seq,
                self.tile_row, self.tile_len, *self.partials.args(), self.scale, result)
        if self.serial:
            attend_serial(*args)
            self._after_fused(kc, vc, q, result)
        elif self._writes_only:
            # the fused call only writes the K/V: on this thread, so that the step wakes the other
            # threads once per layer (for the cascade / flash work), not twice (_parallel.py: a
            # wake-up can cost a scheduler slice on a busy host)
            attend_serial(*args)
            with _parallel.parallel_section(False):
                self._after_fused(kc, vc, q, result)
        else:
            with _parallel.parallel_section(False):
                attend_parallel(*args)
                if self.split:
                    self.partials.reduce(result[:self.num_decode_tokens])
                self._after_fused(kc, vc, q, result)
        if self.sdpa is not None:
            prefill, f32 = self.sdpa
            prefill.run(f32.keys[layer], f32.values[layer], torch.from_numpy(q), torch.from_numpy(result))
        if result.dtype != _host_dtype(out):
            _host.store(out, result)
        return out

    def _after_fused(self, kc: np.ndarray, vc: np.ndarray, q: np.ndarray, result: np.ndarray) -> None:
        """The decode rows by the cascade and the prefill rows by the flash kernel, where the
        step takes them (after the fused call wrote the step's K/V), on the threads the caller set."""
        if self.cascade is not None:
            decode_cascade.cascade_decode(self.serial, q, kc, vc, self.dec_tables, self.dec_lens, self.cascade,
                                          self.scale, result)
        if self.flash_items is not None:
            prefill_flash.flash_prefill(self.serial, q, kc.view(np.float32), vc.view(np.float32), self.pre_tables,
                                        self.pre_lens, self.pre_starts, self.flash_items, self.scale, result)

    def _host_rows(self, name: str, x: Any, shape: tuple[int, int, int]) -> np.ndarray:
        """A checked NumPy view of a query-like array (bfloat16 as float32: a copy)."""
        if tuple(x.shape) != shape:
            raise KernelInputError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
        if _validate.is_device_array(x) or not _validate.is_contiguous(x):
            raise KernelInputError(f"{name} must be a C-contiguous host array")
        dtype = _validate.dtype_name(x)
        if dtype not in _validate.QUERY_DTYPES:
            raise KernelInputError(f"{name} must have dtype in {_validate.QUERY_DTYPES}, got {dtype}")
        if _validate.is_torch(x):
            return x.detach().numpy() if dtype != "bfloat16" else x.detach().float().numpy()
        return np.asarray(x)

    def _kv_rows(self, name: str, x: Any) -> np.ndarray:
        """New K or V rows, checked, as the uint16 bits the kernel stores (`_host.kv_bits`; for
        fp32 tensors through a NumPy view, cheaper than torch's)."""
        if tuple(x.shape) != self.kv_shape:
            raise KernelInputError(f"{name} must have shape {self.kv_shape}, got {tuple(x.shape)}")
        if _validate.is_device_array(x) or not _validate.is_contiguous(x):
            raise KernelInputError(f"{name} must be a C-contiguous host array")
        dtype = _validate.dtype_name(x)
        if dtype != self.caches.dtype:
            raise KernelInputError(f"{name} must have the caches' dtype {self.caches.dtype}, got {dtype}")
        if dtype == "float32" and _validate.is_torch(x):
            return x.detach().numpy().view(np.uint16)
        return _host.kv_bits(x)[0]

    # -- validation (once per step; per layer only the shapes) --------------------------------

    def _check_slots(self, slot_mapping: Any) -> np.ndarray:
        _validate.require("slot_mapping", slot_mapping, ndim=1, dtypes=("int64",))
        slots = _validate.to_host_numpy(slot_mapping)
        if slots is None:
            raise KernelInputError("the CPU step kernel was given a GPU-resident slot_mapping")
        num_slots = self.caches.num_blocks * self.caches.block_size
        if slots.size and int(slots.max()) >= num_slots:
            bad = int(np.flatnonzero(slots >= num_slots)[0])
            raise KernelInputError(f"slot_mapping[{bad}]={int(slots[bad])} >= num_blocks*block_size={num_slots}")
        live = slots[slots >= 0]
        if live.size != np.unique(live).size:
            raise KernelInputError("slot_mapping has duplicate non-negative slots")
        return np.ascontiguousarray(slots)

    def _check_tables(self, block_tables: Any, seq_lens: Any, num_seqs: int) -> tuple[np.ndarray, np.ndarray]:
        for name, array in (("block_tables", block_tables), ("seq_lens", seq_lens)):
            if _validate.is_device_array(array):
                raise KernelInputError(f"the CPU step kernel was given a GPU-resident {name}")
        _validate._check_tables(block_tables, seq_lens, num_seqs, self.caches.num_blocks, self.caches.block_size)
        return _host.index_array(block_tables, np.int32), _host.index_array(seq_lens, np.int32)

    def _check_starts(self, query_start_loc: Any, num_seqs: int, num_rows: int) -> np.ndarray:
        shape = _validate.require("prefill_query_start_loc", query_start_loc, ndim=1, dtypes=("int32",))
        if shape != (num_seqs + 1,):
            raise KernelInputError(f"prefill_query_start_loc must have shape ({num_seqs + 1},), got {shape}")
        starts = _validate.to_host_numpy(query_start_loc)
        if starts is None:
            raise KernelInputError("the CPU step kernel was given a GPU-resident prefill_query_start_loc")
        if int(starts[0]) != 0 or int(starts[-1]) != num_rows:
            raise KernelInputError(f"prefill_query_start_loc must run from 0 to the {num_rows} prefill rows, "
                                   f"got {int(starts[0])} … {int(starts[-1])}")
        q_lens = np.diff(starts.astype(np.int64))
        if (q_lens < 0).any():
            raise KernelInputError("prefill_query_start_loc must be non-decreasing")
        if (q_lens > self.pre_lens).any():
            s = int(np.flatnonzero(q_lens > self.pre_lens)[0])
            raise KernelInputError(f"prefill sequence {s} has {int(q_lens[s])} query tokens but seq_len "
                                   f"{int(self.pre_lens[s])}")
        return np.ascontiguousarray(starts, dtype=np.int32)


def _host_dtype(x: Any) -> np.dtype | None:
    """The NumPy dtype an output array stores (None for bfloat16, which NumPy lacks)."""
    name = _validate.dtype_name(x)
    return None if name == "bfloat16" else np.dtype(name)
