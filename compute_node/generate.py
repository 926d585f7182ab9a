"""One model step on a node: the block manager's steps, then every layer for the batch, then sampling.

`Generator` is the domain logic behind the `Generate` RPC, shared by the node process and the
engine's in-process node. Like `Forward`, everything is checked before anything changes: the
request's fields, the pool steps (`tables.stage`: order, epoch, versions, block ids), each
sequence against its staged table (its new tokens must start exactly at the tail the node
holds, the table must cover them, positions stay within the model's context) and the sampling
parameters. Only then are the copy ops run, the tables committed and the model executed. A
retried request id is answered from the last response, not run twice (a step's writes must
happen once, and a sampled token must not change on a retry).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypedDict

from compute_node.errors import InvalidForward, PeerFetchFailed
from compute_node.host_pool import apply_moves
from compute_node.model import (
    MAX_LOGPROBS,
    InvalidSamplingParams,
    ModelRunner,
    PromptLogprobsRequest,
    SamplingParams,
    SeqWork,
    StepResult,
)
from compute_node.tables import NodeTable, SeqId, TableCache, check_tail, stage
from compute_node.transfer import BlockPuller, PullStats, pull_all, pull_all_staged
from pagedkv.limits import seq_id_problem
from pagedkv.v1 import compute_node_pb2 as pb


@dataclass(slots=True)
class _Seq:
    seq_id: SeqId
    token_ids: list[int]
    context_len: int
    sampling: SamplingParams | None
    num_output_tokens: int
    prompt_logprobs: PromptLogprobsRequest | None = None


class Generator:
    def __init__(self, runner: ModelRunner, tables: TableCache, *, max_batch: int = 4096) -> None:
        self.runner = runner
        self.tables = tables
        self.max_batch = max_batch
        self._last: tuple[str, pb.GenerateResponse] | None = None
        # prefix fetch (compute_node/transfer.py): the puller of a node that can reach other
        # nodes (None: every fetch is recomputed), and where the step's serve grants go
        self.puller: BlockPuller | None = None
        self.on_serves: Callable[[list[Any]], None] | None = None
        self.on_fetch_failed: Callable[[Any, str], None] | None = None

    def reset(self) -> None:
        """A new registration: nothing of the old epoch's pool is valid."""
        self._last = None

    def generate(self, request: pb.GenerateRequest, node_id: str, epoch: int) -> pb.GenerateResponse:
        started = time.perf_counter()
        if not request.request_id:
            raise InvalidForward("request_id must be set")
        if self._last is not None and self._last[0] == request.request_id:
            return self._last[1]
        seqs = self._parse(request)
        runner = self.runner
        host, disk = runner.host_pool, runner.disk_store
        staged = stage(self.tables, request.steps, node_id, epoch, runner.geometry.num_blocks,
                       0 if host is None else host.num_blocks, 0 if disk is None else disk.num_blocks)
        bs = runner.geometry.block_size
        work: list[SeqWork] = []
        tables: dict[SeqId, NodeTable] = {}
        for s in seqs:
            start = s.context_len - len(s.token_ids)
            table = check_tail(s.seq_id, staged.table(self.tables, s.seq_id), start, s.context_len, bs)
            tables[s.seq_id] = table
            work.append(SeqWork(s.seq_id, s.token_ids, start, list(table.block_table), s.sampling,
                                s.num_output_tokens, s.prompt_logprobs))
        fetch_work = self._check_fetches(staged.fetches, work) if staged.fetches else {}
        # A fetch's blocks are written after its step's tier moves and copies (which may still
        # read or write its destination blocks) and before any later step's. When every fetch
        # can be recomputed and comes after every move and copy of the request (one step, the
        # usual case), it is pulled straight into the pool once they have run. Otherwise each
        # is pulled into a host buffer first, before anything is applied — a failed one is
        # recomputed in this step, or fails the step whole when no sequence of the step can
        # recompute it (PeerFetchFailed, ABORTED) — and landed in step order by apply_moves.
        direct = all(f.fetch_id in fetch_work and staged.lands_last(i) for i, f in enumerate(staged.fetches))
        pulled = PullStats()
        landings: list[tuple[tuple[int, int], Callable[[], None]]] = []
        if staged.fetches and not direct:
            pulled, got = pull_all_staged(self.puller, runner.geometry, staged.fetches,
                                          lambda op, why: self._fetch_failed(fetch_work, op, why))
            marks = {f.fetch_id: mark for f, mark in zip(staged.fetches, staged.fetch_marks)}
            landings = [(marks[g.op.fetch_id], partial(g.land, runner.pool)) for g in got]
        # ---- everything is checked: apply ----
        if staged.serves and self.on_serves is not None:
            self.on_serves(staged.serves)   # granted blocks are written and pinned: serve them now
        t0 = time.perf_counter()
        if staged.tier_moves or landings:
            apply_moves(runner.pool, host, staged, disk, landings)   # moves, copies and fetches, in step order
        elif staged.copy_pairs:
            runner.copy_blocks(staged.copy_pairs)
        copy_s = time.perf_counter() - t0
        if staged.fetches and direct:
            # pulled before the step reads them; a failed pull is recomputed in this very step
            pulled = pull_all(self.puller, runner.pool, staged.fetches,
                              lambda op, why: self._recompute(fetch_work[op.fetch_id], op, why))
        self.tables.commit(staged)
        for s in seqs:
            table = tables[s.seq_id]
            table.num_tokens = s.context_len
            self.tables.put(s.seq_id, table)
        was_profiling = runner.profile
        runner.profile = was_profiling or request.profile   # phase timings only when asked
        try:
            result = runner.run_step(work) if work else StepResult([])
        finally:
            runner.profile = was_profiling
        resp = _response(result)
        t = runner.last_timings if work else None
        st = resp.stats
        if t is not None:
            st.prepare_s, st.dense_s, st.attention_s, st.sample_s = t.prepare_s, t.dense_s, t.attention_s, t.sample_s
        st.copy_ops_s = copy_s
        st.num_copy_ops = len(staged.copy_pairs)
        st.last_step_id = self.tables.last_step_id
        st.fetched_blocks, st.fetch_recomputed_tokens = pulled.fetched_blocks, pulled.recomputed_tokens
        st.fetch_s, st.fetch_bytes = pulled.seconds, pulled.num_bytes
        st.total_s = time.perf_counter() - started
        self._last = (request.request_id, resp)
        return resp

    @staticmethod
    def _prompt_logprobs(s: pb.GenerateSequence, vocab: int) -> PromptLogprobsRequest | None:
        """The sequence's prompt log-probability request, checked like the rest of the step
        (InvalidForward before anything changes)."""
        if not s.HasField("prompt_logprobs"):
            return None
        p = s.prompt_logprobs
        targets = tuple(p.target_token_ids)
        if not 1 <= len(targets) <= len(s.token_ids):
            raise InvalidForward(f"sequence {s.seq_id!r}: prompt log-probabilities need 1 to {len(s.token_ids)} "
                                 f"targets (one per new token at most), got {len(targets)}")
        if max(targets) >= vocab:
            raise InvalidForward(f"sequence {s.seq_id!r}: prompt log-probability target {max(targets)} outside "
                                 f"the vocabulary ({vocab})")
        if p.num_top > MAX_LOGPROBS:
            raise InvalidForward(f"sequence {s.seq_id!r}: prompt log-probabilities num_top must be at most "
                                 f"{MAX_LOGPROBS}, got {p.num_top}")
        return PromptLogprobsRequest(int(s.context_len) - len(s.token_ids), targets, int(p.num_top))

    def _check_fetches(self, fetches: list[Any], work: list[SeqWork]) -> dict[str, SeqWork]:
        """A fetch op whose sequence is computed in this step must sit right before that
        sequence's new tokens, on its table's blocks: so a failed pull can be recomputed in the
        step (its tokens prepended). Returns each such fetch's sequence work (a fetch for a
        sequence the step does not compute is left out: it cannot fall back)."""
        by_seq = {w.seq_id: w for w in work}
        bs = self.runner.geometry.block_size
        vocab = self.runner.model_config.vocab_size
        out: dict[str, SeqWork] = {}
        for f in fetches:
            w = by_seq.get(f.seq_id)
            n = len(f.dst_blocks)
            if w is None:
                continue
            first = f.first_token
            if (first % bs or len(f.token_ids) != n * bs or first + n * bs != w.num_computed_tokens
                    or list(w.block_table[first // bs: first // bs + n]) != list(f.dst_blocks)):
                raise InvalidForward(f"fetch {f.fetch_id!r} does not cover the positions just before sequence "
                                     f"{f.seq_id!r}'s new tokens with its table's blocks")
            if f.token_ids and max(f.token_ids) >= vocab:
                raise InvalidForward(f"fetch {f.fetch_id!r}: a token id outside the vocabulary ({vocab})")
            out[f.fetch_id] = w
        return out

    def _fetch_failed(self, fetch_work: dict[str, SeqWork], op: Any, why: str) -> None:
        """A failed pull: recomputed by its sequence in this step; where the step does not
        compute that sequence, the step fails whole (nothing of it applied yet)."""
        w = fetch_work.get(op.fetch_id)
        if w is None:
            raise PeerFetchFailed(f"{why}; sequence {op.seq_id!r} is not computed in this step, so the step "
                                  "cannot recompute it: report the step failed and recompute")
        self._recompute(w, op, why)

    def _recompute(self, w: SeqWork, op: Any, why: str) -> None:
        """A failed pull: the sequence computes the fetched positions itself, in this step."""
        w.token_ids = [*op.token_ids, *w.token_ids]
        w.num_computed_tokens = op.first_token
        if self.on_fetch_failed is not None:
            self.on_fetch_failed(op, why)

    def _parse(self, request: pb.GenerateRequest) -> list[_Seq]:
        runner = self.runner
        vocab = runner.model_config.vocab_size
        if len(request.sequences) > self.max_batch:
            raise InvalidForward(f"a step takes at most {self.max_batch} sequences, got {len(request.sequences)}")
        if not request.sequences and not request.steps:
            raise InvalidForward("a step needs sequences or pool steps")
        out: list[_Seq] = []
        seen: set[str] = set()
        for i, s in enumerate(request.sequences):
            problem = seq_id_problem(s.seq_id)
            if problem is not None:
                raise InvalidForward(f"sequences[{i}].seq_id {problem}")
            if s.seq_id in seen:
                raise InvalidForward(f"sequence {s.seq_id!r} appears twice in the step")
            seen.add(s.seq_id)
            ids = list(s.token_ids)
            if not ids:
                raise InvalidForward(f"sequence {s.seq_id!r} has no new tokens")
            if max(ids) >= vocab:
                raise InvalidForward(f"sequence {s.seq_id!r}: token id {max(ids)} outside the vocabulary ({vocab})")
            if not len(ids) <= s.context_len <= runner.max_model_len:
                raise InvalidForward(
                    f"sequence {s.seq_id!r}: context_len {s.context_len} must be in [{len(ids)}, "
                    f"{runner.max_model_len}] (its new tokens .. the model's context)"
                )
            sampling = None
            if s.HasField("sampling"):
                p = s.sampling
                try:
                    sampling = SamplingParams(
                        temperature=p.temperature, top_p=p.top_p or 1.0, top_k=p.top_k or None, min_p=p.min_p,
                        seed=p.seed if p.HasField("seed") else None,
                        logprobs=p.logprobs if p.HasField("logprobs") else None,
                    )
                except InvalidSamplingParams as exc:
                    raise InvalidForward(f"sequence {s.seq_id!r}: {exc}") from None
            out.append(_Seq(SeqId(s.seq_id), ids, int(s.context_len), sampling, int(s.num_output_tokens),
                            self._prompt_logprobs(s, vocab)))
        return out


def _response(result: StepResult) -> pb.GenerateResponse:
    """The step's sampled tokens and prompt log-probabilities as the protocol's answer."""
    resp = pb.GenerateResponse()
    for out in result.outputs:
        if out is None:
            continue
        tok = resp.tokens.add(seq_id=out.seq_id, token_id=out.token_id)
        if out.logprob is not None:
            tok.logprob = out.logprob
        for token_id, logprob in out.top_logprobs or ():
            tok.top_token_ids.append(token_id)
            tok.top_logprobs.append(logprob)
    for scored in result.prompt_logprobs:
        m = resp.prompt_logprobs.add(seq_id=scored.seq_id)
        m.logprobs.extend(scored.logprobs)
        m.ranks.extend(scored.ranks)
        for row in scored.top:
            m.top_token_ids.extend(t for t, _ in row)
            m.top_logprobs.extend(lp for _, lp in row)
    return resp


class ModelInfoFields(TypedDict, total=False):
    """The model part of `GetNodeInfoResponse`, typed so it can be passed as keywords (empty
    for a node that serves attention only)."""

    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]


def node_info_fields(runner: ModelRunner, model_name: str) -> ModelInfoFields:
    """The model part of `GetNodeInfoResponse`."""
    cfg = runner.model_config
    return {
        "model": model_name,
        "vocab_size": cfg.vocab_size,
        "max_model_len": runner.max_model_len,
        "eos_token_ids": list(cfg.eos_token_ids),
    }


__all__ = ["Generator", "ModelInfoFields", "node_info_fields"]
