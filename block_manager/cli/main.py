"""`block-manager` command line: one entry point with subcommands.

- `replay TRACE.jsonl --num-blocks N --block-size B` prints one JSON object of metrics;
- `gen-trace OUT.jsonl [knobs]` writes a seeded synthetic trace;
- `serve ...`, `admin ...` and `db ...` (schema migrations) pass the rest of the command line to
  `block_manager.server.main` / `block_manager.admin_cli.main`, imported lazily so that the
  offline tools start fast and work without the service's dependencies being importable.

Errors are one line on stderr with a non-zero exit code: 2 for bad input (usage, malformed
trace, bad knobs), 1 for anything the environment caused (unreadable file, missing module),
130 for Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from collections.abc import Callable, Sequence

from pagedkv.cli import ArgumentParser, catch_ctrl_c, quiet_broken_pipe

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

_PASSTHROUGH: dict[str, tuple[str, str]] = {  # subcommand -> (module, help)
    "serve": ("block_manager.service.server", "run the block manager gRPC service"),
    "admin": ("block_manager.cli.admin", "admin plane client (pools, defrag, snapshots)"),
    "db": ("block_manager.cli.db", "schema revisions of the store: current, upgrade, downgrade"),
}


def _fail(message: str, code: int) -> int:
    print(f"block-manager: error: {message}", file=sys.stderr)
    return code


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_replay(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay a JSON-lines trace through the core and print metrics as JSON",
        description="Replay a JSON-lines trace through one pool of the block manager core.",
    )
    p.add_argument("trace", help="trace file (JSON lines: allocate / append / fork / free)")
    p.add_argument("--num-blocks", type=_positive_int, required=True, help="blocks in the pool")
    p.add_argument("--block-size", type=_positive_int, required=True, help="token slots per block")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    p.add_argument("--watermark", type=float, default=0.01, help="admission watermark, fraction of blocks")
    p.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="contiguous baseline reserves this many slots per sequence (default: its exact length)",
    )
    p.add_argument(
        "--max-output-len",
        type=_positive_int,
        default=None,
        help="contiguous baseline reserves prompt + this many slots per sequence",
    )
    p.add_argument("--host-blocks", type=int, default=0,
                   help="a host tier of this many blocks under the pool (swap preemption, prefix offload)")
    p.add_argument("--fsck", action="store_true", help="run the core's consistency check at the end")
    p.add_argument("--indent", type=int, default=None, help="pretty-print the JSON")
    p.set_defaults(func=_run_replay)


_KNOB_HELP = {
    "num_requests": "requests in the trace",
    "seed": "random seed (same knobs + seed -> byte-identical file)",
    "vocab_size": "token ids are drawn from [0, vocab_size)",
    "num_system_prompts": "distinct shared system prompts",
    "system_prompt_len": "tokens per system prompt",
    "shared_prompt_fraction": "fraction of requests that start with a system prompt",
    "prompt_len_min": "shortest per-request prompt (after any system prompt)",
    "prompt_len_max": "longest per-request prompt",
    "output_len_min": "shortest output per sample",
    "output_len_max": "longest output per sample",
    "length_dist": "shape of prompt and output lengths",
    "parallel_n": "samples per request that uses parallel sampling (fork after prefill)",
    "parallel_fraction": "fraction of requests that use parallel sampling",
    "arrival_rate": "mean request arrivals per step (Poisson)",
    "max_running": "most sequences running at once (samples count individually)",
    "num_tenants": "tenants (salts tenant-0...); 1 writes no salt",
}


def _add_gen_trace(subparsers: argparse._SubParsersAction) -> None:
    from block_manager.trace.generate import TraceConfig

    p = subparsers.add_parser(
        "gen-trace",
        help="write a seeded synthetic serving trace",
        description="Write a seeded synthetic serving trace (same knobs -> byte-identical file).",
    )
    p.add_argument("out", help="output file (JSON lines)")
    for f in dataclasses.fields(TraceConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        help_text = f"{_KNOB_HELP.get(f.name, f.name)} (default: {default})"
        if f.name == "length_dist":
            p.add_argument(flag, choices=["loguniform", "lognormal"], default=default, help=help_text)
        else:
            p.add_argument(flag, type=type(default), default=default, help=help_text)
    p.set_defaults(func=_run_gen_trace)


def _run_replay(args: argparse.Namespace) -> int:
    from block_manager.core.errors import CoreError
    from block_manager.trace.format import TraceError
    from block_manager.trace.replay import replay

    try:
        report = replay(
            args.trace,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            enable_prefix_caching=not args.no_prefix_cache,
            watermark=args.watermark,
            max_model_len=args.max_model_len,
            max_output_len=args.max_output_len,
            fsck=args.fsck,
            host_blocks=args.host_blocks,
        )
    except TraceError as e:
        return _fail(f"{args.trace}: {e}", EXIT_USAGE)
    except CoreError as e:  # bad geometry / watermark
        return _fail(f"{type(e).__name__}: {e}", EXIT_USAGE)
    except UnicodeDecodeError as e:
        return _fail(f"{args.trace}: not UTF-8 text ({e.reason})", EXIT_USAGE)
    except OSError as e:
        return _fail(f"{args.trace}: {e.strerror or e}", EXIT_USAGE)
    print(json.dumps(report.to_dict(), indent=args.indent))
    return 0


def _run_gen_trace(args: argparse.Namespace) -> int:
    from block_manager.trace.generate import TraceConfig, TraceConfigError, write_trace

    knobs = {f.name: getattr(args, f.name) for f in dataclasses.fields(TraceConfig)}
    try:
        num_ops = write_trace(args.out, TraceConfig(**knobs))
    except TraceConfigError as e:
        return _fail(str(e), EXIT_USAGE)
    except OSError as e:
        return _fail(f"{args.out}: {e.strerror or e}", EXIT_ERROR)
    print(f"wrote {num_ops} ops to {args.out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="block-manager", description="pagedkv block manager tools")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in _PASSTHROUGH.items():
        # Listed for --help only; main() dispatches these before argparse sees their flags.
        subparsers.add_parser(name, help=help_text, add_help=False)
    _add_replay(subparsers)
    _add_gen_trace(subparsers)
    return parser


def _passthrough(command: str, rest: list[str]) -> int:
    module_name, _ = _PASSTHROUGH[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            return _fail(f"'{command}' is not available in this build ({module_name} is missing)", EXIT_ERROR)
        raise
    entry: Callable[[list[str]], int | None] = module.main
    result = entry(rest)
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    catch_ctrl_c()
    try:
        code = _main(argv)
        sys.stdout.flush()     # here, not at exit: a closed pipe is then caught below
        return code
    except KeyboardInterrupt:  # Ctrl-C in any subcommand: one line, not a traceback
        print("block-manager: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:    # `block-manager admin --json status | head -3`: the reader has all it wanted
        quiet_broken_pipe()
        return EXIT_ERROR


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in _PASSTHROUGH:
        return _passthrough(args_list[0], args_list[1:])
    args = build_parser().parse_args(args_list)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
