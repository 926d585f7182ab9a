"""`pagedkv-serve`: the OpenAI-compatible HTTP server (`engine.api.server`) from the command line.

    pagedkv-serve --model /models/Qwen2.5-0.5B-Instruct                 # embedded: block manager + one node here
    pagedkv-serve --model /models/Qwen2.5-0.5B-Instruct --block-manager 127.0.0.1:50051
                                                                        # the nodes registered there (PAGEDKV_CN_MODEL)

With `--block-manager` the server joins the block manager's fleet (`engine.fleet`): it drives
the nodes the block manager assigns it, so several servers (replicas behind a router) share one
block manager's nodes; `--scheduler-id` names it there, `--advertise-url` is where routers send
it requests, `--nodes a,b` pins the nodes it may own, and `/health` answers 503 while it owns
none. `--no-fleet` drives every registered node as the only scheduler (one engine per block
manager, the behaviour before fleets).

Every flag can also come from the environment as `PAGEDKV_API_<FLAG>` (`PAGEDKV_API_PORT=8000`,
`PAGEDKV_API_KEY=...`); a flag wins over its variable. The KV pool options (`--block-size`,
`--kv-cache-memory`, `--num-kv-blocks`, `--dtype`, `--device`, `--no-prefix-caching`,
`--watermark`) shape the embedded node and block manager; with `--block-manager` the nodes and
the block manager have their own settings. `--port 0` binds a free port; `--port-file` then
tells which (written once the server accepts connections). Across hosts, `--ca-file`, `--cert-file`,
`--key-file` (mutual TLS: a scheduler certificate), `--server-name`, `--tls` and
`--scheduler-token` are this server's credentials towards the block manager and the nodes.

Exit codes: 0 after SIGTERM / SIGINT, 2 for a usage or model problem (no such model directory,
an unsupported architecture, no tokenizer), 1 when start-up failed (block manager unreachable,
no model node registered, the port in use).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import re
import secrets
import socket
import sys
from pathlib import Path
from typing import Any

from pagedkv.cli import ArgumentParser, fail, port_number, seconds_or_zero
from pagedkv.rpc import answered_plain_http

EXIT_START_FAILED = 1
EXIT_USAGE = 2
ENV_PREFIX = "PAGEDKV_API_"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from `536870912`, `512MiB`, `0.5GiB`, `2G`, `2GB` (binary multiples throughout)."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 536870912, 512MiB, 2GiB)")
    scale = 1024 ** " kmgt".index((m.group(2) or " ").lower())
    return int(float(m.group(1)) * scale)


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="pagedkv-serve", description="pagedkv OpenAI-compatible HTTP server",
                                epilog=f"Each flag may also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT).")
    p.add_argument("--model", help="Hugging Face model directory (Llama, Qwen2, Qwen3); required")
    p.add_argument("--served-model-name", help="model id in the API (default: the directory's name)")
    p.add_argument("--block-manager", help="HOST:PORT of a running block manager: serve its registered model nodes "
                   "(default: everything in this process)")
    p.add_argument("--no-fleet", action="store_true",
                   help="with --block-manager: drive every registered node as the only scheduler instead of joining "
                        "the block manager's fleet (one engine per block manager)")
    p.add_argument("--scheduler-id", help="this engine's name at the block manager (with --block-manager; default "
                   "HOSTNAME-PID-RANDOM)")
    p.add_argument("--advertise-url", help="the API base URL routers forward requests to (fleet; default "
                   "http://HOST:PORT as bound, this host's name for 0.0.0.0)")
    p.add_argument("--nodes", type=_node_list, help="a,b: own only these nodes' pools in the fleet (default: any the "
                   "block manager assigns)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="listen port (default 8000; 0: a free one)")
    p.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (env PAGEDKV_API_KEY)")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per scheduler step; longer prompts are prefilled in chunks (default 2048)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (embedded; default 16)")
    p.add_argument("--kv-cache-memory", type=parse_size,
                   help="bytes for the KV pool, e.g. 2GiB (embedded; default 512MiB)")
    p.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks instead (embedded)")
    p.add_argument("--host-kv-memory", type=parse_size,
                   help="host tier under the KV pool, e.g. 2GiB (embedded; swap preemption, prefix offload)")
    p.add_argument("--host-kv-blocks", type=int, help="host tier size in blocks instead (embedded)")
    p.add_argument("--disk-kv-path", help="disk tier under the host tier in this directory (embedded; survives "
                                          "restarts of the same model)")
    p.add_argument("--disk-kv-bytes", type=parse_size, help="disk tier size, e.g. 20GiB (embedded)")
    p.add_argument("--preemption-mode", choices=["auto", "swap", "recompute"], default="auto",
                   help="swap preempted sequences to the host tier or recompute them (default auto: swap where "
                        "the node has a host tier)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="weights and KV dtype (embedded; default the checkpoint's)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (embedded; default auto)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt blocks (embedded)")
    p.add_argument("--watermark", type=float, default=0.01,
                   help="fraction of KV blocks kept free for running sequences (embedded; default 0.01)")
    p.add_argument("--shutdown-grace-s", type=seconds_or_zero, default=5.0,
                   help="open requests get this long after SIGTERM (default 5)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    p.add_argument("--scheduler-token", help="this server's scheduler bearer token at the block manager and the "
                   "nodes (with --block-manager; their auth.tokens 'scheduler' entry)")
    from pagedkv.tls import add_tls_arguments

    tls_group = p.add_argument_group("TLS towards the block manager and the nodes (with --block-manager)")
    add_tls_arguments(tls_group, ENV_PREFIX)
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        env = os.environ.get(ENV_PREFIX + action.dest.upper())
        if env is None and action.dest == "api_key":
            env = os.environ.get("PAGEDKV_API_KEY")
        if env:
            action.default = env.lower() in ("1", "true", "yes", "on") if action.const is True else env
            action.required = False
    return p


def _node_list(text: str) -> tuple[str, ...]:
    nodes = tuple(n.strip() for n in text.split(",") if n.strip())
    if not nodes:
        raise argparse.ArgumentTypeError(f"not a list of node ids: {text!r} (e.g. node-0,node-1)")
    return nodes


MODEL_HINT = ("pass a Hugging Face model directory (Llama, Qwen2, Qwen3), or make a tiny demo one: "
              ".venv/bin/python -m engine.model_init /tmp/tiny-llama")


def _fail(code: int, message: str, hint: str | None = None) -> int:
    return fail("pagedkv-serve", code, message, hint)


def main(argv: list[str] | None = None) -> int:
    """Cheap checks first (flags, the model directory's config, the port), then the slow part
    (the weights, the block manager), then serve; every failure is one line on stderr."""
    args = _parser().parse_args(argv)
    if not args.model:
        return _fail(EXIT_USAGE, "--model is required", MODEL_HINT)
    from pagedkv.logging import configure_logging

    try:
        configure_logging(args.log_level)
    except ValueError as exc:
        return _fail(EXIT_USAGE, str(exc), "one of DEBUG, INFO, WARNING, ERROR")
    problem = model_dir_problem(Path(args.model))
    if problem is not None:
        return _fail(EXIT_USAGE, problem, MODEL_HINT)
    from engine.api.server import bind_socket

    try:                                       # before the weights load: a busy port is said at once
        sock = bind_socket(args.host, int(args.port))
    except OSError as exc:
        return _fail(EXIT_START_FAILED, f"cannot listen on {args.host}:{args.port}: {_os_reason(exc)}",
                     "another server on that port? pick another --port, or --port 0 for a free one")
    if (args.scheduler_id or args.advertise_url or args.nodes) and not args.block_manager:
        sock.close()
        return _fail(EXIT_USAGE, "--scheduler-id, --advertise-url and --nodes need --block-manager",
                     "the embedded block manager has one scheduler: this server")
    if args.no_fleet and (args.advertise_url or args.nodes):
        sock.close()
        return _fail(EXIT_USAGE, "--advertise-url and --nodes are fleet settings: not with --no-fleet",
                     "without a fleet the server drives every registered node")
    try:
        return _build_and_serve(args, sock)
    finally:
        sock.close()


def model_dir_problem(model_dir: Path) -> str | None:
    """What is wrong with `model_dir` before anything loads (the same words `LLM()` uses):
    missing, no `config.json`, an unsupported architecture; None when it looks servable."""
    from compute_node.model.config import ModelConfig
    from compute_node.model.errors import ModelLoadError

    try:
        ModelConfig.from_dir(model_dir)     # an unsupported architecture is named here, before any loading
    except ModelLoadError as exc:
        return str(exc)
    return None


def _os_reason(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "address already in use"
    return (exc.strerror or str(exc)).lower()


def _build_and_serve(args: argparse.Namespace, sock: socket.socket) -> int:
    from compute_node.model.errors import (
        InvalidModelConfig,
        ModelLoadError,
        ModelNotFound,
        UnsupportedModel,
        WeightsError,
    )
    from engine.errors import EngineError
    from engine.tokenizer import TokenizerError

    try:
        llm = _build_llm(args, sock)
    except (ModelNotFound, InvalidModelConfig, UnsupportedModel, WeightsError, TokenizerError) as exc:
        return _fail(EXIT_USAGE, str(exc), MODEL_HINT)              # the directory's contents
    except (ModelLoadError, ValueError) as exc:                      # a flag's value: its size, device, ...
        return _fail(EXIT_USAGE, str(exc), "see pagedkv-serve --help")
    except MemoryError as exc:               # the KV pool (compute_node.pool.PoolAllocationError)
        return _fail(EXIT_START_FAILED, str(exc), "a smaller --num-kv-blocks or --kv-cache-memory")
    except EngineError as exc:              # no node registered, or nodes serving another model
        hint = None
        if args.block_manager and "no compute node" in str(exc):
            hint = f"start one: compute-node serve --model DIR --block-manager {args.block_manager}"
        return _fail(EXIT_START_FAILED, str(exc), hint)
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback: the block manager, the nodes
        code = getattr(exc, "code", None)
        details = getattr(exc, "message", None) or str(exc)
        if args.block_manager and answered_plain_http(details):
            return _fail(EXIT_START_FAILED, f"{args.block_manager} answers plain HTTP, not gRPC: not a block manager",
                         "the block manager listens on its --listen address, 127.0.0.1:50051 by default")
        if args.block_manager and getattr(code, "name", "") in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            return _fail(EXIT_START_FAILED, f"cannot reach the block manager at {args.block_manager}",
                         "is `block-manager serve` running there? check --block-manager and the TLS flags")
        return _fail(EXIT_START_FAILED, _one_line(exc))
    from pagedkv.lifecycle import tune_gc

    tune_gc()   # a server process with its engine built, as the services do (full collections pause every stream)
    try:
        return asyncio.run(_serve(llm, args, sock))
    except OSError as exc:                     # the address is not ours after all
        return _fail(EXIT_START_FAILED, f"cannot listen on {args.host}:{args.port}: {_os_reason(exc)}")
    except KeyboardInterrupt:
        return 130


def _one_line(exc: BaseException) -> str:
    details = exc.details() if hasattr(exc, "details") and callable(exc.details) else None
    return f"{type(exc).__name__}: {details or exc}".splitlines()[0]


def default_scheduler_id() -> str:
    """HOSTNAME-PID-RANDOM: unique per process, and says where the engine runs."""
    host = "".join(c for c in socket.gethostname() if c.isascii() and c.isprintable()) or "engine"
    return f"{host[:96]}-{os.getpid()}-{secrets.token_hex(3)}"


def advertise_url(host: str, sock: socket.socket) -> str:
    """The API base URL of a server bound to `host` on `sock`: the bound port (also for --port
    0), and this host's name for a wildcard address (routers elsewhere cannot dial 0.0.0.0)."""
    port = sock.getsockname()[1]
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _fleet_settings(args: argparse.Namespace, sock: socket.socket) -> Any:
    """The fleet membership of a server with --block-manager (None: --no-fleet, or embedded)."""
    if not args.block_manager or args.no_fleet:
        return None
    from engine.fleet import FleetSettings

    return FleetSettings(address=args.advertise_url or advertise_url(args.host, sock),
                         pin_pool_ids=tuple(args.nodes or ()))


def _build_llm(args: argparse.Namespace, sock: socket.socket) -> Any:
    from engine.llm import LLM
    from pagedkv.tls import tls_from_args

    scheduler_id = None
    if args.block_manager:
        scheduler_id = args.scheduler_id or default_scheduler_id()
    return LLM(
        args.model, block_manager=args.block_manager, block_size=int(args.block_size),
        kv_cache_memory=None if args.kv_cache_memory is None else int(args.kv_cache_memory),
        num_kv_blocks=None if args.num_kv_blocks is None else int(args.num_kv_blocks),
        dtype=args.dtype, device=args.device, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=int(args.max_num_seqs), max_num_batched_tokens=int(args.max_num_batched_tokens),
        max_model_len=None if args.max_model_len is None else int(args.max_model_len),
        watermark=float(args.watermark), tls=tls_from_args(args), token=args.scheduler_token or None,
        preemption_mode=args.preemption_mode,
        host_kv_memory=None if args.host_kv_memory is None else int(args.host_kv_memory),
        host_kv_blocks=None if args.host_kv_blocks is None else int(args.host_kv_blocks),
        disk_kv_path=args.disk_kv_path,
        disk_kv_bytes=None if args.disk_kv_bytes is None else int(args.disk_kv_bytes),
        scheduler_id=scheduler_id, fleet=_fleet_settings(args, sock),
    )


def node_health_check(block_manager: str | None, nodes: dict[str, Any], tls: Any = None, *,
                      fleet: bool = False) -> Any:
    """`/health` beyond the engine thread: with services, the block manager and every node
    answer the gRPC health service as SERVING (a node is SERVING once registered). `tls`: the
    server's own TLS settings towards them (the health service needs no token). `nodes` is the
    engine's live dict, so nodes adopted later are probed too. `fleet`: the engine is a fleet
    member, ready only while it owns a node (one that owns none would queue every request:
    routers and load balancers should send them to another engine)."""
    from pagedkv.healthcheck import check

    def targets() -> dict[str, str]:
        found = {} if block_manager is None else {"block manager": block_manager}
        found.update({f"node {nid}": node.address for nid, node in list(nodes.items()) if hasattr(node, "address")})
        return found

    def probe(found: dict[str, str]) -> tuple[bool, str]:
        bad = [f"{name} {status}" for name, target in found.items()
               if (status := check(target, timeout_s=1.0, tls=tls)) != "SERVING"]
        return (not bad, "; ".join(bad) or "ok")

    async def health_check() -> tuple[bool, str]:
        if fleet and not nodes:
            return False, "owns no node yet (a fleet member: the block manager assigns its nodes)"
        found = targets()
        if not found:
            return True, "ok"
        return await asyncio.to_thread(probe, found)

    return health_check


async def _serve(llm: Any, args: argparse.Namespace, sock: socket.socket) -> int:
    from engine.api.server import build_app, serve_async
    from engine.async_engine import AsyncLLMEngine
    from pagedkv.logging import get_logger
    from pagedkv.tls import is_loopback, tls_from_args

    log = get_logger("engine.api.cli")
    aeng = AsyncLLMEngine(llm.engine)
    name = args.served_model_name or Path(args.model).name
    app = build_app(aeng, llm.tokenizer, name, api_key=args.api_key or None,
                    health_check=node_health_check(args.block_manager, llm.engine.nodes, tls_from_args(args),
                                                   fleet=llm.engine.fleet is not None))
    host = f"[{args.host}]" if ":" in args.host else args.host
    if not args.api_key and not is_loopback(f"{host}:{args.port}"):
        log.warning("listening beyond loopback without an API key: anyone who reaches the port may generate",
                    host=args.host)
    fleet = llm.engine.fleet
    log.info("serving", model=name, model_dir=args.model, block_manager=args.block_manager or "embedded",
             max_model_len=llm.engine.max_model_len, nodes=sorted(llm.engine.nodes),
             scheduler_id=llm.client.scheduler_id if args.block_manager else None,
             fleet=None if fleet is None else fleet.settings.address)
    try:
        await serve_async(app, host=args.host, port=int(args.port), port_file=args.port_file, sock=sock,
                          shutdown_grace_s=float(args.shutdown_grace_s), log_level=args.log_level)
    finally:
        await asyncio.to_thread(_close, llm, aeng, log)
    return 0


def _close(llm: Any, aeng: Any, log: Any) -> None:
    """Stop the engine thread, free what is left, hand the pools back, close the clients."""
    aeng.shutdown()
    engine = llm.engine
    try:
        for rid in list(engine.requests):
            engine.abort_request(rid)
        engine.flush()
        release = getattr(llm.client, "release", None)
        if engine.fleet is not None:
            engine.fleet.leave()   # releases every pool it owns, the others adopt them now
        elif release is not None and getattr(llm.client, "held_pools", None):
            release()
    except Exception as exc:  # noqa: BLE001 - best effort on the way out: leases lapse anyway
        log.warning("could not free every sequence on shutdown", error=_one_line(exc))
    llm.close()


if __name__ == "__main__":
    sys.exit(main())
