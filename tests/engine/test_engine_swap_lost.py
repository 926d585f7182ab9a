"""A swapped sequence whose swap-out step failed on a node that left placement (issue 47).

The engine machine found it with the block manager down (`BM_DOWN`): the node's failed report
rides the next Step and drops the sequence (its swap-out's step wrote it); in that same
Step's planning the swap policy gives the sequence up (NodeOutOfPlacement: RECOMPUTE_FREE).
Its free was queued after the Step had taken its frees, so it went with the Step after, where
the block manager, having dropped it already, answered DoubleFree and the engine stopped. A
free decided while a Step is planned must go with that Step (the block manager skips frees of
what the same Step's reports drop), and a free of what an answer says was dropped is forgotten.
The block manager being down only made the machine reach it: this test needs no resend.
"""

from __future__ import annotations

from engine.params import SamplingParams
from engine.sequence import SeqStatus
from tests.engine.fakes import fake_completion, fake_engine


def test_swap_out_lost_with_its_node_frees_nothing_twice() -> None:
    engine, nodes = fake_engine(2, num_blocks=20, block_size=4, host_num_blocks=12, async_scheduling=False)
    engine.health.first_s, engine.health.max_s = 60.0, 60.0   # the node stays out while the test runs
    core = engine.client.state.core
    try:
        prompt, max_tokens = [7, 3, 9, 4, 1], 6
        rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        engine.step()
        engine.step()
        seq = engine.requests[rid].seqs[0]
        assert seq.status is SeqStatus.RUNNING
        node_id = seq.admitted.node_id
        assert engine.scheduler.swap.swaps_to(node_id)
        engine.scheduler.swap.preempt_victim(seq)   # its swap-out goes with the next Step
        nodes[node_id].dead = True                  # ... whose step on its node then fails
        engine.step()
        assert seq.status is SeqStatus.SWAPPED and node_id in engine.view.down
        # The failed report drops it; the swap policy gives it up in the same Step's planning.
        engine.step()
        assert seq.status is not SeqStatus.SWAPPED
        assert core.fsck() == []
        finished = {}
        for _ in range(50):
            for out in engine.step():   # before the fix: DoubleFree here (the free came a Step late)
                if out.finished:
                    finished[out.request_id] = out
            if not engine.has_unfinished_requests():
                break
        assert finished[rid].outputs[0].token_ids == fake_completion(prompt, max_tokens)
        engine.flush()
        assert core.fsck() == [] and core.sequences() == []
        assert engine.scheduler.queues.to_free == []
    finally:
        engine.close()
