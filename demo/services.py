"""`pagedkv-demo` (services mode): a real model served through the block manager and two nodes.

Starts the block manager and both compute nodes from docker-compose.yml as local processes
(`demo.localstack`), every node loading the model (`--model DIR`, any supported Hugging Face
directory; without it, a small Llama-architecture model with random weights and a small
tokenizer is built locally first: no download). The engine (`engine.llm_engine`) then serves a
mixed workload through them — shared system prompts (prefix hits), `n > 1` parallel samples
(fork + copy-on-write), long and short prompts (chunked prefill), greedy and seeded sampling —
and the report says what it cost and what paging bought: tokens/s, time to first token and
inter-token latency, KV blocks in use against per-request contiguous preallocation, prefix
hits, CoW copies, preemptions, defrag, and how many greedy completions matched the reference:
transformers' `generate` when transformers is installed, else the model run alone (one
sequence, its own pool, no batching, no cache sharing). Everything it started is stopped on the
way out, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from block_manager.client import AdminClient, BlockManagerClient
from demo.localstack import LocalStack
from demo.svg_chart import Chart, Series, write
from engine.executor import RemoteNode
from engine.llm_engine import EngineConfig, LLMEngine
from engine.params import RequestOutput, SamplingParams
from engine.tokenizer import Tokenizer

NODES = ("compute-node-0", "compute-node-1")
NEAR_TIE_REL = 1e-4
CHECK_BATCH = 16            # greedy completions per batched reference forward pass
PIPED_PROGRESS_S = 5.0      # piped output: a progress line at least this often
# The model built when no --model is given: ~5M parameters in float32 (the reference check
# compares in float32 too), 4 layers with GQA, so a 2-core machine serves the default workload
# and checks it within the demo's one-minute budget. Weights random, tokenizer real.
DEMO_MODEL_SPEC: dict[str, Any] = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                                       intermediate_size=1024, vocab_size=4096, dtype="float32")


@dataclass(slots=True)
class DemoRequest:
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class Sample:
    t: float
    used_blocks: int
    contiguous_blocks: int


@dataclass(slots=True)
class ModelDemoReport:
    model: str
    built: bool
    num_requests: int = 0
    generated: int = 0
    wall_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    pools: list[dict[str, Any]] = field(default_factory=list)
    reference: str = ""
    checked: int = 0
    matched: int = 0
    greedy_total: int = 0           # greedy completions served (checked <= this: the check is bounded)
    sampled: int = 0                # completions drawn with temperature > 0: not comparable token by token
    check_s: float = 0.0
    mismatches: list[str] = field(default_factory=list)


def build_workload(tok: Tokenizer, num_requests: int, seed: int, vocab: int) -> list[DemoRequest]:
    """Chat-like requests: a few shared system prompts, user text of mixed length, some n > 1."""
    rng = random.Random(seed)
    from compute_node.model._tiny_corpus import CORPUS

    lines = [ln for ln in CORPUS.splitlines() if ln.strip()]
    systems = [" ".join(rng.sample(lines, 6)) for _ in range(3)]
    out = []
    for i in range(num_requests):
        user = " ".join(rng.sample(lines, rng.choice([1, 1, 2, 4, 8])))
        text = (systems[i % 3] + "\n" if rng.random() < 0.7 else "") + user
        ids = [t for t in tok.encode(text) if t < vocab]
        kind = rng.random()
        max_tokens = rng.choice([16, 32, 64, 96])
        if kind < 0.2:
            params = SamplingParams(n=rng.choice([2, 3, 4]), temperature=0.8, top_p=0.95, max_tokens=max_tokens,
                                    seed=rng.randrange(1 << 30), ignore_eos=True)
        elif kind < 0.35:
            params = SamplingParams(temperature=0.7, max_tokens=max_tokens, seed=rng.randrange(1 << 30),
                                    ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        out.append(DemoRequest(ids, params))
    return out


def run(args: argparse.Namespace) -> int:
    console = Console()
    with tempfile.TemporaryDirectory(prefix="pagedkv-demo-") as tmp:
        model_dir, built = _model_dir(args, Path(tmp))
        # the compose file's own model settings: the nodes mount PAGEDKV_MODEL_DIR and serve
        # PAGEDKV_MODEL from it (model-init finds it there and builds nothing)
        env = {
            "PAGEDKV_CN_NUM_BLOCKS": str(args.node_blocks), "PAGEDKV_LOG_LEVEL": "WARNING",
            "PAGEDKV_MODEL_DIR": str(model_dir.parent), "PAGEDKV_MODEL": model_dir.name,
            "PAGEDKV_BLOCK_SIZE": str(args.block_size),
            # a host tier under each node (docs/tiers.md): preemptions swap, evicted prefixes stay
            "PAGEDKV_CN_HOST_KV_MEMORY": str(args.host_kv_memory) if args.host_kv_memory > 0 else "",
        }
        # the two nodes share this machine's cores: one thread pool each, no oversubscription
        threads = str(max(1, (os.cpu_count() or 2) // len(NODES)))
        overrides = {n: {"OMP_NUM_THREADS": threads, "NUMBA_NUM_THREADS": threads} for n in NODES}
        with LocalStack(Path(tmp) / "stack", interp_env=env, overrides=overrides) as stack:
            console.print(f"starting block manager + {len(NODES)} compute nodes serving {model_dir.name} ...")
            t0 = time.perf_counter()
            stack.up(["block-manager", *NODES])   # the engine here is the scheduler: no API server
            console.print(f"stack healthy in {time.perf_counter() - t0:.1f} s")
            if built:
                console.print(f"[yellow]no --model given: built {model_dir.name}, a random-weight Llama-architecture "
                              "model and a small tokenizer, locally (no download); its text is noise, its "
                              "tokens are checked all the same[/yellow]")
            report = serve(stack, model_dir, args, console)
            report.built = built
        render(report, console)
        plot(report, Path(args.plot))
        console.print(f"plot: {args.plot}")
    return 0 if report.matched == report.checked else 1


def _model_dir(args: argparse.Namespace, tmp: Path) -> tuple[Path, bool]:
    if args.model:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise SystemExit(f"pagedkv-demo: error: --model {path}: no config.json there")
        return path.resolve(), False
    from compute_node.model.tiny import build_tiny_model

    return build_tiny_model(tmp / "tiny-llama", "llama", seed=args.seed, **DEMO_MODEL_SPEC), True


def serve(stack: LocalStack, model_dir: Path, args: argparse.Namespace, console: Console) -> ModelDemoReport:
    tok = Tokenizer(model_dir)
    client = BlockManagerClient(stack.address("block-manager"))
    nodes = {f"node-{i}": RemoteNode(f"node-{i}", stack.address(n)) for i, n in enumerate(NODES)}
    engine = LLMEngine(client, nodes, EngineConfig(max_num_batched_tokens=args.max_batched_tokens),
                       detokenize=tok.decode)
    admin = AdminClient(stack.address("block-manager"))
    report = ModelDemoReport(model=model_dir.name, built=False)
    workload = build_workload(tok, args.requests, args.seed, engine.vocab_size)
    report.num_requests = len(workload)
    outputs: dict[str, RequestOutput] = {}
    ids = []
    try:
        t0 = time.perf_counter()
        # arrivals: a third up front, the rest one per step (a steady stream)
        pending = list(workload)
        head, pending = pending[: len(pending) // 3], pending[len(pending) // 3:]
        for r in head:
            ids.append(engine.add_request(r.prompt_ids, r.params))
        with _progress(console, "serving requests", len(workload)) as advance:
            step = 0
            while engine.has_unfinished_requests() or pending:
                if pending:
                    r = pending.pop(0)
                    ids.append(engine.add_request(r.prompt_ids, r.params))
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out
                        advance(1)
                step += 1
                if step % 4 == 0:
                    report.samples.append(_sample(admin, engine, time.perf_counter() - t0))
        engine.flush()
        report.wall_s = time.perf_counter() - t0
        report.stats = engine.stats.summary()
        report.generated = engine.stats.generated_tokens
        report.pools = admin.status().get("pools", [])
    finally:
        engine.close()
        admin.close()
        client.close()
    _check_reference(report, model_dir, workload, [outputs[i] for i in ids], console, args.max_checked)
    return report


def _sample(admin: AdminClient, engine: LLMEngine, t: float) -> Sample:
    pools = admin.status().get("pools", [])
    used = sum(int(p.get("num_used_blocks", 0)) for p in pools)
    bs = next(iter(engine.pool_blocks.values()))[1]
    # what per-request contiguous preallocation holds: prompt + max_tokens for every running sequence
    contiguous = sum(-(-(len(s.request.prompt_token_ids) + s.request.params.max_tokens) // bs)
                     for s in engine.running)
    return Sample(t, used, contiguous)


def _check_reference(report: ModelDemoReport, model_dir: Path, workload: list[DemoRequest],
                     outputs: list[RequestOutput], console: Console, max_checked: int = 64) -> None:
    """Greedy completions against transformers (an implementation that shares no code with the
    nodes' model), teacher-forced and batched: one forward pass over prompt + completion per
    sequence gives the reference's logits at every generated position, and each greedy token
    must be its argmax (or within a near-tie of it, where float rounding may pick either). That
    is the same verdict as comparing with transformers' own greedy `generate`, at the cost of
    one forward pass instead of one per token. At most `max_checked` requests (the first served),
    so the check stays seconds whatever `--requests` is. Sampled completions are counted, not
    compared: a different sampler draws different tokens from the same distribution."""
    greedy = [(r, o) for r, o in zip(workload, outputs) if r.params.greedy]
    report.greedy_total = sum(len(o.outputs) for _, o in greedy)
    report.sampled = sum(len(o.outputs) for r, o in zip(workload, outputs) if not r.params.greedy)
    todo = [(r, o, c) for r, o in greedy[: max(0, max_checked)] for c in o.outputs]
    todo.sort(key=lambda item: len(item[0].prompt_ids) + len(item[2].token_ids))   # less padding per batch
    if not todo:
        return
    t0 = time.perf_counter()
    reference = _reference(model_dir)
    report.reference = reference.name
    label = f"checking {len(todo)} greedy completions against {reference.name}"
    with _progress(console, label, len(todo)) as advance:
        for start in range(0, len(todo), CHECK_BATCH):
            batch = todo[start:start + CHECK_BATCH]
            verdicts = reference.check_greedy([(r.prompt_ids, c.token_ids) for r, _, c in batch])
            for (r, out, c), bad in zip(batch, verdicts):
                report.checked += 1
                if len(c.token_ids) != r.params.max_tokens:
                    report.mismatches.append(f"{out.request_id}/{c.index}: {len(c.token_ids)} tokens, "
                                             f"asked for {r.params.max_tokens}")
                elif bad is None:
                    report.matched += 1
                else:
                    report.mismatches.append(f"{out.request_id}/{c.index} at token {bad}")
            advance(len(batch))
    report.check_s = time.perf_counter() - t0


def _first_bad(logits: Any, tokens: list[int]) -> int | None:
    """The first position whose token is not the argmax of its logits row, beyond a near-tie
    (relative gap to the top logit under `NEAR_TIE_REL`); None when every token is greedy."""
    import torch

    rows = logits.float()
    top = rows.max(dim=-1).values
    chosen = rows[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)]
    gap = (top - chosen) / top.abs().clamp_min(1e-6)
    bad = torch.nonzero(gap >= NEAR_TIE_REL)
    return int(bad[0, 0]) if len(bad) else None


class _Reference(Protocol):
    name: str

    def check_greedy(self, sequences: list[tuple[list[int], list[int]]]) -> list[int | None]:
        """Per (prompt, completion): the first completion token that is not the reference's
        greedy choice given everything before it (beyond a near-tie), or None."""
        ...


def _reference(model_dir: Path) -> _Reference:
    try:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        return _RunnerReference(model_dir)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    class HfReference:
        name = "transformers"

        def __init__(self) -> None:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

        def check_greedy(self, sequences: list[tuple[list[int], list[int]]]) -> list[int | None]:
            """One right-padded forward pass for the batch (causal attention: padding after a
            sequence never reaches it); the vocabulary projection only where tokens were
            generated, so a large vocabulary costs no batch x length x vocab tensor."""
            width = max(len(p) + len(g) for p, g in sequences)
            ids = torch.zeros(len(sequences), width, dtype=torch.long)
            for i, (p, g) in enumerate(sequences):
                ids[i, : len(p) + len(g)] = torch.tensor(p + g)
            with torch.no_grad():
                hidden = self.model.get_decoder()(input_ids=ids).last_hidden_state
                head = self.model.get_output_embeddings()
                return [_first_bad(head(hidden[i, len(p) - 1 : len(p) + len(g) - 1]), g) if g else None
                        for i, (p, g) in enumerate(sequences)]

    return HfReference()


class _RunnerReference:
    """Without transformers (a demo venv installed by hand): the model run alone, one sequence
    at a time in its own pool. Not independent of the nodes' code; the report says so."""

    name = "the model alone (no transformers installed: not an independent check)"

    def __init__(self, model_dir: Path) -> None:
        from compute_node.model import ModelRunner

        self.model_dir = model_dir

        def runner(num_tokens: int) -> Any:
            return ModelRunner(model_dir, block_size=16, num_blocks=-(-num_tokens // 16), dtype="float32",
                               device="cpu")

        self.runner = runner

    def check_greedy(self, sequences: list[tuple[list[int], list[int]]]) -> list[int | None]:
        from compute_node.model import SeqWork

        verdicts: list[int | None] = []
        for p, g in sequences:
            n = len(p) + len(g)
            dbg = self.runner(n).debug_forward([SeqWork("ref", p + g, 0, list(range(-(-n // 16))))])
            verdicts.append(_first_bad(dbg.logits[len(p) - 1 : n - 1], g) if g else None)
        return verdicts


@contextlib.contextmanager
def _progress(console: Console, label: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on a terminal; piped (CI, `| tee`), a plain line every few seconds and at
    the end, so a long phase is never silent."""
    if console.is_terminal:
        with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task(label, total=total)
            yield lambda k: bar.advance(task, k)
        return
    t0 = last = time.perf_counter()
    done = 0
    console.print(f"{label}: 0/{total}")

    def advance(k: int) -> None:
        nonlocal done, last
        done += k
        now = time.perf_counter()
        if now - last >= PIPED_PROGRESS_S and done < total:
            console.print(f"{label}: {done}/{total} ({now - t0:.0f} s)")
            last = now

    yield advance
    console.print(f"{label}: {done}/{total} done in {time.perf_counter() - t0:.1f} s")


def render(r: ModelDemoReport, console: Console) -> None:
    s = r.stats
    t = Table(title=f"pagedkv demo — {r.model} on 2 compute nodes, {r.num_requests} requests")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rate = r.generated / max(r.wall_s, 1e-9)
    t.add_row("generated tokens / wall", f"{r.generated} in {r.wall_s:.1f} s = {rate:.1f} tok/s")
    t.add_row("time to first token p50 / p99", f"{s.get('ttft_p50_ms', 0):.0f} / {s.get('ttft_p99_ms', 0):.0f} ms")
    t.add_row("inter-token latency p50 / p99", f"{s.get('itl_p50_ms', 0):.0f} / {s.get('itl_p99_ms', 0):.0f} ms")
    peak_used = max((x.used_blocks for x in r.samples), default=0)
    peak_contig = max((x.contiguous_blocks for x in r.samples), default=0)
    t.add_row("peak KV blocks: paged / contiguous preallocation",
              f"{peak_used} / {peak_contig} ({peak_used / max(peak_contig, 1):.2f}x)")
    hits = sum(int(p.get("prefix_hit_tokens", 0)) for p in r.pools)
    queried = sum(int(p.get("prefix_query_tokens", 0)) for p in r.pools)
    t.add_row("prefix cache hit tokens / queried", f"{hits} / {queried} ({100 * hits / max(queried, 1):.1f}%)")
    t.add_row("copy-on-write copies (n > 1 forks)", str(sum(int(p.get("cow_copies", 0)) for p in r.pools)))
    recomputes = int(s.get("preemptions", 0)) - int(s.get("swap_outs", 0))
    t.add_row("preemptions: swapped / recomputed", f"{int(s.get('swap_outs', 0))} / {recomputes}")
    t.add_row("host blocks: swap out / in, offload / onboard",
              f"{int(s.get('swapped_out_blocks', 0))} / {int(s.get('swapped_in_blocks', 0))}, "
              f"{int(s.get('offloaded_blocks', 0))} / {int(s.get('onboarded_blocks', 0))}")
    t.add_row("prefix hit tokens: device / host", f"{int(s.get('prefix_hit_tokens', 0))} / "
              f"{int(s.get('host_hit_tokens', 0))}")
    plans = sum(int(p.get("compaction_plans", 0)) + int(p.get("contiguity_plans", 0)) for p in r.pools)
    t.add_row("defrag plans committed / blocks moved",
              f"{plans} / {sum(int(p.get('defrag_moves', 0)) for p in r.pools)}")
    verdict = "[green]OK[/green]" if r.matched == r.checked else "[red]MISMATCH[/red]"
    t.add_row(f"greedy completions equal to {r.reference or 'the reference'}", f"{verdict} {r.matched}/{r.checked}")
    console.print(t)
    console.print(check_summary(r), markup=False)
    for m in r.mismatches[:5]:
        console.print(f"[red]mismatch: {m}[/red]")


def check_summary(r: ModelDemoReport) -> str:
    """What the correctness check covered, in words (the report's last line)."""
    text = (f"checked: {r.checked} of {r.greedy_total} greedy completions, every token the argmax of the "
            f"logits of {r.reference or 'the reference'} given the tokens before it (batched, {r.check_s:.1f} s)")
    if r.checked < r.greedy_total:
        text += f"; the other {r.greedy_total - r.checked} skipped (--max-checked bounds the check)"
    return text + (f"; {r.sampled} sampled completions (temperature > 0) not compared: a different sampler "
                   "draws different tokens from the same distribution")


def plot(r: ModelDemoReport, path: Path) -> None:
    ts = [x.t for x in r.samples]
    write(Chart(
        title=f"{r.model}: KV memory while serving", x_label="seconds", y_label="KV blocks",
        series=[Series("paged (blocks in use)", ts, [x.used_blocks for x in r.samples]),
                Series("contiguous preallocation", ts, [x.contiguous_blocks for x in r.samples], dashed=True)],
    ), path)


__all__ = ["ModelDemoReport", "build_workload", "check_summary", "run"]
