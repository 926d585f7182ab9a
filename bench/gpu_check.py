"""GPU check of the Numba CUDA kernels (run through bench/gpu_check.sh RESULTS_DIR).

1. Correctness at full size: every CUDA kernel against `kernels.reference` on random ragged
   inputs with shuffled block tables and NaN in every slot past a sequence's end: decode
   one-pass and split-K (fp16 / bf16 / fp32; GQA 4, MHA, MQA; head dim 64 / 128 / 256; block
   size 8 / 16 / 32), prefill (fp16 / bf16 / fp32, mixed types, head dim 256), write_slots,
   copy_blocks, and the graph path (`DecodePlan`, `DecodeGraphs` capture and replay, padded
   rows); then the compute node's decode with CUDA graphs on vs off (`gpu_check_graphs.py`:
   the pool's decode loop always, a `ModelRunner` generation when safetensors and tokenizers
   are importable), with a decode step's time both ways. Any failure → exit status 1.
2. Decode bandwidth: B ∈ {1, 16, 64} × context ∈ {512, 4096, 32768}, 32 query / 8 KV heads,
   head dim 128, fp16, block size 16 (override with --block-sizes). CUDA events, warm-up,
   median of bounded repetitions, K/V rotated over disjoint copies totalling >= 4x L2 so reads
   come from HBM. K/V GB/s, the device's copy bandwidth (4 GiB device-to-device copy, read +
   write bytes), their ratio (target >= 0.8), and torch SDPA over the same K/V stored
   contiguously; the same through the CUDA-graph path (the node's decode) in every cell.
3. Host path: microseconds of Python per call (no synchronisation) for the public API,
   `DecodePlan.launch` and `DecodeGraphs.run`.
4. Prefill (`gpu_check_prefill.py`): one layer of an 8k-token prompt, the paged FA2-class
   kernel vs torch SDPA (flash) over the same K/V made contiguous (goal <= 1.2x), and the
   chunked-prefill path's tokens/s.
Writes RESULTS_DIR/gpu_check.md and RESULTS_DIR/gpu_check.json. Needs only numpy, numba,
numba-cuda, torch and this repository's `kernels/` package; 76-105 s on an H200 (2026-12-04;
mostly Numba JIT of the kernel variants and the float64 reference).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# The sibling modules (gpu_check_graphs, gpu_check_prefill) import as top-level names, also
# when this file is loaded by path (the tests) rather than run as a script.
_BENCH_DIR = str(Path(__file__).resolve().parent)
if _BENCH_DIR not in sys.path:
    sys.path.insert(0, _BENCH_DIR)

EXIT_NO_GPU = 2
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
BATCHES = (1, 16, 64)
CONTEXTS = (512, 4096, 32768)
TOL = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 2e-5}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="results directory (created)")
    p.add_argument("--block-sizes", default="16", help="comma-separated, default 16")
    p.add_argument("--max-reps", type=int, default=50, help="timed repetitions per case (cap)")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--host-path-cpu", action="store_true",
                   help="no GPU needed: Python cost per call of the three decode entry points\n"
                        "in Numba's simulator with every launch stubbed out (prints, exits)")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------


def paged_inputs(torch: Any, gen: Any, lens: list[int], block_size: int, dtype: Any,
                 num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM,
                 spare: int = 16) -> dict[str, Any]:
    """Caches (slots past each sequence NaN), shuffled tables with garbage padding, on the GPU."""
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + spare
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    kc = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    vc = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")
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
    return {"key_cache": kc, "value_cache": vc, "block_tables": tables.cuda(),
            "seq_lens": torch.tensor(lens, dtype=torch.int32, device="cuda")}


def rel_error(out: Any, ref: Any) -> float:
    """Worst (token, head) row error relative to the reference row norm (NaN → inf)."""
    import numpy as np

    got = out.double().cpu().numpy()
    if np.isnan(got).any():
        return math.inf
    err = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    return float(err.max())


# ------------------------------------------------------------------------------------------
# Correctness
# ------------------------------------------------------------------------------------------


class Checks:
    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    def record(self, name: str, err: float, tol: float) -> None:
        ok = err <= tol
        self.results.append({"check": name, "error": err, "tolerance": tol, "ok": ok})
        log(f"{'ok  ' if ok else 'FAIL'} {name}: error {err:.2e} (tolerance {tol:.0e})")

    def guarded(self, name: str, fn: Any) -> None:
        """Run one group of checks; an exception is a failed check, not a crashed script."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported as a failure, with its message
            self.record(f"{name}: {type(exc).__name__}: {exc}"[:200], math.inf, 0.0)


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
        q = (torch.randn((len(lens), NUM_HEADS, head_dim), generator=gen, device="cuda") * 3)
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
        q = torch.randn((sum(q_lens), NUM_HEADS, head_dim), generator=gen, device="cuda") * 3
        q = q.to(getattr(torch, q_name))
        out = torch.full(q.shape, float("nan"), dtype=getattr(torch, out_name), device="cuda")
        scale = 1.0 / math.sqrt(head_dim)
        kernels.paged_prefill_attention(q, query_start_loc=starts.cuda(), scale=scale, out=out,
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
        kc = torch.randn(shape, generator=gen, device="cuda").to(dtype)
        vc = torch.randn(shape, generator=gen, device="cuda").to(dtype)
        num_tokens = 5000
        slots = torch.randperm(4096 * 16, generator=gen, device="cuda")[:num_tokens].cpu()
        slots[::7] = -1  # padding tokens
        key = torch.randn((num_tokens, NUM_KV_HEADS, HEAD_DIM), generator=gen, device="cuda")
        value = torch.randn((num_tokens, NUM_KV_HEADS, HEAD_DIM), generator=gen, device="cuda")
        key, value = key.to(dtype), value.to(dtype)
        k_ref, v_ref = kc.cpu(), vc.cpu()
        kernels.write_slots(key, value, kc, vc, slots.cuda(), backend="cuda")
        reference.write_slots(key.cpu(), value.cpu(), k_ref, v_ref, slots)
        same = torch.equal(kc.cpu(), k_ref) and torch.equal(vc.cpu(), v_ref)
        checks.record(f"write_slots {str(dtype)[6:]}", 0.0 if same else math.inf, 0.0)
    num_layers, num_blocks = 4, 512
    shape = (num_blocks, NUM_KV_HEADS, 16, HEAD_DIM)
    keys = [torch.randn(shape, generator=gen, device="cuda").half() for _ in range(num_layers)]
    values = [torch.randn(shape, generator=gen, device="cuda").half() for _ in range(num_layers)]
    pairs = torch.randint(0, num_blocks, (300, 2), generator=gen, device="cuda").cpu()
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
        layer1 = torch.randn(cache[0].shape, generator=gen, device="cuda").half()
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
            q = (torch.randn((n, NUM_HEADS, HEAD_DIM), generator=gen, device="cuda") * 3).half()
            out = graphs.run(layer, q).clone()
            ref = reference.paged_attention_decode(q, kc[layer], vc[layer], tables[rows],
                                                   seq_lens[rows], scale)
            checks.record(f"graph layer {layer} batch {n} bucket {bucket} parts {plan.num_parts}",
                          rel_error(out, ref), TOL["float16"])


def check_correctness(torch: Any) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every correctness check; returns the results and the node graphs' step times."""
    from gpu_check_graphs import check_node_graphs

    gen = torch.Generator(device="cuda").manual_seed(0)
    checks = Checks()
    checks.guarded("decode", lambda: check_decode(torch, gen, checks))
    checks.guarded("prefill", lambda: check_prefill(torch, gen, checks))
    checks.guarded("cache ops", lambda: check_cache_ops(torch, gen, checks))
    checks.guarded("graphs", lambda: check_graphs(torch, gen, checks))
    node_graphs = check_node_graphs(torch, checks, rel_error)
    return checks.results, node_graphs


# ------------------------------------------------------------------------------------------
# Bandwidth and host path
# ------------------------------------------------------------------------------------------


def time_events(torch: Any, fn: Any, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn(i)` (i = repetition index) between CUDA events."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us(torch: Any, fn: Any, calls: int = 200) -> float:
    """Python microseconds per call (no synchronisation inside: the GPU runs behind)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def copy_bandwidth(torch: Any) -> float:
    """GB/s of a 4 GiB device-to-device copy, counting bytes read + written."""
    n = 4 << 30
    buffers = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
    ms = time_events(torch, lambda _: buffers[1].copy_(buffers[0]), reps=10)
    buffers.clear()
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e9


def bench_decode(torch: Any, block_size: int, max_reps: int, copy_gbs: float) -> list[dict[str, Any]]:
    from kernels.cuda._host import spec_for
    from kernels.cuda.decode import resident_blocks

    spec = spec_for(HEAD_DIM, block_size, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, "f16", "f16",
                    "f16", "decode")
    resident = resident_blocks(spec)
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            rows.append(bench_case(torch, block_size, batch, ctx, max_reps, copy_gbs, resident))
            torch.cuda.empty_cache()
    return rows


def bench_case(torch: Any, block_size: int, batch: int, ctx: int, max_reps: int,
               copy_gbs: float, resident: int) -> dict[str, Any]:
    """One (batch, context) cell: paged decode launched directly and through the graph path,
    and torch SDPA."""
    import torch.nn.functional as F

    import kernels
    from kernels.cuda.decode_split import choose_num_partitions
    from kernels.cuda.graph import DecodeGraphs

    l2_bytes = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20))
    scale = 1.0 / math.sqrt(HEAD_DIM)
    kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * 2  # K and V, fp16
    # Rotate over disjoint copies so successive reps never hit L2 (4x L2 in flight).
    num_sets = max(1, min(32, math.ceil(4 * l2_bytes / kv_bytes)))
    blocks_per_seq = ctx // block_size
    num_blocks = batch * blocks_per_seq * num_sets
    shape = (num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM)
    kc = torch.randn(shape, device="cuda", dtype=torch.float16)
    vc = torch.randn(shape, device="cuda", dtype=torch.float16)
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(
        num_sets, batch, blocks_per_seq)  # shuffled, disjoint sets
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, NUM_HEADS, HEAD_DIM), device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    parts = choose_num_partitions(batch * NUM_KV_HEADS, ctx, resident)
    path = "one-pass" if parts == 1 else f"split x{parts}"
    est_ms = max(kv_bytes / (copy_gbs * 1e9) * 1e3, 0.02)
    reps = int(min(max_reps, max(5, 2000 / est_ms / 100)))
    paged_ms = time_events(torch, lambda i: kernels.paged_attention_decode(
        q, kc, vc, tables[i % num_sets], seq_lens, scale, out=out, backend="cuda"), reps)
    # The graph path, the one the compute node serves decode with (no per-call Python above the
    # replay, so small cells show the kernel rather than the host): one DecodeGraphs per
    # rotation set, so its reads come from HBM too.
    graph_ms = None
    graphs: list[Any] = []
    try:
        for g_i in range(num_sets):
            graphs.append(DecodeGraphs([kc], [vc], NUM_HEADS, blocks_per_seq, scale, buckets=(batch,)))
            graphs[-1].prepare(tables[g_i], seq_lens)
            graphs[-1].capture()
        graph_ms = time_events(torch, lambda i: graphs[i % len(graphs)].run(0, q), reps)
    except Exception as exc:  # noqa: BLE001 - one benchmark cell: reported, the rest still run
        log(f"graph path at B={batch} ctx={ctx} failed: {type(exc).__name__}: {exc}")
    finally:
        graphs.clear()
    kc = vc = tables = None  # free the pool before the contiguous copies
    torch.cuda.empty_cache()
    # The same K/V stored contiguously: [num_sets][batch, kv_heads, ctx, head_dim].
    k_sets = torch.randn((num_sets, batch, NUM_KV_HEADS, ctx, HEAD_DIM), device="cuda",
                         dtype=torch.float16)
    v_sets = torch.randn_like(k_sets)
    # GQA decode as plain SDPA: the group's query heads become G query rows of one KV head
    # (no mask: all of them see the whole context), so K/V are read once.
    q4 = q.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)
    sdpa_ms = time_events(torch, lambda i: F.scaled_dot_product_attention(
        q4, k_sets[i % num_sets], v_sets[i % num_sets], scale=scale), reps)
    gbs = kv_bytes / (paged_ms * 1e-3) / 1e9
    sdpa_gbs = kv_bytes / (sdpa_ms * 1e-3) / 1e9
    row = {"block_size": block_size, "batch": batch, "context": ctx, "path": path,
           "reps": reps, "kv_sets": num_sets, "kv_mb": kv_bytes / 1e6,
           "paged_us": paged_ms * 1e3, "paged_gbs": gbs, "copy_gbs": copy_gbs,
           "ratio_to_copy": gbs / copy_gbs, "sdpa_us": sdpa_ms * 1e3,
           "sdpa_gbs": sdpa_gbs, "speed_vs_sdpa": sdpa_ms / paged_ms,
           "graph_us": graph_ms * 1e3 if graph_ms else None,
           "graph_ratio_to_copy": (kv_bytes / (graph_ms * 1e-3) / 1e9 / copy_gbs
                                   if graph_ms else None)}
    log(f"bs={block_size} B={batch:3d} ctx={ctx:6d} {path:10s} {paged_ms * 1e3:9.1f} us "
        f"{gbs:7.0f} GB/s ({gbs / copy_gbs:.2f} of copy) | SDPA {sdpa_ms * 1e3:9.1f} us"
        + (f" | graph {graph_ms * 1e3:.1f} us" if graph_ms else ""))
    return row


def bench_host_path(torch: Any) -> dict[str, float]:
    """Python cost per call of the three ways to launch decode (B=64, context 512, fp16)."""
    import kernels
    from kernels.cuda.graph import DecodeGraphs
    from kernels.cuda.plan import DecodePlan

    gen = torch.Generator(device="cuda").manual_seed(1)
    inp = paged_inputs(torch, gen, [512] * 64, 16, torch.float16)
    q = torch.randn((64, NUM_HEADS, HEAD_DIM), device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    width = int(inp["block_tables"].shape[1])
    plan = DecodePlan(inp["key_cache"], NUM_HEADS, 64, width)
    graphs = DecodeGraphs([inp["key_cache"]], [inp["value_cache"]], NUM_HEADS, width, 0.1,
                          buckets=(64,))
    graphs.prepare(inp["block_tables"], inp["seq_lens"])
    graphs.capture()
    costs = {
        "public API (validation + dispatch)": host_us(torch, lambda: kernels.paged_attention_decode(
            q, scale=0.1, out=out, backend="cuda", **inp)),
        "DecodePlan.launch": host_us(torch, lambda: plan.launch(
            q, inp["key_cache"], inp["value_cache"], inp["block_tables"], inp["seq_lens"], 0.1,
            out)),
        "DecodeGraphs.run (copy q + replay)": host_us(torch, lambda: graphs.run(0, q)),
    }
    for name, us in costs.items():
        log(f"host path {name}: {us:.1f} us per call")
    return costs


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------


def write_report(out_dir: Path, device: str, checks: list[dict[str, Any]],
                 copy_gbs: float | None, rows: list[dict[str, Any]], wall_s: float,
                 host: dict[str, float] | None = None,
                 node_graphs: dict[str, float] | None = None,
                 prefill: list[dict[str, Any]] | None = None) -> None:
    from gpu_check_prefill import prefill_lines

    out_dir.mkdir(parents=True, exist_ok=True)
    # Strict JSON: a non-finite error (NaN output / mismatch) is written as null.
    json_checks = [{**c, "error": c["error"] if math.isfinite(c["error"]) else None}
                   for c in checks]
    payload = {"device": device, "wall_s": wall_s, "checks": json_checks, "copy_gbs": copy_gbs,
               "decode": rows, "host_path_us": host or {}, "node_graphs": node_graphs or {},
               "prefill": prefill or []}
    (out_dir / "gpu_check.json").write_text(json.dumps(payload, indent=2))
    lines = [f"# GPU check — {device}", "", f"wall time {wall_s:.0f} s", ""]
    if checks:
        lines += ["## Correctness (vs float64 reference)", "", "| check | error | tolerance | ok |",
                  "|---|---|---|---|"]
        lines += [f"| {c['check']} | {c['error']:.2e} | {c['tolerance']:.0e} | "
                  f"{'yes' if c['ok'] else '**NO**'} |" for c in checks]
        lines.append("")
    if rows:
        title = (f"## Decode attention, fp16, {NUM_HEADS} q / {NUM_KV_HEADS} KV heads, "
                 f"head dim {HEAD_DIM}")
        header = ("| block | B | context | path | paged µs | K/V GB/s | ÷ copy BW | SDPA µs | "
                  "SDPA GB/s | paged speed ÷ SDPA | graph µs | graph ÷ copy BW |")
        lines += [title, "", f"Device copy bandwidth (4 GiB D2D, read+write): {copy_gbs:.0f} GB/s",
                  "", header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['block_size']} | {r['batch']} | {r['context']} | {r['path']} | "
                  f"{r['paged_us']:.1f} | {r['paged_gbs']:.0f} | {r['ratio_to_copy']:.2f} | "
                  f"{r['sdpa_us']:.1f} | {r['sdpa_gbs']:.0f} | {r['speed_vs_sdpa']:.2f} | "
                  f"{_opt(r.get('graph_us'), '.1f')} | {_opt(r.get('graph_ratio_to_copy'), '.2f')} |"
                  for r in rows]
        lines.append("")
    lines += prefill_lines(prefill or [])
    if host:
        lines += ["## Host path (Python µs per call, B=64, context 512)", "",
                  "| path | µs |", "|---|---|"]
        lines += [f"| {name} | {us:.1f} |" for name, us in host.items()]
        lines.append("")
    if node_graphs:
        lines += ["## Compute node decode step, CUDA graphs on vs off (ms; speedup = off ÷ on)", "",
                  "| measure | value |", "|---|---|"]
        lines += [f"| {name} | {value:.3f} |" for name, value in node_graphs.items()]
    (out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def host_path_cpu(calls: int = 2000) -> dict[str, float]:
    """Our Python per decode call, without a GPU: the simulator's arrays stand in for device
    tensors and the kernel launch (and graph replay) is a no-op, so what is timed is
    validation, dispatch, variant lookup, address and launch-configuration handling. Host
    tables are range-checked by the public API (device ones would not be), and addresses of
    simulator arrays cost more than `data_ptr()`: an upper bound of the GPU's Python cost."""
    import os

    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before numba is first imported
    import torch

    import kernels
    from kernels.cuda import _runtime, graph, plan

    def stub(kernel: Any, grid: Any, threads: int, stream: Any) -> Any:
        return lambda *args: None

    for module in (_runtime, plan, graph):
        for name in ("launcher",):
            if hasattr(module, name):
                setattr(module, name, stub)
    from kernels.cuda import decode

    decode.launcher = stub
    gen = torch.Generator().manual_seed(0)
    batch, ctx, block = 64, 512, 16
    kc = torch.randn((batch * ctx // block, NUM_KV_HEADS, block, HEAD_DIM), generator=gen).half()
    vc = torch.randn_like(kc)
    tables = torch.randperm(kc.shape[0], generator=gen).to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn((batch, NUM_HEADS, HEAD_DIM), generator=gen).half()
    out = torch.empty_like(q)
    the_plan = plan.DecodePlan(kc, NUM_HEADS, batch, tables.shape[1], num_parts=1)
    graphs = graph.DecodeGraphs([kc], [vc], NUM_HEADS, tables.shape[1], 0.1, buckets=(batch,))
    graphs.prepare(tables, lens)
    graphs._graph(0, batch)._launch = lambda: None  # the replay itself
    paths = {
        "public API (validation + dispatch)": lambda: kernels.paged_attention_decode(
            q, kc, vc, tables, lens, 0.1, out=out, backend="cuda"),
        "DecodePlan.launch": lambda: the_plan.launch(q, kc, vc, tables, lens, 0.1, out),
        # q already in the bucket's buffer: a host-side copy of 512 KB would dominate here,
        # while on a GPU it is one asynchronous launch
        "DecodeGraphs.run (replay)": lambda: graphs.run(0, graphs.query_buffer()),
    }
    costs = {}
    for name, fn in paths.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        costs[name] = (time.perf_counter() - t0) / calls * 1e6
        print(f"{name}: {costs[name]:.1f} us per call (launch stubbed)", flush=True)
    return costs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    block_sizes = [int(b) for b in args.block_sizes.split(",") if b]
    if args.host_path_cpu:
        host_path_cpu()
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible (torch.cuda.is_available() is False); "
              "nothing was checked", file=sys.stderr)
        return EXIT_NO_GPU
    from numba import cuda

    if not cuda.is_available():
        print("gpu_check: no CUDA GPU visible to Numba (numba.cuda.is_available() is False); "
              "nothing was checked", file=sys.stderr)
        return EXIT_NO_GPU
    t0 = time.time()
    device = torch.cuda.get_device_name(0)
    log(f"device {device}, torch {torch.__version__}, results → {args.out}")
    checks, node_graphs = ([], {}) if args.skip_correctness else check_correctness(torch)
    copy_gbs, rows, host, prefill = None, [], None, []
    if not args.skip_bench:
        from gpu_check_prefill import bench_prefill

        copy_gbs = copy_bandwidth(torch)
        log(f"device copy bandwidth {copy_gbs:.0f} GB/s")
        for bs in block_sizes:
            rows += bench_decode(torch, bs, args.max_reps, copy_gbs)
        host = bench_host_path(torch)
        prefill = bench_prefill(torch, time_events, args.max_reps, log)
    write_report(args.out, device, checks, copy_gbs, rows, time.time() - t0, host, node_graphs,
                 prefill)
    failed = [c["check"] for c in checks if not c["ok"]]
    log(f"done in {time.time() - t0:.0f} s; {len(failed)} correctness failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
