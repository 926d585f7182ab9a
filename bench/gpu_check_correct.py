"""Correctness phase of the GPU check: every CUDA kernel against `kernels.reference` at full
size, bitwise determinism, and the compute node's graphs (`gpu_check_graphs.py`).

Random ragged inputs with shuffled block tables and NaN in every slot past a sequence's end:
decode one-pass and split-K (fp16 / bf16 / fp32; GQA 4, MHA, MQA; head dim 64 / 128 / 256;
block size 8 / 16 / 32; split x64; the public API), prefill (fp16 / bf16 / fp32, mixed types,
head dim 256), write_slots, copy_blocks, `DecodePlan` + `DecodeGraphs` (captured, a padded
bucket and a split bucket, two layers); a ragged batch partitioned by the split policy from
host lengths (public API and graph); determinism (the same call twice, compared bitwise).
Any failed check makes gpu_check's exit status 1.
"""

from __future__ import annotations

import math
from typing import Any

from gpu_check_log import log

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
TOL = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 2e-5}
DEVICE = "cuda"  # "cpu" in the smoke run (Numba's simulator, launches stubbed)


def paged_inputs(torch: Any, gen: Any, lens: list[int], block_size: int, dtype: Any,
                 num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM,
                 spare: int = 16) -> dict[str, Any]:
    """Caches (slots past each sequence NaN), shuffled tables with garbage padding, on the GPU."""
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + spare
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    kc = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    vc = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE)
    tables = torch.full((len(lens), max(used) + 1), 10**6, dtype=torch.int32)
    cursor = 0
    for s, nb in enumerate(used):
        tables[s, :nb] = perm[cursor:cursor + nb].cpu().to(torch.int32)
        cursor += nb
    for s, n in enumerate(lens):  # a kernel reading past a sequence's end gets NaN
        if n % block_size:
            last = int(tables[s, used[s] - 1])
            kc[last, :, n % block_size:] = float("nan")
            vc[last, :, n % block_size:] = float("nan")
    return {"key_cache": kc, "value_cache": vc, "block_tables": tables.to(DEVICE),
            "seq_lens": torch.tensor(lens, dtype=torch.int32, device=DEVICE)}


def rel_error(out: Any, ref: Any) -> float:
    """Worst (token, head) row error relative to the reference row norm (NaN → inf)."""
    import numpy as np

    got = out.double().cpu().numpy()
    if np.isnan(got).any():
        return math.inf
    err = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    return float(err.max())


class Checks:
    """Correctness results of one phase: each is a row (`check`, `error`, `tolerance`, `ok`)
    written at once through the phase's context, and logged."""

    def __init__(self, ctx: Any = None) -> None:
        self.ctx = ctx
        self.results: list[dict[str, Any]] = []

    def record(self, name: str, err: float, tol: float) -> None:
        ok = err <= tol
        row = {"check": name, "error": err, "tolerance": tol, "ok": ok}
        self.results.append(row)
        if self.ctx is not None:
            self.ctx.record(row)
        verdict = "smoke" if DEVICE == "cpu" else "ok  " if ok else "FAIL"  # smoke: stubbed kernels
        log(f"{verdict} {name}: error {err:.2e} (tolerance {tol:.0e})")

    def guarded(self, name: str, fn: Any) -> None:
        """Run one group of checks; an exception is a failed check, not a crashed script."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported as a failure, with its message
            message = f"{name}: {type(exc).__name__}: {exc}"[:200]
            self.record(message, math.inf, 0.0)
            if self.ctx is not None:  # also an error: the smoke run's verdict counts these
                self.ctx.errors.append(message)


def check_decode(torch: Any, gen: Any, checks: Checks) -> None:
    import kernels
    from kernels import reference
    from kernels.cuda import decode, decode_split

    lens = [1, 16, 17, 1000, 2999, 4096]
    cases = [("float16", 8, 128, 16), ("bfloat16", 8, 128, 16), ("float32", 8, 128, 16),
             ("float16", 32, 128, 16), ("float16", 1, 128, 16), ("float16", 8, 64, 16),
             ("float16", 8, 256, 16), ("float16", 8, 128, 8), ("float16", 8, 128, 32)]
    for dtype_name, num_kv, head_dim, block_size in cases:
        dtype = getattr(torch, dtype_name)
        inp = paged_inputs(torch, gen, lens, block_size, dtype, num_kv, head_dim)
        q = (torch.randn((len(lens), NUM_HEADS, head_dim), generator=gen, device=DEVICE) * 3)
        q = q.to(dtype)
        scale = 1.0 / math.sqrt(head_dim)
        ref = reference.paged_attention_decode(q, scale=scale, **inp)
        label = f"decode {dtype_name} kv_heads={num_kv} d={head_dim} bs={block_size}"
        for split in (False, True):
            out = torch.full_like(q, float("nan"))
            decode.paged_attention_decode(q, out=out, scale=scale, split=split, **inp)
            checks.record(f"{label} {'split' if split else 'one-pass'}", rel_error(out, ref),
                          TOL[dtype_name])
        out = torch.full_like(q, float("nan"))
        decode_split.paged_attention_decode_split(q, out=out, scale=scale, num_parts=64, **inp)
        checks.record(f"{label} split x64", rel_error(out, ref), TOL[dtype_name])
        out = kernels.paged_attention_decode(q, scale=scale, backend="auto", **inp)
        checks.record(f"{label} public API", rel_error(out, ref), TOL[dtype_name])


def check_prefill(torch: Any, gen: Any, checks: Checks) -> None:
    import numpy as np

    import kernels
    from kernels import reference

    q_lens, seq_lens = [200, 300, 1, 64], [1200, 300, 38, 64]
    starts = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    cases = [("float16", "float16", "float16", 128), ("bfloat16", "bfloat16", "bfloat16", 128),
             ("float32", "float32", "float32", 128), ("float16", "bfloat16", "float32", 128),
             ("float16", "float16", "float16", 256)]
    for q_name, kv_name, out_name, head_dim in cases:
        inp = paged_inputs(torch, gen, seq_lens, 16, getattr(torch, kv_name), head_dim=head_dim)
        q = torch.randn((sum(q_lens), NUM_HEADS, head_dim), generator=gen, device=DEVICE) * 3
        q = q.to(getattr(torch, q_name))
        out = torch.full(q.shape, float("nan"), dtype=getattr(torch, out_name), device=DEVICE)
        scale = 1.0 / math.sqrt(head_dim)
        kernels.paged_prefill_attention(q, query_start_loc=starts.to(DEVICE), scale=scale, out=out,
                                        backend="cuda", **inp)
        ref = reference.paged_prefill_attention(q, query_start_loc=starts, scale=scale, **inp)
        tol = max(TOL[out_name], TOL[kv_name] if kv_name != q_name else 0.0)
        checks.record(f"prefill q={q_name} kv={kv_name} out={out_name} d={head_dim}",
                      rel_error(out, ref), tol)


def check_cache_ops(torch: Any, gen: Any, checks: Checks) -> None:
    import kernels
    from kernels import reference

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        shape = (4096, NUM_KV_HEADS, 16, HEAD_DIM)
        kc = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
        vc = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
        num_tokens = 5000
        slots = torch.randperm(4096 * 16, generator=gen, device=DEVICE)[:num_tokens].cpu()
        slots[::7] = -1  # padding tokens
        key = torch.randn((num_tokens, NUM_KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE)
        value = torch.randn((num_tokens, NUM_KV_HEADS, HEAD_DIM), generator=gen, device=DEVICE)
        key, value = key.to(dtype), value.to(dtype)
        k_ref, v_ref = kc.cpu(), vc.cpu()
        kernels.write_slots(key, value, kc, vc, slots.to(DEVICE), backend="cuda")
        reference.write_slots(key.cpu(), value.cpu(), k_ref, v_ref, slots)
        same = torch.equal(kc.cpu(), k_ref) and torch.equal(vc.cpu(), v_ref)
        checks.record(f"write_slots {str(dtype)[6:]}", 0.0 if same else math.inf, 0.0)
    num_layers, num_blocks = 4, 512
    shape = (num_blocks, NUM_KV_HEADS, 16, HEAD_DIM)
    keys = [torch.randn(shape, generator=gen, device=DEVICE).half() for _ in range(num_layers)]
    values = [torch.randn(shape, generator=gen, device=DEVICE).half() for _ in range(num_layers)]
    pairs = torch.randint(0, num_blocks, (300, 2), generator=gen, device=DEVICE).cpu()
    k_ref, v_ref = [k.cpu() for k in keys], [v.cpu() for v in values]
    kernels.copy_blocks(keys, values, pairs, backend="cuda")
    reference.copy_blocks(k_ref, v_ref, pairs)
    same = all(torch.equal(a.cpu(), b) for a, b in zip(keys + values, k_ref + v_ref, strict=True))
    checks.record("copy_blocks fp16 4 layers, 300 dependent pairs", 0.0 if same else math.inf, 0.0)


def check_graphs(torch: Any, gen: Any, checks: Checks) -> None:
    """DecodePlan and DecodeGraphs (captured CUDA graphs) against the reference: a batch that
    pads its bucket (rows of length 0), a one-sequence bucket whose plan splits, two layers."""
    from kernels import reference
    from kernels.cuda.graph import DecodeGraphs

    lens = [3000, 17, 1]
    inp = paged_inputs(torch, gen, lens, 16, torch.float16)
    tables, seq_lens = inp["block_tables"], inp["seq_lens"]
    width = int(tables.shape[1])
    kc, vc = [inp["key_cache"]], [inp["value_cache"]]
    for cache in (kc, vc):  # a second layer: same block ids, new values, the same NaN slots
        layer1 = torch.randn(cache[0].shape, generator=gen, device=DEVICE).half()
        layer1[torch.isnan(cache[0])] = float("nan")
        cache.append(layer1)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    graphs = DecodeGraphs(kc, vc, NUM_HEADS, width, scale, buckets=(1, 4))
    graphs.capture()
    for rows in (slice(0, 3), slice(1, 2)):
        bucket = graphs.prepare(tables[rows], seq_lens[rows])
        plan = graphs._bucket(bucket).plan
        for layer in range(2):
            n = rows.stop - rows.start
            q = (torch.randn((n, NUM_HEADS, HEAD_DIM), generator=gen, device=DEVICE) * 3).half()
            out = graphs.run(layer, q).clone()
            ref = reference.paged_attention_decode(q, kc[layer], vc[layer], tables[rows],
                                                   seq_lens[rows], scale)
            checks.record(f"graph layer {layer} batch {n} bucket {bucket} parts {plan.num_parts}",
                          rel_error(out, ref), TOL["float16"])


def check_ragged(torch: Any, gen: Any, checks: Checks) -> None:
    """A ragged batch whose lengths the split policy sees (host lengths: a common chunk size,
    more partitions for the long sequences, a device work list), through the public API and
    through a graph prepared with host lengths, against the float64 reference."""
    import kernels
    from kernels import reference
    from kernels.cuda.graph import DecodeGraphs

    lens = [1, 64, 700, 3000, 12000, 5000, 17, 1024]
    scale = 1.0 / math.sqrt(HEAD_DIM)
    for dtype_name in ("float16", "bfloat16"):
        inp = paged_inputs(torch, gen, lens, 16, getattr(torch, dtype_name))
        q = (torch.randn((len(lens), NUM_HEADS, HEAD_DIM), generator=gen, device=DEVICE) * 3)
        q = q.to(getattr(torch, dtype_name))
        ref = reference.paged_attention_decode(q, scale=scale, **inp)
        host = {**inp, "block_tables": inp["block_tables"].cpu(), "seq_lens": inp["seq_lens"].cpu()}
        out = kernels.paged_attention_decode(q, scale=scale, backend="cuda", **host)
        checks.record(f"decode ragged {dtype_name}, host lengths (policy's partitions)",
                      rel_error(out, ref), TOL[dtype_name])
        graphs = DecodeGraphs([inp["key_cache"]], [inp["value_cache"]], NUM_HEADS,
                              int(inp["block_tables"].shape[1]), scale, buckets=(8,))
        try:
            graphs.prepare(inp["block_tables"], inp["seq_lens"], host_seq_lens=host["seq_lens"])
        except TypeError:  # a graph path without per-step partitioning
            graphs.prepare(inp["block_tables"], inp["seq_lens"])
        out = graphs.run(0, q).clone()
        checks.record(f"graph ragged {dtype_name}, host lengths", rel_error(out, ref),
                      TOL[dtype_name])


def check_determinism(torch: Any, gen: Any, checks: Checks) -> None:
    """The same inputs twice must give bitwise the same output (a shared-memory race or a
    wrong cp.async group count shows as non-determinism long before it shows as error,
    review §5.1): one-pass and split decode, fp16 and bf16 prefill, a graph replay; and a
    graph bucket's padded row (length 0) must be exactly zero."""
    import kernels
    from kernels.cuda import decode
    from kernels.cuda.graph import DecodeGraphs

    lens = [1, 17, 1000, 2999, 4096]
    inp = paged_inputs(torch, gen, lens, 16, torch.float16)
    q = (torch.randn((len(lens), NUM_HEADS, HEAD_DIM), generator=gen, device=DEVICE) * 3).half()
    scale = 1.0 / math.sqrt(HEAD_DIM)
    for split in (False, True):
        outs = [decode.paged_attention_decode(q, scale=scale, split=split, **inp)
                for _ in range(2)]
        same = torch.equal(outs[0], outs[1])
        checks.record(f"determinism decode {'split' if split else 'one-pass'}: bitwise equal "
                      f"repeat ({same})", 0.0 if same else math.inf, 0.0)
    for dtype in (torch.float16, torch.bfloat16):
        q_lens, seq_lens = [700, 64, 1], [3000, 64, 40]
        pin = paged_inputs(torch, gen, seq_lens, 16, dtype)
        qp = (torch.randn((sum(q_lens), NUM_HEADS, HEAD_DIM), generator=gen, device=DEVICE) * 3)
        qp = qp.to(dtype)
        starts = torch.tensor([0, 700, 764, 765], dtype=torch.int32, device=DEVICE)
        outs = [kernels.paged_prefill_attention(qp, query_start_loc=starts, scale=scale,
                                                backend="cuda", **pin) for _ in range(2)]
        same = torch.equal(outs[0], outs[1])
        checks.record(f"determinism prefill {str(dtype)[6:]}: bitwise equal repeat ({same})",
                      0.0 if same else math.inf, 0.0)
    graphs = DecodeGraphs([inp["key_cache"]], [inp["value_cache"]], NUM_HEADS,
                          int(inp["block_tables"].shape[1]), scale, buckets=(8,))
    graphs.prepare(inp["block_tables"], inp["seq_lens"])
    outs = [graphs.run(0, q).clone() for _ in range(2)]
    same = torch.equal(outs[0], outs[1])
    checks.record(f"determinism graph replay: bitwise equal repeat ({same})",
                  0.0 if same else math.inf, 0.0)
    padded = graphs._bucket(8).out[len(lens):]
    zero = bool((padded == 0).all())
    checks.record(f"graph bucket's padded rows (length 0) are zeros ({zero})",
                  0.0 if zero else math.inf, 0.0)


def phase_correctness(ctx: Any, torch: Any, smoke: bool) -> None:
    """Every correctness group as a cell of the phase; the node's graphs last (they also time
    a decode step both ways). The smoke run (launches stubbed: numbers meaningless) walks the
    determinism and graph groups only, for the code path."""
    from gpu_check_graphs import check_node_graphs

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    checks = Checks(ctx)
    # in priority order: a phase out of budget keeps the groups that ran
    groups: list[tuple[str, Any]] = [
        ("decode", lambda: check_decode(torch, gen, checks)),
        ("prefill", lambda: check_prefill(torch, gen, checks)),
        ("determinism", lambda: check_determinism(torch, gen, checks)),
        ("ragged", lambda: check_ragged(torch, gen, checks)),
        ("graphs", lambda: check_graphs(torch, gen, checks)),
        ("cache ops", lambda: check_cache_ops(torch, gen, checks))]
    if smoke:  # the float64 references of the others take the smoke run's CPU too long
        groups = [g for g in groups if g[0] in ("determinism", "graphs")]
    for name, fn in groups:
        ctx.cell(name, lambda fn=fn, name=name: checks.guarded(name, fn))
    if not smoke:
        ctx.cell("node graphs", lambda: {"what": "node decode step, graphs on vs off (ms)",
                                         **check_node_graphs(torch, checks, rel_error)})
