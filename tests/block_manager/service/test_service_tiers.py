"""The host tier through the real service: a node registers with host blocks, a Step swaps
sequences out (their moves ride in the pool's PoolStep), the block manager process is killed
and restarted on the same SQLite file between the swap-out and the swap-in, and the swap-in
after the restart brings the sequences back with their tokens (tables announced anew, moves
from the same host blocks). Also: a full host tier refuses a swap-out per item, changing nothing."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import grpc
import pytest

from demo.localstack import ServiceProcess
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from tests.block_manager.service.service_helpers import step_request

REPO = Path(__file__).resolve().parents[3]
ENV = {"PAGEDKV_BLOCK_SIZE": "4", "PAGEDKV_LEASE_TTL_S": "60", "PAGEDKV_DEFRAG__ENABLED": "false"}
SWAP_OUT, SWAP_IN = 1, 2


def start(db: Path, tmp: Path, name: str) -> ServiceProcess:
    argv = [sys.executable, "-m", "block_manager.service.server", "--listen", "127.0.0.1:0",
            "--database-url", f"sqlite:///{db}"]
    return ServiceProcess.start(argv, workdir=tmp, name=name, env={**os.environ, **ENV}, cwd=REPO, timeout_s=30)


def moves(ps, kind: int) -> list[tuple[int, int]]:
    return [(s, d) for k, s, d in zip(ps.tier_kind, ps.tier_src, ps.tier_dst) if k == kind]


@pytest.mark.timeout(120)
def test_swapped_out_sequences_survive_a_block_manager_restart(tmp_path: Path) -> None:
    db = tmp_path / "bm.db"
    proc = start(db, tmp_path, "bm1")
    try:
        stub = pb_grpc.BlockManagerStub(grpc.insecure_channel(proc.address))
        reg = stub.RegisterNode(pb.RegisterNodeRequest(request_id="reg", node_id="n1", num_blocks=16,
                                                       host_num_blocks=12), timeout=10)
        assert reg.host_num_blocks == 12
        ep = reg.epoch
        r = stub.Step(step_request(allocs=[("a", "n1", list(range(1, 11)), 0, None, 0)]), timeout=10)
        assert not r.errors and r.steps[0].step_id == 1
        # fork two children off "a" once its prompt is written (step 1 reported)
        r = stub.Step(step_request(reports={"n1": (ep, 1, 0)}, forks=[("a", ["a1", "a2"])],
                                   appends=[("a1", 1, [50])]), timeout=10)
        assert not r.errors, r.errors
        # swap the parent and both children out together: shared blocks go to host once
        req = step_request(reports={"n1": (ep, 2, 0)})
        req.swap_out_seq_ids.extend(["a", "a1", "a2"])
        r = stub.Step(req, timeout=10)
        assert not r.errors, r.errors
        assert list(r.swapped_out_seq_ids) == ["a", "a1", "a2"]
        ps = r.steps[0]
        out = moves(ps, SWAP_OUT)
        # a: 3 blocks (10 tokens); a1 copy-on-wrote its tail: one block more; a2 shares a's
        assert len(out) == 4 and set(ps.dropped_seq_ids) == {"a", "a1", "a2"}
        out_step = ps.step_id
        assert r.pool_free[0].host_usable_blocks == 12 - 4
        # a swap-in before the swap-out's step is reported is refused (the host copy is unwritten)
        req = step_request()
        req.swap_in_seq_ids.append("a")
        r = stub.Step(req, timeout=10)
        assert [e.reason for e in r.errors] == ["PendingWrite"] and not r.swapped_in_seq_ids
        # report the swap-out step, then kill the block manager hard
        r = stub.Step(step_request(reports={"n1": (ep, out_step, 0)}, allocs=[("b", "n1", None, 3, None, 0)]),
                      timeout=10)
        assert not r.errors
        b_step = r.steps[0].step_id
    finally:
        proc.stop(signal.SIGKILL)
    proc = start(db, tmp_path, "bm2")
    try:
        stub = pb_grpc.BlockManagerStub(grpc.insecure_channel(proc.address))
        req = step_request(reports={"n1": (ep, b_step, 0)})
        req.swap_in_seq_ids.extend(["a", "a1", "a2"])
        r = stub.Step(req, timeout=10)
        assert not r.errors, r.errors
        assert dict(zip(r.swapped_in_seq_ids, r.swapped_in_num_tokens)) == {"a": 10, "a1": 11, "a2": 10}
        ps = r.steps[0]
        back = moves(ps, SWAP_IN)
        assert sorted(s for s, _ in back) == sorted(d for _, d in out)   # from the same host blocks
        new = {sid: (base, n) for sid, base, n in zip(ps.delta_seq_ids, ps.delta_base_versions, ps.delta_num_tokens)}
        assert new == {"a": (0, 10), "a1": (0, 11), "a2": (0, 10)}   # announced anew at their lengths
        # decoding continues: appends after the swap-in
        r = stub.Step(step_request(reports={"n1": (ep, ps.step_id, 0)}, appends=[("a", 1, [60]), ("a2", 1, [61])]),
                      timeout=10)
        assert not r.errors, r.errors
        assert list(r.append_num_tokens) == [11, 11]
    finally:
        proc.stop()


@pytest.mark.timeout(60)
def test_a_full_host_tier_refuses_a_swap_out_per_item(tmp_path: Path) -> None:
    proc = start(tmp_path / "bm.db", tmp_path, "bm")
    try:
        stub = pb_grpc.BlockManagerStub(grpc.insecure_channel(proc.address))
        ep = stub.RegisterNode(pb.RegisterNodeRequest(request_id="reg", node_id="n1", num_blocks=16,
                                                      host_num_blocks=3), timeout=10).epoch
        r = stub.Step(step_request(allocs=[("a", "n1", None, 8, None, 0), ("b", "n1", None, 8, None, 0)]), timeout=10)
        req = step_request(reports={"n1": (ep, r.steps[0].step_id, 0)})
        req.swap_out_seq_ids.extend(["a", "b"])   # 4 blocks together: too many; "a" alone fits
        r = stub.Step(req, timeout=10)
        assert list(r.swapped_out_seq_ids) == ["a"]
        assert [(e.section, e.index, e.reason, e.code) for e in r.errors] == [
            ("swap_out", 1, "OutOfBlocks", grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])]
        # no host tier: a swap-out is refused with a clear reason
        stub.RegisterNode(pb.RegisterNodeRequest(request_id="reg2", node_id="n2", num_blocks=8), timeout=10)
        r = stub.Step(step_request(allocs=[("c", "n2", None, 4, None, 0)]), timeout=10)
        req = step_request(reports={"n2": (1, r.steps[0].step_id, 0)})
        req.swap_out_seq_ids.append("c")
        r = stub.Step(req, timeout=10)
        assert [(e.reason, "no host tier" in e.message) for e in r.errors] == [("FailedPrecondition", True)]
    finally:
        proc.stop()
