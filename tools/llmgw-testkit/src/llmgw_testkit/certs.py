"""Client certificates with any subject, signed by an llmgw CA (``llmgw-control ca init``).

``llmgw-control ca issue`` only makes well-formed certificates (one OU, one CN). Whoever
holds the CA's key, or a CA shared with other uses, can sign anything else: no CN,
several OUs, a SAN-only SPIFFE identity. Tests use these to show the control plane
refuses them.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["SignedFiles", "name_attr", "sign_client"]

ORG = NameOID.ORGANIZATION_NAME
OU = NameOID.ORGANIZATIONAL_UNIT_NAME
CN = NameOID.COMMON_NAME


@dataclass(frozen=True)
class SignedFiles:
    cert: Path
    key: Path
    ca: Path

    def tls(self) -> dict[str, str]:
        """As a ``tls:`` config section (agent, router)."""
        return {"cert": str(self.cert), "key": str(self.key), "ca": str(self.ca)}


def name_attr(oid: x509.ObjectIdentifier, value: str) -> x509.NameAttribute[str]:
    return x509.NameAttribute(oid, value)


def sign_client(
    ca_dir: Path,
    out: Path,
    stem: str,
    subject: list[x509.NameAttribute[str]],
    *,
    uris: tuple[str, ...] = (),
) -> SignedFiles:
    """A client certificate for ``subject`` (and URI SANs), signed by ``ca_dir``'s CA."""
    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    )
    if uris:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]),
            critical=False,
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    out.mkdir(parents=True, exist_ok=True)
    files = SignedFiles(out / f"{stem}.crt", out / f"{stem}.key", ca_dir / "ca.crt")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    files.key.chmod(0o600)
    return files
