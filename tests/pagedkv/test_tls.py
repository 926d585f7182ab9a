"""`pagedkv.tls` and the lifecycle's listener checks: settings, loopback detection, the
service's own TLS environment for probes, and the loud warnings for exposed listeners."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from pagedkv import lifecycle
from pagedkv.tls import TlsSettings, client_tls, is_loopback, open_channel, server_credentials, tls_from_env
from tests.fixtures.certs import DevCerts


def test_settings_rules(tmp_path: Path) -> None:
    assert not TlsSettings().active
    assert TlsSettings(ca_file=tmp_path / "ca.pem").active                     # a CA: TLS
    assert TlsSettings(enabled=True).active                                     # system roots
    assert not TlsSettings(enabled=False, ca_file=tmp_path / "ca.pem").active   # explicitly off
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        TlsSettings(cert_file=tmp_path / "c.pem")
    with pytest.raises(ValueError, match="require_client_cert needs ca_file"):
        TlsSettings(cert_file=tmp_path / "c.pem", key_file=tmp_path / "k.pem", require_client_cert=True)
    assert client_tls() is None
    assert client_tls(server_name="bm").active


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1:0", True), ("127.3.2.1:50051", True), ("localhost:1", True), ("[::1]:5", True),
     ("unix:/tmp/bm.sock", True), ("0.0.0.0:50051", False), ("[::]:50051", False), ("10.1.2.3:1", False),
     ("block-manager:50051", False)],
)
def test_is_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_files_are_checked_at_start(tmp_path: Path, dev_certs: DevCerts) -> None:
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match=r"tls.cert_file .*cert.pem is not a PEM file with a certificate"):
        server_credentials(TlsSettings(cert_file=not_pem, key_file=dev_certs.path("admin-key.pem")))
    with pytest.raises(ValueError, match=r"tls.key_file .* is not a PEM file with a private key"):
        server_credentials(TlsSettings(cert_file=dev_certs.path("admin.pem"), key_file=dev_certs.path("admin.pem")))
    with pytest.raises(OSError, match="cannot read tls.ca_file"):
        open_channel("127.0.0.1:1", TlsSettings(ca_file=tmp_path / "missing.pem"))
    assert isinstance(server_credentials(dev_certs.server("block-manager")), grpc.ServerCredentials)


def test_a_service_tls_environment_read_as_a_client(dev_certs: DevCerts) -> None:
    env = {"PAGEDKV_CN_TLS__CERT_FILE": str(dev_certs.path("compute-node-0.pem")),
           "PAGEDKV_CN_TLS__KEY_FILE": str(dev_certs.path("compute-node-0-key.pem")),
           "PAGEDKV_CN_TLS__CA_FILE": str(dev_certs.ca), "PAGEDKV_CN_TLS__REQUIRE_CLIENT_CERT": "true"}
    tls = tls_from_env("PAGEDKV_CN_TLS__", env)
    assert tls is not None and tls.cert_file == dev_certs.path("compute-node-0.pem") and tls.ca_file == dev_certs.ca
    assert tls_from_env("PAGEDKV_CN_TLS__", {}) is None                           # no TLS there: plaintext probe
    assert tls_from_env("PAGEDKV_CN_TLS__", {**env, "PAGEDKV_CN_TLS__ENABLED": "false"}) is None


async def test_plaintext_and_unauthenticated_listeners_beyond_loopback_are_logged(
    monkeypatch: pytest.MonkeyPatch, dev_certs: DevCerts
) -> None:
    monkeypatch.setattr(lifecycle, "is_loopback", lambda address: False)   # tests listen on 127.0.0.1 only
    for tls, warned in ((None, True), (dev_certs.server("block-manager"), False)):
        server = lifecycle.new_server()
        with capture_logs() as logs:
            lifecycle.bind(server, "127.0.0.1:0", tls)
        await server.stop(0)
        assert any("PLAINTEXT LISTENER" in e["event"] for e in logs) is warned
    monkeypatch.undo()
    with capture_logs() as logs:
        lifecycle.check_exposure("10.0.0.1:50051", None, auth_enabled=False, tokens=False)
        lifecycle.check_exposure("10.0.0.1:50051", None, auth_enabled=True, tokens=True)
        lifecycle.check_exposure("10.0.0.1:50051", dev_certs.server("block-manager"), auth_enabled=True, tokens=True)
        lifecycle.check_exposure("127.0.0.1:50051", None, auth_enabled=False, tokens=False)
    events = [e["event"] for e in logs]
    assert len(events) == 2 and "NO AUTHENTICATION" in events[0] and "cleartext" in events[1]
