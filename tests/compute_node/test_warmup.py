"""The node compiles every CPU kernel before registering (so a cold compile cannot starve
its heartbeats into a fenced lease)."""

import importlib

import pytest

from compute_node.service.warmup import warm_up_cpu_kernels


def _module(name: str):  # type: ignore[no-untyped-def]
    # kernels.cpu re-exports functions under the module names, so import the modules by path
    return importlib.import_module(f"kernels.cpu.{name}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_warm_up_compiles_every_cpu_kernel(dtype: str) -> None:
    assert warm_up_cpu_kernels(2, 32, dtype, block_size=4) >= 0.0
    kernels = [("decode", "_decode_kernel"), ("decode_split", "_partition_kernel"),
               ("decode_split", "_reduce_kernel"), ("prefill", "_prefill_kernel"),
               ("write_slots", "_write_slots_kernel"), ("copy_blocks", "_copy_blocks_kernel")]
    for module, name in kernels:
        dispatcher = getattr(_module(module), name)
        assert dispatcher.signatures, f"{dispatcher.py_func.__name__} was not compiled by the warm-up"
