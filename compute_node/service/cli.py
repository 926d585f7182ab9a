"""`compute-node` command line.

    compute-node serve --config compute_node.yaml [--listen HOST:PORT] [--block-manager HOST:PORT]
                       [--node-id ID] [--num-blocks N] [--model DIR] [--metrics-port P] [--port-file FILE]

Configuration errors are one line on stderr with exit code 2; start-up failures exit 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_ERROR = 1
EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compute-node", description="pagedkv compute node")
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
    p.add_argument("--model", help="serve this Hugging Face model directory (Llama/Qwen2/Qwen3; overrides config)")
    p.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (0: ephemeral)")
    p.add_argument("--port-file", type=Path, help="write the bound gRPC port here once listening")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from compute_node.service.config import load_config
    from compute_node.service.server import serve
    from pagedkv.lifecycle import flag_overrides, run_service_main

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
        )
    )
    if args.num_blocks is not None:
        overrides["memory_budget_bytes"] = None
    return run_service_main(
        "compute-node",
        lambda: load_config(args.config, **overrides),
        lambda config: serve(config, args.port_file),
        lambda config: config.log_level,
    )


if __name__ == "__main__":
    sys.exit(main())
