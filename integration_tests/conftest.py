"""The pair as real processes, started from docker-compose.yml (see demo.localstack).

Two fixtures: `stack`, shared by the tests of a module that only drive it and leave it as they
found it (every sequence freed), and `fresh_stack`, a stack of its own for a test that kills or
restarts a service. So no test depends on another having run before it, or on its order. Both
run the block manager and the nodes (`CORE_SERVICES`, with the one-shot `model-init` they depend
on); the API server's tests start the whole file (`test_api_stack.py`). `StackSlot` lets a
module's last, killing test take over the stack its other tests used (one start fewer: model-init,
the services and their health checks, ~10 CPU-s); test_api_stack.py does. The SIGKILL tests of
test_stack.py keep fresh stacks: after its README client test (examples/embed_client.py skips
the node's Forward by design, so the pools' step sequence runs ahead of what the nodes applied)
a later scheduler's steps are refused ("step 3 builds on step 1, but the node has applied up to
step 0"); it passes there only because it comes last (BENCHMARKS.md, "Test-suite cost, round 5").

The nodes serve a model, as in compose: a tiny one built once per session (`stack_env`: its
directory as PAGEDKV_MODEL_DIR, so model-init finds it present). The synthetic workloads drive
the nodes' `Forward` with the pools' geometry, whatever model shaped them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from demo.localstack import LocalStack
from integration_tests.helpers import LEASE_TTL_S
from tests.fixtures.certs import dev_certs
from tests.fixtures.entry_points import missing_entry_points_dir

__all__ = ["dev_certs"]

STACK_ENV = {"PAGEDKV_LEASE_TTL_S": str(LEASE_TTL_S), "PAGEDKV_CN_NUM_BLOCKS": "1024", "PAGEDKV_LOG_LEVEL": "WARNING"}
CORE_SERVICES = ["block-manager", "compute-node-0", "compute-node-1"]
# the stack's model: small enough to load in a blink, shaped like the real thing (GQA), and with the
# KV geometry the synthetic workloads ran with before the nodes served a model (2 x 2 x 64, float16)
TEST_MODEL = dict(arch="llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                  intermediate_size=256, vocab_size=512, dtype="float16", seed=3)
TEST_MODEL_NAME = "tiny-llama"


@pytest.fixture(scope="session", autouse=True)
def entry_points(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The compose commands on PATH even where the venv predates one (tests/fixtures/entry_points.py)."""
    shims = missing_entry_points_dir(tmp_path_factory.mktemp("entry-points"))
    with pytest.MonkeyPatch.context() as mp:
        if shims is not None:
            mp.setenv("PATH", f"{shims}{os.pathsep}{os.environ.get('PATH', '')}")
        yield


@pytest.fixture(scope="session")
def stack_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`STACK_ENV` plus PAGEDKV_MODEL_DIR: a directory holding the built test model."""
    from compute_node.model.tiny import build_tiny_model

    models = tmp_path_factory.mktemp("models")
    build_tiny_model(models / TEST_MODEL_NAME, **TEST_MODEL)  # type: ignore[arg-type]
    return {**STACK_ENV, "PAGEDKV_MODEL_DIR": str(models), "PAGEDKV_MODEL": TEST_MODEL_NAME}


def _up(workdir: Path, env: dict[str, str]) -> LocalStack:
    stack = LocalStack(workdir, interp_env=env)
    try:
        stack.up(CORE_SERVICES)
    except BaseException:
        stack.down()
        raise
    return stack


@dataclass(slots=True)
class StackSlot:
    """A module's stack, started on first use: `shared()` lends it to the tests that only drive
    it; `take()` hands it to a test that kills or restarts a service (which stops it when done),
    or starts one when none is up, and the slot starts a new one for the next `shared()`."""

    start: Callable[[], LocalStack]
    current: LocalStack | None = None

    def shared(self) -> LocalStack:
        if self.current is None:
            self.current = self.start()
        return self.current

    def take(self) -> LocalStack:
        stack, self.current = self.current, None
        return stack if stack is not None else self.start()

    def close(self) -> None:
        if self.current is not None:
            self.current.down()
            self.current = None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, stack_env: dict[str, str]) -> Iterator[LocalStack]:
    s = _up(tmp_path_factory.mktemp("stack"), stack_env)
    try:
        yield s
    finally:
        s.down()


@pytest.fixture
def fresh_stack(tmp_path: Path, stack_env: dict[str, str]) -> Iterator[LocalStack]:
    s = _up(tmp_path / "stack", stack_env)
    try:
        yield s
    finally:
        s.down()
