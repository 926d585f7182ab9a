"""`block-manager admin events`: the KV events stream on a terminal or in a pipe.

    block-manager admin events                     # what is cached where now (Resync + snapshot), then exit
    block-manager admin events --follow            # live events from now on, until Ctrl-C
    block-manager admin events --follow --from ID  # resume after ID (or Resync + snapshot), then live
    ... [--json] [--max-events N]

One line per event (`#ID kind node=... tier=... ...`), or one JSON object per line with
`--json` (hashes in hex). Lines are flushed as they come, so `| grep`, `| jq` and `| head`
work on a live stream; a reader that goes away (`| head -3`) or Ctrl-C ends the command
quietly (exit 0 and 130). `--max-events N` stops after N lines (scripts, tests). The stream
has no deadline (`--timeout` does not apply to it).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from block_manager.client.admin import AdminClient
from block_manager.client.kv_events import event_dict, event_line
from pagedkv.cli import int_in, quiet_broken_pipe

EXIT_OK = 0
EXIT_INTERRUPTED = 130


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--follow", "-f", action="store_true", help="keep streaming live events (until Ctrl-C)")
    p.add_argument("--from", dest="from_id", type=int_in(0, (1 << 64) - 1), default=None, metavar="ID",
                   help="with --follow: resume after event ID (0: start with a snapshot)")
    p.add_argument("--max-events", type=int_in(0, sys.maxsize), default=0, metavar="N",
                   help="stop after N events (0: no limit)")


def check_arguments(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot work, or None."""
    if args.from_id is not None and not args.follow:
        return "--from needs --follow (without it the command prints the current snapshot and exits)"
    return None


def run(client: AdminClient, args: argparse.Namespace) -> int:
    """Stream and print; BlockManagerError escapes to the caller (one line, its exit code)."""
    if args.follow:
        events = client.kv_events(args.from_id or 0, live_only=args.from_id is None)
    else:
        events = client.kv_events(0)
    num = 0
    try:
        for ev in events:
            print(_render(ev, args.json), flush=True)
            num += 1
            if args.max_events and num >= args.max_events:
                break
            if not args.follow and ev.WhichOneof("kind") == "snapshot_end":
                break
    except KeyboardInterrupt:
        print("block-manager admin events: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:   # `admin events --follow | head -3`: the reader has all it wanted
        quiet_broken_pipe()
        return EXIT_OK
    finally:
        events.close()
    return EXIT_OK


def _render(ev: Any, as_json: bool) -> str:
    return json.dumps(event_dict(ev), sort_keys=True) if as_json else event_line(ev)


__all__ = ["add_arguments", "check_arguments", "run"]
