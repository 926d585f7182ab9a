"""Prefix fetch between nodes benchmark (issue 19 item 1, docs/prefix_fetch.md): CPU, float32,
the demo's random-weight Llama (12 layers, hidden 512) built in a temp dir; a block manager
(in this process) and two model nodes as processes, the engine here. Side by side in one run:

1. TTFT of a request whose `--prefix` tokens are cached on node A while A is drained, so the
   request runs on node B: fetched from A (B pulls the blocks) vs recomputed (a prefix nobody
   holds, same length); rounds alternate, p50 and the ratio are printed.
2. Node->node transfer throughput: `FetchBlocks` (grant checks, a checksum per chunk, gather on
   the source, scatter into the destination pool) vs a raw gRPC stream of the same bytes in
   the same chunk size (no checks, no gather/scatter), from one source process, MB/s each.

    .venv/bin/python bench/bench_prefix_fetch.py [--prefix 2048] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import torch  # noqa: E402

from block_manager.client import AdminClient, BlockManagerClient  # noqa: E402
from block_manager.service.config import load_config as load_bm_config  # noqa: E402
from block_manager.service.server import BlockManagerServer  # noqa: E402
from compute_node.model.tiny import build_tiny_model  # noqa: E402
from compute_node.pool import KvPool, PoolGeometry  # noqa: E402
from compute_node.transfer import DEFAULT_CHUNK_BYTES, BlockPuller  # noqa: E402
from engine.executor import RemoteNode  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.params import SamplingParams  # noqa: E402

BS = 16
RAW_METHOD = "/bench.Raw/Stream"
XFER_GEOM = PoolGeometry(num_layers=12, num_kv_heads=2, head_dim=64, dtype="float32", block_size=BS, num_blocks=256)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check: Any, what: str, timeout_s: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)


class Node:
    def __init__(self, node_id: str, bm: str, model: Path, tmp: Path) -> None:
        port_file = tmp / f"{node_id}.port"
        env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDKV_CN_NODE_ID": node_id,
               "PAGEDKV_CN_LISTEN_ADDRESS": "127.0.0.1:0", "PAGEDKV_CN_BLOCK_MANAGER_ADDRESS": bm,
               "PAGEDKV_CN_MODEL": str(model), "PAGEDKV_CN_NUM_BLOCKS": "1024", "PAGEDKV_CN_BLOCK_SIZE": str(BS),
               "PAGEDKV_CN_DEVICE": "cpu", "PAGEDKV_CN_LOG_LEVEL": "WARNING"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from compute_node.service.cli import main; sys.exit(main())",
             "serve", "--port-file", str(port_file)], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=open(tmp / f"{node_id}.log", "w"),  # noqa: SIM115
        )
        port = _wait(lambda: port_file.exists() and port_file.read_text().strip(), f"{node_id} listening")
        self.remote = RemoteNode(node_id, f"127.0.0.1:{port}")
        _wait(lambda: self.remote.info(timeout_s=30).registered, f"{node_id} registered")

    def stop(self) -> None:
        self.remote.close()
        self.proc.terminate()
        self.proc.wait(30)


def _run(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from arrival to the first token (max_tokens=1: the request's whole life)."""
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    dt = time.perf_counter() - t0
    engine.flush()
    return dt


def ttft(model: Path, prefix_len: int, rounds: int, tmp: Path) -> None:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    bm = BlockManagerServer(load_bm_config(listen_address="127.0.0.1:0", database_url="memory://", block_size=BS,
                                           watermark=0.0, lease_ttl_s=60.0, defrag={"enabled": False}))
    asyncio.run_coroutine_threadsafe(bm.start(), loop).result(60)
    a = Node("node-a", bm.address, model, tmp)
    b = Node("node-b", bm.address, model, tmp)
    engine = LLMEngine(BlockManagerClient(bm.address), {"node-a": a.remote, "node-b": b.remote},
                       EngineConfig(max_num_batched_tokens=prefix_len + 64))
    admin = AdminClient(bm.address)
    rng = random.Random(3)
    fetched: list[float] = []
    recomputed: list[float] = []
    try:
        _run(engine, [rng.randrange(1, 8000) for _ in range(64)])    # warm both paths' first calls
        for _ in range(rounds):
            prefix = [rng.randrange(1, 8000) for _ in range(prefix_len)]
            admin.drain_node("node-b")
            _run(engine, prefix + [1, 2, 3])                              # the prefix lands on A
            admin.drain_node("node-b", undrain=True)
            admin.drain_node("node-a")
            before = engine.stats.fetched_tokens
            fetched.append(_run(engine, prefix + [4, 5, 6]))              # B fetches it from A
            if engine.stats.fetched_tokens - before < prefix_len - BS:
                raise SystemExit("the fetch round did not fetch the prefix")
            fresh = [rng.randrange(1, 8000) for _ in range(prefix_len)]
            before = engine.stats.fetched_tokens
            recomputed.append(_run(engine, fresh + [4, 5, 6]))            # nobody holds it: B recomputes
            if engine.stats.fetched_tokens != before:
                raise SystemExit("the recompute round fetched")
            admin.drain_node("node-a", undrain=True)
        f50, r50 = statistics.median(fetched), statistics.median(recomputed)
        print(f"## TTFT, {prefix_len}-token shared prefix + 3 tokens, on node B with the prefix on drained node A "
              f"({rounds} rounds each, alternating)")
        print(f"fetched from A : p50 {1e3 * f50:8.1f} ms  (all: {', '.join(f'{1e3 * x:.0f}' for x in fetched)})")
        print(f"recomputed     : p50 {1e3 * r50:8.1f} ms  (all: {', '.join(f'{1e3 * x:.0f}' for x in recomputed)})")
        print(f"fetch is {r50 / f50:.1f}x faster than recompute (TTFT p50)")
        if admin.fsck().get("ok") is not True:
            raise SystemExit("fsck failed after the run")
    finally:
        admin.close()
        engine.close()
        engine.client.close()
        a.stop()
        b.stop()
        asyncio.run_coroutine_threadsafe(bm.stop(0), loop).result(60)


# ---- transfer throughput ------------------------------------------------------------------------
def serve_source(port_file: Path, num_grants: int, num_blocks: int, chunk_bytes: int) -> None:
    """The source process of part 2: a node's FetchBlocks with `num_grants` grants of
    `num_blocks` blocks each, and a raw stream of the same bytes in the same chunks, on one
    server with the node's own interceptors (edge guard, error mapping) and channel options."""
    from compute_node.service.config import ComputeNodeConfig
    from compute_node.service.interceptors import ErrorMappingInterceptor
    from compute_node.service.node import ComputeNode
    from compute_node.service.server import edge_guard
    from compute_node.service.servicer import ComputeNodeServicer
    from compute_node.transfer import pack_blocks
    from pagedkv.lifecycle import bind, new_server
    from pagedkv.v1 import compute_node_pb2_grpc as pb_grpc

    class _Serve:
        def __init__(self, fid: str) -> None:
            self.fetch_id, self.dst_pool_id, self.blocks, self.host = fid, "dst", tuple(range(num_blocks)), ()

    pool = KvPool(XFER_GEOM, torch.device("cpu"))
    for t in (*pool.key_caches, *pool.value_caches):
        t.copy_(torch.randn(t.shape))
    payload = bytes(pack_blocks(pool, list(range(num_blocks))))

    async def raw(request: bytes, context: Any) -> Any:
        for off in range(0, len(payload), chunk_bytes):
            yield payload[off:off + chunk_bytes]

    async def main() -> None:
        config = ComputeNodeConfig(node_id="src", block_manager_address="127.0.0.1:1", fetch_grant_ttl_s=3600)
        node = ComputeNode(config)
        node.pool = pool
        node.grants.add([_Serve(f"f{i}") for i in range(num_grants)])
        server = new_server([edge_guard(config), ErrorMappingInterceptor()])
        pb_grpc.add_ComputeNodeServicer_to_server(ComputeNodeServicer(node), server)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Raw", {
            "Stream": grpc.unary_stream_rpc_method_handler(raw, lambda b: b, lambda b: b)})])
        port = bind(server, "127.0.0.1:0", None)
        await server.start()
        port_file.write_text(str(port))
        await server.wait_for_termination()

    asyncio.run(main())


def transfer(num_blocks: int, repeats: int, chunk_bytes: int, tmp: Path) -> None:
    port_file = tmp / "src.port"
    proc = subprocess.Popen([sys.executable, __file__, "--serve-source", str(port_file), "--grants", str(2 * repeats),
                             "--xfer-blocks", str(num_blocks), "--chunk-bytes", str(chunk_bytes)],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "src.log", "w"))  # noqa: SIM115
    try:
        port = _wait(lambda: port_file.exists() and port_file.read_text().strip(), "transfer source listening")
        address = f"127.0.0.1:{port}"
        dst = KvPool(XFER_GEOM, torch.device("cpu"))
        puller = BlockPuller("dst", tls=None, token=None, timeout_s=300, chunk_bytes=chunk_bytes)
        channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        raw = channel.unary_stream(RAW_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        nbytes = num_blocks * XFER_GEOM.bytes_per_block

        class _Op:
            def __init__(self, i: int) -> None:
                self.fetch_id, self.src_pool_id, self.src_address = f"f{i}", "src", address
                self.src_blocks = self.dst_blocks = tuple(range(num_blocks))

        def fetch_once(i: int) -> float:
            t0 = time.perf_counter()
            if puller.pull(dst, _Op(i)) != nbytes:
                raise SystemExit("short transfer")
            return time.perf_counter() - t0

        def raw_once() -> float:
            t0 = time.perf_counter()
            buf = bytearray(nbytes)
            got = 0
            for part in raw(b"", timeout=300):
                buf[got:got + len(part)] = part
                got += len(part)
            if got != nbytes:
                raise SystemExit("short raw stream")
            return time.perf_counter() - t0

        fetch_once(0)
        raw_once()                                                     # warm both (channel, first pages)
        f_s, r_s = [], []
        for i in range(1, repeats + 1):                                # alternating, one run
            f_s.append(fetch_once(i))
            r_s.append(raw_once())
        f, r = statistics.median(f_s), statistics.median(r_s)
        mb = nbytes / 1e6
        pairs = sorted(rr / ff for ff, rr in zip(f_s, r_s))

        def spread(xs: list[float]) -> str:
            return f"min {1e3 * min(xs):.1f} / max {1e3 * max(xs):.1f} ms"

        print(f"## node->node transfer, {num_blocks} blocks x {XFER_GEOM.bytes_per_block // 1024} KiB = {mb:.1f} MB "
              f"({repeats} runs each, alternating, {chunk_bytes // 1024} KiB chunks, same server and channel options)")
        print(f"FetchBlocks (grant, checksum, gather+scatter): p50 {1e3 * f:7.1f} ms = {mb / f:7.1f} MB/s "
              f" ({spread(f_s)})")
        print(f"raw gRPC stream of the same bytes            : p50 {1e3 * r:7.1f} ms = {mb / r:7.1f} MB/s "
              f" ({spread(r_s)})")
        print(f"FetchBlocks / raw throughput: {r / f:.2f}x (p50s); per alternating pair: "
              f"{', '.join(f'{x:.2f}' for x in pairs)}")
        puller.close()
        channel.close()
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens (default 2048)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--xfer-blocks", type=int, default=128, help="blocks per transfer in part 2")
    ap.add_argument("--xfer-repeats", type=int, default=7, help="transfers of each kind in part 2")
    ap.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                    help="chunk size of both streams in part 2 (default: the node's, 4 MiB)")
    ap.add_argument("--transfer-only", action="store_true", help="part 2 only (no model, no TTFT)")
    ap.add_argument("--quick", action="store_true", help="512-token prefix, 2 rounds, 32 blocks")
    ap.add_argument("--serve-source", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--grants", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_source:
        serve_source(args.serve_source, args.grants, args.xfer_blocks, args.chunk_bytes)
        return
    if args.quick:
        args.prefix, args.rounds, args.xfer_blocks, args.xfer_repeats = 512, 2, 32, 3
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print(f"2-core shared VM, no GPU; torch {torch.__version__}; model: 12 layers, hidden 512, float32; "
              f"block size {BS}; load {os.getloadavg()[0]:.1f}")
        transfer(args.xfer_blocks, args.xfer_repeats, args.chunk_bytes, tmp)
        if not args.transfer_only:
            model = build_tiny_model(tmp / "model", max_position_embeddings=max(4096, args.prefix + 128))
            ttft(model, args.prefix, args.rounds, tmp)


if __name__ == "__main__":
    main()
