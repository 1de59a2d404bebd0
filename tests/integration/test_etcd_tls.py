"""etcd over TLS with client-certificate auth: the client and the rendezvous connect with
certificates, and a missing client certificate or a wrong CA fails clearly, naming TLS."""

from __future__ import annotations

import datetime
import ipaddress
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elasticd.errors import ConfigError, EtcdUnavailableError
from elasticd.etcd import gateway
from elasticd.etcd.client import EtcdClient, TLSFiles
from elasticd.etcd.embedded import EmbeddedEtcd, ServerTLS
from elasticd.etcd.gateway import GatewayEndpoint
from elasticd.rendezvous.registry import create_handler

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True)
class Pki:
    """Paths of a CA, a server certificate for 127.0.0.1 and a client certificate."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str  # a CA that signed nothing here


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return str(path)


def _write_cert(path: Path, cert: x509.Certificate) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _ca(name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(name: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, *,
          server: bool) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server \
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(ca.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(root: Path) -> Pki:
    """A self-made CA, a server cert (SAN IP:127.0.0.1) and a client cert, all in PEM files."""
    root.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _ca("elasticd-test-ca")
    server, server_key = _leaf("etcd", ca, ca_key, server=True)
    client, client_key = _leaf("elasticd-agent", ca, ca_key, server=False)
    other, _ = _ca("some-other-ca")
    return Pki(
        ca=_write_cert(root / "ca.pem", ca),
        server_cert=_write_cert(root / "server.pem", server),
        server_key=_write_key(root / "server-key.pem", server_key),
        client_cert=_write_cert(root / "client.pem", client),
        client_key=_write_key(root / "client-key.pem", client_key),
        other_ca=_write_cert(root / "other-ca.pem", other),
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    """Certificates for this module's TLS etcd."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_etcd(pki, tmp_path_factory):
    """An etcd serving clients over TLS and requiring a client certificate from the CA."""
    server = EmbeddedEtcd(str(tmp_path_factory.mktemp("etcd-tls")),
                          tls=ServerTLS(pki.server_cert, pki.server_key, pki.ca))
    server.start()
    try:
        yield server
    finally:
        server.stop(remove_data=True)


def test_client_with_certificates_talks_to_tls_etcd(tls_etcd, pki):
    """With the CA and a client certificate the client reads and writes over TLS."""
    client = EtcdClient(tls_etcd.endpoint, timeout_s=2.0,
                        tls=TLSFiles(pki.ca, pki.client_cert, pki.client_key))
    try:
        client.put("/tls/k", b"v")
        kv = client.get("/tls/k")
        assert kv is not None and kv.value == b"v"
    finally:
        client.close()


def test_rendezvous_over_tls_completes_a_round(tls_etcd, pki):
    """The etcd-v3 handler built from rdzv-conf ca_file/cert_file/key_file completes a round."""
    params = RendezvousParameters(backend="etcd-v3", endpoint=tls_etcd.endpoint, run_id="tls",
                                  min_nodes=1, max_nodes=1, local_addr="127.0.0.1",
                                  ca_file=pki.ca, cert_file=pki.client_cert,
                                  key_file=pki.client_key, node_ttl="2", join_timeout="15",
                                  last_call_timeout="0.2")
    h = create_handler(params)
    try:
        info = h.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
    finally:
        h.shutdown()
        h.client.close()


def _tls_failure(endpoint: str, tls: TLSFiles | None) -> tuple[BaseException, float]:
    client = EtcdClient(endpoint, timeout_s=2.0, tls=tls)
    t0 = time.monotonic()
    try:
        client.get("/tls/k")
    except (ConfigError, EtcdUnavailableError) as exc:
        return exc, time.monotonic() - t0
    finally:
        client.close()
    raise AssertionError("a client with bad TLS settings was served")


@pytest.mark.parametrize("case", ["no_client_cert", "wrong_ca", "plaintext"])
def test_bad_tls_settings_fail_clearly_and_fast(tls_etcd, pki, case):
    """Without a client certificate, with a CA that did not sign the server, or without TLS
    at all, a call fails within its timeout with an error that names TLS and the fix."""
    tls = {
        "no_client_cert": TLSFiles(pki.ca),
        "wrong_ca": TLSFiles(pki.other_ca, pki.client_cert, pki.client_key),
        "plaintext": None,
    }[case]
    exc, took = _tls_failure(tls_etcd.endpoint, tls)
    assert took < 2.0 + 1.5, f"took {took:.1f}s"
    assert "TLS" in str(exc), f"{type(exc).__name__}: {exc}"
    # The fix names the flags a user types (status, stop, run), then the config keys.
    assert "--etcd-ca" in str(exc) and "--etcd-cert" in str(exc), str(exc)


def test_rendezvous_without_client_certificate_is_a_config_error(tls_etcd, pki):
    """next_rendezvous with no client certificate raises ConfigError naming TLS at once,
    not a connection error after join_timeout."""
    params = RendezvousParameters(backend="etcd-v3", endpoint=tls_etcd.endpoint, run_id="tls-bad",
                                  min_nodes=1, max_nodes=1, ca_file=pki.ca, join_timeout="30")
    h = create_handler(params)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="TLS"):
            h.next_rendezvous()
        assert time.monotonic() - t0 < 5.0
    finally:
        h.shutdown()
        h.client.close()


def test_a_forked_childs_gateway_client_uses_the_same_tls_settings(tls_etcd, pki, monkeypatch):
    """Over etcd's HTTP gateway (a forked child's transport) the client with the CA and a
    client certificate reads, writes and keeps a lease; without the client certificate
    etcd refuses it, and with a CA that signed nothing the server is not trusted."""
    monkeypatch.setattr(gateway, "_fork_child", True)
    client = EtcdClient(tls_etcd.endpoint, timeout_s=2.0,
                        tls=TLSFiles(pki.ca, pki.client_cert, pki.client_key))
    assert all(isinstance(ep, GatewayEndpoint) for ep in client.raw().endpoints.values())
    client.put("/gw-tls/k", "v")
    assert client.get("/gw-tls/k").value == b"v"
    lease = client.grant_lease(5)
    assert client.refresh_lease(lease) > 0
    client.revoke_lease(lease)
    client.close()
    for tls in (TLSFiles(pki.ca), TLSFiles(pki.other_ca, pki.client_cert, pki.client_key)):
        refused = EtcdClient(tls_etcd.endpoint, timeout_s=2.0, tls=tls)
        with pytest.raises((ConfigError, EtcdUnavailableError)):
            refused.get("/gw-tls/k")
        refused.close()
