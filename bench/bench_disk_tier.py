"""Disk KV tier benchmark (issue 19 item 2, docs/tiers.md): CPU, float32, a small random-weight
Llama built in a temp dir, the embedded `LLM`; both sides run in one process, interleaved.

TTFT (a 1-token generate) of a request with a long shared prefix (default 2048 tokens):
- recomputed: a fresh node with nothing cached prefills the whole prompt;
- disk onboard: a fresh node (a *restarted* one: empty device and host) whose disk tier holds
  the prefix from an earlier process onboards it disk->host->device in the admitting step and
  prefills only the tail.
Each repetition starts a new `LLM` (model load and a short unrelated warm-up request untimed);
p50 over `--reps` of each, plus the raw disk->host read rate of the slot file for this model's
block geometry.

    .venv/bin/python bench/bench_disk_tier.py [--prefix 2048] [--reps 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from compute_node.model.tiny import build_tiny_model  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.params import SamplingParams  # noqa: E402

BS = 16
MODEL = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512,
             vocab_size=2048)
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def _llm(model: Path, device: int, disk: Path | None) -> LLM:
    # host tier as large as the device pool: a step's evictions pass through it (a block can only
    # spill to disk once the step that offloaded it to host is reported)
    extra = {"host_kv_blocks": device, "disk_kv_path": str(disk), "disk_kv_bytes": 256 << 20} if disk else {}
    return LLM(model, block_size=BS, num_kv_blocks=device, device="cpu", watermark=0.0,
               max_num_batched_tokens=4096, **extra)


def run(model: Path, prefix_len: int, reps: int, tmp: Path) -> None:
    rng = random.Random(5)
    prefix = [rng.randrange(1, 2000) for _ in range(prefix_len)]
    fillers = [[rng.randrange(1, 2000) for _ in range(prefix_len)] for _ in range(3)]
    warm = [rng.randrange(1, 2000) for _ in range(40)]
    device = prefix_len // BS + 8
    disk = tmp / "disk"
    # An earlier process computed the prefix; other prompts pushed it off the device, then off host.
    with _llm(model, device, disk) as llm:
        llm.generate([{"prompt_token_ids": prefix + [7]}], ONE)
        for f in fillers:
            llm.generate([{"prompt_token_ids": f}], ONE)
        spilled = llm.stats()["disk_offloaded_blocks"]
    times: dict[str, list[float]] = {"recompute": [], "disk": []}
    hits: list[int] = []
    ref: list[list[int]] = []
    for rep in range(reps):
        for label in ("recompute", "disk"):
            with _llm(model, device, disk if label == "disk" else None) as llm:
                llm.generate([{"prompt_token_ids": warm}], ONE)   # first-step costs (JIT, allocations) untimed
                prompt = prefix + [9, 10 + rep]
                t0 = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": prompt}], ONE)
                times[label].append(time.perf_counter() - t0)
                if label == "disk":
                    hits.append(llm.stats()["disk_hit_tokens"])
                    assert out[0].outputs[0].token_ids == ref[rep], "disk onboard changed the token"
                else:
                    ref.append(out[0].outputs[0].token_ids)
    rec, dsk = statistics.median(times["recompute"]), statistics.median(times["disk"])
    print(f"## TTFT p50, {prefix_len}-token shared prefix on a restarted node ({reps} reps each, {spilled} blocks "
          f"spilled to disk earlier): recompute {1e3 * rec:.1f} ms, disk onboard {1e3 * dsk:.1f} ms "
          f"(disk hit tokens {min(hits)}): {rec / dsk:.1f}x")


def read_rate(tmp: Path, n_blocks: int = 128) -> None:
    from compute_node.disk_tier import DiskBlockMeta, DiskKvStore
    from compute_node.host_pool import HostKvPool
    from compute_node.pool import PoolGeometry

    g = PoolGeometry(MODEL["num_layers"], MODEL["num_kv_heads"], MODEL["head_dim"], "float32", BS, n_blocks)
    host = HostKvPool(g, n_blocks, torch.device("cpu"))
    store = DiskKvStore(tmp / "rate", 4096 + (n_blocks + 1) * 80 * 1024, g, "bench")
    metas = [DiskBlockMeta(bytes([i % 256]) * 32, None, None, tuple(range(BS))) for i in range(n_blocks)]
    store.write(host, [(i, i, metas[i]) for i in range(n_blocks)])
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        store.read(host, [(i, (i * 7) % n_blocks) for i in range(n_blocks)])
        best = min(best, time.perf_counter() - t0)
    mb = n_blocks * g.bytes_per_block / 1e6
    print(f"## disk->host read (page cache warm, crc32 checked): {n_blocks} blocks of {g.bytes_per_block} bytes in "
          f"{1e3 * best:.1f} ms = {mb / best:.0f} MB/s")
    store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"# bench_disk_tier  torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        model = build_tiny_model(tmp / "llama", "llama", seed=1, **MODEL)
        run(model, args.prefix, args.reps, tmp)
        read_rate(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
