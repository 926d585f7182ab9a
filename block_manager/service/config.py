"""Block manager service configuration: defaults < YAML file < `PAGEDKV_*` environment.

    block-manager serve --config block_manager.yaml
    PAGEDKV_DATABASE_URL=postgresql+psycopg://bm@db:5432/bm block-manager serve
    PAGEDKV_DEFRAG__EVERY_N_STEPS=500            # nested fields use "__"

Environment beats the file so a container can override one knob without a new file.
Validation errors surface as `ConfigError` with every problem listed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from block_manager.core.types import DefragPolicy
from block_manager.service.state import StateConfig
from block_manager.store.backends import parse_store_url
from block_manager.store.errors import StoreError
from pagedkv.auth import AuthSettings
from pagedkv.service_settings import ServiceSettings
from pagedkv.settings import ConfigError, load_settings
from pagedkv.tls import TlsSettings


class DefragSettings(BaseModel):
    """When the service runs the core's defrag policy, and how long a plan may wait."""

    enabled: bool = True
    every_n_steps: int | None = Field(default=1000, ge=1)
    max_high_water_ratio: float | None = Field(default=1.5, gt=1.0)
    min_contiguity: float | None = Field(default=0.5, ge=0.0, le=1.0)
    max_moves: int | None = Field(default=256, ge=1)
    # The policy check scans a pool's tables: run it every this many scheduler steps.
    check_every_steps: int = Field(default=100, ge=1)
    # A plan whose step is not reported complete within this time (the scheduler never
    # sent the Forward, or went away) is aborted (destinations released, tables unchanged).
    timeout_s: float = Field(default=30.0, gt=0)

    def policy(self) -> DefragPolicy:
        return DefragPolicy(
            every_n_steps=self.every_n_steps,
            max_high_water_ratio=self.max_high_water_ratio,
            min_contiguity=self.min_contiguity,
        )


class FailoverSettings(BaseModel):
    """Active/standby on PostgreSQL (docs/operations.md, service/leadership.py): several
    `block-manager serve` on one database; one leads, the others wait as standbys."""

    enabled: bool = False
    # The leader's database session is ended by PostgreSQL after this long without a
    # statement (the leader pings every lease/4): how long a paused or cut-off leader keeps
    # the lock. A standby then takes over within ~50 ms plus its recovery.
    lease_s: float = Field(default=5.0, ge=0.2, le=600)


class KvEventSettings(BaseModel):
    """The KV events stream (docs/kv_events.md): how many recent events are held for a
    subscriber to resume from, and how many one subscriber may have waiting before it is
    dropped to a Resync (a slow subscriber never slows the Step path)."""

    enabled: bool = True   # off: no change is recorded, SubscribeKvEvents answers FAILED_PRECONDITION
    history_events: int = Field(default=100_000, ge=0, le=1 << 24)
    subscriber_buffer_events: int = Field(default=10_000, ge=1, le=1 << 24)
    # At most one live message per subscriber per interval (0: one per published batch).
    batch_interval_s: float = Field(default=0.005, ge=0.0, le=1.0)
    # The same events in vLLM's wire format on ZMQ (service/kv_events_zmq.py), for routers that
    # read vLLM's stream: a PUB socket bound at `zmq_endpoint` (None: off), one topic per node
    # (`zmq_topic`, "{node}" is the node id), and a ROUTER at `zmq_replay_endpoint` (None: no
    # replay) answering from the newest `zmq_buffer_batches` batches. At most `zmq_queue_batches`
    # published batches wait for the publisher thread; past that they are dropped for a
    # snapshot (the Step path never waits for ZMQ). `zmq_hwm`: the sockets' high-water mark.
    zmq_endpoint: str | None = None
    zmq_replay_endpoint: str | None = None
    zmq_topic: str = "kv@{node}"
    zmq_buffer_batches: int = Field(default=10_000, ge=1, le=1 << 20)
    zmq_queue_batches: int = Field(default=10_000, ge=1, le=1 << 20)
    zmq_hwm: int = Field(default=100_000, ge=0)
    # "map": events as tagged maps (vLLM's current format, what vLLM 0.32's decoder reads);
    # "array": positional (vLLM's earlier array_like events, for consumers that decode only those)
    zmq_event_format: Literal["map", "array"] = "map"

    @field_validator("zmq_endpoint", "zmq_replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
            raise ValueError(f"{value!r} is not a ZMQ endpoint to bind (tcp://HOST:PORT, ipc://PATH or inproc://NAME)")
        if scheme == "tcp" and not rest.rpartition(":")[2].isdigit() and not rest.endswith(":*"):
            raise ValueError(f"{value!r}: a tcp endpoint needs a port (tcp://HOST:PORT; 0 or * for an ephemeral one)")
        return value

    @field_validator("zmq_topic")
    @classmethod
    def _zmq_topic(cls, value: str) -> str:
        if "{node}" not in value:
            raise ValueError(f"{value!r} must contain {{node}}: every node's events go out on a topic of their own")
        try:
            value.format(node="n")
        except (IndexError, KeyError, ValueError) as exc:
            raise ValueError(f"{value!r} is not a topic template with {{node}} only: {exc}") from None
        return value

    @model_validator(mode="after")
    def _zmq_needs_events(self) -> KvEventSettings:
        if self.zmq_endpoint is not None and not self.enabled:
            raise ValueError("zmq_endpoint needs kv_events.enabled (the ZMQ publisher sends the same events)")
        if self.zmq_replay_endpoint is not None and self.zmq_endpoint is None:
            raise ValueError("zmq_replay_endpoint needs zmq_endpoint (replay answers from what was published)")
        if (self.zmq_replay_endpoint is not None and self.zmq_replay_endpoint == self.zmq_endpoint
                and not self.zmq_endpoint.endswith((":0", ":*"))):   # two ephemeral ports differ
            raise ValueError("zmq_replay_endpoint must differ from zmq_endpoint")
        return self


class BlockManagerConfig(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDKV_", env_nested_delimiter="__", extra="forbid")

    listen_address: str = "127.0.0.1:50051"
    database_url: str = "sqlite:///./block_manager.db"
    block_size: int = Field(default=16, ge=1, le=4096)
    max_blocks: int = Field(default=1 << 20, ge=1, le=1 << 24)
    prefetch_window: int = Field(default=4, ge=0)
    watermark: float = Field(default=0.01, ge=0.0, lt=1.0)
    enable_prefix_caching: bool = True
    lease_ttl_s: float = Field(default=10.0, gt=0)
    # A scheduler's lease on the pools it drives (renewed by its steps); another scheduler
    # takes a pool over only once this lapsed (the old holder's sequences are dropped).
    scheduler_lease_ttl_s: float = Field(default=30.0, gt=0)
    # Closed steps of a pool that may await their Forward report (pipelining depth).
    max_unsettled_steps: int = Field(default=4, ge=1, le=64)
    defrag: DefragSettings = DefragSettings()
    # Snapshot after this many seconds or journal records, whichever comes first
    # (checked after each group commit: an idle server writes none).
    snapshot_interval_s: float = Field(default=60.0, gt=0)
    snapshot_every_records: int = Field(default=10_000, ge=1)
    request_retention_s: float = Field(default=600.0, gt=0)
    max_retained_requests: int = Field(default=10_000, ge=1)
    # Results of recent requests kept in memory, in outcome items (an AppendSlots of 256
    # sequences weighs 257); older retries read the result back from the store.
    max_retained_result_items: int = Field(default=262_144, ge=1)
    max_batch: int = Field(default=4096, ge=1)
    # Client sessions (exactly-once past the request-id window, service/sessions.py): the
    # answer of a sessioned request is held for `session_window_s` (must be >= the clients'
    # resend window: the engine resends an unanswered step for bm_unavailable_timeout_s =
    # 120 s), at most `max_session_answers` per session (answers the client acknowledged go
    # at once); a session unused for `session_ttl_s` expires.
    session_window_s: float = Field(default=300.0, gt=0)
    session_ttl_s: float = Field(default=900.0, gt=0)
    max_sessions: int = Field(default=1024, ge=1)
    max_session_answers: int = Field(default=16, ge=1)
    # A restart right after a crash may find the old session's lock not yet released.
    store_lock_wait_s: float = Field(default=10.0, ge=0)
    # Upgrade an older store schema at start-up (`serve --migrate`); without it the server
    # refuses to start on an older schema and names the `block-manager db upgrade` to run.
    migrate: bool = False
    failover: FailoverSettings = FailoverSettings()
    kv_events: KvEventSettings = KvEventSettings()
    # SQLite only: FULL fsyncs every group commit (survives power loss); NORMAL fsyncs at
    # WAL checkpoints only (survives a process crash, not a power cut).
    sqlite_synchronous: Literal["FULL", "NORMAL"] = "FULL"
    metrics_address: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535)   # None: no endpoint; 0: ephemeral
    admin_token: str | None = None
    # Security between hosts (README "Running across hosts"): TLS on the listener (mutual TLS
    # with tls.require_client_cert) and who may call what (pagedkv.auth, service/access.py).
    tls: TlsSettings = TlsSettings()
    auth: AuthSettings = AuthSettings()
    # Resource limits: the largest message received or sent, streams per HTTP/2 connection,
    # calls in flight per peer (principal, else client IP), token ids in one Route.
    max_message_bytes: int = Field(default=64 << 20, ge=1 << 16, le=1 << 30)
    max_concurrent_streams: int | None = Field(default=100, ge=1)
    max_inflight_per_peer: int | None = Field(default=256, ge=1)
    max_route_tokens: int = Field(default=1 << 17, ge=1)
    shutdown_grace_s: float = Field(default=5.0, ge=0)
    log_level: str = "INFO"

    @model_validator(mode="after")
    def _session_ttl_covers_window(self) -> BlockManagerConfig:
        if self.session_ttl_s < self.session_window_s:
            raise ValueError("session_ttl_s must be >= session_window_s (a session outlives its answers)")
        return self

    @field_validator("database_url")
    @classmethod
    def _a_store_url(cls, v: str) -> str:
        try:
            parse_store_url(v)
        except StoreError as exc:
            raise ValueError(str(exc)) from None
        return v

    @field_validator("admin_token")
    @classmethod
    def _empty_token_is_none(cls, v: str | None) -> str | None:
        return v or None

    @model_validator(mode="after")
    def _failover_needs_postgres(self) -> BlockManagerConfig:
        if self.failover.enabled and not self.database_url.startswith(("postgresql", "postgres:")):
            raise ValueError("failover.enabled needs a PostgreSQL database_url (postgresql+psycopg://...)")
        return self

    def other_callers(self) -> bool:
        """The admin token calls the admin service even with no `auth.tokens`."""
        return self.admin_token is not None

    def state_config(self) -> StateConfig:
        return StateConfig(
            default_block_size=self.block_size,
            max_blocks=self.max_blocks,
            prefetch_window=self.prefetch_window,
            watermark=self.watermark,
            enable_prefix_caching=self.enable_prefix_caching,
            lease_ttl_s=self.lease_ttl_s,
            defrag_policy=self.defrag.policy(),
            max_batch=self.max_batch,
            scheduler_lease_ttl_s=self.scheduler_lease_ttl_s,
            max_unsettled_steps=self.max_unsettled_steps,
        )


def load_config(path: str | Path | None = None, **overrides: Any) -> BlockManagerConfig:
    """Defaults < YAML `path` < environment < `overrides`; `ConfigError` when invalid."""
    return load_settings(BlockManagerConfig, path, overrides)


__all__ = ["BlockManagerConfig", "ConfigError", "DefragSettings", "FailoverSettings", "KvEventSettings", "load_config"]
