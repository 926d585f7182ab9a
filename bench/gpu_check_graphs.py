"""Decode through the compute node's CUDA graphs vs the direct launch, on a real GPU (issue 13).

Called by bench/gpu_check.py (part of its correctness phase; ~30 s on an H200). Two levels:

1. The node's decode loop (`KvPool.begin_decode` once per step, `DecodeStep.run` per layer,
   the helper the model path and `Forward` share), always: two pools with the same K/V, one
   with graphs, one without; 48 ragged, shuffled sequences (bucket 64, 16 padded rows), 4 layers
   of 32 query / 8 KV heads x 128, fp16, 16 steps of write + attend. Checks graph vs direct and
   graph vs the float64 reference; times a step both ways.
2. A real `ModelRunner` greedy generation, graphs on vs off, when the model stack
   (safetensors, tokenizers) is importable: a random-weight 4-layer Llama built in a temporary
   directory, 48 prompts, 24 decode steps; the direct run is fed the graph run's tokens, so both
   see the same inputs. The picked token's logprob must agree within fp16 noise, and a pick may
   differ only where the two best tokens nearly tie (`judge_forced`: the two paths split
   attention differently, so they are not bitwise equal); times a decode step both ways.

Needs nothing beyond gpu_check's own requirements for part 1; installs nothing.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 4, 32, 8, 128, 16
BATCH, STEPS, MODEL_STEPS = 48, 16, 24
TOL_FP16 = 1e-3
# Logprob differences (nats) that fp16 rounding explains between two attention splits: the
# picked token's logprob may move this much, and a greedy pick may flip only at a tie this close.
TIE_NATS = 0.05


def _step_ms(torch: Any, fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _pools(torch: Any, lens: list[int], gen: Any) -> tuple[Any, Any, Any]:
    """Two pools (graphs on, off) holding the same random K/V, and shuffled tables covering
    every sequence's context plus the steps to come."""
    from compute_node.pool import KvPool, PoolGeometry

    need = [-(-(n + STEPS) // BLOCK) for n in lens]
    geometry = PoolGeometry(LAYERS, NUM_KV_HEADS, HEAD_DIM, "float16", BLOCK, sum(need) + 8)
    device = torch.device("cuda")
    on = KvPool(geometry, device, cuda_graphs=True, max_context=max(need) * BLOCK)
    off = KvPool(geometry, device, cuda_graphs=False)
    for a, b in zip(on.key_caches + on.value_caches, off.key_caches + off.value_caches, strict=True):
        a.copy_(torch.randn(a.shape, generator=gen, device="cuda"))
        b.copy_(a)
    ids = torch.randperm(geometry.num_blocks, generator=gen, device="cuda").to(torch.int32)
    tables = torch.zeros((len(lens), max(need)), dtype=torch.int32, device="cuda")
    cursor = 0
    for s, n in enumerate(need):
        tables[s, :n] = ids[cursor:cursor + n]
        cursor += n
    return on, off, tables


def check_decode_loop(torch: Any, checks: Any, rel_error: Any) -> dict[str, float]:
    """Part 1 (module doc): records checks, returns the step times."""
    from compute_node.decode_path import StepShape
    from kernels import reference

    gen = torch.Generator(device="cuda").manual_seed(13)
    rng = random.Random(13)
    lens = [rng.randint(100, 1500) for _ in range(BATCH)]
    on, off, tables = _pools(torch, lens, gen)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    shape = StepShape(NUM_HEADS, torch.float16, scale)
    times: dict[bool, list[float]] = {True: [], False: []}
    worst, identical = 0.0, True
    for step in range(STEPS):
        seq_lens = torch.tensor([n + step + 1 for n in lens], dtype=torch.int32, device="cuda")
        pos = seq_lens.long() - 1
        slots = tables[torch.arange(BATCH, device="cuda"), pos // BLOCK].long() * BLOCK + pos % BLOCK
        width = int((seq_lens.max().item() + BLOCK - 1) // BLOCK)   # the step's tables: as wide as needed
        step_tables = tables[:, :width].contiguous()
        q = [torch.randn((BATCH, NUM_HEADS, HEAD_DIM), generator=gen, device="cuda").half() * 3
             for _ in range(LAYERS)]
        kv = [torch.randn((BATCH, NUM_KV_HEADS, HEAD_DIM), generator=gen, device="cuda").half()
              for _ in range(LAYERS)]
        outs = {}
        for graphs, pool in ((False, off), (True, on)):
            layer_out = [torch.empty_like(x) for x in q]

            def run(pool: Any = pool, layer_out: list[Any] = layer_out) -> None:
                decode = pool.begin_decode(step_tables, seq_lens, shape)
                for layer in range(LAYERS):
                    pool.write(layer, kv[layer], kv[layer], slots)
                    decode.run(layer, q[layer], out=layer_out[layer])

            ms = _step_ms(torch, run)
            if step >= 2:   # the first steps compile kernels and capture graphs
                times[graphs].append(ms)
            outs[graphs] = layer_out
        for layer in range(LAYERS):
            identical = identical and torch.equal(outs[True][layer], outs[False][layer])
            worst = max(worst, rel_error(outs[True][layer], outs[False][layer].double().cpu().numpy()))
    checks.record(f"node decode loop graph vs direct ({STEPS} steps x {LAYERS} layers, B={BATCH}, "
                  f"bitwise identical: {identical})", worst, TOL_FP16)
    layer = LAYERS - 1
    ref = reference.paged_attention_decode(q[layer], on.key_caches[layer], on.value_caches[layer],
                                           step_tables, seq_lens, scale)
    checks.record("node decode loop graph vs float64 reference (last step)", rel_error(outs[True][layer], ref),
                  TOL_FP16)
    counts = on.decode_path.stats.counts()
    checks.record(f"node decode loop took the graph path every step ({counts})",
                  0.0 if counts == {"graph": STEPS} else math.inf, 0.0)
    result = {"loop_direct_ms": statistics.median(times[False]), "loop_graph_ms": statistics.median(times[True]),
              "graph_static_mb": on.decode_path.static_bytes() / 1e6}
    result["loop_speedup"] = result["loop_direct_ms"] / result["loop_graph_ms"]
    return result


def _generate(torch: Any, runner: Any, prompts: list[list[int]], tables: list[list[int]],
              forced: list[list[int]] | None = None) -> tuple[list[list[int]], list[list[Any]], list[float]]:
    """Prefill every prompt in one step, then greedy decode steps; (tokens, each step's top-2
    logprobs, step ms). `forced`: feed these tokens instead of the ones this run picks
    (teacher forcing), so two runs see the same inputs at every step."""
    from compute_node.model import SamplingParams, SeqWork

    greedy = SamplingParams(temperature=0.0, logprobs=2)
    out = runner.execute([SeqWork(f"s{i}", p, 0, t, greedy) for i, (p, t) in enumerate(zip(prompts, tables))])
    tokens = [[o.token_id] for o in out]
    tops = [[o.top_logprobs] for o in out]
    fed = forced if forced is not None else tokens   # tokens grows as the steps run
    step_ms = []
    for step in range(MODEL_STEPS):
        work = [SeqWork(f"s{i}", [fed[i][step]], len(p) + step, t, greedy, step + 1)
                for i, (p, t) in enumerate(zip(prompts, tables))]
        box: list[Any] = []
        ms = _step_ms(torch, lambda: box.append(runner.execute(work)))  # noqa: B023 - called at once
        if step >= 2:   # the first steps compile kernels and capture graphs
            step_ms.append(ms)
        for i, o in enumerate(box[0]):
            tokens[i].append(o.token_id)
            tops[i].append(o.top_logprobs)
    return tokens, tops, step_ms


def judge_forced(graph_tokens: list[list[int]], graph_tops: list[list[Any]],
                 direct_tops: list[list[Any]]) -> dict[str, float]:
    """Graph path vs direct path on the same inputs (the direct run teacher-forced on the graph
    run's tokens). The two paths split attention differently (a graph's plan is chosen for its
    bucket, the direct launch's for the step), so their fp16 results differ in the last bits and
    a greedy pick can flip where the two best tokens nearly tie. Returns the largest difference
    of the graph-picked token's logprob between the paths (`worst_logprob_diff`), how many
    picks differ (`flips`, of `decisions`) and the widest gap, under the direct path, between
    its best token and the graph's pick (`worst_flip_gap`); a pick outside the direct path's
    top 2 counts as an infinite difference."""
    worst_diff = worst_gap = 0.0
    flips = decisions = 0
    for tokens, g_steps, d_steps in zip(graph_tokens, graph_tops, direct_tops, strict=True):
        for token, g_top, d_top in zip(tokens, g_steps, d_steps, strict=True):
            decisions += 1
            g_lp, d_lp = dict(g_top), dict(d_top)
            if token not in d_lp:
                worst_diff = math.inf
                continue
            worst_diff = max(worst_diff, abs(g_lp[token] - d_lp[token]))
            best_token, best_lp = d_top[0]
            if best_token != token:
                flips += 1
                worst_gap = max(worst_gap, best_lp - d_lp[token])
    return {"worst_logprob_diff": worst_diff, "flips": float(flips), "decisions": float(decisions),
            "worst_flip_gap": worst_gap}


def check_generate(torch: Any, checks: Any) -> dict[str, float]:
    """Part 2 (module doc), or {} when the model stack is not importable."""
    try:
        from compute_node.model import ModelRunner
        from compute_node.model.tiny import build_tiny_model
    except ImportError as exc:
        print(f"[gpu_check] model Generate graphs check skipped: {exc}", flush=True)
        return {}
    rng = random.Random(14)
    prompts = [[rng.randrange(4, 1024) for _ in range(rng.randint(16, 300))] for _ in range(BATCH)]
    need = [-(-(len(p) + MODEL_STEPS + 1) // BLOCK) for p in prompts]
    ids = list(range(sum(need)))
    rng.shuffle(ids)
    starts = [sum(need[:i]) for i in range(BATCH)]
    tables = [ids[s:s + n] for s, n in zip(starts, need)]
    results: dict[bool, tuple[list[list[int]], list[list[Any]], list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "llama", num_layers=LAYERS, hidden_size=1024, num_heads=NUM_HEADS,
                                     num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, intermediate_size=2048,
                                     vocab_size=1024, dtype="float16", max_position_embeddings=1024)
        for graphs in (True, False):   # graphs first: the direct run is forced on its tokens
            runner = ModelRunner(model_dir, block_size=BLOCK, num_blocks=sum(need), device="cuda",
                                 max_model_len=1024, cuda_graphs=graphs)
            results[graphs] = _generate(torch, runner, prompts, tables,
                                        forced=None if graphs else results[True][0])
            if graphs:
                counts = runner.pool.decode_path.stats.counts()
                checks.record(f"model Generate took the graph path every decode step ({counts})",
                              0.0 if counts == {"graph": MODEL_STEPS} else math.inf, 0.0)
            del runner
            torch.cuda.empty_cache()
    j = judge_forced(results[True][0], results[True][1], results[False][1])
    checks.record(f"model Generate graphs vs direct, same inputs: picked token's logprob "
                  f"({int(j['decisions'])} greedy picks)", j["worst_logprob_diff"], TIE_NATS)
    checks.record(f"model Generate graphs vs direct: picks that differ only at near-ties "
                  f"({int(j['flips'])} of {int(j['decisions'])} differ; widest gap, nats)",
                  j["worst_flip_gap"], TIE_NATS)
    direct, graph = statistics.median(results[False][2]), statistics.median(results[True][2])
    return {"generate_direct_ms": direct, "generate_graph_ms": graph, "generate_speedup": direct / graph,
            "generate_flips": j["flips"], "generate_worst_logprob_diff": j["worst_logprob_diff"]}


def check_node_graphs(torch: Any, checks: Any, rel_error: Any) -> dict[str, float]:
    """Both parts (`checks`: gpu_check's `Checks`; `rel_error(out, ref)`: its row error);
    logs and returns the per-step times (ms) and their ratios."""
    timings: dict[str, float] = {}
    checks.guarded("node decode loop graphs", lambda: timings.update(check_decode_loop(torch, checks, rel_error)))
    checks.guarded("model Generate graphs", lambda: timings.update(check_generate(torch, checks)))
    for key, value in timings.items():
        print(f"[gpu_check] node graphs {key}: {value:.3f}", flush=True)
    return timings
