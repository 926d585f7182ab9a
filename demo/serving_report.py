"""The services-mode demo report: a rich table on the console and an SVG of memory over time."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from demo.serving import ServingReport
from demo.svg_chart import Chart, Marker, Series, write


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def memory_summary(r: ServingReport) -> dict[str, float]:
    """Peak/mean blocks in use (block manager's view) vs contiguous preallocation."""
    sampled = [s for s in r.steps if s.used_blocks is not None]
    if not sampled:
        return {}
    paged = [s.used_blocks or 0 for s in sampled]
    contiguous = [s.contiguous_blocks for s in sampled]
    live = [s for s in sampled if s.live_seqs and s.used_blocks]
    bs = r.block_size
    # Slots per live sequence under each scheme; equal memory admits inversely many.
    paged_per_seq = sum((s.used_blocks or 0) * bs for s in live) / max(1, sum(s.live_seqs for s in live))
    contig_per_seq = sum(s.contiguous_blocks * bs for s in live) / max(1, sum(s.live_seqs for s in live))
    waste = sum(s.waste_slots or 0 for s in sampled)
    allocated = sum((s.used_blocks or 0) * bs for s in sampled)
    return {
        "peak_paged": max(paged),
        "mean_paged": sum(paged) / len(paged),
        "peak_contiguous": max(contiguous),
        "mean_contiguous": sum(contiguous) / len(contiguous),
        "concurrency_gain": contig_per_seq / paged_per_seq if paged_per_seq else 0.0,
        # the block manager's own accounting: empty slots of partial last blocks over
        # allocated slots (shared blocks count once), summed over the sampled steps
        "waste_ratio": waste / allocated if allocated else 0.0,
    }


def render(r: ServingReport, console: Console, *, title: str) -> None:
    console.print(f"[bold]{title}[/bold]")
    mem = memory_summary(r)
    sampled = [s for s in r.steps if s.used_blocks is not None]
    t = Table(title="KV memory: paged (block manager's view) vs per-sequence max-length preallocation")
    t.add_column("metric")
    t.add_column("paged", justify="right")
    t.add_column("contiguous", justify="right")
    if mem:
        t.add_row("peak KV blocks", f"{mem['peak_paged']:.0f}", f"{mem['peak_contiguous']:.0f}")
        t.add_row("mean KV blocks", f"{mem['mean_paged']:.0f}", f"{mem['mean_contiguous']:.0f}")
        t.add_row("max concurrency at equal memory", f"{mem['concurrency_gain']:.2f}x", "1.00x")
        t.add_row(
            "waste (allocated slots - tokens) / allocated",
            _pct(mem["waste_ratio"]),
            _pct(
                1
                - sum(s.live_tokens for s in sampled) / max(1, sum(s.contiguous_blocks for s in sampled) * r.block_size)
            ),
        )
    console.print(t)

    pools = r.final_status.get("pools", []) if isinstance(r.final_status, dict) else []
    hits = sum(int(p.get("prefix_hit_tokens", 0)) for p in pools)
    queries = sum(int(p.get("prefix_query_tokens", 0)) for p in pools)
    cow = sum(int(p.get("cow_copies", 0)) for p in pools)
    s = Table(title="Sharing, defragmentation, protocol cost, correctness")
    s.add_column("metric")
    s.add_column("value", justify="right")
    s.add_row(
        "requests / rejected / preempted / skipped", f"{r.num_requests} / {r.rejected} / {r.preempted} / {r.skipped}"
    )
    s.add_row("prefix cache hit tokens / queried", f"{hits} / {queries} ({_pct(hits / queries if queries else 0)})")
    s.add_row("forked children / blocks shared at fork", f"{r.forks} / {r.fork_shared_blocks}")
    s.add_row("CoW copies / blocks saved vs copying at fork", f"{cow} / {r.fork_shared_blocks - cow}")
    if r.swapped_out or r.swap_refused:
        moved = sum(int(p.get("swapped_out_blocks", 0)) for p in pools), sum(
            int(p.get("swapped_in_blocks", 0)) for p in pools)
        s.add_row("swapped out / in (sequences; blocks) / refused",
                  f"{r.swapped_out} / {r.swapped_in} ({moved[0]} / {moved[1]}) / {r.swap_refused}")
    if r.defrag:
        before = r.defrag.get("high_water_before", {})
        after = r.defrag.get("high_water_after", {})
        s.add_row("defrag (admin, step %s): moves" % r.defrag.get("step"), f"{r.defrag.get('moves', 'pending')}")
        s.add_row(
            "high-water mark before -> after",
            ", ".join(f"{k}: {before[k]} -> {after.get(k, '?')}" for k in sorted(before)),
        )
    gen = max(1, r.generated_tokens)
    s.add_row("generated tokens / deferred (no RPC) appends", f"{r.generated_tokens} / {r.deferred_tokens}")
    s.add_row("block manager data-plane RPCs per generated token", f"{r.data_plane_rpcs / gen:.3f}")
    s.add_row("  + Route RPCs per generated token", f"{r.route_rpcs / gen:.3f}")
    s.add_row("Forward RPCs per step", f"{r.forward_rpcs / max(1, len(r.steps)):.2f}")
    s.add_row("step latency p50 / p99", f"{r.step_latency_ms(50):.1f} ms / {r.step_latency_ms(99):.1f} ms")
    verdict = "[green]OK[/green]" if r.check_failures == 0 and r.checks else "[red]FAILED[/red]"
    s.add_row(f"correctness vs float64 reference ({r.check_policy})",
              f"{verdict} {r.checks - r.check_failures}/{r.checks} sequence outputs, "
              f"max rel err {r.max_rel_error:.1e}")
    console.print(s)


def plot(r: ServingReport, path: Path) -> Path:
    """Blocks in use over time against the contiguous baseline, as an SVG."""
    kept = [s for s in r.steps if s.used_blocks is not None]
    steps = [s.step for s in kept]
    chart = Chart(
        title="KV memory in use: paged vs contiguous", x_label="scheduler step",
        y_label=f"KV blocks ({r.block_size} tokens each)",
        series=[Series("contiguous preallocation (prompt + max output)", steps,
                       [s.contiguous_blocks for s in kept], color="#d62728"),
                Series("pagedkv: blocks in use (block manager)", steps, [s.used_blocks for s in kept],
                       color="#1f77b4")],
    )
    if r.num_pool_blocks:
        chart.markers.append(Marker("pool capacity (all nodes)", r.num_pool_blocks))
    if r.defrag:
        chart.markers.append(Marker("admin defrag", int(r.defrag["step"]), vertical=True, color="#2ca02c"))
    return write(chart, path)
