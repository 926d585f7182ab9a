"""Decode cells of the GPU check (review §4.3 items 2-9): the grid, the A/Bs, a million tokens.

Every cell builds its own pool (fp16 unless stated, 32 query / 8 KV heads x 128, block 16),
shuffled block tables unless stated, and rotates over disjoint copies of the K/V totalling
>= 4x L2 so every repetition reads from HBM. Times come from `gpu_timing.time_call`
(kernel-only, back-to-back and host µs per call, per launch path):

- `direct`: the public API (`kernels.paged_attention_decode`, the dispatch rule picks the path);
- `plan`: `DecodePlan.launch` with a forced or the default partition count (what a graph
  replays, without the graph);
- `graph`: `DecodeGraphs.run` (copy q + replay), the path the compute node serves decode with;
- `sdpa`: torch SDPA over the same K/V stored contiguously (GQA as G query rows per KV head).

GB/s counts the K/V bytes the sequences hold (read once); `of_copy` divides by the device's
copy bandwidth measured in the same run.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from gpu_sizes import Sizes, decode_grid, ragged_lengths
from gpu_timing import Timer, gbs, reps_for, time_call

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def kv_bytes(lens: list[int], kv_heads: int, head_dim: int, dtype: str) -> int:
    """K + V bytes of `lens` tokens (what one decode step must read)."""
    return sum(lens) * kv_heads * head_dim * 2 * DTYPE_BYTES[dtype]


def num_sets(kv: int, l2_bytes: int, factor: int, cap: int = 32) -> int:
    """Disjoint K/V copies to rotate over so consecutive repetitions never hit in L2."""
    return max(1, min(cap, math.ceil(factor * l2_bytes / max(kv, 1))))


def table_rows(lens: list[int], block_size: int, sets: int, order: list[int]) -> list[list[list[int]]]:
    """Block tables [sets][seq][width]: each sequence's blocks are consecutive entries of
    `order` (a permutation of the pool's block ids: shuffled, or identity for a contiguous
    layout); rows are padded with block 0 past their length (never read)."""
    per_seq = [-(-n // block_size) for n in lens]
    width = max(per_seq)
    if len(order) < sets * sum(per_seq):
        raise ValueError("order holds fewer blocks than the tables need")
    tables, cursor = [], 0
    for _ in range(sets):
        rows = []
        for n in per_seq:
            rows.append(order[cursor:cursor + n] + [0] * (width - n))
            cursor += n
        tables.append(rows)
    return tables


@dataclass(slots=True)
class Pool:
    """One cell's paged K/V, tables per rotation set, queries and output (on the device)."""

    kc: Any
    vc: Any
    tables: Any  # [sets, batch, width] int32
    lens: Any  # [batch] int32
    q: Any
    out: Any
    lens_list: list[int]
    dtype: str
    heads: int
    head_dim: int
    kv_heads: int

    @property
    def sets(self) -> int:
        return int(self.tables.shape[0])

    @property
    def width(self) -> int:
        return int(self.tables.shape[2])

    @property
    def batch(self) -> int:
        return len(self.lens_list)

    def bytes(self) -> int:
        return kv_bytes(self.lens_list, self.kv_heads, self.head_dim, self.dtype)


class DecodeBench:
    """Builds pools and times launch paths on one device (module doc)."""

    def __init__(self, torch: Any, timer: Timer, device: str, sizes: Sizes, copy_gbs: float) -> None:
        self.torch, self.timer, self.device, self.sizes = torch, timer, device, sizes
        self.copy_gbs = copy_gbs
        props = torch.cuda.get_device_properties(0) if device == "cuda" else None
        self.l2_bytes = int(getattr(props, "L2_cache_size", 64 << 20)) if props else 1 << 20

    def pool(self, lens: list[int], *, dtype: str = "float16", head_dim: int | None = None,
             block_size: int | None = None, layout: str = "shuffled", sets: int | None = None) -> Pool:
        torch, s = self.torch, self.sizes
        head_dim = head_dim or s.head_dim
        block_size = block_size or s.block_size
        kv = kv_bytes(lens, s.kv_heads, head_dim, dtype)
        sets = sets or num_sets(kv, self.l2_bytes, s.l2_sets_factor)
        blocks = sets * sum(-(-n // block_size) for n in lens)
        tdtype = getattr(torch, dtype)
        shape = (blocks, s.kv_heads, block_size, head_dim)
        kc = torch.randn(shape, device=self.device, dtype=tdtype)
        vc = torch.randn(shape, device=self.device, dtype=tdtype)
        order = (torch.randperm(blocks) if layout == "shuffled" else torch.arange(blocks)).tolist()
        tables = torch.tensor(table_rows(lens, block_size, sets, order), dtype=torch.int32,
                              device=self.device)
        q = torch.randn((len(lens), s.heads, head_dim), device=self.device, dtype=tdtype)
        return Pool(kc, vc, tables, torch.tensor(lens, dtype=torch.int32, device=self.device),
                    q, torch.empty_like(q), list(lens), dtype, s.heads, head_dim, s.kv_heads)

    def reps(self, p: Pool) -> int:
        est_us = p.bytes() / (self.copy_gbs * 1e3)
        return reps_for(est_us, hi=self.sizes.max_reps, lo=min(5, self.sizes.max_reps))

    def row(self, p: Pool, name: str, times: Any) -> dict[str, Any]:
        nbytes = p.bytes()
        best = min(times.kernel_us, times.back_to_back_us)
        return {**times.as_row(f"{name}_"), f"{name}_gbs": gbs(nbytes, best),
                f"{name}_of_copy": (gbs(nbytes, best) or 0.0) / self.copy_gbs}

    def time_direct(self, p: Pool) -> dict[str, Any]:
        import kernels

        scale = 1.0 / math.sqrt(p.head_dim)
        times = time_call(self.timer, lambda i: kernels.paged_attention_decode(
            p.q, p.kc, p.vc, p.tables[i % p.sets], p.lens, scale, out=p.out, backend="cuda"),
            self.reps(p))
        return self.row(p, "direct", times)

    def time_plan(self, p: Pool, num_parts: int | None = None, name: str = "plan",
                  schedule: bool = False) -> dict[str, Any]:
        """`DecodePlan.launch`: `num_parts` forced, or the policy's design point; `schedule`:
        the policy applied to this batch's host lengths (a ragged batch), where plans can."""
        from kernels.cuda.plan import DecodePlan

        scale = 1.0 / math.sqrt(p.head_dim)
        plan = DecodePlan(p.kc, p.heads, p.batch, p.width, num_parts=num_parts)
        row: dict[str, Any] = {f"{name}_parts": plan.num_parts}
        if schedule and hasattr(plan, "schedule"):
            row[f"{name}_split"] = plan.schedule(p.lens_list)
            parts = getattr(plan, "parts", None)
            if parts is not None:
                row[f"{name}_parts_min_max"] = f"{int(min(parts))}-{int(max(parts))}"
        times = time_call(self.timer, lambda i: plan.launch(
            p.q, p.kc, p.vc, p.tables[i % p.sets], p.lens, scale, p.out), self.reps(p))
        return {**row, **self.row(p, name, times)}

    def time_graph(self, p: Pool) -> dict[str, Any]:
        from kernels.cuda.graph import DecodeGraphs

        scale = 1.0 / math.sqrt(p.head_dim)
        graphs = []
        for i in range(p.sets):  # one per rotation set: replays read from HBM too
            g = DecodeGraphs([p.kc], [p.vc], p.heads, p.width, scale, buckets=(p.batch,))
            try:  # the host lengths let the policy partition a ragged batch, where it can
                g.prepare(p.tables[i], p.lens, host_seq_lens=p.lens_list)
            except TypeError:
                g.prepare(p.tables[i], p.lens)
            g.capture()
            graphs.append(g)
        times = time_call(self.timer, lambda i: graphs[i % len(graphs)].run(0, p.q), self.reps(p))
        plan = graphs[0]._bucket(p.batch).plan
        row: dict[str, Any] = {"graph_parts": plan.num_parts}
        step_parts = getattr(plan, "parts", None)  # this step's partitions (ragged policy)
        if step_parts is not None:
            row["graph_parts_min_max"] = f"{int(min(step_parts))}-{int(max(step_parts))}"
        if hasattr(plan, "split"):
            row["graph_split"] = bool(plan.split)
        graphs.clear()
        return {**row, **self.row(p, "graph", times)}

    def time_sdpa(self, batch: int, ctx: int, sets: int, dtype: str = "float16",
                  head_dim: int | None = None) -> dict[str, Any]:
        """SDPA over contiguous [sets][B, kv_heads, ctx, d] K/V (call after freeing the pool)."""
        import torch.nn.functional as F

        torch, s = self.torch, self.sizes
        head_dim = head_dim or s.head_dim
        tdtype = getattr(torch, dtype)
        k = torch.randn((sets, batch, s.kv_heads, ctx, head_dim), device=self.device, dtype=tdtype)
        v = torch.randn_like(k)
        q4 = torch.randn((batch, s.kv_heads, s.heads // s.kv_heads, head_dim), device=self.device,
                         dtype=tdtype)
        scale = 1.0 / math.sqrt(head_dim)
        nbytes = kv_bytes([ctx] * batch, s.kv_heads, head_dim, dtype)
        times = time_call(self.timer, lambda i: F.scaled_dot_product_attention(
            q4, k[i % sets], v[i % sets], scale=scale),
            reps_for(nbytes / (self.copy_gbs * 1e3), hi=s.max_reps, lo=min(5, s.max_reps)))
        best = min(times.kernel_us, times.back_to_back_us)
        return {**times.as_row("sdpa_"), "sdpa_gbs": gbs(nbytes, best),
                "sdpa_of_copy": (gbs(nbytes, best) or 0.0) / self.copy_gbs}

    def free(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------
# Phases
# ------------------------------------------------------------------------------------------


def attempt(row: dict[str, Any], name: str, fn: Any) -> None:
    """Add `fn()`'s columns to `row`, or `{name}_error` when it raises: one path failing (a
    graph capture, SDPA out of memory) keeps the cell's other paths."""
    try:
        row.update(fn())
    except Exception as exc:  # noqa: BLE001 - recorded in the row; the next path still runs
        row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]


def phase_grid(ctx: Any, bench: DecodeBench) -> None:
    """Item 2: B x context, direct / graph / SDPA."""
    for batch, context in decode_grid(bench.sizes):
        def cell(batch: int = batch, context: int = context) -> dict[str, Any]:
            p = bench.pool([context] * batch)
            row: dict[str, Any] = {"batch": batch, "context": context, "kv_mb": p.bytes() / 1e6,
                                   "sets": p.sets}
            attempt(row, "direct", functools.partial(bench.time_direct, p))
            attempt(row, "graph", functools.partial(bench.time_graph, p))
            sets = p.sets
            del p
            bench.free()
            attempt(row, "sdpa", lambda: bench.time_sdpa(batch, context, sets))
            if "sdpa_kernel_us" in row and "graph_kernel_us" in row:
                row["graph_speed_vs_sdpa"] = row["sdpa_kernel_us"] / row["graph_kernel_us"]
            bench.free()
            return row

        ctx.cell(f"B={batch} ctx={context}", cell)


def phase_ab(ctx: Any, bench: DecodeBench) -> None:
    """Items 3-8: split counts, shortest split, paging, block size, dtypes/head dims, ragged."""
    s = bench.sizes
    for batch, context in s.split_cells + s.min_split_cells:
        def split_cell(batch: int = batch, context: int = context) -> list[dict[str, Any]]:
            p = bench.pool([context] * batch)
            rows = [{"ab": "split", "batch": batch, "context": context, **bench.time_plan(p)}]
            policy = rows[0]["plan_parts"]
            for parts in sorted(set(s.split_parts) - {policy}):
                if parts <= 64:
                    rows.append({"ab": "split", "batch": batch, "context": context,
                                 **bench.time_plan(p, parts)})
            best = min(r["plan_kernel_us"] for r in rows)
            for r in rows:
                r["vs_best"] = r["plan_kernel_us"] / best
            return rows

        ctx.cell(f"split B={batch} ctx={context}", split_cell)
        bench.free()
    batch, context = s.long_cell
    for layout in ("identity", "shuffled"):
        ctx.cell(f"paging {layout} B={batch} ctx={context}", lambda layout=layout: {
            "ab": "paging", "layout": layout, "batch": batch, "context": context,
            **bench.time_plan(bench.pool([context] * batch, layout=layout, sets=1))})
        bench.free()
    for block_batch, block_ctx in s.block_cells:
        for block_size in s.block_sizes:
            ctx.cell(f"block {block_size} B={block_batch} ctx={block_ctx}",
                     lambda bs=block_size, b=block_batch, c=block_ctx: {
                         "ab": "block size", "block_size": bs, "batch": b, "context": c,
                         **bench.time_plan(bench.pool([c] * b, block_size=bs))})
            bench.free()
    for dtype, head_dim in (("float16", 128), ("bfloat16", 128), ("float16", 64), ("bfloat16", 64)):
        ctx.cell(f"{dtype} d{head_dim} B={batch} ctx={context}",
                 lambda dtype=dtype, head_dim=head_dim: {
                     "ab": "dtype/head dim", "dtype": dtype, "head_dim": head_dim, "batch": batch,
                     "context": context,
                     **bench.time_plan(bench.pool([context] * batch, dtype=dtype,
                                                  head_dim=head_dim))})
        bench.free()

    def ragged() -> dict[str, Any]:
        lens = ragged_lengths(s)
        p = bench.pool(lens)
        row = {"ab": "ragged", "batch": len(lens), "context": max(lens),
               "mean_context": sum(lens) / len(lens), "kv_mb": p.bytes() / 1e6}
        attempt(row, "direct", lambda: bench.time_direct(p))
        attempt(row, "plan", lambda: bench.time_plan(p, schedule=True))
        attempt(row, "graph", lambda: bench.time_graph(p))
        return row

    ctx.cell("ragged", ragged)
    bench.free()


def reference_rows(torch: Any, q: Any, k: Any, v: Any, scale: float) -> Any:
    """Float64 attention of query rows q [rows, d] over k, v [tokens, d] (no mask), on q's device."""
    scores = (q.double() @ k.double().T) * scale
    return torch.softmax(scores, dim=-1) @ v.double()


def gather_head(p: Pool, seq: int, kv_head: int, block_size: int, tokens: int) -> tuple[Any, Any]:
    """One sequence's K and V rows [tokens, d] of one KV head, in order, from the pool."""
    blocks = p.tables[0, seq, :-(-tokens // block_size)].long()
    k = p.kc[blocks, kv_head].reshape(-1, p.head_dim)[:tokens]
    v = p.vc[blocks, kv_head].reshape(-1, p.head_dim)[:tokens]
    return k, v


def phase_million(ctx: Any, bench: DecodeBench) -> None:
    """Item 9: one sequence of a million tokens: decode (sampled rows vs float64) and a prefill
    chunk after the million-token prefix."""
    import kernels

    torch, s = bench.torch, bench.sizes
    n, chunk = s.million, s.million_chunk
    group = s.heads // s.kv_heads
    scale = 1.0 / math.sqrt(s.head_dim)
    holder: dict[str, Pool] = {}

    def decode() -> dict[str, Any]:
        p = holder["p"] = bench.pool([n + chunk], sets=1)
        lens = torch.tensor([n], dtype=torch.int32, device=bench.device)
        out = kernels.paged_attention_decode(p.q, p.kc, p.vc, p.tables[0], lens, scale,
                                             backend="cuda")
        k, v = gather_head(p, 0, 0, s.block_size, n)
        ref = reference_rows(torch, p.q[0, :group], k, v, scale)
        err = float(((out[0, :group].double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
        times = time_call(bench.timer, lambda i: kernels.paged_attention_decode(
            p.q, p.kc, p.vc, p.tables[0], lens, scale, out=p.out, backend="cuda"), 5)
        nbytes = kv_bytes([n], s.kv_heads, s.head_dim, "float16")
        best = min(times.kernel_us, times.back_to_back_us)
        return {"what": "decode", "tokens": n, "error_vs_float64": err, "ok": err <= 2e-3,
                **times.as_row("direct_"), "gbs": gbs(nbytes, best),
                "of_copy": (gbs(nbytes, best) or 0.0) / bench.copy_gbs}

    def prefill() -> dict[str, Any]:
        p = holder["p"]
        q = torch.randn((chunk, s.heads, s.head_dim), device=bench.device, dtype=torch.float16)
        out = torch.empty_like(q)
        lens = torch.tensor([n + chunk], dtype=torch.int32, device=bench.device)
        starts = torch.tensor([0, chunk], dtype=torch.int32, device=bench.device)

        def call(_: int) -> Any:
            return kernels.paged_prefill_attention(q, p.kc, p.vc, p.tables[0], lens, starts, scale,
                                                   out=out, backend="cuda", max_query_len=chunk)

        call(0)
        k, v = gather_head(p, 0, 0, s.block_size, n + chunk)
        last = chunk - 1  # the chunk's last token sees the whole prefix and the chunk
        ref = reference_rows(torch, q[last, :group], k, v, scale)
        err = float(((out[last, :group].double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
        times = time_call(bench.timer, call, 3, warmup=1, b2b_calls=3)
        from gpu_check_prefill import causal_flops

        flops = causal_flops(chunk, s.heads, s.head_dim, prefix=n)
        return {"what": f"prefill chunk {chunk} after {n}", "tokens": n + chunk,
                "error_vs_float64": err, "ok": err <= 2e-3, **times.as_row("prefill_"),
                "tflops": flops / (times.kernel_us * 1e-6) / 1e12}

    try:
        ctx.cell("1M decode", decode)
        if "p" in holder:
            ctx.cell("1M prefill chunk", prefill)
    finally:
        holder.clear()
        bench.free()
