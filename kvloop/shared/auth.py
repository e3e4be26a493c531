"""Caller credentials without certificates: tokens signed with a cluster secret, naming a role and a subject.

Where TLS is terminated by a mesh or absent, the broker cannot read a caller's identity from a certificate, so
every caller presents ``authorization: Bearer <token>`` as gRPC metadata. A token is
``kvl1.<claims>.<mac>``: ``claims`` is base64url JSON ``{"role", "sub", "iat", "exp"}`` and ``mac`` the base64url
HMAC-SHA256 of ``kvl1.<claims>`` under the cluster secret. ``role`` is one of :data:`ROLES`; for an engine,
``sub`` is its engine id, so a token acts for one engine only. ``exp`` 0 means no expiry.

Why this shape: the broker keeps one secret instead of a list of credentials (an engine added to the fleet needs a
token minted for it, not a broker restart), and the role and engine id are bound inside what the secret signs,
as in Kubernetes' service-account tokens and etcd's JWT tokens. vLLM's single static API key was the other model:
one key for every caller cannot tell an engine from a router. Rotation: the secret file may hold several secrets,
one per line; the first signs, any verifies. Add a new first line, re-mint every token, then drop the old line.

Secrets and tokens come from files (or an env variable naming a file), never from argv. Pure but for
:func:`read_secrets` and :func:`write_private`; time is an argument.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvloop.shared.errors import KvloopError, Status

ROLES = ("engine", "router", "operator")
"""engine: its sidecar, for its own engine id; router: placement; operator: inspection and every call."""
PREFIX = "kvl1"
METADATA_KEY = "authorization"
SECRET_MIN_BYTES = 32


class Unauthenticated(KvloopError):
    """The caller presented no credential, or one that does not verify."""

    status = Status.UNAUTHENTICATED


@dataclass(frozen=True)
class Claims:
    role: str
    subject: str
    issued_at: float
    expires_at: float = 0.0


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: bytes, signed: str) -> str:
    return _b64(hmac.new(secret, signed.encode(), hashlib.sha256).digest())


def mint(secret: bytes, role: str, subject: str, now: float, ttl_s: float = 0.0) -> str:
    """A token for ``role`` and ``subject`` (an engine id for engines), valid from ``now`` for ``ttl_s`` (0: ever).

    Expiry is in whole seconds, rounded up, and always after ``now``: a positive ``ttl_s`` below float resolution
    at ``now`` must not mint a token that is expired already (``tests/unit/test_access.py``)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {list(ROLES)}, not {role!r}")
    if not subject:
        raise ValueError("subject is required")
    expires = max(math.ceil(now + ttl_s), math.floor(now) + 1) if ttl_s > 0 else 0
    claims = {"role": role, "sub": subject, "iat": int(now), "exp": expires}
    signed = f"{PREFIX}.{_b64(json.dumps(claims, separators=(',', ':')).encode())}"
    return f"{signed}.{_mac(secret, signed)}"


def verify(secrets_: list[bytes], token: str, now: float) -> Claims:
    """The claims of ``token`` if one of ``secrets_`` signed it and it has not expired; ``Unauthenticated``
    otherwise (the message says which check failed, never the token)."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != PREFIX:
        raise Unauthenticated(f"{METADATA_KEY}: not a kvloop token (expected {PREFIX}.<claims>.<mac>)")
    signed = f"{parts[0]}.{parts[1]}"
    if not any(hmac.compare_digest(_mac(s, signed), parts[2]) for s in secrets_):
        raise Unauthenticated(f"{METADATA_KEY}: token signature does not verify with this cluster's secret")
    try:
        raw = json.loads(_unb64(parts[1]))
        claims = Claims(role=str(raw["role"]), subject=str(raw["sub"]), issued_at=float(raw["iat"]),
                        expires_at=float(raw.get("exp", 0)))
    except (ValueError, KeyError, TypeError) as exc:
        raise Unauthenticated(f"{METADATA_KEY}: token claims are malformed ({type(exc).__name__})") from exc
    if claims.role not in ROLES:
        raise Unauthenticated(f"{METADATA_KEY}: token role {claims.role!r} is not one of {list(ROLES)}")
    if claims.expires_at and now >= claims.expires_at:
        raise Unauthenticated(f"{METADATA_KEY}: token for {claims.role} {claims.subject!r} has expired")
    return claims


def bearer(metadata: object) -> str | None:
    """The bearer token in gRPC invocation metadata (pairs of key, value), or None."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == METADATA_KEY and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):].strip()
    return None


def new_secret() -> str:
    return secrets.token_hex(SECRET_MIN_BYTES)


def read_secrets(path: Path) -> list[bytes]:
    """Every secret in ``path``, one per line (the first signs); each at least SECRET_MIN_BYTES long."""
    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no secret in the file")
    if any(len(line) < SECRET_MIN_BYTES for line in lines):
        raise ValueError(f"{path}: every secret must be at least {SECRET_MIN_BYTES} characters")
    return [line.encode() for line in lines]


def read_token(path: Path) -> str:
    token = Path(path).read_text().strip()
    if not token.startswith(PREFIX + "."):
        raise ValueError(f"{path}: not a kvloop token")
    return token


SHARED_TOKEN_MIN_CHARS = 16


def read_shared_token(path: Path, field: str) -> str:
    """A token both sides hold as it is (not a minted kvloop token: the picker's ext_proc token) from ``path``;
    ConfigError naming ``field`` when the file cannot be read or holds fewer than 16 characters."""
    from kvloop.shared.errors import ConfigError

    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror}", field=field) from None
    if len(token) < SHARED_TOKEN_MIN_CHARS:
        raise ConfigError(f"{field}: {path} must hold a token of at least {SHARED_TOKEN_MIN_CHARS} characters",
                          field=field)
    return token


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by its owner only (created 0600, never world-readable in between)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)
    return path


def check_token_file(config: object, field: str) -> None:
    """Validation of a ``*_token_file`` setting: unset, or a readable file holding a kvloop token."""
    from kvloop.shared.errors import ConfigError

    path = getattr(config, field)
    if path is None:
        return
    try:
        read_token(Path(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{field}: {exc}", field=field) from None


def token_of(config: object, field: str = "broker_token_file") -> str | None:
    """The token in the file ``config.<field>`` names, or None when unset."""
    path = getattr(config, field, None)
    return read_token(Path(path)) if path is not None else None


class ClusterCredentials:
    """A cluster's secret and its callers' tokens in one private folder (``secret``, ``ROLE-SUBJECT.token``), as
    ``kvloop up`` and the compose cluster make them: a new secret per folder, each token minted on first ask."""

    def __init__(self, folder: Path, clock: float | None = None) -> None:
        import time

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        self.secret_file = self.folder / "secret"
        if not self.secret_file.is_file():
            for stale in self.folder.glob("*.token"):  # signed by a secret that is gone
                stale.unlink()
            write_private(self.secret_file, new_secret())
        self._secret = read_secrets(self.secret_file)[0]
        self._now = time.time() if clock is None else clock

    def token_file(self, role: str, subject: str) -> Path:
        path = self.folder / f"{role}-{subject}.token"
        if not path.is_file():
            write_private(path, mint(self._secret, role, subject, self._now))
        return path

    def token(self, role: str, subject: str) -> str:
        return read_token(self.token_file(role, subject))
