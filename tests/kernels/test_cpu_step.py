"""The CPU step kernel (`kernels.cpu.step.StepAttention`: a model step's K/V write and all of its
decode and prefill attention in one call per layer) against the float64 reference, and its
input checks; plus the vectorisable `exp_f32` the CPU attention kernels use.

Cases are ragged on purpose: decode contexts of 1 token, exactly one block, one past a block,
partial last blocks and a long one (split-K when the parallel path takes it); prefill chunks
onto a cached prefix, whole prompts, one token, several query tiles; shuffled block tables;
MHA, GQA and MQA head layouts; fp32, fp16 and bf16 caches and queries.
"""

from __future__ import annotations

import importlib
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from numba import njit
from paged_cases import as_f64, assert_close_rel, random_kv, shuffled_tables

from kernels import KernelInputError, reference
from kernels.cpu import decode as cpu_decode
from kernels.cpu._tile import exp_f32
from kernels.cpu.step import KvBits, StepAttention

PARALLEL = importlib.import_module("kernels.cpu._parallel")
REL = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 8e-3}

DECODE_LENS = [1, 16, 17, 100, 1100, 33]
PREFILL = [(1, 1), (16, 16), (40, 17), (300, 33), (64, 64), (700, 5)]   # (seq_len, q_len)


@dataclass(slots=True)
class StepCase:
    key_caches: list[Any]          # per layer [num_blocks, num_kv_heads, block_size, head_dim]
    value_caches: list[Any]
    query: Any                     # [num_tokens, num_heads, head_dim], decode rows first
    keys: list[Any]                # per layer [num_tokens, num_kv_heads, head_dim], the caches' dtype
    values: list[Any]
    slot_mapping: np.ndarray       # int64 [num_tokens]
    num_decode: int
    dec_tables: np.ndarray | None
    dec_lens: np.ndarray | None
    pre_tables: np.ndarray | None
    pre_lens: np.ndarray | None
    pre_starts: np.ndarray | None
    scale: float


def _query(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> Any:
    q = rng.standard_normal(shape, dtype=np.float32) * 4.0   # logits spread ~4: far from uniform
    return torch.from_numpy(q).to(torch.bfloat16) if dtype == "bfloat16" else q.astype(dtype)


def _to_torch(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(x)


def make_step(
    rng: np.random.Generator, decode_lens: list[int], prefill: list[tuple[int, int]], *, num_heads: int,
    num_kv_heads: int, head_dim: int = 64, block_size: int = 16, kv_dtype: str = "float32",
    query_dtype: str = "float32", num_layers: int = 2, as_torch: bool = True,
) -> StepCase:
    """Decode sequences then prefill sequences over one shuffled pool; each new token's slot is
    its position's (the last `q_len` positions of its sequence)."""
    seq_lens = decode_lens + [s for s, _ in prefill]
    q_lens = [1] * len(decode_lens) + [q for _, q in prefill]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5
    tables = shuffled_tables(rng, seq_lens, block_size, num_blocks)
    slots = []
    for s, (n, q) in enumerate(zip(seq_lens, q_lens)):
        positions = np.arange(n - q, n)
        slots.append(tables[s, positions // block_size].astype(np.int64) * block_size + positions % block_size)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    num_tokens = sum(q_lens)
    kv_shape = (num_tokens, num_kv_heads, head_dim)
    convert = _to_torch if as_torch else (lambda x: x)
    nd = len(decode_lens)
    starts = np.concatenate([[0], np.cumsum(q_lens[nd:])]).astype(np.int32)
    return StepCase(
        key_caches=[convert(random_kv(rng, shape, kv_dtype)) for _ in range(num_layers)],
        value_caches=[convert(random_kv(rng, shape, kv_dtype)) for _ in range(num_layers)],
        query=convert(_query(rng, (num_tokens, num_heads, head_dim), query_dtype)),
        keys=[convert(random_kv(rng, kv_shape, kv_dtype)) for _ in range(num_layers)],
        values=[convert(random_kv(rng, kv_shape, kv_dtype)) for _ in range(num_layers)],
        slot_mapping=np.concatenate(slots),
        num_decode=nd,
        dec_tables=np.ascontiguousarray(tables[:nd]) if nd else None,
        dec_lens=np.array(seq_lens[:nd], np.int32) if nd else None,
        pre_tables=np.ascontiguousarray(tables[nd:]) if prefill else None,
        pre_lens=np.array(seq_lens[nd:], np.int32) if prefill else None,
        pre_starts=starts if prefill else None,
        scale=head_dim**-0.5,
    )


def begin(case: StepCase, **overrides: Any) -> StepAttention:
    args: dict[str, Any] = dict(
        num_heads=int(case.query.shape[1]), slot_mapping=case.slot_mapping, num_decode_tokens=case.num_decode,
        decode_block_tables=case.dec_tables, decode_seq_lens=case.dec_lens, prefill_block_tables=case.pre_tables,
        prefill_seq_lens=case.pre_lens, prefill_query_start_loc=case.pre_starts, scale=case.scale,
    )
    args.update(overrides)
    return StepAttention(KvBits(case.key_caches, case.value_caches), **args)


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x.copy()


def expected(case: StepCase, layer: int) -> tuple[np.ndarray, Any, Any]:
    """float64 attention output of `layer` and its caches after the step's writes (reference
    kernels on copies)."""
    kc, vc = _clone(case.key_caches[layer]), _clone(case.value_caches[layer])
    reference.write_slots(case.keys[layer], case.values[layer], kc, vc, case.slot_mapping)
    q64 = as_f64(case.query)
    parts = []
    nd = case.num_decode
    if nd:
        parts.append(reference.paged_attention_decode(q64[:nd], kc, vc, case.dec_tables, case.dec_lens, case.scale))
    if case.pre_tables is not None:
        parts.append(reference.paged_prefill_attention(q64[nd:], kc, vc, case.pre_tables, case.pre_lens,
                                                       case.pre_starts, case.scale))
    return np.concatenate(parts), kc, vc


def _equal(a: Any, b: Any) -> bool:
    return bool(torch.equal(_to_torch(a), _to_torch(b)))


@pytest.fixture(params=["serial", "parallel"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Small steps run on the calling thread; force each path (the parallel one takes split-K
    for the long decode context when the (sequence, KV head) items are too few)."""
    threshold = 2**62 if request.param == "serial" else -1
    monkeypatch.setattr(PARALLEL, "SERIAL_MAX_ATTENTION_WORK", threshold)
    return request.param


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (16, 2), (8, 1)],
                         ids=["mha", "gqa3", "gqa8", "mqa"])
def test_mixed_step_matches_reference(kv_dtype: str, num_heads: int, num_kv_heads: int, path: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{kv_dtype}{num_heads}{num_kv_heads}{path}".encode()))
    case = make_step(rng, DECODE_LENS, PREFILL, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     kv_dtype=kv_dtype, query_dtype=kv_dtype)
    step = begin(case)
    assert step.serial == (path == "serial")
    for layer in range(2):
        want, want_k, want_v = expected(case, layer)
        out = step.run(layer, case.query, case.keys[layer], case.values[layer])
        assert isinstance(out, torch.Tensor) and out.dtype == case.query.dtype
        assert_close_rel(out, want, REL[kv_dtype])
        # The writes are plain bit copies: the caches equal the reference's exactly.
        assert _equal(case.key_caches[layer], want_k) and _equal(case.value_caches[layer], want_v)


@pytest.mark.parametrize("kind", ["decode_only", "prefill_only"])
def test_single_group_steps(kind: str, path: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{kind}{path}".encode()))
    dec, pre = (DECODE_LENS, []) if kind == "decode_only" else ([], PREFILL)
    case = make_step(rng, dec, pre, num_heads=8, num_kv_heads=2, as_torch=False)
    out = np.full(case.query.shape, np.nan, np.float32)   # poison: unwritten rows stay NaN
    got = begin(case).run(1, case.query, case.keys[1], case.values[1], out=out)
    assert got is out
    want, want_k, _ = expected(case, 1)
    assert_close_rel(out, want, REL["float32"])
    assert _equal(case.key_caches[1], want_k)


def test_split_decode_used_for_few_long_sequences(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PARALLEL, "SERIAL_MAX_ATTENTION_WORK", -1)
    rng = np.random.default_rng(5)
    case = make_step(rng, [2000], [(40, 7)], num_heads=8, num_kv_heads=1)
    step = begin(case)
    assert step.split == cpu_decode.use_split(1, 1, 2000, 16)
    want, _, _ = expected(case, 0)
    assert_close_rel(step.run(0, case.query, case.keys[0], case.values[0]), want, REL["float32"])


@pytest.mark.parametrize("prefill_path", ["sdpa", "tiles", "flash"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 1), (14, 2)],
                         ids=["mha", "gqa3", "mqa", "gqa7"])
def test_float32_prefill_paths_match_reference(prefill_path: str, num_heads: int, num_kv_heads: int) -> None:
    """float32 caches: prefill rows through torch's SDPA, the Numba tiles or the AVX2 flash
    kernel, each against float64 — whole prompts (square causal), chunks after a cached prefix
    (a bottom-right mask), a one-token-longer chunk, shuffled tables, partial last blocks — with
    decode rows in the same step; the SDPA and flash paths are refused for other cache dtypes."""
    rng = np.random.default_rng(zlib.crc32(f"{prefill_path}{num_heads}{num_kv_heads}".encode()))
    case = make_step(rng, [5, 33], [(90, 30), (12, 12), (47, 2), (130, 129)], num_heads=num_heads,
                     num_kv_heads=num_kv_heads)
    flags = {"sdpa": dict(sdpa_prefill=True), "tiles": dict(sdpa_prefill=False),
             "flash": dict(flash_prefill=True)}[prefill_path]
    step = begin(case, **flags)
    assert (step.sdpa is not None) == (prefill_path == "sdpa")
    assert (step.flash_items is not None) == (prefill_path == "flash")
    for layer in range(2):
        want, want_k, _ = expected(case, layer)
        assert_close_rel(step.run(layer, case.query, case.keys[layer], case.values[layer]), want, REL["float32"])
        assert _equal(case.key_caches[layer], want_k)
    half = make_step(rng, [5], [(20, 4)], num_heads=num_heads, num_kv_heads=num_kv_heads, kv_dtype="float16",
                     query_dtype="float16")
    assert begin(half).sdpa is None and begin(half).flash_items is None
    with pytest.raises(KernelInputError, match="float32 caches"):
        begin(half, **(flags if prefill_path != "tiles" else dict(sdpa_prefill=True)))


@pytest.mark.parametrize("preferred", [True, False])
def test_default_float32_prefill_path(preferred: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default float32 prefill takes the flash kernel where the CPU prefers it (AVX2 without
    AVX-512) and torch's SDPA elsewhere; an explicit `sdpa_prefill` wins over the preference,
    shapes the flash kernel cannot take (head_dim not a multiple of 16) fall back to SDPA, and
    asking for both paths, or for flash on such a shape, is refused."""
    from kernels.cpu import prefill_flash

    monkeypatch.setattr(prefill_flash, "preferred", lambda: preferred)
    rng = np.random.default_rng(11)
    case = make_step(rng, [7], [(40, 9)], num_heads=6, num_kv_heads=2)
    default = begin(case)
    assert (default.flash_items is not None) == preferred and (default.sdpa is not None) == (not preferred)
    want, _, _ = expected(case, 0)
    assert_close_rel(default.run(0, case.query, case.keys[0], case.values[0]), want, REL["float32"])
    assert begin(case, sdpa_prefill=True).flash_items is None
    assert begin(case, sdpa_prefill=False).flash_items is None and begin(case, sdpa_prefill=False).sdpa is None
    with pytest.raises(KernelInputError, match="not both"):
        begin(case, sdpa_prefill=True, flash_prefill=True)
    odd = make_step(rng, [3], [(20, 4)], num_heads=2, num_kv_heads=1, head_dim=24)
    assert begin(odd).flash_items is None and begin(odd).sdpa is not None
    with pytest.raises(KernelInputError, match="multiples of 16"):
        begin(odd, flash_prefill=True)
    decode_only = make_step(rng, [7, 20], [], num_heads=6, num_kv_heads=2)
    assert begin(decode_only).flash_items is None


@pytest.mark.parametrize("flash", [None, True], ids=["default", "flash-asked"])
def test_long_contexts_take_sdpa_beside_flash(flash: bool | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU prefers the flash kernel, a step's sequences with a context over
    `MAX_DEFAULT_CONTEXT` prefill through SDPA and the others through flash, in the same step (both
    against float64; the generic prefill entry point splits the same way, to the bit); asking
    for flash takes every sequence through it."""
    import kernels
    from kernels.cpu import prefill_flash

    monkeypatch.setattr(prefill_flash, "preferred", lambda: True)
    rng = np.random.default_rng(12)
    long = prefill_flash.MAX_DEFAULT_CONTEXT + 37
    case = make_step(rng, [9], [(40, 9), (long, 20), (70, 70)], num_heads=6, num_kv_heads=2, as_torch=False,
                     num_layers=1)
    copies = (_clone(case.key_caches[0]), _clone(case.value_caches[0]))
    step = begin(case, flash_prefill=flash)
    covered = {int(s) for s in step.flash_items[:, 0]} if step.flash_items is not None else set()
    assert covered == ({0, 1, 2} if flash else {0, 2})
    assert (step.sdpa is not None) == (flash is None)
    want, _, _ = expected(case, 0)
    got = step.run(0, case.query, case.keys[0], case.values[0])
    assert_close_rel(got, want, REL["float32"])
    if flash is None:
        kc, vc = copies
        kernels.write_slots(case.keys[0], case.values[0], kc, vc, case.slot_mapping)
        nd = case.num_decode
        pre = kernels.paged_prefill_attention(case.query[nd:], kc, vc, case.pre_tables, case.pre_lens,
                                              case.pre_starts, case.scale)
        np.testing.assert_array_equal(got[nd:], pre)


def test_same_result_as_the_separate_kernels() -> None:
    """One fused call gives exactly what write_slots + decode + prefill give (same arithmetic:
    for float32 caches both prefill through the same path, the flash kernel on an AVX2 CPU
    without AVX-512 and SDPA elsewhere)."""
    import kernels

    rng = np.random.default_rng(6)
    case = make_step(rng, [5, 40, 130], [(90, 30), (12, 12)], num_heads=9, num_kv_heads=3, as_torch=False)
    copies = ([_clone(c) for c in case.key_caches], [_clone(c) for c in case.value_caches])
    fused = begin(case).run(0, case.query, case.keys[0], case.values[0])
    kc, vc = copies[0][0], copies[1][0]
    kernels.write_slots(case.keys[0], case.values[0], kc, vc, case.slot_mapping)
    nd = case.num_decode
    dec = kernels.paged_attention_decode(case.query[:nd], kc, vc, case.dec_tables, case.dec_lens, case.scale)
    pre = kernels.paged_prefill_attention(case.query[nd:], kc, vc, case.pre_tables, case.pre_lens, case.pre_starts,
                                          case.scale)
    np.testing.assert_array_equal(fused, np.concatenate([dec, pre]))
    np.testing.assert_array_equal(case.key_caches[0], kc)


def _bad(case: StepCase) -> dict[str, Any]:
    """Each entry: an override of `begin`'s arguments that must be refused."""
    dup = case.slot_mapping.copy()
    dup[1] = dup[0]
    far = case.slot_mapping.copy()
    far[0] = 10**9
    table = case.dec_tables.copy()
    table[0, 0] = 10**6
    long = case.dec_lens.copy()
    long[0] = table.shape[1] * 16 + 1
    starts = case.pre_starts.copy()
    starts[-1] += 1
    return {
        "duplicate slot": dict(slot_mapping=dup),
        "slot past the pool": dict(slot_mapping=far),
        "slot dtype": dict(slot_mapping=case.slot_mapping.astype(np.int32)),
        "block id past the pool": dict(decode_block_tables=table),
        "context longer than its table": dict(decode_seq_lens=long),
        "decode rows without tables": dict(decode_block_tables=None),
        "too many decode rows": dict(num_decode_tokens=len(case.slot_mapping) + 1),
        "prefill rows mismatch": dict(prefill_query_start_loc=starts),
        "heads not a multiple of KV heads": dict(num_heads=7),
        "scale": dict(scale=float("nan")),
    }


@pytest.mark.parametrize("what", list(_bad(make_step(np.random.default_rng(0), [3, 20], [(30, 9)], num_heads=4,
                                                     num_kv_heads=2))))
def test_bad_step_refused_before_anything_is_written(what: str) -> None:
    case = make_step(np.random.default_rng(0), [3, 20], [(30, 9)], num_heads=4, num_kv_heads=2)
    before = [_clone(c) for c in case.key_caches]
    with pytest.raises(KernelInputError):
        begin(case, **_bad(case)[what])
    assert all(_equal(a, b) for a, b in zip(case.key_caches, before))


@pytest.mark.parametrize("what", ["query shape", "key dtype", "value not contiguous", "layer"])
def test_bad_layer_inputs_refused_before_anything_is_written(what: str) -> None:
    case = make_step(np.random.default_rng(1), [3, 20], [(30, 9)], num_heads=4, num_kv_heads=2)
    step = begin(case)
    q, k, v, layer = case.query, case.keys[0], case.values[0], 0
    if what == "query shape":
        q = q[:-1]
    elif what == "key dtype":
        k = k.to(torch.float16)
    elif what == "value not contiguous":
        v = torch.cat([v, v], dim=-1)[..., ::2]
    else:
        layer = 2
    before = _clone(case.key_caches[0])
    with pytest.raises(KernelInputError):
        step.run(layer, q, k, v)
    assert _equal(case.key_caches[0], before)


@njit
def _exp_all(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = exp_f32(x[i])


def test_exp_f32_within_one_ulp_relative() -> None:
    x = np.concatenate([np.linspace(-87.0, 88.0, 400_001, dtype=np.float32),
                        np.array([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5], np.float32)])
    out = np.empty_like(x)
    _exp_all(x, out)
    want = np.exp(x.astype(np.float64))
    assert (np.abs(out - want) / want).max() <= 2.0**-23   # a float32 ulp relative to the value
    assert out[x == 0].tolist() == [1.0, 1.0]   # exp(0) is exact: softmax's max element weighs 1


def test_exp_f32_edges() -> None:
    x = np.array([-np.inf, -1e4, -87.5, np.inf, 1e4, np.nan], np.float32)
    out = np.empty_like(x)
    _exp_all(x, out)
    assert out[:3].tolist() == [0.0, 0.0, 0.0]     # underflow (and the -inf of an empty running max)
    assert np.isposinf(out[3:5]).all()
    assert np.isnan(out[5])                        # a NaN logit is not hidden
