"""The block manager holds a 1,000,000-token sequence (62,500 blocks of 16) within its bounds.

The core allocates it (prefix hashes of every full block included), hands the step out, takes
one more token, snapshots and restores it exactly; the Step payload and result the service
would send and journal stay under the documented gRPC message bound (64 MiB,
`BlockManagerConfig.max_message_bytes`), and a real SQLite journal stores and recovers the snapshot
and the record. Sizes and times are printed (never asserted as time).
"""

from __future__ import annotations

import json
import time

from block_manager.core import BlockManager
from block_manager.service.config import BlockManagerConfig
from block_manager.service.step_codec import pool_step_dict
from block_manager.store import NewRecord, open_store, payload_digest

MILLION = 1_000_000
BLOCK_SIZE = 16
NUM_BLOCKS = MILLION // BLOCK_SIZE  # 62,500
MESSAGE_BOUND = BlockManagerConfig.model_fields["max_message_bytes"].default  # 64 MiB


def test_a_million_token_sequence(tmp_path) -> None:
    assert NUM_BLOCKS == 62_500 and MESSAGE_BOUND == 64 << 20
    bm = BlockManager()
    bm.add_pool("node-a", NUM_BLOCKS + NUM_BLOCKS // 50 + 64, BLOCK_SIZE)  # above the 1% watermark
    tokens = [i % 50_000 for i in range(MILLION)]
    t0 = time.perf_counter()
    result = bm.allocate("long", "node-a", tokens)
    t_alloc = time.perf_counter() - t0
    assert len(result.block_table) == NUM_BLOCKS and len(set(result.block_table)) == NUM_BLOCKS
    assert len(result.slot_mapping) == MILLION and result.num_cached_tokens == 0

    out = bm.close_step("node-a")
    assert out is not None
    (delta,) = out.deltas
    step = pool_step_dict(out, epoch=1)
    step_bytes = len(json.dumps(step))
    assert step_bytes < MESSAGE_BOUND
    bm.settle_steps("node-a", completed_up_to=out.step_id)

    # The 1,000,001st token opens block 62,501.
    outcome = bm.append_tokens(["long"], [1])
    assert not outcome.failures
    nxt = bm.close_step("node-a")
    assert nxt is not None
    bm.settle_steps("node-a", completed_up_to=nxt.step_id)
    view = bm.get_sequence("long")
    assert view.num_tokens == MILLION + 1 and len(view.block_table) == NUM_BLOCKS + 1
    assert bm.fsck() == []

    t0 = time.perf_counter()
    snapshot = bm.to_snapshot()
    encoded = json.dumps(snapshot)
    restored = BlockManager.from_snapshot(json.loads(encoded))
    t_snap = time.perf_counter() - t0
    assert restored.to_snapshot() == snapshot
    assert restored.get_sequence("long").block_table == view.block_table
    assert restored.fsck() == []

    # The journal: the allocation's payload (every token id) as one record, then the snapshot,
    # in a real SQLite file; both come back.
    payload = {"alloc": {"seq_ids": ["long"], "pool_ids": ["node-a"], "token_ids": tokens}}
    payload_bytes = len(json.dumps(payload))
    assert payload_bytes < MESSAGE_BOUND
    store = open_store(f"sqlite:///{tmp_path / 'bm.db'}")
    try:
        (seq_no,) = store.append([NewRecord("alloc-long", "step", payload, step,
                                            payload_digest(payload))])
        store.write_snapshot(seq_no, snapshot)
        recovered = store.recover()
    finally:
        store.close()
    assert recovered.snapshot == snapshot and recovered.snapshot_seq_no == seq_no
    print(f"\n1M-token sequence: allocate {t_alloc:.2f} s; step result {step_bytes / 1e6:.2f} MB, "
          f"payload {payload_bytes / 1e6:.2f} MB, snapshot {len(encoded) / 1e6:.2f} MB "
          f"(bound {MESSAGE_BOUND / 2**20:.0f} MiB); snapshot + restore {t_snap:.2f} s")
