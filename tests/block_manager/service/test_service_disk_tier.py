"""The disk tier through the real block manager process (SQLite): a node registers with disk
slots and the blocks its slot file holds; the block manager is SIGKILLed and restarted on the
same file and still knows them (the registration is journalled); a prompt continuing those
blocks is admitted with them as cached tokens, its PoolStep carrying disk->host then
host->device moves; admin status shows the disk tier. A malformed registration
is refused with INVALID_ARGUMENT and leaves the node's current registration as it was."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import grpc
import pytest

from block_manager.core import hash_prefix
from demo.localstack import ServiceProcess
from pagedkv.v1 import block_manager_pb2 as pb
from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc
from pagedkv.v1 import common_pb2
from tests.block_manager.service.service_helpers import step_request

REPO = Path(__file__).resolve().parents[3]
ENV = {"PAGEDKV_BLOCK_SIZE": "4", "PAGEDKV_LEASE_TTL_S": "60", "PAGEDKV_DEFRAG__ENABLED": "false"}
DISK_ONBOARD, ONBOARD = 6, 4
PROMPT = list(range(1, 14))             # 3 full blocks + 1 token


def start(db: Path, tmp: Path, name: str) -> ServiceProcess:
    argv = [sys.executable, "-m", "block_manager.service.server", "--listen", "127.0.0.1:0",
            "--database-url", f"sqlite:///{db}"]
    return ServiceProcess.start(argv, workdir=tmp, name=name, env={**os.environ, **ENV}, cwd=REPO, timeout_s=30)


def seeds(salt: str | None = None) -> list[common_pb2.DiskBlock]:
    hashes = hash_prefix(PROMPT, 4, salt)
    out = []
    for i, h in enumerate(hashes):
        b = common_pb2.DiskBlock(slot=7 - i, block_hash=h, parent_hash=hashes[i - 1] if i else b"",
                                 token_ids=PROMPT[4 * i: 4 * i + 4], last_used=i + 1)
        out.append(b)
    return out


def register(stub, rid: str, **kw) -> pb.RegisterNodeResponse:
    return stub.RegisterNode(pb.RegisterNodeRequest(request_id=rid, node_id="n1", num_blocks=16, **kw), timeout=10)


@pytest.mark.timeout(180)
def test_seeded_disk_blocks_survive_a_block_manager_restart_and_onboard(tmp_path: Path) -> None:
    db = tmp_path / "bm.db"
    proc = start(db, tmp_path, "bm1")
    try:
        stub = pb_grpc.BlockManagerStub(grpc.insecure_channel(proc.address))
        reg = register(stub, "reg", host_num_blocks=8, disk_num_blocks=8, disk_blocks=seeds())
        assert reg.disk_num_blocks == 8
        proc.stop(signal.SIGKILL)
    finally:
        proc.stop()
    proc = start(db, tmp_path, "bm2")
    try:
        channel = grpc.insecure_channel(proc.address)
        stub = pb_grpc.BlockManagerStub(channel)
        admin = pb_grpc.BlockManagerAdminStub(channel)
        (pool,) = admin.Status(pb.StatusRequest(), timeout=10).pools
        assert (pool.disk_num_blocks, pool.disk_cached_blocks) == (8, 3)
        r = stub.Step(step_request(allocs=[("a", "n1", PROMPT, 0, None, 0)]), timeout=10)
        assert not r.errors, r.errors
        assert list(r.alloc_num_cached_tokens) == [12]        # the 3 blocks on disk, none recomputed
        ps = r.steps[0]
        moves = list(zip(ps.tier_kind, ps.tier_src, ps.tier_dst))
        loads = [(s, d) for k, s, d in moves if k == DISK_ONBOARD]
        onboards = [(s, d) for k, s, d in moves if k == ONBOARD]
        assert [s for s, _ in loads] == [7, 6, 5]             # the slots the node reported
        assert [d for _, d in loads] == [s for s, _ in onboards]   # disk -> host -> device
        (pool,) = admin.Status(pb.StatusRequest(), timeout=10).pools
        assert pool.disk_onboarded_blocks == 3 and pool.disk_hit_tokens == 12
        assert admin.Fsck(pb.FsckRequest(), timeout=10).ok
    finally:
        proc.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", ["no_host", "slot", "tokens", "hash", "too_many"])
def test_a_malformed_disk_registration_is_refused_and_changes_nothing(tmp_path: Path, bad: str) -> None:
    proc = start(tmp_path / "bm.db", tmp_path, "bm")
    try:
        channel = grpc.insecure_channel(proc.address)
        stub = pb_grpc.BlockManagerStub(channel)
        admin = pb_grpc.BlockManagerAdminStub(channel)
        first = register(stub, "reg1", host_num_blocks=8, disk_num_blocks=8, disk_blocks=seeds())
        blocks = seeds()
        kw = {"host_num_blocks": 8, "disk_num_blocks": 8}
        if bad == "no_host":
            kw["host_num_blocks"] = 0
        elif bad == "slot":
            blocks[0].slot = 8
        elif bad == "tokens":
            del blocks[1].token_ids[-1]
        elif bad == "hash":
            blocks[2].block_hash = b"short"
        else:
            kw["disk_num_blocks"] = 2
        with pytest.raises(grpc.RpcError) as err:
            register(stub, "reg2", disk_blocks=blocks, **kw)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        (node,) = admin.ListNodes(pb.ListNodesRequest(), timeout=10).nodes
        assert node.epoch == first.epoch and not node.fenced   # the current registration stands
        (pool,) = admin.Status(pb.StatusRequest(), timeout=10).pools
        assert pool.disk_cached_blocks == 3
    finally:
        proc.stop()
