"""Phase `step_graph` of bench/gpu_check.py: whole-step decode graphs vs the eager path (issue 43 item 3).

`compute_node/step_graph.py` captures a pure-decode step's whole forward per batch bucket; it
is opt-in (`step_graphs`) until this phase has measured it on a GPU. One `ModelRunner` over
an fp16 random Llama (8 layers, hidden 2048, 32 / 8 heads x 128 — the kernel variants phase
`jit` already compiled — intermediate 4096, vocab 8192; ~0.8 GB), 64 prompts of 16-300
tokens prefilled eagerly, then 24 decode steps whose batch shrinks 64 → 40 → 17 → 9 → 3 → 1
(sequences finish; buckets 64, 64, 32, 16, 4, 1, the last five padded; lengths ragged).

Teacher forcing: every step runs twice on the same runner and inputs, first eagerly (per-layer
decode graphs, dense layers launched one by one), then through the whole-step graph; the next
step is fed the graph run's greedy picks. A step's own K/V write precedes its attention in
both runs, so each run attends over the same context (the graph run rewrites the same slots).
Judged as the node-graph check judges graph vs direct (`gpu_check_graphs.judge_forced`): the
picked token's logprob within fp16 noise, a pick differing only at a near-tie. Timing: each
run's wall time of `execute` (host preparation, the forward, sampling; the sampled ids' copy
to the host synchronises), median per batch size without the size's first step (it captures);
and at B=64 and B=1 the host µs to enqueue the forward, eager vs replay, beside the forward's
time to the GPU's end (`_host_cost`).

`--cpu-smoke`: a 2-layer toy model on the simulator's pool with launches stubbed; numbers and
checks meaningless, the path exercised end to end.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_check_graphs import TIE_NATS, judge_forced

SIZES = (64, 40, 17, 9, 3, 1)   # active sequences, each for STEPS_PER_SIZE steps
STEPS_PER_SIZE = 4
BLOCK = 16


def _model(tmp: Path, smoke: bool) -> Path:
    from compute_node.model.tiny import build_tiny_model

    if smoke:
        return build_tiny_model(tmp / "llama", num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1,
                                head_dim=32, intermediate_size=128, vocab_size=300, dtype="float16",
                                max_position_embeddings=512)
    return build_tiny_model(tmp / "llama", num_layers=8, hidden_size=2048, num_heads=32, num_kv_heads=8,
                            head_dim=128, intermediate_size=4096, vocab_size=8192, dtype="float16",
                            max_position_embeddings=1024)


def _runner(model_dir: Path, device: str, num_blocks: int, smoke: bool) -> Any:
    import torch

    from compute_node.model import ModelRunner
    from compute_node.pool import KvPool

    runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=num_blocks, device=device, max_model_len=512,
                         cuda_graphs=True, step_graphs=True)
    if smoke:   # the simulator's pool: CUDA kernels (stubbed) on CPU tensors
        runner.pool = KvPool(runner.geometry, torch.device("cpu"), cuda_graphs=True, max_context=512,
                             backend="cuda")
    return runner


def run_forced(ctx: Any, device: str, smoke: bool) -> None:
    """The phase's cells (module doc)."""
    import random

    from compute_node.model import SamplingParams, SeqWork

    sizes = (5, 3, 1) if smoke else SIZES
    steps_per_size = 2 if smoke else STEPS_PER_SIZE
    rng = random.Random(43)
    prompts = [[rng.randrange(4, 250) for _ in range(rng.randint(16, 40 if smoke else 300))]
               for _ in range(sizes[0])]
    total_steps = len(sizes) * steps_per_size
    need = [-(-(len(p) + total_steps + 1) // BLOCK) for p in prompts]
    ids = list(range(sum(need)))
    rng.shuffle(ids)
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(prompts))]
    pick = SamplingParams(temperature=0.0, logprobs=2)
    state: dict[str, Any] = {}

    with tempfile.TemporaryDirectory() as tmp:
        def setup() -> dict[str, Any]:
            t0 = time.perf_counter()
            runner = state["runner"] = _runner(_model(Path(tmp), smoke), device, sum(need), smoke)
            runner.step_graphs = False
            first = runner.execute([SeqWork(f"s{i}", p, 0, tables[i], pick) for i, p in enumerate(prompts)])
            state["last"] = [o.token_id for o in first]
            state["computed"] = [len(p) for p in prompts]
            return {"setup_s": round(time.perf_counter() - t0, 2), "sequences": len(prompts)}

        if not ctx.cell("model and prefill", setup):
            return
        runner, last, computed = state["runner"], state["last"], state["computed"]
        graph_tokens: list[list[int]] = []
        graph_tops: list[list[Any]] = []
        eager_tops: list[list[Any]] = []
        times: dict[tuple[int, bool], list[float]] = {}

        def steps() -> dict[str, Any]:
            for size in sizes:
                for _ in range(steps_per_size):
                    work = [SeqWork(f"s{i}", [last[i]], computed[i], tables[i], pick) for i in range(size)]
                    outs = {}
                    for graphed in (False, True):
                        runner.step_graphs = graphed
                        t0 = time.perf_counter()
                        outs[graphed] = runner.execute(work)
                        times.setdefault((size, graphed), []).append((time.perf_counter() - t0) * 1e3)
                    graph_tokens.append([o.token_id for o in outs[True]])
                    graph_tops.append([o.top_logprobs for o in outs[True]])
                    eager_tops.append([o.top_logprobs for o in outs[False]])
                    for i, o in enumerate(outs[True]):
                        last[i], computed[i] = o.token_id, computed[i] + 1
            graphs = runner._step_graphs
            return {"steps": len(graph_tokens), "graph_steps": graphs.stats.graph_steps if graphs else 0,
                    "graphs_captured": graphs.num_graphs if graphs else 0,
                    "static_mb": round(graphs.static_bytes() / 1e6, 2) if graphs else 0.0}

        if not ctx.cell("teacher-forced steps", steps):
            return
        judged = judge_forced(graph_tokens, graph_tops, eager_tops)
        ctx.record({"check": "whole-step graph vs eager, same inputs: picked token's logprob (nats)",
                    "value": judged["worst_logprob_diff"], "tolerance": TIE_NATS,
                    "ok": judged["worst_logprob_diff"] <= TIE_NATS})
        ctx.record({"check": f"whole-step graph vs eager: picks differ only at near-ties "
                             f"({int(judged['flips'])} of {int(judged['decisions'])} differ; widest gap, nats)",
                    "value": judged["worst_flip_gap"], "tolerance": TIE_NATS,
                    "ok": judged["worst_flip_gap"] <= TIE_NATS})
        graphs = runner._step_graphs
        ctx.record({"check": "every decode step replayed a whole-step graph",
                    "value": graphs.stats.counts() if graphs else {}, "ok": graphs is not None
                    and graphs.stats.counts() == {"graph": len(graph_tokens)}})
        for size in sizes:
            def timing(size: int = size) -> dict[str, Any]:
                eager = statistics.median(times[(size, False)][1:] or times[(size, False)])
                graph = statistics.median(times[(size, True)][1:] or times[(size, True)])
                return {"batch": size, "eager_step_ms": round(eager, 3), "graph_step_ms": round(graph, 3),
                        "speedup": round(eager / graph, 3) if graph > 0 else None,
                        "first_graph_step_ms": round(times[(size, True)][0], 3)}

            ctx.cell(f"step time B={size}", timing)
        for size in (sizes[0], sizes[-1]):
            ctx.cell(f"host per forward B={size}", lambda size=size: _host_cost(runner, size, last, computed, tables,
                                                                                 pick, device, smoke))
        state.clear()   # the model and its pool: freed before the next phase


def _host_cost(runner: Any, size: int, last: list[int], computed: list[int], tables: list[list[int]],
               pick: Any, device: str, smoke: bool) -> dict[str, Any]:
    """Host µs to enqueue one step's forward (embedding to logits) eagerly and as a graph
    replay, beside the forward's time to the GPU's end: the issue's "host time per decode step
    <= 10%" (the runner's preparation and sampling excluded, being the same on both paths).
    The step re-writes the K/V of each sequence's next position, read by nothing after it."""
    import torch

    from compute_node.model import SeqWork

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    work = [SeqWork(f"s{i}", [last[i]], computed[i], tables[i], pick) for i in range(size)]
    row: dict[str, Any] = {"batch": size}
    with torch.inference_mode():
        for name, graphed in (("eager", False), ("graph", True)):
            runner.step_graphs = graphed
            host, total = [], []
            for _ in range(3 if smoke else 12):
                graphs = runner._graphed_step(work)   # the runner's own per-step binding
                inputs = runner._prepare(work, graphs)
                sync()
                t0 = time.perf_counter()
                if graphs is not None and graphs.load(inputs):
                    graphs.replay()
                else:
                    hidden = runner.model.forward(inputs.input_ids, inputs.positions, runner.pool, inputs.meta)
                    runner.model.logits(hidden)
                t1 = time.perf_counter()
                sync()
                host.append(t1 - t0)
                total.append(time.perf_counter() - t0)
            row[f"{name}_host_us"] = round(statistics.median(host[1:]) * 1e6, 1)
            row[f"{name}_forward_us"] = round(statistics.median(total[1:]) * 1e6, 1)
            row[f"{name}_host_share"] = round(row[f"{name}_host_us"] / max(row[f"{name}_forward_us"], 1e-3), 3)
    return row


def phase_step_graph(ctx: Any, device: str, smoke: bool) -> None:
    run_forced(ctx, device, smoke)
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
