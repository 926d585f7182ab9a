"""A fleet as real processes (issue 46): docker-compose.yml's services run by `demo.localstack`,
as the other integration tests run them: the block manager and two compute nodes, then the two
API replicas (`pagedkv-serve --block-manager ...`, each joining the fleet as a scheduler) and
`pagedkv-router` in front. Shared by integration_tests/test_fleet.py and bench/bench_fleet.py.

What differs from compose (`LocalStack.overrides`): the block manager's scheduler lease is short
(`FLEET_TTL_S`), so an engine killed by a test loses its nodes to the survivor in seconds, not 30;
the metrics ports of the block manager and the nodes are picked here (compose's become ephemeral
ports under localstack, which nobody could read back), so a test can read their counters; the
replicas' shutdown grace is 1 s.

Also here: reading Prometheus counters over HTTP, OpenAI completions with token-id prompts over
plain HTTP (streamed or not), and the greedy-token comparison with transformers for answers that
name their tokens as text (`logprobs`), which is all the OpenAI API gives back.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from block_manager.client.admin import AdminClient
from demo.localstack import LocalStack
from tests.support.polling import eventually_sync

# The scheduler lease of the fleet's block manager: engines heartbeat every third of it, and an
# engine that stops heartbeating loses its nodes after it (docs: fleet mode).
FLEET_TTL_S = 3.0
CORE_SERVICES = ["block-manager", "compute-node-0", "compute-node-1"]
NODE_SERVICES = {"node-0": "compute-node-0", "node-1": "compute-node-1"}
ENGINE_SERVICES = ("api-server", "api-server-2")
ROUTER_SERVICE = "router"
HTTP_TIMEOUT_S = 60.0


def free_port() -> int:
    """A port free now (for the metrics endpoints, which take a fixed port: a race with another
    process binding it in between is possible but harmless here, the start then fails loudly)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- Prometheus ----------------------------------------------------------------------------------
def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a `/metrics` endpoint: (sample name, labels, value)."""
    body = httpx.get(url, timeout=HTTP_TIMEOUT_S).text
    return [(s.name, dict(s.labels), float(s.value)) for fam in text_string_to_metric_families(body)
            for s in fam.samples]


def counter(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` (a counter's `_total` or not) whose labels include
    `labels`; 0 when none (a counter never incremented may not be exported yet)."""
    names = {name, f"{name}_total"}
    return sum(v for n, lab, v in scrape(url) if n in names and all(lab.get(k) == w for k, w in labels.items()))


# -- OpenAI completions over plain HTTP ----------------------------------------------------------
@dataclass(slots=True)
class Completion:
    """One completion's answer: its tokens as the API names them (`logprobs.tokens`), its text,
    why it finished; for a stream whether it ended with `[DONE]`, and the message of an error
    event in it (the router's when the engine went away mid-answer)."""

    tokens: list[str]
    text: str
    finish_reason: str | None
    done: bool = True
    error: str | None = None


def completion_body(model: str, prompt: Sequence[int], max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "stream": stream}


def complete(base_url: str, model: str, prompt: Sequence[int], max_tokens: int,
             timeout_s: float = HTTP_TIMEOUT_S) -> Completion:
    """POST /v1/completions (greedy, EOS ignored); raises for a non-200 answer."""
    r = httpx.post(f"{base_url}/v1/completions", json=completion_body(model, prompt, max_tokens), timeout=timeout_s)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return Completion(list(choice["logprobs"]["tokens"]), choice["text"], choice["finish_reason"])


def stream_chunks(base_url: str, model: str, prompt: Sequence[int], max_tokens: int,
                  timeout_s: float = HTTP_TIMEOUT_S) -> Iterator[dict[str, Any]]:
    """The SSE chunks of a streamed completion as they arrive (None-free; `[DONE]` ends it)."""
    body = completion_body(model, prompt, max_tokens, stream=True)
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                yield {"done": True}
                return
            yield json.loads(data)


def add_chunk(out: Completion, chunk: dict[str, Any]) -> None:
    """One streamed chunk (or `{"done": True}` for `[DONE]`) into `out`."""
    if chunk.get("done"):
        out.done = True
    if "error" in chunk:
        out.error = str((chunk["error"] or {}).get("message"))
    for choice in chunk.get("choices") or []:
        out.text += choice.get("text") or ""
        out.tokens += (choice.get("logprobs") or {}).get("tokens") or []
        out.finish_reason = choice.get("finish_reason") or out.finish_reason


def collect_stream(chunks: Iterator[dict[str, Any]]) -> Completion:
    """A streamed completion put together (done=False when the stream ended without `[DONE]`)."""
    out = Completion([], "", None, done=False)
    for chunk in chunks:
        add_chunk(out, chunk)
    return out


# -- the processes -------------------------------------------------------------------------------
@dataclass(slots=True)
class Server:
    """An HTTP service of the fleet (an engine replica or the router): a compose service that
    `stack` runs."""

    name: str
    stack: LocalStack

    @property
    def url(self) -> str:
        return "http://" + self.stack.address(self.name)

    def alive(self) -> bool:
        run = self.stack.running.get(self.name)
        return run is not None and run.proc.poll() is None

    def counter(self, name: str, **labels: str) -> float:
        return counter(self.url + "/metrics", name, **labels)

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """SIGKILL, the whole process group (the service's own session)."""
        self.stack.kill(self.name)

    def stop(self) -> None:
        """SIGTERM: a graceful exit (an engine frees its sequences and leaves the fleet)."""
        self.stack.stop(self.name)


@dataclass
class Fleet:
    """docker-compose.yml's services as processes (`demo.localstack`): the block manager, two
    nodes, the two API replicas in fleet mode and the router.

    `up()` starts the core (block manager, model-init, nodes); `start_engine` / `start_router`
    add the rest, each waited for by its `/health` (an engine is ready once it owns a node);
    `down()` stops all. Engine names are the compose services', which are also their scheduler
    ids (compose sets PAGEDKV_API_SCHEDULER_ID so)."""

    workdir: Path
    env: dict[str, str]
    ttl_s: float = FLEET_TTL_S
    stack: LocalStack = field(init=False)
    engines: dict[str, Server] = field(init=False, default_factory=dict)
    router: Server | None = field(init=False, default=None)
    bm_metrics_port: int = field(init=False, default_factory=free_port)
    node_metrics_ports: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.node_metrics_ports = {node: free_port() for node in NODE_SERVICES}
        overrides = {"block-manager": {"PAGEDKV_SCHEDULER_LEASE_TTL_S": str(self.ttl_s),
                                       "PAGEDKV_METRICS_PORT": str(self.bm_metrics_port)}}
        for node, service in NODE_SERVICES.items():
            overrides[service] = {"PAGEDKV_CN_METRICS_PORT": str(self.node_metrics_ports[node])}
        for service in ENGINE_SERVICES:
            overrides[service] = {"PAGEDKV_API_SHUTDOWN_GRACE_S": "1"}
        self.stack = LocalStack(self.workdir, interp_env=self.env, overrides=overrides)

    # -- where things are ----------------------------------------------------------------------
    @property
    def model_dir(self) -> Path:
        return Path(self.env["PAGEDKV_MODEL_DIR"]) / self.env.get("PAGEDKV_MODEL", "tiny-llama")

    @property
    def model_name(self) -> str:
        return self.model_dir.name

    @property
    def bm_address(self) -> str:
        return self.stack.address("block-manager")

    def bm_counter(self, name: str, **labels: str) -> float:
        return counter(f"http://127.0.0.1:{self.bm_metrics_port}/metrics", name, **labels)

    def node_counter(self, node_id: str, name: str, **labels: str) -> float:
        return counter(f"http://127.0.0.1:{self.node_metrics_ports[node_id]}/metrics", name, **labels)

    def admin(self) -> AdminClient:
        return AdminClient(self.bm_address, timeout_s=20.0)

    # -- life cycle ----------------------------------------------------------------------------
    def up(self) -> Fleet:
        try:
            self.stack.up(CORE_SERVICES)
        except BaseException:
            self.down()
            raise
        return self

    def start_engine(self, service: str, *, wait_ready: bool = True, timeout_s: float = 120.0) -> Server:
        """An API replica (`pagedkv-serve --block-manager ...`, compose's command): it joins the
        fleet as scheduler `service`."""
        self.stack.start(service, wait=False, timeout_s=timeout_s)
        server = self.engines[service] = Server(service, self.stack)
        if wait_ready:
            self.wait_ready(server, timeout_s)
        return server

    def start_router(self, *, timeout_s: float = 120.0) -> Server:
        self.stack.start(ROUTER_SERVICE, wait=False, timeout_s=timeout_s)
        self.router = Server(ROUTER_SERVICE, self.stack)
        self.wait_ready(self.router, timeout_s)
        return self.router

    def wait_ready(self, server: Server, timeout_s: float = 120.0) -> None:
        """Until `/health` answers 200 (probed over HTTP here: the compose health check is a
        process per probe)."""
        def ready() -> bool:
            if not server.alive():
                raise AssertionError(f"{server.name} exited:\n{self.stack.log_tail(server.name)}")
            return server.ready()

        eventually_sync(ready, timeout_s=timeout_s, interval_s=0.1, what=f"{server.name} ready")

    def down(self) -> None:
        self.stack.down()

    def alive(self) -> bool:
        """Every engine and the router started here still runs."""
        return all(s.alive() for s in [*self.engines.values(), *([self.router] if self.router else [])])

    def __enter__(self) -> Fleet:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- who owns what -------------------------------------------------------------------------
    def owners(self) -> dict[str, str]:
        """pool id -> scheduler id of the fleet member owning it now (the block manager's view:
        `ListSchedulers`)."""
        with self.admin() as admin:
            members = admin.list_schedulers()
        return {pool: m.scheduler_id for m in members for pool in m.pool_ids}

    def wait_owners(self, want: Mapping[str, int], timeout_s: float) -> dict[str, str]:
        """Until each named scheduler owns that many pools and every node is owned; the owners."""
        def settled() -> dict[str, str]:
            owners = self.owners()
            counts = {name: sum(1 for o in owners.values() if o == name) for name in want}
            return owners if counts == dict(want) and set(owners) == set(NODE_SERVICES) else {}

        return eventually_sync(settled, timeout_s=timeout_s, interval_s=0.1, what=f"ownership {dict(want)}")


# -- tokens vs transformers ----------------------------------------------------------------------
def check_greedy_texts(ours: Sequence[str], prompt: Sequence[int], hf_model: Any, tokenizer: Any,
                       label: str, near_tie_rel: float | None = None) -> int:
    """Our greedy tokens, as the API names them (`logprobs.tokens`: each token's text), against
    transformers' greedy tokens for the same prompt: `compare_greedy`'s rule for token texts. Equal
    texts match; at the first difference our text must be that of a token tied with the
    reference's best (relative gap below `near_tie_rel`, default NEAR_TIE_REL: float16 nodes vs
    float32 transformers may pick either), and later tokens are then not compared. Returns how
    many tokens matched."""
    from tests.compute_node.model.model_helpers import NEAR_TIE_REL, hf_greedy

    tie = NEAR_TIE_REL if near_tie_rel is None else near_tie_rel
    ref = hf_greedy(hf_model, list(prompt), len(ours))
    for step, (text, want) in enumerate(zip(ours, ref.tokens)):
        if text == tokenizer.token_text(want):
            continue
        logits = ref.logits[step].float()
        best = float(logits.max())
        scale = max(abs(best), 1e-6)
        tied = [t for t in range(logits.shape[0])
                if (best - float(logits[t])) / scale < tie and tokenizer.token_text(t) == text]
        if tied:
            return step
        raise AssertionError(f"{label}: token {step} differs (ours {text!r}, transformers {want} = "
                             f"{tokenizer.token_text(want)!r}), not a near-tie")
    if len(ours) != len(ref.tokens):
        raise AssertionError(f"{label}: {len(ours)} tokens vs {len(ref.tokens)}")
    return len(ours)
