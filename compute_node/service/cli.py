"""`compute-node` command line.

    compute-node serve --config compute_node.yaml [--listen HOST:PORT] [--block-manager HOST:PORT]
                       [--node-id ID] [--num-blocks N] [--model DIR] [--metrics-port P] [--port-file FILE]

Configuration errors (a flag, the YAML, a model directory that is missing or not a supported
model) are one line on stderr with exit code 2, found before anything listens; start-up
failures (a port in use, TLS files) exit 1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from pagedkv.cli import ArgumentParser

EXIT_ERROR = 1
EXIT_USAGE = 2


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="compute-node", description="pagedkv compute node")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the compute node gRPC service")
    p.add_argument("--config", type=Path, help="YAML config file (PAGEDKV_CN_* environment variables override it)")
    p.add_argument("--listen", help="listen address HOST:PORT (overrides config)")
    p.add_argument("--block-manager", help="block manager address HOST:PORT (overrides config)")
    p.add_argument("--node-id", help="node id, also the pool id (overrides config)")
    p.add_argument("--num-blocks", type=int, help="blocks in the pool (overrides config)")
    p.add_argument("--host-kv-memory", type=int, metavar="BYTES",
                   help="host tier under the KV pool, in bytes (swap preemption, prefix offload; docs/tiers.md)")
    p.add_argument("--host-kv-blocks", type=int, metavar="N", help="host tier size in blocks instead of bytes")
    p.add_argument("--disk-kv-path", metavar="DIR",
                   help="disk tier under the host tier: its slot file's directory (survives restarts; docs/tiers.md)")
    p.add_argument("--disk-kv-bytes", type=int, metavar="BYTES", help="disk tier size in bytes")
    p.add_argument("--model", help="serve this Hugging Face model directory (Llama/Qwen2/Qwen3; overrides config)")
    p.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (0: ephemeral)")
    p.add_argument("--port-file", type=Path, help="write the bound gRPC port here once listening")
    return parser


# libgomp's spin before a waiting thread sleeps, in its own units (iterations of a pause loop):
# long enough to bridge the gaps between a step's back-to-back parallel regions, far shorter than
# libgomp's default (300,000), which keeps spinning between steps (BENCHMARKS.md "Services
# mode, round 4").
NODE_SPINCOUNT = "10000"


def short_omp_spin(environ: MutableMapping[str, str]) -> bool:
    """Unless the environment already says how OpenMP threads wait (`OMP_WAIT_POLICY` or
    `GOMP_SPINCOUNT`), make them spin briefly, then sleep (`GOMP_SPINCOUNT=NODE_SPINCOUNT`);
    True when set here. Must run before torch loads (libgomp reads it once).

    Why neither of libgomp's own choices: its default spins a few ms at every barrier, and on a
    host whose cores other processes keep busy the node's 2 threads then ran ~5x slower; sleeping
    at once (`OMP_WAIT_POLICY=PASSIVE`, this function's earlier choice) costs a wake-up of
    ~100 µs in each of a decode step's ~120 parallel regions, which left the node 8–20% behind
    the embedded engine on idle cores. The short spin beat both there (1.14x the embedded
    engine, 1.24x the passive node) and stayed 3.5x the default spin under load (BENCHMARKS.md,
    "Services mode, round 2" and "round 4"; with oneDNN-packed weights 0.90x the embedded engine,
    1.01x with libgomp's default spin). A dedicated host may set `GOMP_SPINCOUNT=300000`
    (libgomp's default); a crowded one `OMP_WAIT_POLICY=PASSIVE` (then decode steps run on one
    torch thread: `dense_threads.py`)."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = NODE_SPINCOUNT
    return True


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    short_omp_spin(os.environ)   # before anything imports torch
    from compute_node.service.config import load_config
    from pagedkv.lifecycle import flag_overrides, run_service_main
    from pagedkv.settings import ConfigError

    overrides = flag_overrides(
        (
            ("listen_address", args.listen),
            ("block_manager_address", args.block_manager),
            ("node_id", args.node_id),
            ("num_blocks", args.num_blocks),
            ("model", args.model),
            ("metrics_port", args.metrics_port),
            ("host_kv_memory", args.host_kv_memory),
            ("host_kv_blocks", args.host_kv_blocks),
            ("disk_kv_path", args.disk_kv_path),
            ("disk_kv_bytes", args.disk_kv_bytes),
        )
    )
    if args.num_blocks is not None:
        overrides["memory_budget_bytes"] = None
    def load() -> Any:
        """The config, with its model directory checked before anything listens or loads."""
        config = load_config(args.config, **overrides)
        if config.model is not None:
            from compute_node.model.config import ModelConfig
            from compute_node.model.errors import ModelLoadError

            try:
                ModelConfig.from_dir(config.model)
            except ModelLoadError as exc:
                raise ConfigError(f"{exc} (pass a Hugging Face model directory, or make a tiny demo one: "
                                  f".venv/bin/python -m engine.model_init /tmp/tiny-llama)") from None
        return config

    def serve_node(config: Any) -> Any:
        # torch, Numba and the model (~2.5 CPU-s) only once the config and ports are known good
        from compute_node.service.server import serve

        return serve(config, args.port_file)

    return run_service_main("compute-node", load, serve_node, lambda config: config.log_level)


if __name__ == "__main__":
    sys.exit(main())
