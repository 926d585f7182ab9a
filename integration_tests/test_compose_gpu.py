"""docker-compose.gpu.yml: two nodes on two GPUs by default, both on one GPU when the host has
only one (issue 10: the file silently needed 2 GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from demo.localstack import interpolate

GPU_FILE = Path(__file__).resolve().parents[1] / "docker-compose.gpu.yml"


def _device_ids(env: dict[str, str]) -> dict[str, list[str]]:
    doc = yaml.safe_load(GPU_FILE.read_text())
    out = {}
    for name, svc in doc["services"].items():
        if not name.startswith("compute-node"):
            continue
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        out[name] = [interpolate(str(d), env) for d in device["device_ids"]]
    return out


def test_gpu_override_follows_the_gpus_present() -> None:
    assert _device_ids({}) == {"compute-node-0": ["0"], "compute-node-1": ["1"]}
    assert _device_ids({"PAGEDKV_CN1_GPU": "0"}) == {"compute-node-0": ["0"], "compute-node-1": ["0"]}
    text = GPU_FILE.read_text()
    assert "driver >= 580" in text and "ONE GPU" in text


def test_async_scheduling_is_off_on_cpu_compose_and_on_with_gpus() -> None:
    """The CPU nodes share the API server's host (overlap only takes a core from them); GPU
    nodes leave the CPU free. Both overridable by PAGEDKV_ASYNC_SCHEDULING."""
    from engine.async_policy import async_scheduling_from_env

    base = yaml.safe_load((GPU_FILE.parent / "docker-compose.yml").read_text())
    gpu = yaml.safe_load(GPU_FILE.read_text())
    for doc, env, expected in ((base, {}, False), (gpu, {}, True), (base, {"PAGEDKV_ASYNC_SCHEDULING": "1"}, True)):
        value = interpolate(str(doc["services"]["api-server"]["environment"]["PAGEDKV_ASYNC_SCHEDULING"]), env)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PAGEDKV_ASYNC_SCHEDULING", value)
            assert async_scheduling_from_env() is expected, (value, expected)


def test_gpu_override_sizes_kv_memory_in_bytes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The merged environment of a GPU node sizes its pool from bytes (no fixed block count),
    and the compute node's settings accept it."""
    from compute_node.service.config import load_config

    base = yaml.safe_load((GPU_FILE.parent / "docker-compose.yml").read_text())
    gpu = yaml.safe_load(GPU_FILE.read_text())
    env = {k: interpolate(str(v), {}) for k, v in base["x-compute-node-env"].items()}
    env.update({k: interpolate(str(v), {}) for k, v in gpu["services"]["compute-node-0"]["environment"].items()})
    assert env["PAGEDKV_CN_MEMORY_BUDGET_BYTES"] == str(4 << 30) and env["PAGEDKV_CN_NUM_BLOCKS"] == ""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = load_config(None)
    assert cfg.num_blocks is None and cfg.memory_budget_bytes == 4 << 30 and cfg.device == "cuda:0"
    big = {k: interpolate(str(v), {"PAGEDKV_CN_KV_MEMORY_BYTES": str(20 << 30)})
           for k, v in gpu["services"]["compute-node-1"]["environment"].items()}
    assert big["PAGEDKV_CN_MEMORY_BUDGET_BYTES"] == str(20 << 30)
