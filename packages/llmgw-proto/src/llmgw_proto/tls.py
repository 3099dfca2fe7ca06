"""TLS contexts for the agent and publish streams (gRPC over HTTP/2, mutual TLS).

Both sides verify the other against the llmgw CA; the server requires a client
certificate. ALPN offers only ``h2``, as gRPC requires.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from llmgw_proto.config import BaseConfig, ConfigError

log = structlog.get_logger(__name__)

__all__ = [
    "ROLES",
    "CertReloader",
    "PeerIdentity",
    "TlsConfig",
    "UnreadableIdentity",
    "client_context",
    "peer_identity",
    "read_identity",
    "server_context",
]


class TlsConfig(BaseConfig):
    """The ``tls:`` section every program has: its certificate, key and the llmgw CA.

    Plaintext must be asked for, here or with ``--insecure``; otherwise all three files
    are required and must exist.
    """

    insecure: bool = False
    cert: str = ""
    key: str = ""
    ca: str = ""

    def with_insecure_flag(self, flag: bool) -> TlsConfig:
        """The one way ``--insecure`` applies: it turns plaintext on, never off."""
        return msgspec.structs.replace(self, insecure=True) if flag else self

    def check(self, source: str, field: str) -> None:
        """Raise a ConfigError naming ``source``, ``field.cert`` (etc.) and the missing path."""
        if self.insecure:
            return
        for name in ("cert", "key", "ca"):
            value = getattr(self, name)
            if not value:
                raise ConfigError(
                    source,
                    f"required unless {field.removeprefix('$.')}.insecure is true "
                    "(or --insecure is given)",
                    f"{field}.{name}",
                )
            path = Path(value)
            if not path.is_file():
                why = "is a directory" if path.is_dir() else "no such file"
                raise ConfigError(source, f"{why}: {value}", f"{field}.{name}")

    def files(self) -> tuple[Path, Path, Path]:
        return Path(self.cert), Path(self.key), Path(self.ca)


def server_context(
    cert: Path, key: Path, ca: Path, *, require_client_cert: bool = True
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    ctx.set_alpn_protocols(["h2"])
    return ctx


def client_context(cert: Path, key: Path, ca: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    ctx.set_alpn_protocols(["h2"])
    return ctx


@dataclass(frozen=True)
class PeerIdentity:
    """Who is at the other end of a stream, from its certificate's subject."""

    role: str  # node, router, server or admin (the organizational unit)
    name: str  # the common name: a node id, a router name, a host


class UnreadableIdentity(ValueError):
    """A verified certificate whose subject does not say who it is (see read_identity)."""


# admin: an operator allowed to change the fleet through the admin API (issue 29).
ROLES = ("node", "router", "server", "admin")
# Longer than any node id or host name; a subject field is at most 64 characters anyway.
MAX_NAME = 253


def read_identity(peer_cert: dict[str, object] | None) -> PeerIdentity:
    """The identity of a verified peer certificate; UnreadableIdentity saying why not.

    The subject must hold exactly one common name (the node id, router name or host) and
    exactly one organizational unit that is one of :data:`ROLES`. Anything else - no
    CN, an empty one, no OU, an unknown OU, several of either - is unreadable: the
    caller refuses the peer (as Kubernetes' x509 authenticator refuses a certificate
    without a CN). Subject alternative names are not identities here: a SAN-only
    (SPIFFE-style) certificate, with a URI SAN and no CN/OU, is unreadable too.
    """
    if not peer_cert:
        raise UnreadableIdentity("no certificate subject")
    subject = peer_cert.get("subject", ())
    names: list[str] = []
    roles: list[str] = []
    if isinstance(subject, tuple | list):
        for rdn in subject:
            if not isinstance(rdn, tuple | list):
                continue
            for pair in rdn:
                if not isinstance(pair, tuple | list) or len(pair) != 2:
                    continue
                attr, value = pair
                if attr == "commonName":
                    names.append(str(value))
                elif attr == "organizationalUnitName":
                    roles.append(str(value))
    if not names:
        spiffe = _uri_sans(peer_cert)
        if spiffe:
            raise UnreadableIdentity(
                f"no common name (URI SAN {spiffe[0]!r} is not an llmgw identity: "
                "issue the certificate with `llmgw-control ca issue`)"
            )
        raise UnreadableIdentity("no common name in the certificate subject")
    if len(names) > 1:
        raise UnreadableIdentity(f"{len(names)} common names in the certificate subject")
    name = names[0]
    if not name.strip():
        raise UnreadableIdentity("an empty common name")
    if name != name.strip() or len(name) > MAX_NAME or not name.isprintable():
        raise UnreadableIdentity(f"common name {name[:80]!r} is not a valid name")
    if not roles:
        raise UnreadableIdentity(
            f"no organizational unit (node, router, server or admin) for {name!r}"
        )
    if len(roles) > 1:
        raise UnreadableIdentity(
            f"{len(roles)} organizational units for {name!r}: {', '.join(map(repr, roles))}"
        )
    if roles[0] not in ROLES:
        raise UnreadableIdentity(
            f"organizational unit {roles[0][:80]!r} for {name!r} is not node, router, server or admin"
        )
    return PeerIdentity(role=roles[0], name=name)


def _uri_sans(peer_cert: dict[str, object]) -> list[str]:
    sans = peer_cert.get("subjectAltName", ())
    out: list[str] = []
    if isinstance(sans, tuple | list):
        for pair in sans:
            if isinstance(pair, tuple | list) and len(pair) == 2 and pair[0] == "URI":
                out.append(str(pair[1]))
    return out


def peer_identity(peer_cert: dict[str, object] | None) -> PeerIdentity | None:
    """:func:`read_identity`, or None where the subject does not say who it is."""
    try:
        return read_identity(peer_cert)
    except UnreadableIdentity:
        return None


class CertReloader:
    """Re-reads certificate files into a live SSLContext when they change.

    ``load_cert_chain`` on an existing context affects only new handshakes, so open
    streams keep going while new ones get the rotated certificate.
    """

    def __init__(
        self, ctx: ssl.SSLContext, cert: Path, key: Path, ca: Path, *, interval: float = 5.0
    ) -> None:
        self.ctx = ctx
        self.files = (Path(cert), Path(key), Path(ca))
        self.interval = interval
        self._stamp = self._stamps()
        self.reloads = 0

    def _stamps(self) -> tuple[tuple[float, int], ...]:
        out = []
        for path in self.files:
            try:
                st = path.stat()
                out.append((st.st_mtime, st.st_size))
            except OSError:
                out.append((0.0, -1))
        return tuple(out)

    def check(self) -> bool:
        """Reload if any file changed since the last look; True when it reloaded."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return False
        cert, key, ca = self.files
        try:
            self.ctx.load_cert_chain(str(cert), str(key))
            self.ctx.load_verify_locations(cafile=str(ca))
        except (OSError, ssl.SSLError) as err:
            # A half-written rotation: keep serving with what we have, try again later.
            log.warning("certificate reload failed", error=str(err), cert=str(cert))
            return False
        self._stamp = stamp
        self.reloads += 1
        log.info("certificates reloaded", cert=str(cert))
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            with contextlib.suppress(Exception):
                self.check()
