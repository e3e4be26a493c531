"""Who may open an ext_proc stream on the endpoint picker. Pure.

Two ways to be let in, either enough:

- **The token** (``ext_proc_token_file``): the gateway sends ``authorization: Bearer TOKEN`` as gRPC metadata
  (Envoy's ``grpc_service.initial_metadata``, as ``kvloop up --gateway`` and the tests configure it).
- **The mesh's word** (``ext_proc_mesh_callers``): a gateway that a mesh runs (Istio's, configured from an
  InferencePool) cannot be told to send a token, but its calls reach the picker through the picker's own mesh
  sidecar, which checks the caller's certificate (mutual TLS, STRICT) and states its identity in
  ``x-forwarded-client-cert`` (Istio's inbound sidecars replace whatever the caller sent:
  ``forward_client_cert_details: SANITIZE_SET``). The picker admits the SPIFFE ids listed. Only sound where every
  connection to the port passes that sidecar, as the Istio overlay arranges; anywhere else a caller could write
  the header itself, so the setting's help and docs/gateway.md say so.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

XFCC = "x-forwarded-client-cert"


def split_outside_quotes(text: str, sep: str) -> list[str]:
    """``text`` cut at each ``sep`` that is not inside double quotes (XFCC quotes a Subject holding , or ;)."""
    parts: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == sep and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return parts


def nearest_uri(xfcc: str) -> str:
    """The URI (a SPIFFE id) of the element the nearest proxy added to ``x-forwarded-client-cert``; "" when none.

    Proxies append, so the last element is the one the picker's own sidecar wrote."""
    elements = [e for e in split_outside_quotes(xfcc, ",") if e.strip()]
    if not elements:
        return ""
    for pair in split_outside_quotes(elements[-1], ";"):
        key, _, value = pair.strip().partition("=")
        if key.lower() == "uri":
            return value.strip().strip('"')
    return ""


class CallerCheck:
    """The picker's door: the token, the mesh's listed identities, or (development only) anyone."""

    def __init__(self, token: bytes | None, mesh_callers: Iterable[str] = ()) -> None:
        self.token = token
        self.mesh_callers = frozenset(mesh_callers)

    @property
    def open(self) -> bool:
        return self.token is None and not self.mesh_callers

    def refusal(self, metadata: dict[str, str]) -> str:
        """Why a stream with this gRPC metadata is refused; "" when it is let in."""
        if self.open:
            return ""
        sent = metadata.get("authorization", "")
        if self.token is not None and hmac.compare_digest(sent.encode(), b"Bearer " + self.token):
            return ""
        if self.mesh_callers and nearest_uri(metadata.get(XFCC, "")) in self.mesh_callers:
            return ""
        wanted = []
        if self.token is not None:
            wanted.append("'authorization: Bearer <token>' metadata, the token of ext_proc_token_file")
        if self.mesh_callers:
            wanted.append("a mesh identity of ext_proc_mesh_callers in x-forwarded-client-cert")
        return "authorization: the picker wants " + " or ".join(wanted)
