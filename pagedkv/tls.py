"""TLS for every listener and channel of the project, from one settings model.

Both services' configs hold a `tls:` section (`TlsSettings`); every client (sync, async, admin,
the node's link to the block manager, the compute-node client, the health check, the engine)
takes the same model. One place turns it into gRPC credentials:

- server: `server_credentials(tls)` — certificate chain + key; with `require_client_cert` the
  server demands a client certificate signed by `ca_file` (mutual TLS) and the services derive
  the caller's identity from it (`pagedkv.auth`);
- client: `channel_credentials(tls)` — `ca_file` verifies the server (the system roots when
  unset), `cert_file`/`key_file` are the client certificate for mTLS, `server_name` overrides
  the name checked in the server's certificate (dialling an IP, a tunnel, a health probe);
- `open_channel(target, tls, options, aio=...)`: a plaintext channel when `tls` is None or not
  active, a secure one otherwise — every client builds its channel here.

TLS is active when `enabled` says so, or (unset) when any certificate file is given: a config
that names a CA or a certificate gets TLS, one that names nothing stays plaintext (loopback
development). `is_loopback` tells the lifecycle whether a plaintext listener must be reported.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, model_validator

ChannelOptions = Sequence[tuple[str, Any]]


class TlsSettings(BaseModel):
    """Transport security of one service (its listener and its own outgoing calls) or client."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # None: TLS when any of cert_file / ca_file is set; True / False: explicitly on / off.
    enabled: bool | None = None
    # PEM certificate chain and private key: the server's certificate, and the client
    # certificate this process presents when it calls another service (mutual TLS).
    cert_file: Path | None = None
    key_file: Path | None = None
    # PEM CA bundle: verifies client certificates (server side) and servers (client side;
    # unset: the system's roots).
    ca_file: Path | None = None
    # Server side: refuse clients without a certificate signed by `ca_file` (mutual TLS).
    require_client_cert: bool = False
    # Client side: the name expected in the server's certificate (default: the target's host).
    server_name: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> TlsSettings:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls: cert_file and key_file go together")
        if self.require_client_cert and self.ca_file is None:
            raise ValueError("tls: require_client_cert needs ca_file (the CA that signs client certificates)")
        if self.require_client_cert and self.enabled is False:
            raise ValueError("tls: require_client_cert needs TLS enabled")
        return self

    def check_listener(self) -> None:
        """A service's own settings: a TLS listener (or one demanding client certificates)
        needs the server's certificate and key. Raises ValueError (a config error)."""
        if self.require_client_cert and not (self.cert_file and self.key_file):
            raise ValueError("tls.require_client_cert needs the server's tls.cert_file and tls.key_file")
        if self.active and not (self.cert_file and self.key_file):
            raise ValueError("a TLS listener needs tls.cert_file and tls.key_file")

    @property
    def active(self) -> bool:
        if self.enabled is not None:
            return self.enabled
        return self.cert_file is not None or self.ca_file is not None


def _read_pem(path: Path | None, what: str) -> bytes | None:
    """The bytes of a PEM file; `ValueError` naming the setting when it holds no certificate
    (no private key, for a `key_file`): gRPC would fail later, deep inside the handshake, with
    a message that names no file."""
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise OSError(exc.errno, f"cannot read {what} {path}: {exc.strerror}") from None
    marker = b"PRIVATE KEY-----" if what.endswith("key_file") else b"-----BEGIN CERTIFICATE-----"
    if marker not in data:
        kind = "private key" if what.endswith("key_file") else "certificate"
        raise ValueError(f"{what} {path} is not a PEM file with a {kind}")
    return data


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """Credentials of a TLS listener (mutual TLS when `require_client_cert`)."""
    if tls.cert_file is None or tls.key_file is None:
        raise ValueError("tls: a TLS listener needs cert_file and key_file")
    cert = _read_pem(tls.cert_file, "tls.cert_file")
    key = _read_pem(tls.key_file, "tls.key_file")
    ca = _read_pem(tls.ca_file, "tls.ca_file")
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=tls.require_client_cert
    )


def channel_credentials(tls: TlsSettings) -> grpc.ChannelCredentials:
    """Credentials of a client channel: the CA that verifies the server, and the client
    certificate when one is configured."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(tls.ca_file, "tls.ca_file"),
        private_key=_read_pem(tls.key_file, "tls.key_file"),
        certificate_chain=_read_pem(tls.cert_file, "tls.cert_file"),
    )


def channel_options(tls: TlsSettings | None, options: Iterable[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    """`options` plus the server-name override when `tls` sets one."""
    opts = list(options)
    if tls is not None and tls.active and tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return opts


def open_channel(
    target: str, tls: TlsSettings | None = None, options: Iterable[tuple[str, Any]] = (), *, aio: bool = False
) -> Any:
    """A `grpc.Channel` (or `grpc.aio.Channel` with `aio`) to `target`: plaintext when `tls`
    is None or not active, TLS otherwise."""
    opts = channel_options(tls, options)
    if tls is None or not tls.active:
        return grpc.aio.insecure_channel(target, options=opts) if aio else grpc.insecure_channel(target, options=opts)
    creds = channel_credentials(tls)
    return grpc.aio.secure_channel(target, creds, options=opts) if aio else grpc.secure_channel(target, creds, opts)


def client_tls(
    *,
    ca_file: str | Path | None = None,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
    server_name: str | None = None,
    enabled: bool | None = None,
) -> TlsSettings | None:
    """Client settings from command-line style options; None when none is given (plaintext)."""
    if enabled is None and not any((ca_file, cert_file, key_file, server_name)):
        return None
    return TlsSettings(
        enabled=enabled if enabled is not None else True,
        ca_file=Path(ca_file) if ca_file else None,
        cert_file=Path(cert_file) if cert_file else None,
        key_file=Path(key_file) if key_file else None,
        server_name=server_name or None,
    )


_CLI_OPTIONS = (
    ("--tls", "TLS", "TLS with the system's CA roots (implied by any option below)"),
    ("--ca-file", "CA_FILE", "PEM CA bundle that verifies the server"),
    ("--cert-file", "CERT_FILE", "PEM client certificate (mutual TLS)"),
    ("--key-file", "KEY_FILE", "PEM key of --cert-file"),
    ("--server-name", "SERVER_NAME", "name expected in the server's certificate (default: the target's host)"),
)


def add_tls_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, env_prefix: str, *, defaults: bool = True
) -> None:
    """`--tls --ca-file --cert-file --key-file --server-name`, each defaulting to the environment
    variable `<env_prefix><NAME>` (e.g. PAGEDKV_ADMIN_CA_FILE). `defaults=False`: a value is set
    only when the option is given (a subcommand's copy of the main parser's options)."""
    for flag, name, text in _CLI_OPTIONS:
        env = f"{env_prefix}{name}"
        if flag == "--tls":
            on = os.environ.get(env, "").lower() in ("1", "true", "yes") if defaults else argparse.SUPPRESS
            parser.add_argument(flag, action="store_true", default=on, help=f"{text} (env {env}=1)")
        else:
            value = (os.environ.get(env) or None) if defaults else argparse.SUPPRESS
            parser.add_argument(flag, default=value, help=f"{text} (env {env})")


def tls_from_args(args: argparse.Namespace) -> TlsSettings | None:
    """Client settings from `add_tls_arguments`' options (None: plaintext)."""
    return client_tls(
        ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file, server_name=args.server_name,
        enabled=True if args.tls else None,
    )


def tls_from_env(prefix: str, environ: Mapping[str, str] | None = None) -> TlsSettings | None:
    """A service's own TLS settings as a client's, from its environment (`<prefix>CA_FILE`, ...;
    e.g. prefix PAGEDKV_TLS__ or PAGEDKV_CN_TLS__): the health check inside a service's container
    dials it with the service's own certificate. None when TLS is not active there."""
    env = os.environ if environ is None else environ
    values = {k: env.get(f"{prefix}{k.upper()}") or None for k in ("enabled", "ca_file", "cert_file", "key_file")}
    enabled = None if values["enabled"] is None else values["enabled"].lower() in ("1", "true", "yes", "on")
    files = {k: Path(v) if v else None for k, v in values.items() if k != "enabled"}
    settings = TlsSettings(enabled=enabled, server_name=env.get(f"{prefix}SERVER_NAME") or None,
                           ca_file=files["ca_file"], cert_file=files["cert_file"], key_file=files["key_file"])
    return settings if settings.active else None


def host_of(address: str) -> str:
    """The host of `HOST:PORT` / `[V6]:PORT` / `unix:...` (brackets removed)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return "unix"
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    if address.startswith("["):
        host = address[1:].split("]", 1)[0]
    return host


def is_loopback(address: str) -> bool:
    """Whether a listen address can only be reached from this host (loopback or a Unix
    socket). `0.0.0.0`, `[::]` and any routable address are not."""
    host = host_of(address)
    if host in ("unix", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False   # a host name: it may resolve to anything


__all__ = [
    "TlsSettings",
    "add_tls_arguments",
    "channel_credentials",
    "channel_options",
    "client_tls",
    "host_of",
    "is_loopback",
    "open_channel",
    "server_credentials",
    "tls_from_args",
    "tls_from_env",
]
