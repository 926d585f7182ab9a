"""Drive a running block manager from your scheduler: one round trip per step, at most."""
import os
import sys

from block_manager.client import BlockManagerClient

target = os.environ.get("PAGEDKV_TARGET", "127.0.0.1:50051")
with BlockManagerClient(target, timeout_s=5.0) as client:
    routes = client.route(list(range(100, 164)), salt="tenant-1")   # cache-aware placement
    if not routes:
        sys.exit(f"no compute node is registered with the block manager at {target}: start one first")
    pool = routes[0].pool_id
    client.tracker.set_block_size(pool, 16)       # lets the client answer in-block appends locally
    step = client.step()
    step.allocate("req-a", pool, list(range(100, 170)), salt="tenant-1")
    first = step.commit()                         # Allocate: table, cached tokens, slots to compute
    print("prefill slots", first.allocations["req-a"].slot_mapping[:4], "...")
    for token in (11, 12, 13):                    # decode: one StepBatch per scheduler step
        step = client.step()
        step.append("req-a", [token])
        out = step.commit().appends["req-a"]      # slot_mapping, version, context_len for Forward
        print("token", token, "-> slot", out.slot_mapping, "(no RPC)" if out.deferred else "")
    client.free(["req-a"])
    print("rpcs", client.stats.rpcs, "deferred tokens", client.stats.deferred_tokens)
