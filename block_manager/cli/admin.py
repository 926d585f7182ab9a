"""`block-manager admin ...`: the operator's view of a running block manager.

    block-manager admin [--target HOST:PORT[,HOST:PORT...]] [--token T] [--json] [--timeout S]
                        [--tls] [--ca-file F] [--cert-file F --key-file F] [--server-name N] COMMAND
      status | nodes | schedulers | seqs [--pool P] [--limit N] | table SEQ | defrag [POOL] [--kind K]
      | drain NODE [--undrain] | fsck | reset-prefix-cache [--pool P]
      | events [--follow [--from ID]] [--max-events N]    (KV events: docs/kv_events.md)

The global options may also follow the command (`admin status --target HOST:PORT`).
Human-readable rich tables by default (pools and nodes sorted by id, "(none)" for an empty
list), `--json` (the admin RPC's response, proto field names) for scripts. Failures are one
line on stderr, never a traceback; a target that is not a block manager (a compute node's
port, say) is named as what it is. Exit codes: 0 ok; 1 the server refused the request or
`fsck` found problems; 2 bad usage; 3 the server could not be reached, did not answer in
time, or is not a block manager.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from block_manager.cli import events
from block_manager.client.admin import AdminClient, served_services
from block_manager.client.errors import BlockManagerError
from block_manager.client.retry import RetryPolicy
from pagedkv.cli import ArgumentParser, int_in, seconds
from pagedkv.rpc import answered_plain_http
from pagedkv.tls import add_tls_arguments, tls_from_args

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
DEFAULT_TARGET = "127.0.0.1:50051"
PROG = "block-manager admin"
UINT32_MAX = (1 << 32) - 1     # ListSequencesRequest.limit
CLI_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2)

Result = dict[str, Any]


def _global_options(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The options every command takes, before or after the command name. Only the main
    parser has defaults: a subcommand's copy sets a value only when it is given."""

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    p.add_argument(
        "--target",
        default=default(os.environ.get("PAGEDKV_ADMIN_TARGET", DEFAULT_TARGET)),
        help="HOST:PORT, or several comma-separated (active/standby: the one that serves) "
        "(env PAGEDKV_ADMIN_TARGET)",
    )
    p.add_argument(
        "--token",
        default=default(os.environ.get("PAGEDKV_ADMIN_TOKEN") or None),
        help="admin bearer token (env PAGEDKV_ADMIN_TOKEN)",
    )
    p.add_argument("--json", action="store_true", default=default(False), help="print the raw response as JSON")
    p.add_argument(
        "--timeout", type=seconds, default=default(5.0), help="per-call deadline in seconds (default 5)"
    )
    add_tls_arguments(p, "PAGEDKV_ADMIN_", defaults=defaults)


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Inspect and operate a running block manager.")
    _global_options(p, defaults=True)
    common = ArgumentParser(add_help=False)
    _global_options(common, defaults=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, parents=[common])

    command("status", "server state and per-pool usage")
    command("nodes", "registered compute nodes")
    command("schedulers", "fleet members (engines) and the pools each owns")
    s = command("seqs", "live sequences")
    s.add_argument("--pool", default="", help="only this pool")
    s.add_argument("--limit", type=int_in(0, UINT32_MAX), default=0, help="at most this many (0: server maximum)")
    s = command("table", "one sequence's block table")
    s.add_argument("seq", help="sequence id")
    s = command("defrag", "start defragmentation plans")
    s.add_argument("pool", nargs="?", default="", help="pool id (default: every pool)")
    s.add_argument("--kind", default="", choices=["", "compaction", "contiguity"], help="default compaction")
    s = command("drain", "stop admitting new sequences on a node")
    s.add_argument("node", help="node id")
    s.add_argument("--undrain", action="store_true", help="admit new sequences again")
    command("fsck", "consistency check (exit 1 when problems are found)")
    s = command("reset-prefix-cache", "drop cached prefix blocks")
    s.add_argument("--pool", default="", help="only this pool (default: every pool)")
    events.add_arguments(command("events", "KV events: what is cached where (--follow: live)"))
    return p


def _status(client: AdminClient, args: argparse.Namespace) -> Result:
    """Status, plus (for the human view) the node list, so the node count can say how many
    registered nodes are active, draining and fenced, as `admin nodes` lists them."""
    result = client.status()
    if not args.json and result.get("state") != "recovering":
        result["_nodes"] = client.list_nodes().get("nodes", [])
    return result


_HOST_FIELDS = ("host_num_blocks", "host_free_blocks", "host_used_blocks", "host_cached_blocks")


def _nodes(client: AdminClient) -> Result:
    """The node list with each node's host tier joined in (a node's pool is its host tier's
    owner, docs/tiers.md), so `nodes` shows both tiers; all 0 for a node without one, or while
    the block manager is recovering and has no pool statistics yet."""
    result = client.list_nodes()
    status = client.status()
    pools = {p["pool_id"]: p for p in status.get("pools", [])} if status.get("state") != "recovering" else {}
    for n in result.get("nodes", []):
        pool = pools.get(n.get("pool_id") or n["node_id"], {})
        for field in _HOST_FIELDS:
            n[field] = pool.get(field, 0)
    return result


def _call(client: AdminClient, args: argparse.Namespace) -> Result:
    calls: dict[str, Callable[[], Result]] = {
        "status": lambda: _status(client, args),
        "nodes": lambda: _nodes(client),
        "schedulers": lambda: {"schedulers": [dataclasses.asdict(s) for s in client.list_schedulers()]},
        "seqs": lambda: client.list_sequences(args.pool, args.limit),
        "table": lambda: client.describe_sequence(args.seq),
        "defrag": lambda: client.trigger_defrag(args.pool, args.kind),
        "drain": lambda: client.drain_node(args.node, undrain=args.undrain),
        "fsck": client.fsck,
        "reset-prefix-cache": lambda: client.reset_prefix_cache(args.pool),
    }
    return calls[args.command]()


# ---- human-readable views -------------------------------------------------------------
def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in columns:
        t.add_column(
            col,
            justify="left"
            if col in ("pool", "node", "seq", "address", "device", "dtype", "kind", "block table")
            else "right",
        )
    for row in rows:
        t.add_row(*(str(v) for v in row))
    return t


def _print_table(con: Console, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    if rows:
        con.print(_table(title, columns, rows))
    else:
        con.print(f"{title}: (none)")


def _short(ids: Sequence[Any], keep: int = 12) -> str:
    text = " ".join(str(i) for i in ids[:keep])
    return text + (f" … (+{len(ids) - keep})" if len(ids) > keep else "")


def _node_counts(r: Result) -> str:
    nodes = r.get("_nodes")
    if nodes is None:
        return f"nodes {r['num_nodes']} active"
    fenced = sum(1 for n in nodes if n.get("fenced"))
    draining = sum(1 for n in nodes if n.get("draining") and not n.get("fenced"))
    text = f"nodes {len(nodes) - fenced} active"
    if draining:
        text += f" ({draining} draining)"
    return text + f", {fenced} fenced"


def _show_status(con: Console, r: Result) -> None:
    """Fits an 80-column terminal: two header lines, then the pools as two narrow tables
    (capacity, then activity) rather than one of 17 columns that a terminal would crop."""
    con.print(f"state [bold]{r['state']}[/bold]  {_node_counts(r)}  sequences {r['num_sequences']}")
    con.print(f"store {r['store']}  journal seq {r['last_seq_no']}  uptime {r['uptime_s']:.0f}s", markup=False)
    pools = sorted(r["pools"], key=lambda p: p["pool_id"])
    if not pools:
        con.print("pools: (none)")
        return
    capacity = [
        (p["pool_id"], p["num_blocks"], p["block_size"], p["num_free_blocks"], p["num_used_blocks"],
         p["num_cached_blocks"], p["num_reserved_blocks"], f"{100 * p['usage']:.1f}%", p["high_water_mark"])
        for p in pools
    ]
    _print_table(con, "pools", ("pool", "blocks", "bs", "free", "used", "cached", "reserved", "usage", "hwm"),
                 capacity)
    activity = []
    for p in pools:
        hit = p["prefix_hit_tokens"] / p["prefix_query_tokens"] if p["prefix_query_tokens"] else 0.0
        activity.append((p["pool_id"], p["num_sequences"], p["num_tokens"], p["waste_slots"], f"{100 * hit:.1f}%",
                         p["cow_copies"], p["evictions"], p["defrag_moves"], f"{p['contiguity']:.2f}"))
    _print_table(con, "pool activity",
                 ("pool", "seqs", "tokens", "waste", "hit", "cow", "evict", "defrag", "contig"), activity)
    hosts = [p for p in pools if p.get("host_num_blocks")]
    if hosts:   # the host tier under each pool that has one (docs/tiers.md), again as two narrow tables
        _print_table(con, "host tier", ("pool", "blocks", "free", "used", "cached", "swapped seqs"), [
            (p["pool_id"], p["host_num_blocks"], p.get("host_free_blocks", 0), p.get("host_used_blocks", 0),
             p.get("host_cached_blocks", 0), p.get("num_swapped_sequences", 0)) for p in hosts])
        _print_table(con, "host moves", ("pool", "swap out", "swap in", "offload", "onboard", "hit tokens"), [
            (p["pool_id"], p.get("swapped_out_blocks", 0), p.get("swapped_in_blocks", 0), p.get("offloaded_blocks", 0),
             p.get("onboarded_blocks", 0), p.get("host_hit_tokens", 0)) for p in hosts])
    disks = [p for p in pools if p.get("disk_num_blocks")]
    if disks:   # the disk tier under the host tier (docs/tiers.md)
        _print_table(con, "disk tier", ("pool", "slots", "cached", "spilled", "onboarded", "hit tokens"), [
            (p["pool_id"], p["disk_num_blocks"], p.get("disk_cached_blocks", 0), p.get("disk_offloaded_blocks", 0),
             p.get("disk_onboarded_blocks", 0), p.get("disk_hit_tokens", 0)) for p in disks])


def _show_nodes(con: Console, r: Result) -> None:
    """Fits an 80-column terminal: membership, then each tier (docs/tiers.md) as its own narrow
    table, rather than one wide table that a terminal would crop."""
    nodes = sorted(r["nodes"], key=lambda n: n["node_id"])
    _print_table(con, "nodes", ("node", "epoch", "address", "draining", "fenced", "lease"), [
        (n["node_id"], n["epoch"], n["address"] or "-", "yes" if n["draining"] else "no",
         "yes" if n["fenced"] else "no", f"{n['lease_remaining_s']:.1f}s") for n in nodes])
    if not nodes:
        return
    _print_table(con, "device tier", ("node", "blocks", "bs", "device", "dtype"), [
        (n["node_id"], n["num_blocks"], n["block_size"], n["geometry"]["device"] or "-",
         n["geometry"]["dtype"] or "-") for n in nodes])
    hosts = [n for n in nodes if n.get("host_num_blocks")]
    if hosts:
        _print_table(con, "host tier", ("node", "blocks", "free", "used", "cached"), [
            (n["node_id"], n["host_num_blocks"], n.get("host_free_blocks", 0), n.get("host_used_blocks", 0),
             n.get("host_cached_blocks", 0)) for n in hosts])


def _show_schedulers(con: Console, r: Result) -> None:
    """Fleet members (docs/block_manager_service.md, "Fleet mode"); pools asked to be released
    are marked with a `*`."""
    rows = []
    for m in sorted(r["schedulers"], key=lambda m: m["scheduler_id"]):
        asked = set(m["release_pool_ids"])
        pools = " ".join(f"{p}*" if p in asked else p for p in m["pool_ids"]) or "-"
        rows.append((m["scheduler_id"], m["address"] or "-", pools, " ".join(m["pin_pool_ids"]) or "any",
                     m["num_running"], m["num_waiting"], f"{m['remaining_s']:.1f}s"))
    _print_table(con, "schedulers", ("scheduler", "address", "pools (*: releasing)", "pins", "running", "waiting",
                                     "lease"), rows)


def _show_seqs(con: Console, r: Result) -> None:
    rows = [
        (s["seq_id"], s["pool_id"], s["num_tokens"], len(s["block_table"]), s["version"], _short(s["block_table"]))
        for s in r["sequences"]
    ]
    _print_table(con, "sequences", ("seq", "pool", "tokens", "blocks", "version", "block table"), rows)
    if r["truncated"]:
        con.print(f"(truncated after {len(rows)}; use --pool or --limit)")


def _show_table(con: Console, r: Result) -> None:
    t = r["table"]
    con.print(f"seq {t['seq_id']}  pool {t['pool_id']}  version {t['version']}  tokens {t['num_tokens']}  "
              f"block size {r['block_size']}  blocks {r['num_blocks']}")
    bs, n = r["block_size"], t["num_tokens"]
    rows = [(i, b, f"{i * bs}-{min(n, (i + 1) * bs) - 1}") for i, b in enumerate(t["block_table"])]
    _print_table(con, "block table", ("logical", "block", "tokens"), rows)


def _show_defrag(con: Console, r: Result) -> None:
    if not r["plans"]:
        con.print("nothing to defragment")
        return
    rows = [(p["plan_id"], p["pool_id"], p["kind"], len(p["moves"])) for p in r["plans"]]
    con.print(_table("defrag plans started", ("plan", "pool", "kind", "moves"), rows))


def _show_fsck(con: Console, r: Result) -> None:
    if r["ok"]:
        con.print("fsck: ok")
        return
    con.print(f"fsck: {len(r['problems'])} problem(s)")
    for problem in r["problems"]:
        con.print(f"  - {problem}", markup=False)


def _show(con: Console, args: argparse.Namespace, r: Result) -> None:
    views: dict[str, Callable[[Console, Result], None]] = {
        "status": _show_status,
        "nodes": _show_nodes,
        "schedulers": _show_schedulers,
        "seqs": _show_seqs,
        "table": _show_table,
        "defrag": _show_defrag,
        "fsck": _show_fsck,
        "drain": lambda c, r: c.print(
            f"node {args.node}: {'admitting new sequences' if args.undrain else 'draining'} "
            f"({r['num_sequences']} live sequences)"
        ),
        "reset-prefix-cache": lambda c, r: c.print(f"reset {r['num_blocks_reset']} cached block(s)"),
    }
    views[args.command](con, r)


_KNOWN_SERVICES = {"pagedkv.v1.ComputeNode": "a pagedkv compute node"}


def _not_a_block_manager(target: str, timeout_s: float, args: argparse.Namespace) -> str:
    services = served_services(target, timeout_s, tls_from_args(args))
    if services is None:
        return f"{target} does not serve the block manager admin API (UNIMPLEMENTED); is --target right?"
    known = [_KNOWN_SERVICES[s] for s in services if s in _KNOWN_SERVICES]
    what = known[0] if known else "a gRPC server"
    listed = ", ".join(services) or "no services"
    return f"{target} is not a block manager: it is {what} ({listed}); point --target at the block manager"


def _tls_hint(exc: BlockManagerError, args: argparse.Namespace) -> str:
    """A connection the server closed during the handshake is usually a TLS mismatch."""
    text = exc.message.lower()
    if not any(w in text for w in ("socket closed", "handshake", "ssl", "certificate")):
        return ""
    if tls_from_args(args) is None:
        return ": the server may require TLS; pass --ca-file (and --cert-file/--key-file for mutual TLS)"
    return ": TLS handshake failed; check --ca-file, --cert-file/--key-file and --server-name"


def _error_line(exc: BlockManagerError, args: argparse.Namespace) -> tuple[str, int]:
    name = exc.code.name
    if answered_plain_http(exc.message):
        return (f"{args.target} answers plain HTTP, not gRPC: not a block manager (the OpenAI server? "
                f"the block manager listens on {DEFAULT_TARGET} unless its --listen says otherwise)"), EXIT_UNREACHABLE
    if name == "UNIMPLEMENTED":
        return _not_a_block_manager(args.target, args.timeout, args), EXIT_UNREACHABLE
    if name == "UNAVAILABLE" and ("connect" in exc.message.lower() or not exc.message):
        return f"cannot reach block manager at {args.target} (UNAVAILABLE){_tls_hint(exc, args)}", EXIT_UNREACHABLE
    if name == "UNAVAILABLE":
        return f"block manager at {args.target} is unavailable: {exc.message}", EXIT_UNREACHABLE
    if name == "DEADLINE_EXCEEDED":
        return (
            f"block manager at {args.target} did not answer within {args.timeout:g}s (DEADLINE_EXCEEDED)",
            EXIT_UNREACHABLE,
        )
    if name == "UNAUTHENTICATED":
        return f"unauthenticated: {exc.message} (pass --token or set PAGEDKV_ADMIN_TOKEN)", EXIT_REFUSED
    return f"{name.lower().replace('_', ' ')}: {exc.message}", EXIT_REFUSED


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed its usage line already
        return int(exc.code or 0) if exc.code in (0, None) else EXIT_USAGE
    try:
        tls = tls_from_args(args)
        client = AdminClient(args.target, token=args.token, timeout_s=args.timeout, retry=CLI_RETRY, tls=tls)
    except (OSError, ValueError) as exc:   # an unreadable or non-PEM certificate file
        print(f"{PROG}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "events":
        return _events(client, args)
    try:
        with client:
            result = _call(client, args)
    except BlockManagerError as exc:
        line, code = _error_line(exc, args)
        print(f"{PROG}: error: {line}", file=sys.stderr)
        return code
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        con = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 200, highlight=False)
        _show(con, args, result)
    if args.command == "fsck" and not result["ok"]:
        return EXIT_REFUSED
    return EXIT_OK


def _events(client: AdminClient, args: argparse.Namespace) -> int:
    """A stream, not one answer: printed as it comes (cli/events.py)."""
    problem = events.check_arguments(args)
    if problem is not None:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with client:
            return events.run(client, args)
    except BlockManagerError as exc:
        line, code = _error_line(exc, args)
        print(f"{PROG}: error: {line}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
