"""docker-compose.gpu.yml: two nodes on two GPUs by default, both on one GPU when the host has
only one (issue 10: the file silently needed 2 GPUs)."""

from __future__ import annotations

from pathlib import Path

import yaml

from demo.localstack import interpolate

GPU_FILE = Path(__file__).resolve().parents[1] / "docker-compose.gpu.yml"


def _device_ids(env: dict[str, str]) -> dict[str, list[str]]:
    doc = yaml.safe_load(GPU_FILE.read_text())
    out = {}
    for name, svc in doc["services"].items():
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        out[name] = [interpolate(str(d), env) for d in device["device_ids"]]
    return out


def test_gpu_override_follows_the_gpus_present() -> None:
    assert _device_ids({}) == {"compute-node-0": ["0"], "compute-node-1": ["1"]}
    assert _device_ids({"PAGEDKV_CN1_GPU": "0"}) == {"compute-node-0": ["0"], "compute-node-1": ["0"]}
    text = GPU_FILE.read_text()
    assert "driver >= 580" in text and "ONE GPU" in text
