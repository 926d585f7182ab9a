"""Who is calling: principals, their credentials, and how a call is mapped to one.

A **principal** is a role and, for roles that have one, a name:

| principal | may (block manager) | may (compute node) |
|---|---|---|
| `node:<node id>` | RegisterNode / Heartbeat / GetTables for that node id only | — |
| `scheduler` | Step (any `scheduler_id`), Route | Forward, Generate, GetNodeInfo |
| `scheduler:<id>` | Step with `scheduler_id == <id>` only, Route | Forward, Generate, GetNodeInfo |
| `admin` / `admin:<who>` | the admin plane (`BlockManagerAdmin`), SubscribeKvEvents | GetNodeInfo |
| `subscriber` / `subscriber:<who>` | SubscribeKvEvents only (an external KV-aware router) | — |

(the per-method rules live with each service: `block_manager/service/access.py`,
`compute_node/service/access.py`). A call proves its principal in one of two ways:

- **a client certificate** (mutual TLS, `tls.require_client_cert`): its identities — every
  subject alternative name (DNS, URI, e-mail, IP) and the subject's common name — are looked
  up in `auth.cert_principals` (identity -> principal); failing that, a URI SAN
  `<auth.cert_uri_prefix><role>[/<name>]` (default prefix `spiffe://pagedkv/`, SPIFFE style) names
  the principal directly. A certificate that maps to no principal, or to several, is refused;
- **a bearer token** (`authorization: Bearer <token>` metadata): `auth.tokens` maps each
  principal to its token. Sent over plaintext a token can be read off the wire: use TLS beyond
  loopback. A token, when sent, decides; otherwise the certificate does.

Tokens are compared by their SHA-256 (a dict lookup over fixed-length digests: no early-exit
string comparison of secrets). Authentication is on when `auth.enabled` says so, or (unset)
when client certificates are required or any token is configured; off, the services behave as
in development (no identity checks; the block manager's legacy `admin_token` still guards the
admin plane).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

ROLES = ("admin", "scheduler", "node", "subscriber")
_NAME = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
MIN_TOKEN_CHARS = 16


@dataclass(slots=True, frozen=True)
class Principal:
    """An authenticated caller: `role` and (node: always; others: optionally) `name`."""

    role: str
    name: str = ""
    via: str = "token"   # "token" or "cert": how the call proved it (logs only)

    def __str__(self) -> str:
        return f"{self.role}:{self.name}" if self.name else self.role


def parse_principal(text: str) -> Principal:
    """`admin`, `admin:alice`, `scheduler`, `scheduler:s1`, `node:node-0`; `ValueError` otherwise."""
    role, _, name = text.partition(":")
    if role not in ROLES:
        raise ValueError(f"principal {text!r}: the role must be one of {', '.join(ROLES)}")
    if role == "node" and not name:
        raise ValueError(f"principal {text!r}: a node principal names its node id (node:<id>)")
    if name and not _NAME.match(name):
        raise ValueError(f"principal {text!r}: the name must be 1-128 characters of [A-Za-z0-9._:-]")
    return Principal(role, name)


@dataclass(slots=True, frozen=True)
class Refusal:
    """Why a call was refused: UNAUTHENTICATED (no or invalid credentials) or
    PERMISSION_DENIED (valid credentials, not allowed)."""

    code: grpc.StatusCode
    message: str


class AuthSettings(BaseModel):
    """The `auth:` section of both services."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # None: on when client certificates are required or any token is configured.
    enabled: bool | None = None
    # principal -> bearer token, e.g. {"admin": "...", "scheduler": "...", "node:node-0": "..."}
    tokens: dict[str, str] = {}
    # certificate identity (a SAN or the subject CN) -> principal, e.g. {"node0.example.com": "node:node-0"}
    cert_principals: dict[str, str] = {}
    # A URI SAN "<prefix><role>[/<name>]" names its principal directly ("" turns this off).
    cert_uri_prefix: str = "spiffe://pagedkv/"

    @field_validator("tokens")
    @classmethod
    def _good_tokens(cls, v: dict[str, str]) -> dict[str, str]:
        for principal, token in v.items():
            parse_principal(principal)
            if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable() or " " in token:
                raise ValueError(
                    f"auth.tokens[{principal!r}]: a token is at least {MIN_TOKEN_CHARS} printable ASCII characters "
                    "without spaces (e.g. `openssl rand -hex 32`)"
                )
        if len(set(v.values())) != len(v):
            raise ValueError("auth.tokens: every principal needs its own token")
        return v

    @field_validator("cert_principals")
    @classmethod
    def _good_mapping(cls, v: dict[str, str]) -> dict[str, str]:
        for principal in v.values():
            parse_principal(principal)
        return v

    @model_validator(mode="after")
    def _explicit_off(self) -> AuthSettings:
        if self.enabled is False and self.tokens:
            raise ValueError("auth: tokens are configured but auth.enabled is false")
        return self

    def is_enabled(self, require_client_cert: bool) -> bool:
        if self.enabled is not None:
            return self.enabled
        return require_client_cert or bool(self.tokens)


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def bearer(metadata: Iterable[tuple[str, Any]] | None) -> bytes | None:
    """The `authorization` metadata value, as bytes (None when absent)."""
    for key, value in metadata or ():
        if key == "authorization":
            return value.encode() if isinstance(value, str) else bytes(value)
    return None


class Authenticator:
    """Maps a call to its principal (or a refusal) from the settings of one service."""

    def __init__(self, settings: AuthSettings, extra_tokens: Mapping[str, str | None] | None = None) -> None:
        self.settings = settings
        self._tokens: dict[bytes, Principal] = {}
        for principal, token in {**settings.tokens, **{k: v for k, v in (extra_tokens or {}).items() if v}}.items():
            self._tokens[_digest(f"Bearer {token}".encode())] = parse_principal(principal)
        self._certs = {identity: parse_principal(p) for identity, p in settings.cert_principals.items()}
        self._prefix = settings.cert_uri_prefix

    @property
    def has_tokens(self) -> bool:
        return bool(self._tokens)

    def from_token(self, value: bytes) -> Principal | Refusal:
        principal = self._tokens.get(_digest(value))
        if principal is None:
            return Refusal(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        return principal

    def from_certificate(self, auth_context: Mapping[str, Iterable[bytes]]) -> Principal | Refusal | None:
        """The principal a verified client certificate names; None when the peer sent none."""
        if list(auth_context.get("transport_security_type", ())) != [b"ssl"]:
            return None
        sans = [v.decode(errors="replace") for v in auth_context.get("x509_subject_alternative_name", ())]
        cns = [v.decode(errors="replace") for v in auth_context.get("x509_common_name", ())]
        if not sans and not cns and not auth_context.get("x509_pem_cert"):
            return None     # TLS without a client certificate
        found: set[Principal] = set()
        for identity in (*sans, *cns):
            mapped = self._certs.get(identity)
            if mapped is not None:
                found.add(mapped)
        if not found and self._prefix:
            for uri in sans:
                if uri.startswith(self._prefix):
                    role, _, name = uri[len(self._prefix) :].partition("/")
                    try:
                        found.add(parse_principal(f"{role}:{name}" if name else role))
                    except ValueError:
                        continue
        shown = ", ".join((*sans, *(f"CN={c}" for c in cns)))[:300]
        if not found:
            return Refusal(grpc.StatusCode.PERMISSION_DENIED, f"client certificate ({shown}) maps to no principal")
        if len(found) > 1:
            names = ", ".join(sorted(map(str, found)))
            return Refusal(grpc.StatusCode.PERMISSION_DENIED, f"client certificate maps to several principals: {names}")
        (principal,) = found
        return Principal(principal.role, principal.name, "cert")

    def identify(self, context: grpc.aio.ServicerContext) -> Principal | Refusal:
        """The caller of `context`: its bearer token if it sent one, else its certificate."""
        value = bearer(context.invocation_metadata())
        if value is not None:
            return self.from_token(value)
        from_cert = self.from_certificate(context.auth_context())
        if from_cert is not None:
            return from_cert
        return Refusal(grpc.StatusCode.UNAUTHENTICATED, "credentials required: a client certificate or a bearer token")


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


__all__ = [
    "MIN_TOKEN_CHARS",
    "ROLES",
    "AuthSettings",
    "Authenticator",
    "Principal",
    "Refusal",
    "bearer",
    "parse_principal",
    "token_metadata",
]
