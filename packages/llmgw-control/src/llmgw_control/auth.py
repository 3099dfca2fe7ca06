"""Who may change the fleet through the admin API: a bearer token or an admin certificate.

GETs (status, explain, metrics, the page, engine logs) stay open: the admin API binds
to loopback by default. Every change (POST) needs one of:

- ``Authorization: Bearer TOKEN``, the token in ``admin_auth.token_file`` (default
  ``<state_dir>/admin.token``, made with mode 0600 at the first start when missing; a
  file readable by group or others is refused);
- with ``admin_auth.tls: true`` (the admin API then serves HTTPS with the control
  plane's certificate, client certificates optional), a client certificate of the
  ``admin`` role (``llmgw-control ca issue --admin NAME``, OU=admin).

:func:`authorize` is pure: the request's header and peer certificate in, who it is
(for the log and the stored override) or why not out.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from llmgw_proto.config import BaseConfig
from llmgw_proto.tls import UnreadableIdentity, read_identity

__all__ = [
    "AdminAuth",
    "Credentials",
    "Denied",
    "TokenError",
    "authorize",
    "load_token",
    "token_path",
]

TOKEN_FILE = "admin.token"  # noqa: S105 - a file name, not a secret


class AdminAuth(BaseConfig):
    # The bearer token's file; "" = <state.state_dir>/admin.token (made when missing).
    token_file: str = ""
    # Serve the admin API over TLS (the tls: cert, key and ca) and accept admin certificates.
    tls: bool = False


@dataclass(frozen=True)
class Credentials:
    """What the admin API accepts: the token (None: no token) and whether certs count."""

    token: str | None
    certificates: bool = False


@dataclass(frozen=True)
class Denied:
    status: int  # 401 no or wrong credential, 403 a certificate of another role
    reason: str


def authorize(
    creds: Credentials, authorization: str, peer_cert: dict[str, object] | None
) -> str | Denied:
    """Who makes a change (``token`` or ``admin:NAME``), or why it is refused."""
    if creds.certificates and peer_cert:
        try:
            identity = read_identity(peer_cert)
        except UnreadableIdentity as err:
            return Denied(403, f"unreadable client certificate: {err}")
        if identity.role == "admin":
            return f"admin:{identity.name}"
        if not authorization:
            return Denied(
                403, f"certificate of {identity.role} {identity.name!r} is not an admin's"
            )
    scheme, _, given = authorization.strip().partition(" ")
    if not authorization:
        how = "an Authorization: Bearer header with the admin token"
        if creds.certificates:
            how += " or an admin client certificate"
        return Denied(401, f"changes need {how} (llmgw-control --token-file, LLMGW_ADMIN_TOKEN)")
    if scheme.lower() != "bearer" or not given.strip():
        return Denied(401, "Authorization header is not 'Bearer TOKEN'")
    if creds.token is None:
        return Denied(401, "no admin token is configured on this control plane")
    if not hmac.compare_digest(given.strip().encode(), creds.token.encode()):
        return Denied(401, "wrong admin token")
    return "token"


def token_path(auth: AdminAuth, state_dir: str, config_path: Path | None) -> Path:
    raw = Path(auth.token_file or str(Path(state_dir) / TOKEN_FILE)).expanduser()
    if not raw.is_absolute() and config_path is not None:
        raw = config_path.resolve().parent / raw
    return raw


class TokenError(Exception):
    """The token file is unusable; the message names the file and the setting."""


def load_token(path: Path, *, create: bool) -> str:
    """The token in ``path``; made (0600, 32 random bytes hex) when missing and ``create``."""
    setting = "admin_auth.token_file"
    try:
        st = path.stat()
    except FileNotFoundError:
        if not create:
            raise TokenError(f"{setting} {path}: no such file") from None
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        token = secrets.token_hex(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(
            f"{setting} {path}: readable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}); chmod 600 it"
        )
    token = path.read_text(encoding="utf-8", errors="replace").strip()
    if len(token) < 16 or any(c.isspace() for c in token):
        raise TokenError(f"{setting} {path}: the token must be 16 or more non-blank characters")
    return token
