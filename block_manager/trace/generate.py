"""Seeded generator of realistic serving traces in the replay format.

The generator plays a tiny continuous-batching scheduler: requests arrive as a Poisson
process per step, wait in FIFO order, and are admitted while the number of running sequences
stays within `max_running`. An admitted request is prefilled (`allocate` with its prompt),
forked right away into `n - 1` extra samples when it uses parallel sampling, and then every
running sequence decodes one token per step (one batched `append` line per step). A sequence
that has produced its output length is freed at the end of that step.

The schedule ignores memory on purpose: it is what a scheduler *wants* to run, and the
replay decides what a pool of a given size can hold (rejections, preemptions). Every
randomness comes from one seeded NumPy generator, so the same config gives a byte-identical
file.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

LengthDist = Literal["loguniform", "lognormal"]


class TraceConfigError(ValueError):
    """A generator knob is out of range; raised before anything is written."""


@dataclass(slots=True)
class TraceConfig:
    """Knobs of a generated trace. Defaults resemble a chat-serving mix."""

    num_requests: int = 200
    seed: int = 0
    vocab_size: int = 32_000
    # Shared system prompts: `shared_prompt_fraction` of requests start with one of
    # `num_system_prompts` fixed prompts of `system_prompt_len` tokens (chosen uniformly).
    num_system_prompts: int = 4
    system_prompt_len: int = 256
    shared_prompt_fraction: float = 0.5
    # Per-request prompt (after any system prompt) and output lengths, clipped to [min, max].
    prompt_len_min: int = 50
    prompt_len_max: int = 1000
    output_len_min: int = 50
    output_len_max: int = 2000
    length_dist: LengthDist = "loguniform"
    # Parallel sampling: `parallel_fraction` of requests sample `parallel_n` continuations.
    parallel_n: int = 4
    parallel_fraction: float = 0.0
    # Arrivals: Poisson with mean `arrival_rate` requests per step; admission is FIFO while
    # running sequences (samples count individually) stay within `max_running`.
    arrival_rate: float = 1.0
    max_running: int = 256
    # Tenants: requests are spread uniformly over `num_tenants` salts ("tenant-0", ...);
    # with one tenant no salt is written.
    num_tenants: int = 1

    def validate(self) -> None:
        """Raise `TraceConfigError` naming the first bad knob."""
        positive = {
            "num_requests": self.num_requests,
            "vocab_size": self.vocab_size,
            "prompt_len_min": self.prompt_len_min,
            "output_len_min": self.output_len_min,
            "parallel_n": self.parallel_n,
            "max_running": self.max_running,
            "num_tenants": self.num_tenants,
        }
        for name, value in positive.items():
            if value < 1:
                raise TraceConfigError(f"{name} must be >= 1, got {value}")
        if self.num_system_prompts < 0 or self.system_prompt_len < 0:
            raise TraceConfigError("num_system_prompts and system_prompt_len must be >= 0")
        if self.prompt_len_max < self.prompt_len_min:
            raise TraceConfigError("prompt_len_max must be >= prompt_len_min")
        if self.output_len_max < self.output_len_min:
            raise TraceConfigError("output_len_max must be >= output_len_min")
        for name in ("shared_prompt_fraction", "parallel_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise TraceConfigError(f"{name} must be in [0, 1], got {value}")
        if self.shared_prompt_fraction > 0 and (
            self.num_system_prompts == 0 or self.system_prompt_len == 0
        ):
            raise TraceConfigError(
                "shared_prompt_fraction > 0 needs num_system_prompts >= 1 and system_prompt_len >= 1"
            )
        if not self.arrival_rate > 0 or not math.isfinite(self.arrival_rate):
            raise TraceConfigError(f"arrival_rate must be > 0, got {self.arrival_rate}")
        if self.parallel_fraction > 0 and self.parallel_n > self.max_running:
            raise TraceConfigError("parallel_n must be <= max_running")
        if self.length_dist not in ("loguniform", "lognormal"):
            raise TraceConfigError(f"length_dist must be loguniform or lognormal, got {self.length_dist!r}")


@dataclass(slots=True)
class _Request:
    """A request waiting for admission: everything drawn at arrival time."""

    request_id: str
    prompt: list[int]
    salt: str | None
    output_lens: list[int]  # one per sample


@dataclass(slots=True)
class _Running:
    seq_id: str
    num_left: int  # output tokens still to generate


def _draw_length(rng: np.random.Generator, lo: int, hi: int, dist: LengthDist) -> int:
    """Draw a length in [lo, hi]. Both shapes are heavy towards short lengths, like serving."""
    if lo == hi:
        return lo
    log_lo, log_hi = math.log(lo), math.log(hi)
    if dist == "loguniform":
        value = math.exp(rng.uniform(log_lo, log_hi))
    else:
        # Median at the geometric midpoint; +-2 sigma spans [lo, hi] before clipping.
        value = rng.lognormal((log_lo + log_hi) / 2, (log_hi - log_lo) / 4)
    return int(min(hi, max(lo, round(value))))


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, size=n).tolist()


class TraceGenerator:
    """Turns a `TraceConfig` into trace ops (dicts), one scheduler step at a time."""

    def __init__(self, config: TraceConfig) -> None:
        config.validate()
        self.config = config
        self.rng = np.random.default_rng(config.seed)
        self.system_prompts = [
            _tokens(self.rng, config.system_prompt_len, config.vocab_size)
            for _ in range(config.num_system_prompts)
        ]

    def _new_request(self, index: int) -> _Request:
        cfg, rng = self.config, self.rng
        prompt: list[int] = []
        if cfg.shared_prompt_fraction > 0 and rng.random() < cfg.shared_prompt_fraction:
            prompt.extend(self.system_prompts[int(rng.integers(0, len(self.system_prompts)))])
        user_len = _draw_length(rng, cfg.prompt_len_min, cfg.prompt_len_max, cfg.length_dist)
        prompt.extend(_tokens(rng, user_len, cfg.vocab_size))
        salt = f"tenant-{int(rng.integers(0, cfg.num_tenants))}" if cfg.num_tenants > 1 else None
        n = cfg.parallel_n if cfg.parallel_fraction > 0 and rng.random() < cfg.parallel_fraction else 1
        output_lens = [
            _draw_length(rng, cfg.output_len_min, cfg.output_len_max, cfg.length_dist) for _ in range(n)
        ]
        return _Request(f"r{index}", prompt, salt, output_lens)

    def ops(self) -> Iterator[dict[str, object]]:
        """Yield the trace ops in order; the schedule ends when every request is freed."""
        cfg, rng = self.config, self.rng
        waiting: deque[_Request] = deque()
        running: list[_Running] = []
        num_arrived = 0
        while num_arrived < cfg.num_requests or waiting or running:
            num_new = min(int(rng.poisson(cfg.arrival_rate)), cfg.num_requests - num_arrived)
            for _ in range(num_new):
                waiting.append(self._new_request(num_arrived))
                num_arrived += 1
            while waiting and len(running) + len(waiting[0].output_lens) <= cfg.max_running:
                request = waiting.popleft()
                yield from self._admit(request, running)
            if not running:
                continue
            new_tokens = _tokens(rng, len(running), cfg.vocab_size)
            yield {
                "op": "append",
                "seqs": {seq.seq_id: [token] for seq, token in zip(running, new_tokens)},
            }
            for seq in running:
                seq.num_left -= 1
            finished_ids = [seq.seq_id for seq in running if seq.num_left == 0]
            running = [seq for seq in running if seq.num_left > 0]
            if finished_ids:
                yield {"op": "free", "seqs": finished_ids}

    def _admit(self, request: _Request, running: list[_Running]) -> Iterator[dict[str, object]]:
        op: dict[str, object] = {"op": "allocate", "seq": request.request_id, "tokens": request.prompt}
        if request.salt is not None:
            op["salt"] = request.salt
        yield op
        child_ids = [f"{request.request_id}/{i}" for i in range(1, len(request.output_lens))]
        if child_ids:
            yield {"op": "fork", "parent": request.request_id, "children": child_ids}
        for seq_id, output_len in zip([request.request_id, *child_ids], request.output_lens):
            running.append(_Running(seq_id, output_len))


def generate_trace(config: TraceConfig) -> Iterator[str]:
    """Yield the trace as JSON lines (without newlines)."""
    for op in TraceGenerator(config).ops():
        yield json.dumps(op, separators=(",", ":"))


def write_trace(path: str | Path, config: TraceConfig) -> int:
    """Write the trace to `path` (one op per line); returns the number of ops written."""
    num_ops = 0
    with open(path, "w", encoding="utf-8") as f:
        for line in generate_trace(config):
            f.write(line)
            f.write("\n")
            num_ops += 1
    return num_ops


def config_fields() -> dict[str, object]:
    """Default value of every knob, for CLI flag generation and documentation."""
    return asdict(TraceConfig())
