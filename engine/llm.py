"""`LLM`: generate text with a Hugging Face model directory, the paged KV cache underneath.

    from pagedkv import LLM, SamplingParams
    llm = LLM(model="/models/Qwen2.5-0.5B-Instruct")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(outs[0].outputs[0].text)

By default everything runs in this process: the block manager's state machine
(`LocalBlockManagerClient`, no server) and one model node on the best device (CUDA when
present). `LLM(model=DIR, block_manager="host:port")` drives running services instead: the
nodes registered with that block manager (started with `compute-node serve --model DIR`),
found through the block manager and used data-parallel, routed by prefix; nodes that register
later are adopted as requests are routed to them. Across hosts, `tls=` (a `TlsSettings`: the CA
that verifies the services, and the scheduler's client certificate for mutual TLS) and/or
`token=` (the scheduler's bearer token) are presented to the block manager and to every node.
With `fleet=FleetSettings(...)` the engine joins the block manager's fleet instead
(`engine.fleet`, what `pagedkv-serve --block-manager` does): it drives only the nodes the block
manager assigns it, so several engines can share one block manager's nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compute_node.device_names import device_name_problem
from compute_node.model.config import ModelConfig
from engine.async_policy import choose_async_scheduling
from engine.errors import InvalidEngineArgs
from engine.executor import NodeExecutor, RemoteNode
from engine.fleet import FleetMember, FleetSettings
from engine.llm_engine import EngineConfig, EngineError, LLMEngine
from engine.params import InvalidParams, RequestOutput, SamplingParams
from engine.tokenizer import Tokenizer
from pagedkv.tls import TlsSettings

if TYPE_CHECKING:
    from block_manager.client import BlockManagerClient

Prompt = str | Mapping[str, Any]   # text, or {"prompt_token_ids": [...]}


class LLM:
    """A model served with continuous batching over a paged KV cache (see the module docstring).

    Options: `block_size` (tokens per KV block), `kv_cache_memory` (bytes for the KV pool) or
    `num_kv_blocks`, `dtype` ("float32", "float16", "bfloat16"; default the checkpoint's),
    `device` ("auto", "cpu", "cuda", "cuda:N"), `enable_prefix_caching`, `max_num_seqs`,
    `max_num_batched_tokens` (per step; longer prompts are prefilled in chunks),
    `max_model_len`. With `block_manager`: `tls`, `token` (the scheduler's credentials),
    `scheduler_id` (its name at the block manager; default a fresh one) and `fleet` (join the
    fleet: see the module docstring).
    Host tier (docs/tiers.md): `host_kv_memory` (bytes) or `host_kv_blocks`, and `preemption_mode`
    ("auto": swap where the node has a host tier, "swap", "recompute"). Disk tier under it:
    `disk_kv_path` (a directory) and `disk_kv_bytes`; it outlives the process. `async_scheduling`:
    plan each step while the nodes run the previous one. None: `PAGEDKV_ASYNC_SCHEDULING` when
    set ("0" off), else on only when no node computes on this host's CPU (every node on a GPU
    or on another host; `engine.async_policy`): the embedded CPU node and CPU nodes on loopback
    need the cores the engine plans on meanwhile (BENCHMARKS.md, engine modes side by side).
    `prepack_linear`: the embedded CPU node packs its matmul weights for oneDNN (float32 /
    bfloat16; `compute_node.model.linear`); False keeps plain weights and `F.linear`.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        block_manager: str | None = None,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        num_kv_blocks: int | None = None,
        dtype: str | None = None,
        device: str = "auto",
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        watermark: float = 0.01,
        tls: TlsSettings | None = None,
        token: str | None = None,
        preemption_mode: str = "auto",
        host_kv_memory: int | None = None,
        host_kv_blocks: int | None = None,
        disk_kv_path: str | Path | None = None,
        disk_kv_bytes: int | None = None,
        async_scheduling: bool | None = None,
        prepack_linear: bool = True,
        scheduler_id: str | None = None,
        fleet: FleetSettings | None = None,
    ) -> None:
        self.model_dir = Path(model)
        if not self.model_dir.is_dir():
            raise EngineError(f"model directory {str(self.model_dir)!r} does not exist")
        # Everything cheap first (the config.json, every argument), so a mistake is said before
        # the tokenizer, torch and the weights load. The config before the tokenizer: an empty or
        # foreign directory gets the words the command line uses ("has no config.json").
        ModelConfig.from_dir(self.model_dir)
        _check_tier_args(block_manager, host_kv_memory, host_kv_blocks, disk_kv_path, disk_kv_bytes, prepack_linear)
        if block_manager is None and (fleet is not None or scheduler_id is not None):
            raise InvalidEngineArgs("fleet and scheduler_id need block_manager= (the embedded block manager has "
                                    "one scheduler: this one)")
        try:   # validated here; whether steps overlap is settled once the nodes are known (below)
            config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len, preemption_mode=preemption_mode,
                                  async_scheduling=False)
        except ValueError as exc:
            raise InvalidEngineArgs(str(exc)) from None
        bm_config = None
        if block_manager is None:
            from block_manager.service.config import load_config

            if (problem := device_name_problem(device)) is not None:
                raise InvalidEngineArgs(f"device: {problem}")
            # load_config, not the class: its errors are one readable line (`ConfigError`)
            bm_config = load_config(database_url="memory://", block_size=block_size, watermark=watermark,
                                    enable_prefix_caching=enable_prefix_caching)
        self.tokenizer = Tokenizer(self.model_dir)
        nodes: dict[str, NodeExecutor]
        client: BlockManagerClient
        connect: Callable[[str, str], NodeExecutor] | None = None
        member: FleetMember | None = None
        if block_manager is None:   # embedded: the block manager in this process (bm_config)
            from engine.local_bm import LocalBlockManagerClient
            from engine.local_node import LocalNode

            client = LocalBlockManagerClient(bm_config)
            if kv_cache_memory is None and num_kv_blocks is None:
                kv_cache_memory = 512 << 20
            node = LocalNode.start(client, "local-0", self.model_dir, block_size=block_size,
                                   num_blocks=num_kv_blocks, kv_memory_bytes=None if num_kv_blocks else kv_cache_memory,
                                   dtype=dtype, device=device, max_model_len=max_model_len,
                                   host_num_blocks=host_kv_blocks, host_memory_bytes=host_kv_memory,
                                   disk_kv_path=disk_kv_path, disk_kv_bytes=disk_kv_bytes,
                                   prepack_linear=prepack_linear)
            nodes = {node.node_id: node}
        else:
            from block_manager.client import BlockManagerClient

            def connect(pool_id: str, address: str) -> NodeExecutor:
                return RemoteNode(pool_id, address, tls=tls, token=token)

            client = BlockManagerClient(block_manager, tls=tls, token=token, scheduler_id=scheduler_id)
            member = FleetMember(client, fleet) if fleet is not None else None
            routes = client.route([0])
            if not routes:
                raise EngineError(f"no compute node is registered with the block manager at {block_manager}")
            nodes = {r.pool_id: connect(r.pool_id, r.address) for r in routes}
        self.client = client
        config = replace(config, async_scheduling=choose_async_scheduling(
            async_scheduling, [node.info() for node in nodes.values()]))
        self.engine = LLMEngine(client, nodes, config, detokenize=self.tokenizer.decode, connect=connect,
                                fleet=member)
        if block_manager is not None and self.engine.model_name != self.model_dir.name:
            self.close()   # its threads stop; a fleet member leaves at once
            raise EngineError(f"the nodes serve {self.engine.model_name!r}, not {self.model_dir.name!r}")
        if self.tokenizer.eos_token_id is not None:
            self.engine.eos_token_ids = self.engine.eos_token_ids | {self.tokenizer.eos_token_id}

    def stats(self) -> dict[str, float]:
        """The engine's counters: preemptions, recomputed tokens, prefix and host-tier hits,
        swapped / offloaded / onboarded blocks (docs/tiers.md), latency percentiles."""
        return self.engine.stats.summary()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in order, each with `n` completions. Per prompt (or
        for all), `SamplingParams.prompt_logprobs` also scores the prompt
        (`RequestOutput.prompt_logprobs`, vLLM's shape; such a request bypasses the prefix
        cache) and `SamplingParams.cache_salt` keeps its prefix cache apart from other salts."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise InvalidParams(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, per_prompt):
                text, token_ids = self._tokens(prompt)
                ids.append(self.engine.add_request(token_ids, p, prompt=text))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            self.engine.flush()
            raise
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        self.engine.flush()
        return [finished[rid] for rid in ids]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Conversations through the model's chat template, like vLLM's `LLM.chat`: one
        conversation (a list of `{"role", "content"}` messages) or a list of them; always a
        list of `RequestOutput`, one per conversation, in order."""
        if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
            raise InvalidParams("chat takes a conversation (a non-empty list of {'role', 'content'} messages) "
                                "or a list of conversations")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts: list[Prompt] = []
        for conversation in conversations:
            if isinstance(conversation, (str, Mapping)) or not isinstance(conversation, Sequence) \
                    or not all(isinstance(m, Mapping) for m in conversation):
                raise InvalidParams("each conversation is a list of {'role', 'content'} messages")
            turns = [m for m in conversation if isinstance(m, Mapping)]   # all of them (checked above)
            text = self.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
                            "prompt": text})
        return self.generate(prompts, sampling_params)

    def _tokens(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, Sequence) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidParams("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        raise InvalidParams("a prompt is a string or {'prompt_token_ids': [...]}")

    def close(self) -> None:
        """Stop the engine (its pools handed back), close nodes and the block manager client."""
        self.engine.close()
        for node in self.engine.nodes.values():
            node.close()
        self.client.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_tier_args(block_manager: str | None, host_kv_memory: int | None, host_kv_blocks: int | None,
                     disk_kv_path: str | Path | None, disk_kv_bytes: int | None, prepack_linear: bool) -> None:
    """The options that belong to the embedded node, and the disk tier's pairings."""
    if block_manager is not None and (host_kv_memory or host_kv_blocks):
        raise InvalidEngineArgs(
            "host_kv_memory / host_kv_blocks size the embedded node's host tier; with block_manager= each "
            "node's own config sets it (compute-node serve --host-kv-memory)")
    if block_manager is not None and disk_kv_path is not None:
        raise InvalidEngineArgs(
            "disk_kv_path sizes the embedded node's disk tier; with block_manager= each node's own config "
            "sets it (compute-node serve --disk-kv-path --disk-kv-bytes)")
    if block_manager is not None and not prepack_linear:
        raise InvalidEngineArgs(
            "prepack_linear is the embedded node's setting; with block_manager= each node's own config sets "
            "it (PAGEDKV_CN_PREPACK_LINEAR=false)")
    if (disk_kv_path is None) != (disk_kv_bytes is None):
        raise InvalidEngineArgs("give both disk_kv_path and disk_kv_bytes, or neither")
    if disk_kv_path is not None and not (host_kv_memory or host_kv_blocks):
        raise InvalidEngineArgs("disk_kv_path needs a host tier above it (host_kv_memory or host_kv_blocks)")


__all__ = ["LLM"]
