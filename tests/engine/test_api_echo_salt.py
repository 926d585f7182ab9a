"""`echo` + `logprobs` on /v1/completions (what lm-eval's `local-completions` sends) and
`cache_salt` on both endpoints, through a real server and the official `openai` client.

Prompt log-probabilities equal transformers' log-softmax of the same tokens within 1e-4
(float32 on both sides), also for a prompt whose prefix is cached (a scoring request computes
every position: `cached_tokens` 0). Salts: the same salt shares cached blocks, another salt
or none shares nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from engine.llm import LLM
from engine.params import MAX_LOGPROBS
from tests.compute_node.model.model_helpers import hf_greedy
from tests.engine.test_api_server import aeng, client, llm, model_dir, server  # noqa: F401 - fixtures

ATOL = 1e-4
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPT = "The paged cache keeps every block of the prompt it has seen before"


def _reference(hf_models: dict[str, Any], ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_models["llama-gqa4-hd64"](torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def _check_echo(lp: Any, ids: list[int], ref: torch.Tensor, served: LLM, num_generated: int) -> None:
    """OpenAI's legacy shape over prompt + completion; the prompt's values are transformers'."""
    n = len(ids) + num_generated
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(ids)] == [served.tokenizer.token_text(t) for t in ids]
    assert lp.text_offset[0] == 0 and all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    for pos in range(1, len(ids)):
        want = float(ref[pos - 1, ids[pos]])
        assert abs(lp.token_logprobs[pos] - want) <= ATOL, f"position {pos}"
        top = lp.top_logprobs[pos]
        assert lp.tokens[pos] in top and abs(top[lp.tokens[pos]] - want) <= ATOL
        best = float(ref[pos - 1].max())
        assert abs(max(top.values()) - best) <= ATOL, f"position {pos}: the most likely token is listed"


def test_echo_logprobs_are_the_prompts_as_lm_eval_asks(client: openai.OpenAI, llm: LLM,  # noqa: F811
                                                       model_dir: Path, hf_models: dict[str, Any]) -> None:  # noqa: F811
    ids = llm.tokenizer.encode(PROMPT)
    ref = _reference(hf_models, ids)
    out = client.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
                                    **GREEDY)
    choice = out.choices[0]
    _check_echo(choice.logprobs, ids, ref, llm, 1)
    assert choice.text.startswith(PROMPT) and len(choice.text) >= len(PROMPT)
    # the greedy token is the last prompt row's best: the same forward pass scored the prompt
    assert abs(choice.logprobs.token_logprobs[-1] - float(ref[-1].max())) <= ATOL
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 1

    only = client.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                     **GREEDY)
    assert only.choices[0].text == PROMPT and only.usage.completion_tokens == 0
    _check_echo(only.choices[0].logprobs, ids, ref, llm, 0)

    chunks = list(client.completions.create(model=model_dir.name, prompt=ids, max_tokens=4, echo=True,
                                            logprobs=2, stream=True, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(llm.tokenizer.decode(ids))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == len(ids) + 4


def test_echo_of_a_cached_prefix_is_scored_from_a_full_prefill(client: openai.OpenAI, llm: LLM,  # noqa: F811
                                                               model_dir: Path, hf_models: dict[str, Any]) -> None:  # noqa: F811
    prompt = PROMPT + " and again"
    ids = llm.tokenizer.encode(prompt)
    for _ in range(2):
        plain = client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=2, **GREEDY)
    assert plain.usage.prompt_tokens_details.cached_tokens >= 8     # the prefix is cached
    out = client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=2, echo=True, logprobs=3,
                                    **GREEDY)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    _check_echo(out.choices[0].logprobs, ids, _reference(hf_models, ids), llm, 2)
    assert out.choices[0].text == prompt + plain.choices[0].text


def test_echo_without_logprobs_returns_the_prompt_text(client: openai.OpenAI, model_dir: Path) -> None:  # noqa: F811
    out = client.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=3, echo=True, **GREEDY)
    plain = client.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=3, **GREEDY)
    assert out.choices[0].logprobs is None and out.choices[0].text == PROMPT + plain.choices[0].text


@pytest.mark.parametrize("body, param", [
    ({"echo": True, "logprobs": MAX_LOGPROBS + 1, "max_tokens": 1}, "logprobs"),
    ({"echo": True, "logprobs": -1, "max_tokens": 1}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),                           # 0 only with echo
    ({"echo": True, "max_tokens": -1}, "max_tokens"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": 7}, "cache_salt"),
    ({"cache_salt": "x" * 1025}, "cache_salt"),
])
def test_bad_echo_and_salt_are_400(server: Any, body: dict[str, Any], param: str, llm: LLM) -> None:  # noqa: F811
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        if path.endswith("chat/completions") and param != "cache_salt":
            continue
        r = httpx.post(server.url + path, json={**base, **body}, timeout=30)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param


def _cached(client: openai.OpenAI, model: str, chat: bool, salt: str | None) -> int:  # noqa: F811
    extra: dict[str, Any] = {"ignore_eos": True, **({"cache_salt": salt} if salt is not None else {})}
    text = "Tenant isolation: a salted prefix is never served to another salt, however long it is"
    if chat:
        out: Any = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                  max_tokens=1, temperature=0, extra_body=extra)
    else:
        out = client.completions.create(model=model, prompt=text, max_tokens=1, temperature=0, extra_body=extra)
    return out.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("chat", [False, True])
def test_cache_salt_isolates_and_the_same_salt_shares(client: openai.OpenAI, model_dir: Path,  # noqa: F811
                                                      chat: bool) -> None:
    name = model_dir.name
    tag = "chat" if chat else "cmpl"
    assert _cached(client, name, chat, f"{tag}-a") == 0
    assert _cached(client, name, chat, f"{tag}-a") > 0           # the same salt shares
    assert _cached(client, name, chat, f"{tag}-b") == 0          # another salt does not
    unsalted = _cached(client, name, chat, None)
    assert _cached(client, name, chat, None) > unsalted          # unsalted requests share
    if not chat:   # (a chat template's head may be cached unsalted by earlier tests)
        assert unsalted == 0, "a salted prefix served an unsalted request"


def test_lm_eval_local_completions_request_shape(client: openai.OpenAI, llm: LLM,  # noqa: F811
                                                 model_dir: Path, hf_models: dict[str, Any]) -> None:  # noqa: F811
    """What lm-eval's `local-completions` does for a log-likelihood request: a batch of token-id
    prompts (context + continuation), `echo=true, logprobs=1, max_tokens=1, temperature=0`, then
    per choice the sum of `token_logprobs[ctxlen:-1]` and "greedy" = each of those tokens is its
    position's best in `top_logprobs`. Both equal what transformers says of the same tokens."""
    ctx = llm.tokenizer.encode("Question: which cache keeps pages? Answer:")
    conts = [llm.tokenizer.encode(t, add_special_tokens=False) for t in (" the paged one", " none", " blocks")]
    conts.append(hf_greedy(hf_models["llama-gqa4-hd64"], ctx, 3).tokens)   # one the model itself would pick
    prompts = [ctx + c for c in conts]
    out = client.completions.create(model=model_dir.name, prompt=prompts, echo=True, logprobs=1, max_tokens=1,
                                    temperature=0, seed=1234)
    assert len(out.choices) == len(prompts)
    for choice, prompt, cont in zip(sorted(out.choices, key=lambda c: c.index), prompts, conts):
        lp = choice.logprobs
        ctxlen = len(ctx)
        ours = sum(lp.token_logprobs[ctxlen:-1])
        greedy = all(tok == max(top.values()) for tok, top in zip(lp.token_logprobs[ctxlen:-1],
                                                                  lp.top_logprobs[ctxlen:-1]))
        ref = _reference(hf_models, prompt)
        rows = ref[ctxlen - 1 : len(prompt) - 1]
        want = float(sum(rows[i, t] for i, t in enumerate(cont)))
        assert abs(ours - want) <= ATOL * len(cont)
        assert greedy == all(int(rows[i].argmax()) == t for i, t in enumerate(cont))
        assert greedy == (cont is conts[-1]), "only the model's own continuation is greedy"


def test_vllm_prompt_logprobs_extension(server: Any, llm: LLM, model_dir: Path,  # noqa: F811
                                        hf_models: dict[str, Any]) -> None:
    """vLLM's `prompt_logprobs` on /v1/completions: each choice's `prompt_logprobs`, None first,
    then `{token id: {logprob, rank, decoded_token}}` with the prompt token and the top N; with
    `echo` + a smaller `logprobs`, the echoed `top_logprobs` keep to `logprobs`."""
    ids = llm.tokenizer.encode(PROMPT)
    ref = _reference(hf_models, ids)
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": model_dir.name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 4,
        "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for pos in range(1, len(ids)):
        entry = scored[pos]
        assert str(ids[pos]) in entry and len(entry) in (4, 5)
        assert abs(entry[str(ids[pos])]["logprob"] - float(ref[pos - 1, ids[pos]])) <= ATOL
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(ids[pos]) or e["rank"] <= 4)
        assert ranks[:4] == [1, 2, 3, 4] and all(isinstance(e["decoded_token"], str) for e in entry.values())
    assert all(top is None or len(top) <= 2 for top in choice["logprobs"]["top_logprobs"])
    for body, param in (({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
                        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs")):
        bad = httpx.post(server.url + "/v1/completions", timeout=30, json={"prompt": "hi", "max_tokens": 1, **body})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
