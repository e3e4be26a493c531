"""Optional TLS and mutual TLS for kvloop's links, from PEM file paths in each service's config.

Every kvloop service config names its files the same way:

- a **server** (the broker's gRPC port, the sidecar's gRPC port, the router's HTTP port) has ``tls_cert``,
  ``tls_key`` and ``tls_ca``: cert and key turn TLS on; ``tls_ca`` also *requires* each client to present a
  certificate signed by that CA (mutual TLS). Nothing set: plaintext, as before (loopback and local dev).
- a **client of the broker** (the router, the sidecar, ``kvloop broker status``) has ``broker_tls_ca`` (the
  CA that signed the broker's certificate; empty = the system's roots), ``broker_tls_cert`` and
  ``broker_tls_key`` (its own certificate, which a broker with ``tls_ca`` requires and reads its identity
  from), and ``broker_tls_server_name`` (the name to check the broker's certificate against when it differs
  from the dialled host). Any of the first three set: TLS towards the broker.

Files are read once at start (restart a service to rotate its certificates). :func:`check_files` validates
them for ``validate()``: each named file exists and parses, a certificate and its key match, and the error
names the field (``tls_key: does not match tls_cert ...``). The gRPC identity of a caller is read with
:func:`peer_names`: the certificate's subject common name and every subject alternative name (DNS, URI,
IP, e-mail), as gRPC reports them.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvloop.shared.errors import ConfigError

_CERT_MARK = b"-----BEGIN CERTIFICATE-----"
_KEY_MARK = b"PRIVATE KEY-----"


def _path(value: Path | str | None) -> Path | None:
    return Path(value) if value not in (None, "") else None


@dataclass(frozen=True)
class TlsFiles:
    """One side's PEM files: its certificate chain and key, and the CA it checks the other side against.
    ``server_name`` (clients only) overrides the name the server's certificate must carry."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    server_name: str = ""

    @classmethod
    def of(cls, config: Any, prefix: str) -> TlsFiles:
        """The files of ``config``'s fields ``PREFIXcert``, ``PREFIXkey``, ``PREFIXca`` (and ``PREFIXserver_name``
        when it has one), e.g. ``TlsFiles.of(config, "broker_tls_")``."""
        return cls(cert=_path(getattr(config, prefix + "cert")), key=_path(getattr(config, prefix + "key")),
                   ca=_path(getattr(config, prefix + "ca")),
                   server_name=str(getattr(config, prefix + "server_name", "")))

    @property
    def enabled(self) -> bool:
        return any(p is not None for p in (self.cert, self.key, self.ca))

    @property
    def mutual(self) -> bool:
        """A server that requires client certificates (all three files)."""
        return self.cert is not None and self.key is not None and self.ca is not None

    def read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(cert, key, ca) bytes, None where not set."""
        def read(path: Path | None) -> bytes | None:
            return path.read_bytes() if path is not None else None

        return read(self.cert), read(self.key), read(self.ca)

    # gRPC.

    def server_credentials(self) -> Any:
        """``grpc.ServerCredentials``: TLS with this cert and key; with a CA, client certificates required."""
        import grpc

        cert, key, ca = self.read()
        assert cert is not None and key is not None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> Any:
        """``grpc.ChannelCredentials`` of a client: trust ``ca`` (or the system roots), present cert and key."""
        import grpc

        cert, key, ca = self.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    # HTTP (the router).

    def server_ssl_context(self) -> ssl.SSLContext:
        """An ``ssl.SSLContext`` for an HTTPS server; with a CA, a client certificate signed by it is required."""
        assert self.cert is not None and self.key is not None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        if self.ca is not None:
            context.load_verify_locations(cafile=str(self.ca))
            context.verify_mode = ssl.CERT_REQUIRED
        return context


def bearer_interceptors(token: str) -> list[Any]:
    """``grpc.aio`` client interceptors that add ``authorization: Bearer <token>`` to every call of a channel (one
    per call shape: grpc.aio files an interceptor under its first matching kind only)."""
    import grpc

    from kvloop.shared.auth import METADATA_KEY

    pair = (METADATA_KEY, f"Bearer {token}")

    def details(d: Any) -> Any:
        metadata = grpc.aio.Metadata(*tuple(d.metadata or ()))
        metadata.add(*pair)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Any, d: Any, request: Any) -> Any:
            return await continuation(details(d), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation: Any, d: Any, request: Any) -> Any:
            return await continuation(details(d), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation: Any, d: Any, requests: Any) -> Any:
            return await continuation(details(d), requests)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation: Any, d: Any, requests: Any) -> Any:
            return await continuation(details(d), requests)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]


def insecure_or_secure_channel(address: str, tls: TlsFiles | None, options: Sequence[tuple[str, Any]] = (),
                               token: str | None = None) -> Any:
    """A ``grpc.aio`` channel to ``address``: TLS when ``tls`` is enabled, plaintext otherwise; with ``token``, every
    call carries it as a bearer credential (:mod:`kvloop.shared.auth`)."""
    import grpc

    interceptors = bearer_interceptors(token) if token else None
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()],
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


def _check_pem(path: Path, field: str, mark: bytes, what: str) -> None:
    if not path.is_file():
        raise ConfigError(f"{field}: no such file (got {str(path)!r})", field=field)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc.strerror}", field=field) from None
    if mark not in data:
        raise ConfigError(f"{field}: {path} holds no PEM {what}", field=field)
    if mark == _CERT_MARK:
        try:
            ssl.create_default_context().load_verify_locations(cafile=str(path))
        except ssl.SSLError as exc:
            raise ConfigError(f"{field}: {path} is not a valid PEM certificate ({exc.reason or exc})",
                              field=field) from None


def check_files(config: Any, prefix: str, *, server: bool) -> None:
    """Validate the TLS fields ``PREFIXcert``/``PREFIXkey``/``PREFIXca`` of ``config``; ``ConfigError`` names the
    bad field. A server needs cert and key together (a CA alone cannot serve); a client may set only a CA
    (verify the server, present nothing) but a cert needs its key and a key its cert."""
    cert_f, key_f, ca_f = prefix + "cert", prefix + "key", prefix + "ca"
    files = TlsFiles.of(config, prefix)
    if server and files.ca is not None and files.cert is None:
        raise ConfigError(f"{cert_f}: required with {ca_f} (a server needs its own certificate and key)",
                          field=cert_f)
    if (files.cert is None) != (files.key is None):
        missing, other = (key_f, cert_f) if files.key is None else (cert_f, key_f)
        raise ConfigError(f"{missing}: required with {other}", field=missing)
    if files.cert is not None and files.key is not None:
        _check_pem(files.cert, cert_f, _CERT_MARK, "certificate")
        _check_pem(files.key, key_f, _KEY_MARK, "private key")
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(files.cert, files.key)
        except ssl.SSLError as exc:
            raise ConfigError(f"{key_f}: does not match {cert_f}, or is not an unencrypted PEM private key "
                              f"({exc.reason or exc})", field=key_f) from None
    if files.ca is not None:
        _check_pem(files.ca, ca_f, _CERT_MARK, "CA certificate")


def peer_names(context: Any) -> frozenset[str]:
    """The names a gRPC caller's verified certificate carries (subject CN and every SAN); empty without one."""
    auth = context.auth_context() or {}
    names: set[str] = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for raw in auth.get(key, ()):
            names.add(raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw))
    return frozenset(names)
