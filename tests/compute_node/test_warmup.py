"""The node compiles every CPU kernel before registering, so a cold compile cannot hold the GIL
through a real Forward and starve its heartbeats into a fenced lease.

Checked in a fresh process (the compiled-signature sets are process-global, so in the test
process another test may already have compiled everything; a child of the suite's fork server
has imported Numba but compiled nothing): before the warm-up no kernel has a
compiled signature, after it every kernel has one, and a real write / copy / decode / split-K /
prefill / model step (both variants) through the node's `KvPool` adds none: the warm-up
compiled exactly what a Forward or a Generate runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support import fork_server

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import importlib, json, sys
import torch
from compute_node.pool import KvPool, PoolGeometry
from compute_node.service.warmup import warm_up_cpu_kernels
from kernels.cpu.decode import paged_attention_decode as cpu_decode

from kernels.cpu import prefill_flash

dtype, bs = sys.argv[1], int(sys.argv[2])
KERNELS = [("attend", "attend_serial"), ("attend", "attend_parallel"),
           ("decode_split", "_reduce_kernel"), ("write_slots", "_write_slots_kernel"),
           ("copy_blocks", "_copy_blocks_kernel")]
flash = dtype == "float32" and prefill_flash.usable(32, bs) and prefill_flash.preferred()
if flash:   # the step's flash-prefill and cascade-decode paths (AVX2 without AVX-512)
    KERNELS += [("prefill_flash", "_flash_serial"), ("prefill_flash", "_flash_parallel"),
                ("decode_cascade", "_cascade_serial"), ("decode_cascade", "_cascade_parallel")]

def compiled():
    return {f"{m}.{k}": len(getattr(importlib.import_module(f"kernels.cpu.{m}"), k).signatures) for m, k in KERNELS}

before = compiled()
seconds = warm_up_cpu_kernels(2, 32, dtype, block_size=bs)
after = compiled()
pool = KvPool(PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=32, dtype=dtype, block_size=bs, num_blocks=16),
              torch.device("cpu"))
g = torch.Generator().manual_seed(0)
kv = lambda n: torch.randn(n, 2, 32, generator=g).to(pool.key_caches[0].dtype)
pool.write(0, kv(6), kv(6), torch.arange(6, dtype=torch.int64))
pool.copy_blocks([(1, 5)])
tables = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)
pool.decode(0, torch.randn(2, 4, 32, generator=g), tables, torch.tensor([6, 5], dtype=torch.int32), 0.2)
cpu_decode(torch.randn(2, 4, 32, generator=g), pool.key_caches[0], pool.value_caches[0], tables,
           torch.tensor([6, 5], dtype=torch.int32), 0.2, split=True)
pool.prefill(0, torch.randn(5, 4, 32, generator=g), tables, torch.tensor([6, 3], dtype=torch.int32),
             torch.tensor([0, 3, 5], dtype=torch.int32), 0.2)
for serial in (True, False):   # the model path's step kernel (what a model node's Generate runs)
    step = pool.begin_cpu_step(num_heads=4, slot_mapping=torch.tensor([6, 1, 2], dtype=torch.int64),
                               num_decode_tokens=1, decode_block_tables=tables[:1],
                               decode_seq_lens=torch.tensor([7], dtype=torch.int32), prefill_block_tables=tables[1:],
                               prefill_seq_lens=torch.tensor([3], dtype=torch.int32),
                               prefill_query_start_loc=torch.tensor([0, 2], dtype=torch.int32), scale=0.2)
    step.serial = serial
    step.run(0, torch.randn(3, 4, 32, generator=g).to(pool.key_caches[0].dtype), kv(3), kv(3))
    # two decode rows sharing their first block (the cascade where the CPU takes it), a prefill row
    shared = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)
    step = pool.begin_cpu_step(num_heads=4, slot_mapping=torch.tensor([bs, 2 * bs, bs + 1], dtype=torch.int64),
                               num_decode_tokens=2, decode_block_tables=shared,
                               decode_seq_lens=torch.tensor([bs + 1, bs + 1], dtype=torch.int32),
                               prefill_block_tables=shared[:1],
                               prefill_seq_lens=torch.tensor([bs + 2], dtype=torch.int32),
                               prefill_query_start_loc=torch.tensor([0, 1], dtype=torch.int32), scale=0.2)
    step.serial = serial
    step.run(0, torch.randn(3, 4, 32, generator=g).to(pool.key_caches[0].dtype), kv(3), kv(3))
print(json.dumps({"before": before, "after": after, "final": compiled(), "seconds": seconds, "flash": flash}))
"""


@pytest.mark.parametrize(("dtype", "block_size"), [("float16", 4), ("bfloat16", 4), ("float32", 4), ("float32", 16)])
def test_warm_up_compiles_what_a_forward_runs(dtype: str, block_size: int) -> None:
    """Block size 16 with float32: the flash-prefill and cascade-decode kernels too, on a CPU
    that takes them (block size 4 fits no 16-key tile)."""
    proc = fork_server.run([sys.executable, "-c", _SCRIPT, dtype, str(block_size)], cwd=REPO, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["before"].values()) == {0}, f"kernels compiled before the warm-up: {out['before']}"
    missing = [name for name, n in out["after"].items() if n == 0]
    assert not missing, f"not compiled by the warm-up: {missing}"
    assert out["final"] == out["after"], "a real Forward compiled kernels the warm-up missed"
    assert out["seconds"] > 0
