"""Shared test code: tiny model directories with their transformers twin, a minimal block
allocator, a minimal continuous-batching loop over `ModelRunner`, and the greedy comparison
against transformers `generate` with the near-tie rule."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compute_node.model import ModelRunner, SamplingParams, SeqWork
from compute_node.model.tiny import build_tiny_model

GREEDY = SamplingParams(temperature=0.0)
NEAR_TIE_REL = 1e-4


class BlockAllocator:
    """Free list of block ids, handed out in a shuffled order so tables are never contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("test pool too small")
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


@dataclass
class Request:
    """One generation in a scripted schedule.

    Admitted at step `admit_step`; its prompt is computed `chunk_size` tokens per step (None:
    all at once); with `share_from`, its table starts with that request's first
    `shared_blocks` blocks and those tokens are not recomputed (a prefix-cache hit)."""

    prompt: list[int]
    max_new_tokens: int
    admit_step: int = 0
    chunk_size: int | None = None
    share_from: int | None = None
    shared_blocks: int = 0
    sample: SamplingParams = GREEDY
    # state
    table: list[int] = field(default_factory=list)
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


def run_schedule(runner: ModelRunner, requests: list[Request], seed: int = 0) -> list[list[int]]:
    """Drive `runner` step by step over `requests` (every running sequence in one `execute`:
    prefill chunks and decodes mixed); returns each request's generated tokens."""
    bs = runner.geometry.block_size
    alloc = BlockAllocator(runner.geometry.num_blocks, seed)
    step = 0
    while not all(r.done for r in requests):
        batch: list[SeqWork] = []
        owners: list[Request] = []
        for i, r in enumerate(requests):
            if r.done or r.admit_step > step:
                continue
            if not r.table and r.num_computed == 0 and not r.pending:
                _admit(r, requests, alloc, bs)
            if r.num_computed < len(r.prompt):
                end = len(r.prompt) if r.chunk_size is None else min(len(r.prompt), r.num_computed + r.chunk_size)
                new = r.prompt[r.num_computed:end]
                wants = end == len(r.prompt)
            else:
                new, wants = r.pending, True
            needed = -(-(r.num_computed + len(new)) // bs)
            r.table += alloc.take(needed - len(r.table))
            batch.append(SeqWork(f"seq-{i}", list(new), r.num_computed, list(r.table),
                                 r.sample if wants else None, len(r.output)))
            owners.append(r)
        outputs = runner.execute(batch)
        for r, work, out in zip(owners, batch, outputs):
            r.num_computed += len(work.token_ids)
            if out is not None:
                r.output.append(out.token_id)
                r.logprobs.append((out.logprob, out.top_logprobs))
                r.pending = [out.token_id]
        step += 1
        if step > 10_000:
            raise RuntimeError("schedule did not finish")
    return [r.output for r in requests]


def _admit(r: Request, requests: list[Request], alloc: BlockAllocator, bs: int) -> None:
    if r.share_from is None:
        return
    source = requests[r.share_from]
    shared = r.shared_blocks * bs
    if source.num_computed < shared or source.prompt[:shared] != r.prompt[:shared]:
        raise RuntimeError("scenario bug: the shared prefix is not computed yet or differs")
    r.table = source.table[: r.shared_blocks]
    r.num_computed = r.shared_blocks * bs


@dataclass
class Reference:
    tokens: list[int]
    logits: list[torch.Tensor]   # raw logits [vocab] before each generated token


def hf_greedy(hf_model: Any, prompt: list[int], max_new_tokens: int) -> Reference:
    """transformers `generate`, greedy, batch 1, EOS disabled (every step is compared)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False, eos_token_id=None,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
    return Reference(out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits])


def compare_greedy(ours: list[int], ref: Reference, label: str) -> int:
    """Assert `ours` equals the reference token for token, except after a near-tie: the first
    divergence is tolerated only where the reference's top-2 logit gap is below NEAR_TIE_REL
    (relative) and our token is one of the tied ones; later tokens are then not compared.
    Returns how many tokens matched."""
    for step, (a, b) in enumerate(zip(ours, ref.tokens)):
        if a == b:
            continue
        logits = ref.logits[step].float()
        top2 = torch.topk(logits, 2).values
        scale = max(abs(float(top2[0])), 1e-6)
        gap = float(top2[0] - top2[1]) / scale
        ours_gap = float(top2[0] - logits[a]) / scale
        if gap < NEAR_TIE_REL and ours_gap < NEAR_TIE_REL:
            return step
        raise AssertionError(
            f"{label}: token {step} differs (ours {a}, transformers {b}); the reference's top-2 logit gap "
            f"there is {gap:.3e} relative (ours is {ours_gap:.3e} below the top), not a near-tie"
        )
    if len(ours) != len(ref.tokens):
        raise AssertionError(f"{label}: {len(ours)} tokens vs {len(ref.tokens)}")
    return len(ours)


_MODELS: dict[tuple[str, str, str], Path] = {}


def tiny_model_dir(root: Path, arch: str, **kwargs: Any) -> Path:
    """Build (once per process) a tiny model directory for these arguments."""
    key = (str(root), arch, repr(sorted(kwargs.items())))
    if key not in _MODELS:
        name = f"{arch}-{len(_MODELS)}"
        _MODELS[key] = build_tiny_model(root / name, arch, **kwargs)
    return _MODELS[key]


def load_hf(model_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    return model
