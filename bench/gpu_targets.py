"""Issue 43's performance targets, judged from the GPU check's rows (the summary's first table).

Each target names the cells it reads; a target whose cells did not run (phase skipped, cell
failed) says "not measured" rather than passing. Pure: tests/kernels/test_cuda_gpu_check.py
feeds it rows by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

Rows = dict[str, list[dict[str, Any]]]  # phase name -> its rows

KV_BIG_MB = 256.0  # "every cell whose K/V is >= 256 MB"


def _rows(rows: Rows, phase: str, **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows.get(phase, []) if all(r.get(k) == v for k, v in match.items())]


def _value(rows: Iterable[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]


def _target(name: str, goal: str, values: list[float], ok: Callable[[float], bool],
            fmt: str = ".2f") -> dict[str, Any]:
    if not values:
        return {"target": name, "goal": goal, "measured": "not measured", "met": None}
    shown = ", ".join(format(v, fmt) for v in values)
    return {"target": name, "goal": goal, "measured": shown, "met": all(ok(v) for v in values)}


def judge(rows: Rows) -> list[dict[str, Any]]:
    """One row per target: what was measured and whether it is met (None: not measured)."""
    out = []
    checks = [r for phase in ("correctness", "million") for r in rows.get(phase, []) if "ok" in r]
    out.append({"target": "correctness: every check within tolerance, repeats bitwise equal",
                "goal": "all", "measured": f"{sum(bool(r['ok']) for r in checks)}/{len(checks)}"
                if checks else "not measured",
                "met": all(bool(r["ok"]) for r in checks) if checks else None})
    for dtype in ("float16", "bfloat16"):
        prompt = [r for r in rows.get("prefill", []) if r.get("prefix") == 0 and r.get("dtype") == dtype
                  and r.get("head_dim") == 128]
        out.append(_target(f"prefill 8k {dtype} d128: paged time / SDPA flash", "<= 1.0",
                           _value(prompt, "paged_vs_sdpa"), lambda v: v <= 1.0))
    chunk = _rows(rows, "prefill", prefix=32768, q_len=64, dtype="float16")
    out.append(_target("prefill chunk 64 after 32k: speed / SDPA's", ">= 0.7",
                       [1 / v for v in _value(chunk, "paged_vs_sdpa") if v], lambda v: v >= 0.7))
    big = [r for r in rows.get("decode", []) if float(r.get("kv_mb") or 0) >= KV_BIG_MB]
    out.append(_target("decode graph path / copy bandwidth, cells with K/V >= 256 MB", ">= 0.9",
                       _value(big, "graph_of_copy"), lambda v: v >= 0.9))
    long = _rows(rows, "decode", batch=64, context=32768)
    out.append(_target("decode B=64 x 32768 graph: speed / SDPA's", ">= 1.0",
                       _value(long, "graph_speed_vs_sdpa"), lambda v: v >= 1.0))
    ragged = _rows(rows, "decode_ab", ab="ragged")
    out.append(_target("decode ragged batch, graph path / copy bandwidth", ">= 0.8",
                       _value(ragged, "graph_of_copy"), lambda v: v >= 0.8))
    for phase in ("engine_1b", "engine_8b"):
        theirs = [r for r in rows.get(phase, []) if "ours_vs_hf_throughput" in r]
        out.append(_target(f"{phase}: throughput / transformers'", ">= 3",
                           _value(theirs, "ours_vs_hf_throughput"), lambda v: v >= 3.0))
        b1 = [r for r in rows.get(phase, []) if str(r.get("what", "")).startswith("batch-1 step")]
        out.append(_target(f"{phase}: batch-1 decode step / weights floor", "<= 1.3",
                           _value(b1, "vs_floor"), lambda v: v <= 1.3))
        b64 = [r for r in rows.get(phase, []) if "engine_share" in r]
        out.append(_target(f"{phase}: batch-64 decode step / weights + K/V floor", "<= 1.5",
                           _value(b64, "vs_floor"), lambda v: v <= 1.5))
        out.append(_target(f"{phase}: host (engine) share of a decode step", "<= 0.10",
                           _value(b64, "engine_share"), lambda v: v <= 0.10))
    return out


def lines(targets: list[dict[str, Any]]) -> list[str]:
    """The markdown table of `judge`'s rows."""
    verdict = {True: "met", False: "**not met**", None: "-"}
    return (["## Issue 43 targets", "", "| target | goal | measured | verdict |", "|---|---|---|---|"]
            + [f"| {t['target']} | {t['goal']} | {t['measured']} | {verdict[t['met']]} |"
               for t in targets] + [""])
