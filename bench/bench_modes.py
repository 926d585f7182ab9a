"""Engine modes side by side (issue 21, performance): embedded vs services, one node vs two,
the engine vs transformers, on a SmolLM-135M-shaped random-weight Llama (hidden 576, 30 layers,
9 query / 3 KV heads, head dim 64, MLP 1536, vocab 49152, tied embeddings; built in a temp dir
with `build_tiny_model`, nothing downloaded), float32, CPU.

Modes, each the same workload (`--requests` requests, prompts uniform in [16, --max-prompt],
outputs uniform in [16, --max-output], greedy, EOS ignored), alternating `--repeats` times in
one process so that the shared machine's load hits them alike; p50 of the runs and ratios of
p50s are printed:

- `embedded`: `LLM(model)`: block manager state machine and the model node in this process
  (async scheduling off: `LLM`'s default for the embedded CPU node);
- `services`: `LLM(model, block_manager=ADDR)` over a block manager process and one
  `compute-node serve --model` process (thread budget: its default, all cores), async
  scheduling as `LLM` chooses it (`engine.async_policy`: off, the node is a CPU node on
  loopback); `services async=1`: the same stack with async scheduling forced on;
- `2 nodes (compose)`: a second block manager with two node processes, each with
  `PAGEDKV_CN_NODES_PER_HOST=2` as docker-compose.yml sets it (cores / 2 threads each), async
  as `LLM` chooses it; `--two-node-default-threads` adds two nodes left at all cores each (the
  pre-issue setup);
- `--node-env K=V[,K2=V2]` (repeatable): also one node (and its block manager) with this extra
  environment, e.g. `GOMP_SPINCOUNT=300000` (libgomp's own spin-wait) or `OMP_WAIT_POLICY=PASSIVE`
  (a node spins briefly, `GOMP_SPINCOUNT=10000`, unless told: docs/compute_node.md);
- `--node-tree DIR`: also one node (and its block manager) run from another checkout, e.g. the
  commit before the node's step thread (`git archive COMMIT | tar -x -C DIR`), beside this one.

Per services mode the node processes' CPU is read from /proc (per thread): CPU-s per run and how
many threads burned more than 5% of it (the model's OpenMP team(s), the gRPC pollers, ...).

`--shape demo54m --requests 64` is issue 21's two-nodes workload: 64 concurrent streams on the
54M model (`build_tiny_model`'s defaults: 12 layers, hidden 512, 8/2 heads, vocab 8192); the
`hf` part runs on the 135M shape only.

Per mode the step is split with the engine's counters: block manager Step (`bm_s`), node
Generate calls (`node_s`, wall; in services mode: gRPC + the node process's work) and the rest
(engine bookkeeping in this process).

`--parts hf` (on by default): the embedded engine vs transformers `generate` (one left-padded
batch) on the issue's workload — `--requests` requests, prompts uniform in [16,
`--hf-max-prompt` 512], outputs in [16, `--hf-max-output` 128], as `bench_engine.py`'s — then
batch-1 decode step time (after a `--b1-context`-token prompt), one more profiled mixed run split
into prefill-carrying and decode-only steps (runner timers) beside transformers' prefill alone
(`generate` of one token), and where an embedded decode
step at batch 1 and `--requests` goes (runner timers: dense, attention kernels, sampling, batch
prep; engine counters: block manager, the rest; torch.profiler for the dense phase's torch-op
share). The rotation runs the engine twice, with its matmul weights packed for oneDNN (the
default) and with plain weights and `F.linear` (what transformers runs: "pagedkv F.linear");
`--hf-per-op` adds the engine with the CPU step kernel off (the per-kernel attention calls it
replaced).

    .venv/bin/python bench/bench_modes.py [--requests 8] [--max-prompt 128] [--max-output 48] \
        [--repeats 3] [--parts services,nodes,hf] [--hf-max-prompt 512] [--hf-max-output 128] [--hf-per-op]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_engine import batch1_itl, decode_split  # noqa: E402
from bench_model import decode_latency_transformers, run_transformers  # noqa: E402

from block_manager.client import BlockManagerClient  # noqa: E402
from compute_node.model.tiny import build_tiny_model, count_parameters  # noqa: E402
from demo.localstack import ServiceProcess  # noqa: E402
from engine.executor import RemoteNode  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.params import SamplingParams  # noqa: E402

# SmolLM-135M's shape (its config.json), random weights.
SMOL_135M: dict[str, Any] = dict(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                                 intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                                 max_position_embeddings=2048, dtype="float32")
# `build_tiny_model`'s defaults: the 54.0M-parameter Llama of the earlier benchmarks.
DEMO_54M: dict[str, Any] = dict(num_layers=12, hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
                                intermediate_size=2048, vocab_size=8192, tie_word_embeddings=False,
                                max_position_embeddings=2048, dtype="float32")
SHAPES = {"smol135m": SMOL_135M, "demo54m": DEMO_54M}
BLOCK_SIZE = 16
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def make_workload(n: int, max_prompt: int, max_output: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(4, vocab) for _ in range(rng.randint(min(16, max_prompt), max_prompt))],
             rng.randint(min(16, max_output), max_output)) for _ in range(n)]


def fresh_tokens(workload: list[tuple[list[int], int]], vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """The same lengths with other token ids: every run is a prefix-cache miss (modes that share
    a block manager, and repetitions, would otherwise hit each other's cached prompts)."""
    rng = random.Random(seed)
    return [([rng.randrange(4, vocab) for _ in p], n) for p, n in workload]


class NodeClock:
    """Wraps a node's Generate (a `RemoteNode`'s stub, or the embedded node's generator) and sums
    the node's own phase times from each reply's `stats` (the engine asks for them with
    `profile_nodes`; on CPU they cost a few `perf_counter` calls): total (the whole step on the
    node: the engine's `node_s` minus this is transport, i.e. gRPC, protobuf, the node's event
    loop and thread hop), dense and attention kernels."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = {"total": 0.0, "dense": 0.0, "attention": 0.0}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _count(self, reply: Any) -> Any:
        st = reply.stats
        self.seconds["total"] += st.total_s
        self.seconds["dense"] += st.dense_s
        self.seconds["attention"] += st.attention_s
        return reply

    def Generate(self, request: Any, **kwargs: Any) -> Any:   # noqa: N802 (the stub's method)
        return self._count(self.inner.Generate(request, **kwargs))

    def generate(self, request: Any, *args: Any) -> Any:
        return self._count(self.inner.generate(request, *args))


def clock_nodes(llm: LLM) -> LLM:
    llm.engine.config.profile_nodes = True
    for node in llm.engine.nodes.values():
        if isinstance(node, RemoteNode):
            node._stub = NodeClock(node._stub)   # type: ignore[assignment]
        else:
            node.generator = NodeClock(node.generator)   # type: ignore[attr-defined]
    return llm


def node_seconds(llm: LLM) -> dict[str, float]:
    out = {"total": 0.0, "dense": 0.0, "attention": 0.0}
    for n in llm.engine.nodes.values():
        clock = getattr(n, "_stub", None) or getattr(n, "generator", None)
        if isinstance(clock, NodeClock):
            for k, v in clock.seconds.items():
                out[k] += v
    return out


def run(llm: LLM, workload: list[tuple[list[int], int]], async_scheduling: bool | None = None) -> dict[str, float]:
    """Requested tokens/s of the workload through `llm`'s engine, and the step split."""
    engine = llm.engine
    if async_scheduling is not None:
        engine.config.async_scheduling = async_scheduling
    st = engine.stats
    steps0, bm0, node0, rpcs0, clock0 = st.num_steps, st.bm_s, st.node_s, st.num_bm_rpcs, node_seconds(llm)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    t0 = time.perf_counter()
    for (prompt, _), p in zip(workload, params):
        engine.add_request(prompt, p)
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - t0
    engine.flush()
    steps = max(1, st.num_steps - steps0)
    return {"tok_s": sum(n for _, n in workload) / seconds, "seconds": seconds, "steps": steps,
            "step_ms": 1e3 * seconds / steps, "bm_ms": 1e3 * (st.bm_s - bm0) / steps,
            "node_ms": 1e3 * (st.node_s - node0) / steps, "rpcs": (st.num_bm_rpcs - rpcs0) / steps,
            **{f"{k}_ms": 1e3 * (v - clock0[k]) / steps for k, v in node_seconds(llm).items()}}


def thread_cpu(pids: list[int]) -> dict[tuple[int, int], float]:
    """CPU seconds (user + system) of every thread of `pids`, by (pid, tid)."""
    out: dict[tuple[int, int], float] = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:   # the thread ended
                continue
            out[(pid, int(tid))] = (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def busy_threads(before: dict[tuple[int, int], float], after: dict[tuple[int, int], float]) -> dict[str, float]:
    """The nodes' CPU-s over a run and how many threads took more than 5% of it."""
    used = [cpu - before.get(key, 0.0) for key, cpu in after.items()]
    total = sum(used)
    return {"cpu_s": total, "busy_threads": sum(1 for u in used if total and u > 0.05 * total)}


@contextmanager
def stack(model_dir: Path, workdir: Path, num_nodes: int, num_blocks: int,
          node_env: dict[str, str], tree: Path = REPO) -> Iterator[tuple[str, list[int]]]:
    """A block manager process and `num_nodes` `compute-node serve --model` processes (their code
    from `tree`); yields the block manager's address and the nodes' pids once every node is
    registered. Everything is stopped on exit."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PAGEDKV_LOG_LEVEL": "WARNING", "PAGEDKV_CN_LOG_LEVEL": "WARNING"}
    env.pop("PAGEDKV_CN_THREADS", None)
    env.pop("PAGEDKV_CN_NODES_PER_HOST", None)
    with ExitStack() as stop:
        bm = stop.enter_context(ServiceProcess.start(
            [sys.executable, "-m", "block_manager.cli.main", "serve", "--listen", "127.0.0.1:0",
             "--database-url", "memory://", "--metrics-port", "0"],
            workdir=workdir, name="bm", cwd=tree, env={**env, "PAGEDKV_BLOCK_SIZE": str(BLOCK_SIZE)}))
        pids = []
        for i in range(num_nodes):
            node = stop.enter_context(ServiceProcess.start(
                [sys.executable, "-m", "compute_node.service.cli", "serve", "--listen", "127.0.0.1:0",
                 "--block-manager", bm.address, "--node-id", f"node-{i}", "--model", str(model_dir),
                 "--num-blocks", str(num_blocks), "--metrics-port", "0"],
                workdir=workdir, name=f"node-{i}", cwd=tree, timeout_s=300,
                env={**env, "PAGEDKV_CN_DEVICE": "cpu", "PAGEDKV_CN_BLOCK_SIZE": str(BLOCK_SIZE), **node_env}))
            pids.append(node.proc.pid)
        client = BlockManagerClient(bm.address)
        try:
            deadline = time.monotonic() + 300
            while len(client.route([0])) < num_nodes:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{num_nodes} nodes not registered after 300 s (logs in {workdir})")
                time.sleep(0.2)
        finally:
            client.close()
        yield bm.address, pids


def p50(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def modes_part(args: argparse.Namespace, model_dir: Path, workload: list[tuple[list[int], int]],
               num_blocks: int, tmp: Path) -> LLM:
    """The embedded engine and the services stacks, alternating; returns the embedded LLM."""
    opts = dict(block_size=BLOCK_SIZE, max_num_batched_tokens=args.budget, max_num_seqs=args.requests)
    embedded = clock_nodes(LLM(model_dir, num_kv_blocks=num_blocks, device="cpu", **opts))
    # name -> (LLM, its async scheduling for the runs, node pids)
    modes: dict[str, tuple[LLM, bool, list[int]]] = {
        "embedded": (embedded, embedded.engine.config.async_scheduling, [])}
    with ExitStack() as stop:
        def services(name: str, workdir: str, num_nodes: int, env: dict[str, str], tree: Path = REPO,
                     forced: tuple[bool | None, ...] = (None,)) -> None:
            addr, pids = stop.enter_context(stack(model_dir, tmp / workdir, num_nodes, num_blocks, env, tree))
            llm = clock_nodes(stop.enter_context(LLM(model_dir, block_manager=addr, **opts)))
            chosen = llm.engine.config.async_scheduling   # LLM's choice, restored before its own runs
            for mode in forced:
                modes[name if mode is None else f"{name} async={int(mode)}"] = (llm, chosen if mode is None else mode,
                                                                              pids)

        if "services" in args.parts or "nodes" in args.parts:
            services("services", "one", 1, {}, forced=(None, True))
            chosen = modes["services"][0].engine.config.async_scheduling
            print(f"LLM's async scheduling for CPU nodes on loopback: {'on' if chosen else 'off'}")
        if args.node_tree is not None:
            services(f"services, node from {args.node_tree.name}", "tree", 1, {}, tree=args.node_tree)
        for i, extra in enumerate(args.node_env):
            services(f"services, node with {extra}", f"env{i}", 1, dict(kv.split("=", 1) for kv in extra.split(",")))
        if "nodes" in args.parts:
            services("2 nodes (compose)", "two", 2, {"PAGEDKV_CN_NODES_PER_HOST": "2"})
            if args.two_node_default_threads:
                services("2 nodes (all cores each)", "two-default", 2, {})
        warm = make_workload(2, 32, 8, args.vocab, 99)
        for llm, mode, _ in modes.values():
            run(llm, warm, mode)
        if len(modes) == 1:
            return embedded
        results: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
        loads: list[float] = []
        for rep in range(args.repeats):
            order = list(modes) if rep % 2 == 0 else list(reversed(modes))
            for name in order:
                llm, mode, pids = modes[name]
                loads.append(os.getloadavg()[0])
                work = fresh_tokens(workload, args.vocab, 1000 * rep + list(modes).index(name))
                cpu0 = thread_cpu(pids)
                r = run(llm, work, mode)
                results[name].append({**r, **busy_threads(cpu0, thread_cpu(pids))})
        base = p50(results["embedded"], "tok_s")
        print(f"\n## modes (load average 1 min during the runs: {min(loads):.1f}-{max(loads):.1f})")
        print("| mode | runs tok/s | p50 tok/s | / embedded | step ms | block manager ms | node ms | on the node "
              "(sum over nodes): total / dense / attention ms | engine rest ms | steps | BM RPCs/step | "
              "node CPU-s per run (threads > 5%) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        per_rep = [" ".join(f"{x:.1f}" for x in loads[i:i + len(modes)]) for i in range(0, len(loads), len(modes))]
        print(f"load average at each run's start, per repetition (run order): {' / '.join(per_rep)}")
        for name, rs in results.items():
            step, bm, node = p50(rs, "step_ms"), p50(rs, "bm_ms"), p50(rs, "node_ms")
            runs = " ".join(f"{r['tok_s']:.1f}" for r in rs)
            on_node = " / ".join(f"{p50(rs, k):.1f}" for k in ("total_ms", "dense_ms", "attention_ms"))
            cpu = f"{p50(rs, 'cpu_s'):.1f} ({p50(rs, 'busy_threads'):.0f})" if modes[name][2] else "–"
            print(f"| {name} | {runs} | {p50(rs, 'tok_s'):.1f} | "
                  f"**{p50(rs, 'tok_s') / base:.2f}x** | {step:.1f} | {bm:.2f} | {node:.1f} | {on_node} | "
                  f"{step - bm - node:.2f} | {p50(rs, 'steps'):.0f} | {p50(rs, 'rpcs'):.2f} | {cpu} |")
        for name, rs in results.items():
            if name != "embedded":
                ratios = [r["tok_s"] / e["tok_s"] for r, e in zip(rs, results["embedded"])]
                print(f"{name} / embedded per repetition: {' '.join(f'{x:.2f}' for x in ratios)}")
        if "2 nodes (compose)" in results:
            one = results["services"]
            ratios = [t["tok_s"] / o["tok_s"] for t, o in zip(results["2 nodes (compose)"], one)]
            print(f"2 nodes (compose) / 1 node: {p50(results['2 nodes (compose)'], 'tok_s') / p50(one, 'tok_s'):.2f}x "
                  f"(goal >= 1.0x; per repetition {' '.join(f'{x:.2f}' for x in ratios)})")
    return embedded


def hf_part(args: argparse.Namespace, model_dir: Path, embedded: LLM) -> None:
    """The embedded engine vs transformers on the hf workload (its own prompt/output ranges),
    batch-1 decode and the decode step split; with `--hf-per-op` the engine also runs with the
    CPU step kernel off (per-kernel attention calls: the path before it) in the same rotation."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    run_transformers(hf, make_workload(2, 32, 8, SMOL_135M["vocab_size"], 99), 1)
    runner = next(iter(embedded.engine.nodes.values())).runner   # type: ignore[attr-defined]
    # name -> (CPU step kernel on, matmul weights packed for oneDNN)
    variants = {"pagedkv": (True, True), "pagedkv F.linear": (True, False),
                **({"pagedkv per-op": (False, True)} if args.hf_per_op else {})}

    def configure(fused: bool, packed: bool) -> None:
        runner.fused_cpu_attention = fused
        if packed:
            runner.model.pack_linear_weights()
        else:
            runner.model.unpack_linear_weights()
    workload = make_workload(args.requests, args.hf_max_prompt, args.hf_max_output, SMOL_135M["vocab_size"],
                             args.seed + 1)
    ours: dict[str, list[float]] = {name: [] for name in variants}
    b1: dict[str, list[float]] = {name: [] for name in variants}
    theirs, b1_theirs, loads = [], [], []
    for rep in range(args.repeats):
        loads.append(os.getloadavg()[0])
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            configure(*variants[name])
            # its own token ids (the same lengths): a variant run after another on the same
            # prompts would find them in the prefix cache and skip their prefill
            work = fresh_tokens(workload, SMOL_135M["vocab_size"], 7000 + 100 * rep + list(variants).index(name))
            ours[name].append(run(embedded, work)["seconds"])
            b1[name].append(batch1_itl(embedded, args.b1_context, args.b1_steps))
            print(f"  rep {rep} {name}: mixed {ours[name][-1]:.2f} s, batch-1 step {1e3 * b1[name][-1]:.1f} ms",
                  flush=True)
        theirs.append(run_transformers(hf, work, 1).seconds)
        b1_theirs.append(decode_latency_transformers(hf, args.b1_context, args.b1_steps, repeats=1))
        print(f"  rep {rep} transformers: mixed {theirs[-1]:.2f} s, batch-1 step {1e3 * b1_theirs[-1]:.1f} ms "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    configure(True, True)
    split = mixed_split(embedded, fresh_tokens(workload, SMOL_135M["vocab_size"], 7999))
    # transformers' prefill alone: the same padded batch, one new token each.
    hf_prefill = run_transformers(hf, [(p, 1) for p, _ in fresh_tokens(workload, SMOL_135M["vocab_size"], 7998)],
                                  1).seconds
    requested = sum(n for _, n in workload)
    t, bt = statistics.median(theirs), statistics.median(b1_theirs)
    print(f"\n## engine (embedded) vs transformers (load average 1 min: {min(loads):.1f}-{max(loads):.1f}); "
          f"{args.requests} requests, prompts 16-{args.hf_max_prompt} ({sum(len(p) for p, _ in workload)} tokens), "
          f"outputs 16-{args.hf_max_output} ({requested} tokens)")
    print(f"transformers: mixed {requested / t:.1f} tok/s, runs s {[round(x, 2) for x in theirs]}; batch-1 step "
          f"{1e3 * bt:.1f} ms, runs ms {[round(1e3 * x, 1) for x in b1_theirs]}")
    for name in variants:
        o, bo = statistics.median(ours[name]), statistics.median(b1[name])
        print(f"{name}: mixed {requested / o:.1f} tok/s **{t / o:.2f}x** transformers (goal >= 2x), runs s "
              f"{[round(x, 2) for x in ours[name]]}; batch-1 step ({args.b1_context}-token context) {1e3 * bo:.1f} ms "
              f"**{bo / bt:.2f}x** (goal <= 1.0x), runs ms {[round(1e3 * x, 1) for x in b1[name]]}")
    print(f"transformers prefill alone (the padded batch, max_new_tokens=1): {hf_prefill:.2f} s")
    for kind, t in split.items():
        print(f"pagedkv mixed run (one more, profiled), {kind} steps: {t['steps']:.0f} steps, "
              f"{t['tokens']:.0f} tokens, "
              f"{t['wall']:.2f} s = dense {t['dense']:.2f} + attention kernels {t['attention']:.2f} + sampling "
              f"{t['sample']:.2f} + batch prep {t['prepare']:.2f} + the rest (node, block manager, engine) "
              f"{t['wall'] - t['dense'] - t['attention'] - t['sample'] - t['prepare']:.2f} s")
    for name, variant in variants.items():
        configure(*variant)
        for batch in (1, args.requests):
            s = decode_split(embedded, batch, 12)
            share = aten_share(embedded, batch)
            model = s["dense"] + s["sample"] + s["prepare"]
            print(f"{name} decode step at batch {batch}: {1e3 * s['step']:.1f} ms = dense {1e3 * s['dense']:.1f} "
                  f"(torch ops {1e3 * share * s['dense']:.1f}, Python layer loop {1e3 * (1 - share) * s['dense']:.1f}) "
                  f"+ attention kernels {1e3 * s['attention']:.1f} + sampling {1e3 * s['sample']:.2f} + batch prep "
                  f"{1e3 * s['prepare']:.2f} + node rest {1e3 * (s['node'] - model - s['attention']):.2f} + block "
                  f"manager {1e3 * s['bm']:.2f} + engine {1e3 * (s['step'] - s['bm'] - s['node']):.2f} ms")
    configure(True, True)


def mixed_split(llm: LLM, workload: list[tuple[list[int], int]]) -> dict[str, dict[str, float]]:
    """One profiled run of the mixed workload, its steps split into those that carry prefill
    tokens and decode-only ones: seconds of wall (engine.step), dense, attention kernels,
    sampling and batch preparation (runner timers), steps and tokens per kind."""
    engine = llm.engine
    runner = next(iter(engine.nodes.values())).runner   # type: ignore[attr-defined]
    kinds = ("prefill-carrying", "decode-only")
    out = {k: dict.fromkeys(("steps", "tokens", "wall", "dense", "attention", "sample", "prepare"), 0.0)
           for k in kinds}
    seen: dict[str, int] = {}
    execute = runner.execute

    def counted(batch: Any) -> Any:
        seen["prefill"] = sum(len(w.token_ids) > 1 for w in batch)
        seen["tokens"] = sum(len(w.token_ids) for w in batch)
        return execute(batch)

    runner.execute = counted
    runner.profile = True
    try:
        for prompt, n in workload:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        while engine.has_unfinished_requests():
            seen.clear()
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            if not seen:
                continue
            t, row = runner.last_timings, out[kinds[0] if seen["prefill"] else kinds[1]]
            for key, value in (("steps", 1), ("tokens", seen["tokens"]), ("wall", wall), ("dense", t.dense_s),
                               ("attention", t.attention_s), ("sample", t.sample_s), ("prepare", t.prepare_s)):
                row[key] += value
    finally:
        runner.profile = False
        del runner.execute   # the instance attribute; the class's method again
    engine.flush()
    return out


def aten_share(llm: LLM, batch: int, steps: int = 3) -> float:
    """The share of the dense phase spent inside aten ops (torch.profiler's self CPU time) over
    `steps` decode steps at `batch` running sequences; the rest is the Python around them."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    runner = next(iter(engine.nodes.values())).runner   # type: ignore[attr-defined]
    for i in range(batch):
        engine.add_request([7 + (i * 13 + j) % 4000 for j in range(64)],
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):
        engine.step()
    dense = 0.0
    runner.profile = True
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
                dense += runner.last_timings.dense_s
    finally:
        runner.profile = False
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush()
    ops = [e for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::")) and e.key != "aten::argmax"]
    return min(1.0, sum(e.self_cpu_time_total for e in ops) / 1e6 / dense) if dense else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--max-output", type=int, default=48)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-max-prompt", type=int, default=512,
                    help="hf part: prompts uniform in [16, this] (the issue's / bench_engine's workload)")
    ap.add_argument("--hf-max-output", type=int, default=128, help="hf part: outputs uniform in [16, this]")
    ap.add_argument("--hf-per-op", action="store_true",
                    help="hf part: also run the engine with the CPU step kernel off (per-kernel attention calls)")
    ap.add_argument("--b1-context", type=int, default=128)
    ap.add_argument("--b1-steps", type=int, default=16)
    ap.add_argument("--parts", default="services,nodes,hf", help="comma list of services, nodes, hf")
    ap.add_argument("--two-node-default-threads", action="store_true",
                    help="also two nodes at all cores each (PAGEDKV_CN_NODES_PER_HOST unset)")
    ap.add_argument("--node-tree", type=Path, default=None,
                    help="also one node run from this checkout (another commit's code), beside this one")
    ap.add_argument("--node-env", action="append", default=[], metavar="K=V[,K2=V2]",
                    help="also one node with this extra environment (repeatable)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smol135m",
                    help="the model's shape (demo54m with --requests 64: issue 21's two-nodes workload)")
    ap.add_argument("--num-layers", type=int, default=None, help="fewer for a smoke run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.parts = set(args.parts.split(","))
    if args.shape != "smol135m" and "hf" in args.parts:
        ap.error("the hf part runs on the 135M shape: pass --parts services,nodes with --shape " + args.shape)
    spec = {**SHAPES[args.shape], "num_layers": args.num_layers or SHAPES[args.shape]["num_layers"]}
    args.vocab = spec["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model_dir = build_tiny_model(tmp / "smol", "llama", seed=args.seed, **spec)
        workload = make_workload(args.requests, args.max_prompt, args.max_output, spec["vocab_size"], args.seed)
        max_len = max(len(p) + n for p, n in workload)
        if "hf" in args.parts:
            max_len = max(max_len, args.hf_max_prompt + args.hf_max_output)
        num_blocks = max(args.requests, 8) * -(-max(max_len, args.b1_context + args.b1_steps + 80) // BLOCK_SIZE) + 64
        print(f"# bench_modes  llama {count_parameters(model_dir) / 1e6:.1f}M ({spec['num_layers']} layers, hidden "
              f"{spec['hidden_size']}, {spec['num_heads']}/{spec['num_kv_heads']} heads) fp32 cpu, {os.cpu_count()} "
              f"cores, torch threads {torch.get_num_threads()}; {args.requests} requests, prompts "
              f"{sum(len(p) for p, _ in workload)} tokens, requested {sum(n for _, n in workload)} tokens; "
              f"{args.repeats} alternating repetitions, p50; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        embedded = modes_part(args, model_dir, workload, num_blocks, tmp)
        try:
            if "hf" in args.parts:
                hf_part(args, model_dir, embedded)
        finally:
            embedded.close()


if __name__ == "__main__":
    main()
