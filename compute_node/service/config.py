"""Compute node configuration: defaults < YAML file < `PAGEDKV_CN_*` environment < overrides.

    compute-node serve --config compute_node.yaml
    PAGEDKV_CN_NODE_ID=gpu0 PAGEDKV_CN_BLOCK_MANAGER_ADDRESS=bm:50051 compute-node serve
    PAGEDKV_CN_GEOMETRY__NUM_LAYERS=32              # nested fields use "__"

The pool size is either `num_blocks` (default 1024) or derived from `memory_budget_bytes`,
which then needs an explicit `block_size`; with `num_blocks` the block size may be left unset
and the block manager's default is used (learned at registration).
Validation errors surface as `ConfigError` with every problem listed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from compute_node.device_names import device_name_problem
from pagedkv.auth import AuthSettings
from pagedkv.endpoints import split_targets
from pagedkv.service_settings import ServiceSettings
from pagedkv.settings import ConfigError, load_settings
from pagedkv.tls import TlsSettings

DType = Literal["float16", "bfloat16", "float32"]
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
DEFAULT_NUM_BLOCKS = 1024


class GeometrySettings(BaseModel):
    """The model's attention shape: what one token's K/V looks like in every layer."""

    num_layers: int = Field(default=2, ge=1, le=1024)
    num_kv_heads: int = Field(default=2, ge=1, le=1024)
    head_dim: int = Field(default=64, ge=1, le=1024)
    dtype: DType = "float16"


class ComputeNodeConfig(ServiceSettings):
    # env_ignore_empty: an empty variable means "not set" (a compose override blanks
    # PAGEDKV_CN_NUM_BLOCKS to size the pool by PAGEDKV_CN_MEMORY_BUDGET_BYTES instead).
    model_config = SettingsConfigDict(
        env_prefix="PAGEDKV_CN_", env_nested_delimiter="__", extra="forbid", env_ignore_empty=True
    )

    node_id: str = Field(default="node-0", pattern=r"^[A-Za-z0-9._:\-]{1,128}$")
    listen_address: str = "127.0.0.1:50061"
    # What the node tells routers to dial; defaults to the bound listen address.
    advertise_address: str | None = None
    block_manager_address: str = "127.0.0.1:50051"
    geometry: GeometrySettings = GeometrySettings()
    # A Hugging Face model directory to serve (Llama / Qwen2 / Qwen3 safetensors): the node then
    # answers `Generate` and its pool's geometry and dtype come from the model (`geometry` is
    # ignored); `model_dtype` overrides the checkpoint's dtype; `max_model_len` caps positions.
    # Without a model the node serves attention only (`Forward`, the synthetic test path).
    model: str | None = None
    model_dtype: DType | None = None
    max_model_len: int | None = Field(default=None, ge=1)
    # None: use the block manager's default block size (learned at registration).
    block_size: int | None = Field(default=None, ge=1, le=4096)
    num_blocks: int | None = Field(default=None, ge=1, le=1 << 24)
    memory_budget_bytes: int | None = Field(default=None, ge=1)
    # The host tier under the pool (docs/tiers.md; model and attention-only nodes alike):
    # `host_kv_blocks`, or as many blocks as fit in `host_kv_memory` bytes; pinned memory on
    # CUDA. Unset: no host tier.
    host_kv_blocks: int | None = Field(default=None, ge=0, le=1 << 24)
    host_kv_memory: int | None = Field(default=None, ge=0)
    # The disk tier under the host tier (docs/tiers.md; model nodes): a slot file in directory
    # `disk_kv_path` of at most `disk_kv_bytes`; it outlives the process (same model and layout).
    disk_kv_path: str | None = None
    disk_kv_bytes: int | None = Field(default=None, ge=1)
    # "auto": CUDA when torch sees a GPU, else the CPU; or an explicit "cpu" / "cuda:N".
    device: str = "auto"
    max_batch: int = Field(default=4096, ge=1)
    # The node's torch and Numba threads (`compute_node/threads.py`): `threads`, or unset, the
    # host's cores divided by `nodes_per_host` (how many nodes share this host's cores).
    threads: int | None = Field(default=None, ge=1, le=1024)
    nodes_per_host: int = Field(default=1, ge=1, le=1024)
    # A CPU model node whose OpenMP threads wait passively (the default) runs steps of at most
    # this many tokens (decode-sized) on one torch thread, larger ones on all `threads`: a
    # sleeping thread costs a wake-up per parallel region (compute_node/service/dense_threads.py).
    # 0: every step on all `threads`.
    serial_dense_tokens: int = Field(default=32, ge=0)
    # On the CPU (float32 / bfloat16), the model's matmul weights are packed once for oneDNN
    # (`compute_node/model/linear.py`: ~2x faster decode steps than plain F.linear); false keeps
    # plain weights and F.linear (what transformers runs).
    prepack_linear: bool = True
    # On a GPU, decode attention replays CUDA graphs (one per layer and batch-size bucket,
    # captured at first use) where a step fits them, instead of one launch per layer.
    cuda_graphs: bool = True
    # On a GPU (model nodes), a pure-decode step replays one CUDA graph of the whole forward
    # per batch-size bucket (compute_node/step_graph.py). Off until a GPU run has measured it.
    step_graphs: bool = False
    # Deadline of each node -> block manager call. Registration is retried while the block
    # manager is unreachable, first after `retry_interval_s`, then with a doubling, jittered
    # delay capped at `max_retry_interval_s`.
    rpc_timeout_s: float = Field(default=5.0, gt=0)
    retry_interval_s: float = Field(default=0.5, gt=0)
    max_retry_interval_s: float = Field(default=10.0, gt=0)
    metrics_address: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535)   # None: no endpoint; 0: ephemeral
    # Security between hosts (README "Running across hosts"). `tls`: the Forward listener and
    # the node's own channel to the block manager (its certificate is the client certificate
    # there; ca_file verifies both ways). `auth`: who may send Forwards (schedulers only).
    # `block_manager_token`: this node's bearer token at the block manager (without mTLS).
    tls: TlsSettings = TlsSettings()
    auth: AuthSettings = AuthSettings()
    block_manager_token: str | None = None
    # Resource limits: the largest message received or sent (a Forward carries Q/K/V),
    # streams per HTTP/2 connection, calls in flight per peer (principal, else client IP).
    max_message_bytes: int = Field(default=256 << 20, ge=1 << 16, le=(1 << 31) - 1)
    max_concurrent_streams: int | None = Field(default=100, ge=1)
    max_inflight_per_peer: int | None = Field(default=64, ge=1)
    shutdown_grace_s: float = Field(default=5.0, ge=0)
    log_level: str = "INFO"
    # Prefix fetch between nodes (docs/prefix_fetch.md). `peer_token`: this node's bearer token
    # at other nodes (without mTLS; under mTLS its certificate identifies it). A pull's deadline,
    # how long a granted transfer may wait to be pulled (and a pull may wait for its grant to
    # arrive with the source's step), the chunk size. `fetch_test_pause_file` is a TEST HOOK: a
    # source that has sent its first chunk creates that file and stops sending (holds the stream),
    # so a test can kill it mid-transfer deterministically. Never set it in production.
    peer_token: str | None = None
    fetch_timeout_s: float = Field(default=30.0, gt=0)
    fetch_grant_ttl_s: float = Field(default=60.0, gt=0)
    fetch_grant_wait_s: float = Field(default=10.0, gt=0)
    fetch_chunk_bytes: int = Field(default=4 << 20, ge=1 << 12, le=4 << 20)
    fetch_test_pause_file: str | None = None

    @field_validator("block_manager_address")
    @classmethod
    def _host_ports(cls, v: str) -> str:
        split_targets(v)          # HOST:PORT, or several comma-separated: a typo is a config error
        return v

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        if (problem := device_name_problem(v)) is not None:
            raise ValueError(problem)       # "device: ...", as LLM(device=) and pagedkv-serve say it
        return v

    @field_validator("block_manager_token")
    @classmethod
    def _empty_token_is_none(cls, v: str | None) -> str | None:
        return v or None

    @model_validator(mode="after")
    def _retry_bounds(self) -> ComputeNodeConfig:
        if self.max_retry_interval_s < self.retry_interval_s:
            raise ValueError("max_retry_interval_s must be >= retry_interval_s")
        return self

    @model_validator(mode="after")
    def _one_pool_size(self) -> ComputeNodeConfig:
        if self.num_blocks is not None and self.memory_budget_bytes is not None:
            raise ValueError("set at most one of num_blocks or memory_budget_bytes")
        if self.host_kv_blocks is not None and self.host_kv_memory is not None:
            raise ValueError("set at most one of host_kv_blocks or host_kv_memory")
        if self.host_kv_memory and self.model is None and self.block_size is None:
            # An attention-only node sizes its host tier before registering (it sends the size).
            raise ValueError("host_kv_memory on an attention-only node needs an explicit block_size")
        if (self.disk_kv_path is None) != (self.disk_kv_bytes is None):
            raise ValueError("set both disk_kv_path and disk_kv_bytes, or neither")
        if self.disk_kv_path is not None:
            if self.model is None:
                raise ValueError("disk_kv_path needs a model (the disk tier is fingerprinted by the model's weights)")
            if not (self.host_kv_blocks or self.host_kv_memory):
                raise ValueError("disk_kv_path needs a host tier above it (host_kv_blocks or host_kv_memory)")
        if self.memory_budget_bytes is not None:
            # The pool size is derived before registering, so the block size must be known.
            if self.block_size is None:
                raise ValueError("memory_budget_bytes needs an explicit block_size")
            g = self.geometry
            block_bytes = 2 * g.num_layers * g.num_kv_heads * g.head_dim * self.block_size * _ITEMSIZE[g.dtype]
            if self.memory_budget_bytes < block_bytes:
                raise ValueError(
                    f"memory_budget_bytes {self.memory_budget_bytes} is below one block ({block_bytes} bytes)"
                )
        elif self.num_blocks is None:
            self.num_blocks = DEFAULT_NUM_BLOCKS
        return self


def load_config(path: str | Path | None = None, **overrides: Any) -> ComputeNodeConfig:
    """Defaults < YAML `path` < environment < `overrides`; `ConfigError` when invalid."""
    return load_settings(ComputeNodeConfig, path, overrides)

__all__ = ["ComputeNodeConfig", "ConfigError", "GeometrySettings", "load_config"]
