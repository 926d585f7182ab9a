"""`pagedkv-router`: the KV-aware router (`engine.api.router`) from the command line.

    pagedkv-router --block-manager 127.0.0.1:50051 --model /models/Qwen2.5-0.5B-Instruct --port 8000
    pagedkv-router --model DIR --engines http://10.0.0.5:8000,http://10.0.0.6:8000   # no block manager: by load

`--model` is read for its tokenizer and chat template only (no weights): the router tokenizes
each prompt as the engines do, so the prefix it looks up is the one they cache. The engines are
the fleet members the block manager names (`pagedkv-serve --block-manager ...` replicas);
`--engines` is the fallback while it names none. Every flag can also come from the environment
as `PAGEDKV_ROUTER_<FLAG>`; a flag wins over its variable. `--port 0` binds a free port and
`--port-file` tells which. `--ca-file`, `--cert-file`, `--key-file`, `--server-name`, `--tls` and
`--scheduler-token` are the router's credentials towards the block manager (it only calls Route:
a `scheduler` or `scheduler:<id>` principal).

Exit codes: 0 after SIGTERM / SIGINT, 2 for a usage or model problem (no tokenizer), 1 when
start-up failed (the port in use).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from pagedkv.cli import ArgumentParser, fail, int_in, port_number, seconds, seconds_or_zero

EXIT_START_FAILED = 1
EXIT_USAGE = 2
ENV_PREFIX = "PAGEDKV_ROUTER_"

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="pagedkv-router", description="pagedkv KV-aware router in front of pagedkv-serve replicas",
                       epilog=f"Each flag may also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT).")
    p.add_argument("--model", help="the served model's directory (its tokenizer and chat template); required")
    p.add_argument("--block-manager", help="HOST:PORT of the block manager whose fleet this router fronts")
    p.add_argument("--engines", help="comma-separated engine base URLs used while the block manager names no "
                   "fleet member (or without --block-manager)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="listen port (default 8000; 0: a free one)")
    p.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (the header is passed on to "
                   "the engines, which check their own key)")
    p.add_argument("--refresh-s", type=seconds, default=2.0,
                   help="re-read the fleet (owners, loads) from the block manager this often (default 2)")
    p.add_argument("--route-timeout-s", type=seconds, default=2.0,
                   help="a Route unanswered this long routes the request by load (default 2)")
    p.add_argument("--max-imbalance", type=int_in(0, 1 << 20), default=16,
                   help="requests the owner of a cached prefix may have beyond the least loaded engine before that "
                        "one serves instead, fetching the prefix (default 16)")
    p.add_argument("--connect-timeout-s", type=seconds, default=3.0,
                   help="an engine that does not accept the connection this fast is skipped (default 3)")
    p.add_argument("--shutdown-grace-s", type=seconds_or_zero, default=5.0,
                   help="open streams get this long after SIGTERM (default 5)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    p.add_argument("--scheduler-token", help="bearer token at the block manager (its auth.tokens 'scheduler' entry)")
    from pagedkv.tls import add_tls_arguments

    add_tls_arguments(p.add_argument_group("TLS towards the block manager"), ENV_PREFIX)
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        env = os.environ.get(ENV_PREFIX + action.dest.upper())
        if env:
            action.default = env.lower() in ("1", "true", "yes", "on") if action.const is True else env
    return p


def _fail(code: int, message: str, hint: str | None = None) -> int:
    return fail("pagedkv-router", code, message, hint)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.model:
        return _fail(EXIT_USAGE, "--model is required", "the model directory the engines serve (its tokenizer)")
    engines = [e for e in (args.engines or "").split(",") if e.strip()]
    if not args.block_manager and not engines:
        return _fail(EXIT_USAGE, "nothing to route to",
                     "pass --block-manager HOST:PORT (the fleet) or --engines URL,...")
    from engine.tokenizer import Tokenizer, TokenizerError
    from pagedkv.logging import configure_logging

    try:
        configure_logging(args.log_level)
    except ValueError as exc:
        return _fail(EXIT_USAGE, str(exc), "one of DEBUG, INFO, WARNING, ERROR")
    try:
        tokenizer = Tokenizer(args.model)
    except TokenizerError as exc:
        return _fail(EXIT_USAGE, str(exc), "pass the model directory the engines serve")
    from engine.api.server import bind_socket

    try:
        sock = bind_socket(args.host, int(args.port))
    except OSError as exc:
        return _fail(EXIT_START_FAILED, f"cannot listen on {args.host}:{args.port}: {(exc.strerror or exc)}",
                     "pick another --port, or --port 0 for a free one")
    try:
        return asyncio.run(_serve(args, tokenizer, engines, sock))
    except KeyboardInterrupt:
        return 130
    finally:
        sock.close()


async def _serve(args: argparse.Namespace, tokenizer: Tokenizer, engines: list[str], sock: socket.socket) -> int:
    from engine.api.router import Router, RouterConfig
    from engine.api.server import serve_async
    from pagedkv.logging import get_logger
    from pagedkv.tls import is_loopback, tls_from_args

    log = get_logger("engine.api.router_cli")
    config = RouterConfig(block_manager=args.block_manager or None, engines=engines, api_key=args.api_key or None,
                          tls=tls_from_args(args), token=args.scheduler_token or None, refresh_s=float(args.refresh_s),
                          route_timeout_s=float(args.route_timeout_s),
                          connect_timeout_s=float(args.connect_timeout_s), max_imbalance=int(args.max_imbalance))
    router = Router(config, tokenizer)
    host = f"[{args.host}]" if ":" in args.host else args.host
    if not args.api_key and not is_loopback(f"{host}:{args.port}"):
        log.warning("listening beyond loopback without an API key: the engines' own keys are all that guard them",
                    host=args.host)
    await router.start()
    log.info("routing", block_manager=args.block_manager or "none", static_engines=engines,
             fleet=sorted(router.fleet.members))
    try:
        await serve_async(router.app(), host=args.host, port=int(args.port), port_file=args.port_file, sock=sock,
                          shutdown_grace_s=float(args.shutdown_grace_s), log_level=args.log_level)
    finally:
        await router.close()
    return 0


__all__ = ["main"]
