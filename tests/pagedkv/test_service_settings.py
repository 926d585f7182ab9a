"""`ServiceSettings`: the listener, TLS, auth and log-level rules both services' settings share,
checked on a service of its own and on the two real ones."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from block_manager.service.config import BlockManagerConfig
from compute_node.service.config import ComputeNodeConfig
from pagedkv.auth import AuthSettings
from pagedkv.service_settings import ServiceSettings
from pagedkv.tls import TlsSettings


class _Toy(ServiceSettings):
    tls: TlsSettings = TlsSettings()
    auth: AuthSettings = AuthSettings()
    log_level: str = "INFO"
    backdoor: str | None = None

    def other_callers(self) -> bool:
        return self.backdoor is not None


@pytest.mark.parametrize("cls", [_Toy, BlockManagerConfig, ComputeNodeConfig])
def test_the_shared_rules_hold_in_every_service(cls: type[ServiceSettings]) -> None:
    assert not cls().auth_enabled
    with pytest.raises(ValidationError, match="unknown log level"):
        cls(log_level="chatty")
    with pytest.raises(ValidationError, match="nobody could call"):
        cls(auth={"enabled": True})
    assert cls(auth={"tokens": {"scheduler": "t" * 32}}).auth_enabled


def test_a_service_may_name_callers_of_its_own() -> None:
    assert _Toy(auth={"enabled": True}, backdoor="yes").auth_enabled
    assert BlockManagerConfig(auth={"enabled": True}, admin_token="admin-secret").auth_enabled
    with pytest.raises(ValidationError, match="nobody could call"):
        BlockManagerConfig(auth={"enabled": True}, admin_token="")   # an empty token is no token
