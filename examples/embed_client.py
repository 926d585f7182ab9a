"""Drive a running block manager from your scheduler: one Step per scheduler step, at most."""
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
    result = step.commit()                        # the admission, and the pool's step for its node
    adm = result.allocations["req-a"]
    seq = client.tracker.get("req-a")
    print("prefill", adm.num_tokens - adm.num_cached_tokens, "tokens, first slots",
          seq.slot_mapping(adm.num_cached_tokens, adm.num_cached_tokens + 4), "...")
    # A real scheduler now passes result.steps[pool].message to the node's Forward with the
    # step's tokens, and reports the Forward; the report travels with the next step.
    client.report(result.steps[pool], ok=True)
    for token in (11, 12, 13):                    # decode: one Step per scheduler step, at most
        step = client.step()
        step.append("req-a", [token])
        result = step.commit()
        out = result.appends["req-a"]             # what the Forward writes: 1 token, the new length
        print("token", token, "-> context", out.context_len, "(no RPC)" if out.deferred else "")
        for pool_step in result.steps.values():
            client.report(pool_step, ok=True)
    client.free(["req-a"])
    client.release()                              # hand the pool back: another scheduler may drive it
    print("rpcs", client.stats.rpcs, "deferred tokens", client.stats.deferred_tokens)
