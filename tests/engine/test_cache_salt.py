"""`SamplingParams.cache_salt` (vLLM's `cache_salt`): requests with different salts never share
KV blocks, the same salt (or none) shares. Seen from the block manager: the blocks a pair of
identical prompts holds while both run, the blocks left cached after, and the cached prompt
tokens of each request."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.llm import LLM
from engine.params import InvalidParams, RequestOutput, SamplingParams
from tests.engine.services import Services

BLOCK_SIZE = 4
PROMPT = [random.Random(12).randrange(1, 512) for _ in range(22)]   # 5 full blocks, 2 tokens over
FULL_BLOCKS = len(PROMPT) // BLOCK_SIZE


def _llm(model_dirs: dict[str, Path]) -> LLM:
    return LLM(model_dirs["llama-gqa4-hd64"], block_size=BLOCK_SIZE, num_kv_blocks=128, device="cpu")


def _params(salt: str | None, max_tokens: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, cache_salt=salt)


def _metrics(llm: LLM):   # type: ignore[no-untyped-def]
    return llm.client.state.core.metrics("local-0")   # type: ignore[attr-defined]


def _blocks_held_while_running(llm: LLM, salts: tuple[str | None, ...]) -> int:
    """Blocks in use while identical prompts (one per salt) run, admitted in one step."""
    engine = llm.engine
    ids = [engine.add_request(PROMPT, _params(s, max_tokens=8)) for s in salts]
    engine.step()
    engine.drain()
    used = _metrics(llm).num_used_blocks
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    engine.flush()
    assert _metrics(llm).num_used_blocks == 0
    return used


@pytest.mark.parametrize("salts, shared", [
    ((None, None), True), (("tenant-a", "tenant-a"), True), (("tenant-a", "tenant-b"), False),
    ((None, "tenant-a"), False),
])
def test_a_running_pair_shares_blocks_only_under_one_salt(model_dirs: dict[str, Path],
                                                          salts: tuple[str | None, str | None],
                                                          shared: bool) -> None:
    with _llm(model_dirs) as llm:
        alone = _blocks_held_while_running(llm, (None,))
    with _llm(model_dirs) as llm:         # nothing cached: what the pair holds is what it shares
        used = _blocks_held_while_running(llm, salts)
    if shared:
        assert used <= 2 * alone - FULL_BLOCKS, f"{salts}: {used} blocks, {alone} alone"
    else:
        assert used == 2 * alone, f"{salts}: {used} blocks, {alone} alone"


def test_cached_prefix_is_served_only_to_its_salt(model_dirs: dict[str, Path]) -> None:
    with _llm(model_dirs) as llm:
        def cached(salt: str | None) -> int:
            out = llm.generate([{"prompt_token_ids": PROMPT}], _params(salt))[0]
            llm.engine.flush()
            return out.num_cached_tokens

        assert cached("a") == 0
        assert cached("a") == FULL_BLOCKS * BLOCK_SIZE          # the same salt shares
        assert cached("b") == 0                                # another salt does not
        assert cached(None) == 0                               # nor does no salt
        assert cached(None) == FULL_BLOCKS * BLOCK_SIZE
        assert cached("b") == FULL_BLOCKS * BLOCK_SIZE
        # one copy of the prompt's full blocks per salt (a, b, none) stays cached, none shared
        assert _metrics(llm).num_cached_blocks >= 3 * FULL_BLOCKS


@pytest.mark.parametrize("bad", ["", 7, b"a", "x" * 1025])
def test_a_bad_salt_is_refused(bad: object) -> None:
    with pytest.raises(InvalidParams, match="cache_salt"):
        SamplingParams(cache_salt=bad)   # type: ignore[arg-type]


def test_salts_over_services(model_dirs: dict[str, Path]) -> None:
    """The salt travels in the Step to a block manager process's core (the gRPC path)."""
    services = Services(model_dirs["llama-gqa4-hd64"], num_nodes=1)
    try:
        engine = services.engine()
        try:
            def cached(salt: str | None) -> int:
                rid = engine.add_request(PROMPT, _params(salt))
                done: dict[str, RequestOutput] = {}
                while engine.has_unfinished_requests():
                    done.update((o.request_id, o) for o in engine.step() if o.finished)
                engine.flush()
                return done[rid].num_cached_tokens

            hit = FULL_BLOCKS * BLOCK_SIZE
            assert [cached(s) for s in ("x", "x", "y", None, None)] == [0, hit, 0, 0, hit]
        finally:
            engine.close()
    finally:
        services.close()
