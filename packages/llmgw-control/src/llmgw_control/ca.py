"""The llmgw certificate authority: one CA, and certificates that name who holds them.

    llmgw-control ca init  --dir DIR
    llmgw-control ca issue --dir DIR --node gpu-a        # an agent's client certificate
    llmgw-control ca issue --dir DIR --router edge-1     # a router's client certificate
    llmgw-control ca issue --dir DIR --server ctl.example,10.0.0.2   # the control plane's
    llmgw-control ca issue --dir DIR --admin alice       # an operator's, for admin changes

A certificate's subject carries the holder's role in the organizational unit
(``node``, ``router``, ``server``, ``admin``) and its name in the common name; the control
plane reads both from the peer certificate of every stream.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["ROLES", "CaError", "Issued", "init_ca", "issue"]

ROLES = ("node", "router", "server", "admin")
ORGANIZATION = "llmgw"
CA_CERT = "ca.crt"
CA_KEY = "ca.key"


class CaError(Exception):
    """A problem with the CA directory or a request; the message says what to do."""


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # Created with owner-only permissions from the start, never readable by others.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, 0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def init_ca(directory: Path, *, days: int = 3650, name: str = "llmgw CA") -> Issued:
    """Make a new CA in ``directory``; refuses to overwrite an existing one."""
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if cert_path.exists() or key_path.exists():
        raise CaError(
            f"{directory} already holds a CA ({CA_CERT}/{CA_KEY}); refusing to replace it"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    return Issued(cert_path, key_path)


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if not cert_path.exists() or not key_path.exists():
        raise CaError(f"no CA in {directory}: run `llmgw-control ca init --dir {directory}` first")
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CaError(f"{key_path} is not an llmgw CA key")
    return cert, key


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue(
    directory: Path,
    role: str,
    name: str,
    *,
    hosts: list[str] | None = None,
    days: int = 365,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
    out: Path | None = None,
) -> Issued:
    """Issue a certificate for ``role`` (node, router, server or admin) named ``name``.

    Server certificates list ``hosts`` (DNS names or IP addresses) as subject
    alternative names; clients need nothing but their name.
    """
    if role not in ROLES:
        raise CaError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    if not name or any(c in name for c in "/\\\0") or name.startswith("."):
        raise CaError(f"invalid name {name!r}: use letters, digits, dots and dashes")
    ca_cert, ca_key = _load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    start = not_before or now - datetime.timedelta(minutes=5)
    end = not_after or now + datetime.timedelta(days=days)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if role == "server" else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                    x509.NameAttribute(NameOID.COMMON_NAME, name),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if role == "server":
        builder = builder.add_extension(_san(hosts or [name]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    target = out or directory
    target.mkdir(parents=True, exist_ok=True)
    stem = f"{role}-{name}"
    issued = Issued(target / f"{stem}.crt", target / f"{stem}.key")
    _write_key(issued.key, key)
    _write_cert(issued.cert, cert)
    return issued
