"""GPU check of the Numba CUDA kernels (run through bench/gpu_check.sh RESULTS_DIR).

1. Correctness at full size: every CUDA kernel (decode one-pass and split-K, prefill,
   write_slots, copy_blocks; fp16 / fp32 / bf16; GQA, MHA, MQA) against `kernels.reference`
   on random ragged inputs with shuffled block tables. Any failure → exit status 1.
2. Decode bandwidth: B ∈ {1, 16, 64} × context ∈ {512, 4096, 32768}, 32 query / 8 KV heads,
   head dim 128, fp16, block size 16 (override with --block-sizes). CUDA events, warm-up,
   median of bounded repetitions; K/V pools larger than L2 (rotating over disjoint block sets)
   so the numbers are HBM numbers. Reports K/V GB/s, the device's copy bandwidth (large
   device-to-device copy, read + write bytes), their ratio, and torch SDPA over the same K/V
   stored contiguously.
Writes RESULTS_DIR/gpu_check.md and RESULTS_DIR/gpu_check.json. Needs only numpy, numba,
numba-cuda, torch and this repository's `kernels/` package; bounded to a few minutes on an H200.
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

EXIT_NO_GPU = 2
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
BATCHES = (1, 16, 64)
CONTEXTS = (512, 4096, 32768)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="results directory (created)")
    p.add_argument("--block-sizes", default="16", help="comma-separated, default 16")
    p.add_argument("--max-reps", type=int, default=50, help="timed repetitions per case (cap)")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------


def paged_inputs(torch: Any, gen: Any, lens: list[int], block_size: int, dtype: Any,
                 num_kv_heads: int = NUM_KV_HEADS, spare: int = 16) -> dict[str, Any]:
    """Caches (unused slots NaN), shuffled tables with garbage padding, on the GPU."""
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + spare
    shape = (num_blocks, num_kv_heads, block_size, HEAD_DIM)
    kc = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    vc = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")
    tables = torch.full((len(lens), max(used) + 1), 10**6, dtype=torch.int32)
    cursor = 0
    for s, nb in enumerate(used):
        tables[s, :nb] = perm[cursor:cursor + nb].cpu().to(torch.int32)
        cursor += nb
    # Poison the slots past each sequence's end: a kernel reading them gets NaN.
    for s, n in enumerate(lens):
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


def check_correctness(torch: Any) -> list[dict[str, Any]]:
    import numpy as np

    import kernels
    from kernels import reference
    from kernels.cuda import decode

    gen = torch.Generator(device="cuda").manual_seed(0)
    results: list[dict[str, Any]] = []

    def record(name: str, err: float, tol: float) -> None:
        ok = err <= tol
        results.append({"check": name, "error": err, "tolerance": tol, "ok": ok})
        log(f"{'ok  ' if ok else 'FAIL'} {name}: error {err:.2e} (tolerance {tol:.0e})")

    # fp16 out: per-element rounding 2^-11 → 1e-3 of the row norm; bf16 2^-8 → 8e-3;
    # fp32: float32 accumulation over <= 4K tokens with fast exp → 2e-5.
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 2e-5}
    lens = [1, 16, 17, 1000, 2999, 4096]
    for dtype, num_kv in ((torch.float16, 8), (torch.float32, 8), (torch.bfloat16, 8),
                          (torch.float16, 32), (torch.float16, 1)):
        inp = paged_inputs(torch, gen, lens, 16, dtype, num_kv_heads=num_kv)
        q = (torch.randn((len(lens), NUM_HEADS, HEAD_DIM), generator=gen, device="cuda") * 3)
        q = q.to(dtype)
        scale = 1.0 / math.sqrt(HEAD_DIM)
        ref = reference.paged_attention_decode(q, scale=scale, **inp)
        for split in (False, True):
            out = torch.full_like(q, float("nan"))
            decode.paged_attention_decode(q, out=out, scale=scale, split=split, **inp)
            record(f"decode {str(dtype)[6:]} kv_heads={num_kv} {'split' if split else 'one-pass'}",
                   rel_error(out, ref), tol[dtype])
        out = kernels.paged_attention_decode(q, scale=scale, backend="auto", **inp)
        record(f"decode {str(dtype)[6:]} kv_heads={num_kv} public API", rel_error(out, ref),
               tol[dtype])

    for dtype in (torch.float16, torch.bfloat16):
        q_lens, seq_lens = [200, 300, 1, 64], [1200, 300, 38, 64]
        inp = paged_inputs(torch, gen, seq_lens, 16, dtype)
        starts = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
        q = (torch.randn((sum(q_lens), NUM_HEADS, HEAD_DIM), generator=gen, device="cuda") * 3)
        q = q.to(dtype)
        scale = 1.0 / math.sqrt(HEAD_DIM)
        out = torch.full_like(q, float("nan"))
        kernels.paged_prefill_attention(q, query_start_loc=starts.cuda(), scale=scale, out=out,
                                        backend="cuda", **inp)
        ref = reference.paged_prefill_attention(q, query_start_loc=starts, scale=scale, **inp)
        record(f"prefill {str(dtype)[6:]}", rel_error(out, ref), tol[dtype])

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
        record(f"write_slots {str(dtype)[6:]}", 0.0 if same else math.inf, 0.0)

    num_layers, num_blocks = 4, 512
    shape = (num_blocks, NUM_KV_HEADS, 16, HEAD_DIM)
    keys = [torch.randn(shape, generator=gen, device="cuda").half() for _ in range(num_layers)]
    values = [torch.randn(shape, generator=gen, device="cuda").half() for _ in range(num_layers)]
    pairs = torch.randint(0, num_blocks, (300, 2), generator=gen, device="cuda").cpu()
    k_ref, v_ref = [k.cpu() for k in keys], [v.cpu() for v in values]
    kernels.copy_blocks(keys, values, pairs, backend="cuda")
    reference.copy_blocks(k_ref, v_ref, pairs)
    same = all(torch.equal(a.cpu(), b) for a, b in zip(keys + values, k_ref + v_ref))
    record("copy_blocks fp16 4 layers, 300 dependent pairs", 0.0 if same else math.inf, 0.0)
    return results


# ------------------------------------------------------------------------------------------
# Bandwidth
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


def copy_bandwidth(torch: Any) -> float:
    """GB/s of a 4 GiB device-to-device copy, counting bytes read + written."""
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_events(torch, lambda _: dst.copy_(src), reps=10)
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e9


def bench_decode(torch: Any, block_size: int, max_reps: int, copy_gbs: float) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    import kernels
    from kernels.cuda._runtime import num_sms
    from kernels.cuda.decode import choose_num_partitions, partition_size

    props = torch.cuda.get_device_properties(0)
    l2_bytes = int(getattr(props, "L2_cache_size", 64 << 20))
    scale = 1.0 / math.sqrt(HEAD_DIM)
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * 2  # K and V, fp16
            # Rotate over disjoint copies so successive reps never hit L2 (4x L2 in flight).
            num_sets = max(1, min(32, math.ceil(4 * l2_bytes / kv_bytes)))
            blocks_per_seq = ctx // block_size
            num_blocks = batch * blocks_per_seq * num_sets
            shape = (num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM)
            kc = torch.randn(shape, device="cuda", dtype=torch.float16)
            vc = torch.randn(shape, device="cuda", dtype=torch.float16)
            perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
            tables = perm.view(num_sets, batch, blocks_per_seq)  # shuffled, disjoint sets
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            q = torch.randn((batch, NUM_HEADS, HEAD_DIM), device="cuda", dtype=torch.float16)
            out = torch.empty_like(q)
            parts = choose_num_partitions(batch, NUM_KV_HEADS, ctx, block_size, num_sms())
            path = "one-pass" if parts == 1 else f"split x{parts} ({partition_size(block_size)} tok)"
            est_ms = max(kv_bytes / (copy_gbs * 1e9) * 1e3, 0.02)
            reps = int(min(max_reps, max(5, 2000 / est_ms / 100)))

            def run_paged(i: int) -> None:
                kernels.paged_attention_decode(q, kc, vc, tables[i % num_sets], seq_lens, scale,
                                               out=out, backend="cuda")

            paged_ms = time_events(torch, run_paged, reps)
            del kc, vc, tables, perm
            # The same K/V stored contiguously: [num_sets][batch, kv_heads, ctx, head_dim].
            k_sets = torch.randn((num_sets, batch, NUM_KV_HEADS, ctx, HEAD_DIM), device="cuda",
                                 dtype=torch.float16)
            v_sets = torch.randn_like(k_sets)
            # GQA decode as plain SDPA: the group's query heads become G query rows of one
            # KV head (no mask: all of them see the whole context), so K/V are read once.
            q4 = q.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)

            def run_sdpa(i: int) -> None:
                F.scaled_dot_product_attention(q4, k_sets[i % num_sets], v_sets[i % num_sets],
                                               scale=scale)

            sdpa_ms = time_events(torch, run_sdpa, reps)
            del k_sets, v_sets
            torch.cuda.empty_cache()
            gbs = kv_bytes / (paged_ms * 1e-3) / 1e9
            sdpa_gbs = kv_bytes / (sdpa_ms * 1e-3) / 1e9
            row = {"block_size": block_size, "batch": batch, "context": ctx, "path": path,
                   "reps": reps, "kv_sets": num_sets, "kv_mb": kv_bytes / 1e6,
                   "paged_us": paged_ms * 1e3, "paged_gbs": gbs, "copy_gbs": copy_gbs,
                   "ratio_to_copy": gbs / copy_gbs, "sdpa_us": sdpa_ms * 1e3,
                   "sdpa_gbs": sdpa_gbs, "speed_vs_sdpa": sdpa_ms / paged_ms}
            rows.append(row)
            log(f"bs={block_size} B={batch:3d} ctx={ctx:6d} {path:22s} "
                f"{paged_ms * 1e3:9.1f} us {gbs:7.0f} GB/s ({gbs / copy_gbs:.2f} of copy) | "
                f"SDPA {sdpa_ms * 1e3:9.1f} us {sdpa_gbs:7.0f} GB/s")
    return rows


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------


def write_report(out_dir: Path, device: str, checks: list[dict[str, Any]],
                 copy_gbs: float | None, rows: list[dict[str, Any]], wall_s: float) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # Strict JSON: a non-finite error (NaN output / mismatch) is written as null.
    json_checks = [{**c, "error": c["error"] if math.isfinite(c["error"]) else None}
                   for c in checks]
    payload = {"device": device, "wall_s": wall_s, "checks": json_checks, "copy_gbs": copy_gbs,
               "decode": rows}
    (out_dir / "gpu_check.json").write_text(json.dumps(payload, indent=2))
    lines = [f"# GPU check — {device}", "", f"wall time {wall_s:.0f} s", ""]
    if checks:
        lines += ["## Correctness (vs float64 reference)", "", "| check | error | tolerance | ok |",
                  "|---|---|---|---|"]
        lines += [f"| {c['check']} | {c['error']:.2e} | {c['tolerance']:.0e} | "
                  f"{'yes' if c['ok'] else '**NO**'} |" for c in checks]
        lines.append("")
    if rows:
        lines += [f"## Decode attention, fp16, {NUM_HEADS} q / {NUM_KV_HEADS} KV heads, "
                  f"head dim {HEAD_DIM}", "",
                  f"Device copy bandwidth (4 GiB D2D, read+write): {copy_gbs:.0f} GB/s", "",
                  "| block | B | context | path | paged µs | K/V GB/s | ÷ copy BW | SDPA µs | "
                  "SDPA GB/s | paged speed ÷ SDPA |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['block_size']} | {r['batch']} | {r['context']} | {r['path']} | "
                  f"{r['paged_us']:.1f} | {r['paged_gbs']:.0f} | {r['ratio_to_copy']:.2f} | "
                  f"{r['sdpa_us']:.1f} | {r['sdpa_gbs']:.0f} | {r['speed_vs_sdpa']:.2f} |"
                  for r in rows]
    (out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    block_sizes = [int(b) for b in args.block_sizes.split(",") if b]
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
    checks = [] if args.skip_correctness else check_correctness(torch)
    copy_gbs, rows = None, []
    if not args.skip_bench:
        copy_gbs = copy_bandwidth(torch)
        log(f"device copy bandwidth {copy_gbs:.0f} GB/s")
        for bs in block_sizes:
            rows += bench_decode(torch, bs, args.max_reps, copy_gbs)
    write_report(args.out, device, checks, copy_gbs, rows, time.time() - t0)
    failed = [c["check"] for c in checks if not c["ok"]]
    log(f"done in {time.time() - t0:.0f} s; {len(failed)} correctness failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
