"""The checks every service's settings share: one listener, its TLS, who may call it, the log level.

The block manager (`block_manager/service/config.py`) and the compute node
(`compute_node/service/config.py`) each declare their own `tls`, `auth` and `log_level`
fields (where they sit in the settings, with their comments); the rules for those fields live
here once, so a new rule (say, a stricter TLS check) reaches both services:

- a TLS listener, or one demanding client certificates, needs the server's certificate and key;
- with authentication on, somebody must be able to call: a token, client certificates, or a
  caller the service knows of its own (`other_callers`: the block manager's admin token);
- the log level is one `pagedkv.logging` knows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Self

from pydantic import field_validator, model_validator

from pagedkv.settings import YamlEnvSettings, checked_log_level

if TYPE_CHECKING:
    from pagedkv.auth import AuthSettings
    from pagedkv.tls import TlsSettings


class ServiceSettings(YamlEnvSettings):
    """A service's settings (see the module docstring); the subclass declares the fields."""

    if TYPE_CHECKING:   # declared by each service's settings, in its own order
        tls: TlsSettings
        auth: AuthSettings
        log_level: str

    @property
    def auth_enabled(self) -> bool:
        """Callers must present a credential (on unless `auth.enabled` turns it off, when any
        token or client certificates are configured)."""
        return self.auth.is_enabled(self.tls.require_client_cert)

    def other_callers(self) -> bool:
        """A credential of the service's own beyond `auth` and client certificates."""
        return False

    @model_validator(mode="after")
    def _listener_security(self) -> Self:
        self.tls.check_listener()
        if self.auth_enabled and not (self.auth.tokens or self.tls.require_client_cert or self.other_callers()):
            raise ValueError("auth.enabled: nobody could call: configure auth.tokens or tls.require_client_cert")
        return self

    @field_validator("log_level", check_fields=False)
    @classmethod
    def _known_log_level(cls, v: str) -> str:
        return checked_log_level(v)


__all__ = ["ServiceSettings"]
