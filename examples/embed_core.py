"""Embed the block manager core in your own scheduler: no server, no database."""
from block_manager.core import AppendFailure, AppendRequest, BlockManager

bm = BlockManager(watermark=0.01)                 # keep 1% free for running sequences' growth
bm.add_pool("gpu0", num_blocks=1024, block_size=16)


def run_forward(pool_id: str) -> None:
    """One step: hand the pool's copy ops and table deltas to your worker's Forward (with the
    step's tokens), then report it: only written blocks are ever copied or moved."""
    out = bm.close_step(pool_id)
    if out is not None:
        print(f"step {out.step_id}: {len(out.copy_ops)} copies, {len(out.deltas)} table deltas")
        bm.settle_steps(pool_id, out.step_id)     # the worker's Forward completed


system = list(range(100, 164))                    # a 64-token shared system prompt
a = bm.allocate("req-a", "gpu0", system + [1, 2, 3], salt="tenant-1")
run_forward("gpu0")
b = bm.allocate("req-b", "gpu0", system + [7, 8], salt="tenant-1")
print("req-b reused", b.num_cached_tokens, "cached tokens; compute slots", b.slot_mapping)

bm.fork("req-a", ["req-a/1", "req-a/2"])          # parallel sampling: share every block
step = bm.append_slots([AppendRequest("req-a/1", 1, (42,)), AppendRequest("req-a/2", 1, (43,))])
for r in step:
    if isinstance(r, AppendFailure):
        print(r.seq_id, "preempt:", r.error)      # that sequence is unchanged
    else:
        print(r.seq_id, "slot", r.slot_mapping, "copy-on-write", [(op.src, op.dst) for op in r.copy_ops])
run_forward("gpu0")

bm.free(["req-a", "req-a/1", "req-a/2", "req-b"])  # full blocks stay cached for the next hit
print(bm.metrics("gpu0"))
assert not bm.fsck()
