"""`pagedkv.auth`: principals, token and certificate identities, settings validation."""

from __future__ import annotations

import grpc
import pytest

from pagedkv.auth import Authenticator, AuthSettings, Principal, Refusal, parse_principal

TOKEN = "t" * 32


def cert_context(*sans: str, cn: str = "x") -> dict[str, list[bytes]]:
    """What grpc's `auth_context()` holds for a verified client certificate."""
    return {"transport_security_type": [b"ssl"], "x509_common_name": [cn.encode()],
            "x509_subject_alternative_name": [s.encode() for s in sans], "x509_pem_cert": [b"-----BEGIN"]}


def test_principals() -> None:
    assert parse_principal("node:node-0") == Principal("node", "node-0")
    assert str(parse_principal("scheduler")) == "scheduler"
    for bad in ("node", "root", "admin:has space", ""):
        with pytest.raises(ValueError):
            parse_principal(bad)


def test_settings_validation() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        AuthSettings(tokens={"admin": "short"})
    with pytest.raises(ValueError, match="its own token"):
        AuthSettings(tokens={"admin": TOKEN, "scheduler": TOKEN})
    with pytest.raises(ValueError, match="role must be one of"):
        AuthSettings(cert_principals={"cn": "root"})
    assert not AuthSettings().is_enabled(False)
    assert AuthSettings().is_enabled(True)                       # client certificates required
    assert AuthSettings(tokens={"admin": TOKEN}).is_enabled(False)
    assert not AuthSettings(enabled=False).is_enabled(True)


def test_tokens() -> None:
    auth = Authenticator(AuthSettings(tokens={"node:node-0": TOKEN}), {"admin": "legacy", "scheduler": None})
    assert auth.from_token(f"Bearer {TOKEN}".encode()) == Principal("node", "node-0")
    assert auth.from_token(b"Bearer legacy") == Principal("admin")
    for bad in (TOKEN.encode(), b"Bearer ", b"Bearer nope", f"bearer {TOKEN}".encode()):
        refusal = auth.from_token(bad)
        assert isinstance(refusal, Refusal) and refusal.code == grpc.StatusCode.UNAUTHENTICATED


def test_certificates() -> None:
    auth = Authenticator(AuthSettings(cert_principals={"gpu7.example.com": "node:node-7"}))
    assert auth.from_certificate({"transport_security_type": [b"insecure"]}) is None
    assert auth.from_certificate({"transport_security_type": [b"ssl"]}) is None          # TLS, no client cert
    assert auth.from_certificate(cert_context("spiffe://pagedkv/node/node-0")) == Principal("node", "node-0", "cert")
    assert auth.from_certificate(cert_context("spiffe://pagedkv/scheduler")) == Principal("scheduler", "", "cert")
    assert auth.from_certificate(cert_context("gpu7.example.com")) == Principal("node", "node-7", "cert")
    assert auth.from_certificate(cert_context(cn="gpu7.example.com")) == Principal("node", "node-7", "cert")
    # the explicit mapping wins over the URI convention
    assert auth.from_certificate(cert_context("spiffe://pagedkv/admin", "gpu7.example.com")).role == "node"
    for ctx in (cert_context("spiffe://other/node/node-0"), cert_context("spiffe://pagedkv/root"),
                cert_context("spiffe://pagedkv/node")):
        refusal = auth.from_certificate(ctx)
        assert isinstance(refusal, Refusal) and refusal.code == grpc.StatusCode.PERMISSION_DENIED
    several = auth.from_certificate(cert_context("spiffe://pagedkv/admin", "spiffe://pagedkv/node/node-0"))
    assert isinstance(several, Refusal) and "several" in several.message
    off = Authenticator(AuthSettings(cert_uri_prefix=""))
    assert isinstance(off.from_certificate(cert_context("spiffe://pagedkv/admin")), Refusal)
