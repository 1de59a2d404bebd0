"""A throw-away certificate authority that makes the embedded etcd private to its owner.

Why: ``--standalone`` used to serve etcd on 127.0.0.1 in plaintext without auth, and
every local user can connect to a loopback port: one found it and overwrote
``checkpoint/latest``. The embedded etcd now serves TLS and requires a client certificate
signed by a CA generated at start. The CA's key is never written to disk (nothing else
needs signing); the client key is written 0600 inside a 0700 directory, so only the
owner (and root) can present it. Loopback plus a private client key is the boundary:
no password exists, so nothing secret crosses the socket in clear.

The same CA signs a peer certificate: etcd's peer port (raft and the peer HTTP API) used to
be plain http on 127.0.0.1, where any local user could read the cluster id from
``GET /members`` and POST a raft proposal to ``/raft`` that wrote any key. Members now serve
peers with TLS and ``--peer-client-cert-auth`` from this CA.

Keys are ECDSA P-256; certificates are valid for 30 days (a standalone run that lasts
longer restarts its etcd with fresh ones on the next start).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 30


@dataclass(frozen=True)
class PrivatePki:
    """PEM files of a generated CA, etcd's server certificate and the owner's client one."""

    directory: str
    ca_file: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    peer_cert: str
    peer_key: str

    @property
    def peer(self) -> PeerTLS:
        """What etcd members present to each other (and trust): the peer leaf and the CA."""
        return PeerTLS(self.ca_file, self.peer_cert, self.peer_key)


@dataclass(frozen=True)
class PeerTLS:
    """etcd's peer TLS: ``--peer-cert-file``, ``--peer-key-file``, ``--peer-trusted-ca-file``.

    Served with ``--peer-client-cert-auth``: a member accepts raft traffic and the peer HTTP
    API (``/members``, ``/raft``) only from a holder of a certificate this CA signed.
    """

    ca_file: str
    cert_file: str
    key_file: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: str, data: bytes) -> str:
    # 0600 from the first byte: no window in which the key is readable by others.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, 0o600)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def generate_private_pki(directory: str) -> PrivatePki:
    """Create a CA, a server certificate for 127.0.0.1, a client certificate and a peer
    certificate (server and client auth, for raft between members) in ``directory``.

    ``directory`` is created (or tightened) to mode 0700; every file is 0600.

    Args:
        directory: where the PEM files go (e.g. ``<etcd data dir>/tls``).

    Returns:
        The paths of the files.
    """
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("elasticd embedded etcd CA"))
          .issuer_name(_name("elasticd embedded etcd CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, usages: list[x509.ObjectIdentifier], san: bool) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
        return _cert_pem(builder.sign(ca_key, hashes.SHA256())), _key_pem(key)

    # Server auth only: the server key is on disk for etcd to read, so with client auth too
    # any process of the owner's uid (the workers' training code) could present it as a
    # client certificate (issue 21). etcd's gRPC gateway dials itself with this certificate;
    # elasticd talks gRPC only, so a gateway refused by client-cert auth costs nothing.
    server_cert, server_key = leaf("elasticd-embedded-etcd", [ExtendedKeyUsageOID.SERVER_AUTH],
                                   san=True)
    client_cert, client_key = leaf("elasticd-owner", [ExtendedKeyUsageOID.CLIENT_AUTH], san=False)
    # A member dials its peers (client auth) and serves them (server auth, 127.0.0.1).
    peer_cert, peer_key = leaf("elasticd-etcd-peer",
                               [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                               san=True)
    j = os.path.join
    return PrivatePki(
        directory=directory,
        ca_file=_write(j(directory, "ca.pem"), _cert_pem(ca)),
        server_cert=_write(j(directory, "server.pem"), server_cert),
        server_key=_write(j(directory, "server-key.pem"), server_key),
        client_cert=_write(j(directory, "client.pem"), client_cert),
        client_key=_write(j(directory, "client-key.pem"), client_key),
        peer_cert=_write(j(directory, "peer.pem"), peer_cert),
        peer_key=_write(j(directory, "peer-key.pem"), peer_key),
    )
