"""The broker's authentication and authorization (broker/access.py, kvloop/shared/auth.py) and the launcher's TLS
pass-through to the sidecar."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvloop.broker.access import ENGINE_RPCS, INSPECT_RPCS, LEASE_RPCS, ROUTER_RPCS, Access
from kvloop.broker.config import BrokerConfig
from kvloop.engines.config import EngineConfig
from kvloop.engines.sidecar import SidecarConfig
from kvloop.shared.auth import (
    ROLES,
    ClusterCredentials,
    Unauthenticated,
    mint,
    new_secret,
    read_secrets,
    verify,
    write_private,
)
from kvloop.shared.errors import ConfigError, PermissionDenied
from kvloop.v1 import broker_pb2 as pb


def test_every_broker_rpc_is_classified_once() -> None:
    methods = set(pb.DESCRIPTOR.services_by_name["KVBroker"].methods_by_name)
    tables = [set(ENGINE_RPCS), set(LEASE_RPCS), set(ROUTER_RPCS), set(INSPECT_RPCS)]
    assert set().union(*tables) == methods
    assert sum(len(t) for t in tables) == len(methods)


class Peer:
    def __init__(self, *names: str) -> None:
        self.names = names

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_common_name": [n.encode() for n in self.names[:1]],
                "x509_subject_alternative_name": [n.encode() for n in self.names]}


def access(**values: str) -> Access:
    a = Access(BrokerConfig(**values))
    a.enabled = a.mutual_tls = True  # as with tls_cert, tls_key and tls_ca set
    return a


def test_engine_identity_template_and_allow_list() -> None:
    keepalive = pb.KeepAliveRequest(engine_id="dec-1")
    owner = {"lease-1": "dec-1"}.get
    spiffe = access(engine_identity="spiffe://kvloop/engine/{engine_id}")
    spiffe.check("KeepAlive", keepalive, Peer("sidecar", "spiffe://kvloop/engine/dec-1"), owner)
    with pytest.raises(PermissionDenied, match=r"^engine_id: .* not 'spiffe://kvloop/engine/dec-1'"):
        spiffe.check("KeepAlive", keepalive, Peer("dec-1"), owner)
    listed = access(allowed_engines="dec-2")
    with pytest.raises(PermissionDenied, match="not in allowed_engines"):
        listed.check("KeepAlive", keepalive, Peer("dec-1"), owner)
    plain = access()
    plain.check("ReleaseLease", pb.ReleaseLeaseRequest(lease_id="lease-1"), Peer("dec-1"), owner)
    plain.check("ReleaseLease", pb.ReleaseLeaseRequest(lease_id="unknown"), Peer("x"), owner)  # the core: NOT_FOUND
    with pytest.raises(PermissionDenied, match=r"^lease_id: "):
        plain.check("RenewLease", pb.RenewLeaseRequest(lease_id="lease-1"), Peer("dec-2"), owner)
    plain.check("Place", pb.PlaceRequest(), Peer("anyone"), owner)  # client_identities empty: any certificate
    with pytest.raises(PermissionDenied, match="not open to any caller"):
        plain.check("Unknown", None, Peer("dec-1"), owner)
    admin = access(admin_identities="ops", client_identities="router")
    admin.check("KeepAlive", keepalive, Peer("ops"), owner)
    admin.check("Inspect", pb.InspectRequest(), Peer("router"), owner)
    with pytest.raises(PermissionDenied, match="client_identities"):
        admin.check("Inspect", pb.InspectRequest(), Peer("dec-1"), owner)


def test_access_is_off_without_mutual_tls() -> None:
    assert not Access(BrokerConfig()).enabled
    Access(BrokerConfig()).check("KeepAlive", pb.KeepAliveRequest(engine_id="x"), Peer(), lambda _: None)


def test_launcher_passes_tls_paths_to_the_sidecar(tmp_path: Path) -> None:
    config = EngineConfig(broker_tls_ca=Path("ca.crt"), broker_tls_cert=tmp_path / "e.crt",
                          broker_tls_key=tmp_path / "e.key", broker_tls_server_name="broker.kvloop",
                          sidecar_tls_cert=tmp_path / "s.crt", sidecar_tls_key=tmp_path / "s.key",
                          sidecar_tls_ca=tmp_path / "ca.crt")
    env = config.sidecar_tls_env()
    assert env["BROKER_TLS_CA"] == str(Path("ca.crt").absolute())  # the sidecar runs in the work directory
    assert env["BROKER_TLS_SERVER_NAME"] == "broker.kvloop" and env["TLS_CA"] == str(tmp_path / "ca.crt")
    known = {SidecarConfig.env_name(f.name) for f in SidecarConfig.fields()}
    assert {f"KVLOOP_SIDECAR_{k}" for k in env} <= known
    assert EngineConfig().sidecar_tls_env() == {}


class TokenCall:
    """A fake gRPC context carrying a bearer token and no certificate."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}


def token_access(tmp_path: Path) -> tuple[Access, bytes]:
    secret = tmp_path / "secret"
    write_private(secret, new_secret())
    return Access(BrokerConfig(auth_secret_file=secret), clock=lambda: 1000.0), read_secrets(secret)[0]


def test_tokens_name_a_role_and_an_engine_and_each_rpc_wants_its_own(tmp_path: Path) -> None:
    a, secret = token_access(tmp_path)
    owner = {"lease-1": "dec-1"}.get
    engine = TokenCall(mint(secret, "engine", "dec-1", 1000.0))
    router = TokenCall(mint(secret, "router", "router", 1000.0))
    operator = TokenCall(mint(secret, "operator", "ops", 1000.0))
    register = pb.RegisterEngineRequest(engine=pb.Engine(engine_id="dec-1"))
    assert a.check("RegisterEngine", register, engine, owner).roles == {"engine"}
    a.check("ReleaseLease", pb.ReleaseLeaseRequest(lease_id="lease-1"), engine, owner)
    with pytest.raises(PermissionDenied, match=r"^engine\.engine_id: .*not an engine token for 'dec-2'"):
        a.check("RegisterEngine", pb.RegisterEngineRequest(engine=pb.Engine(engine_id="dec-2")), engine, owner)
    with pytest.raises(PermissionDenied, match=r"^engine_id: .*a token for router 'router'"):
        a.check("KeepAlive", pb.KeepAliveRequest(engine_id="dec-1"), router, owner)
    with pytest.raises(PermissionDenied, match=r"^caller: Place is for routers; .*engine 'dec-1'"):
        a.check("Place", pb.PlaceRequest(), engine, owner)
    with pytest.raises(PermissionDenied, match=r"^caller: Inspect is for routers and operators"):
        a.check("Inspect", pb.InspectRequest(), engine, owner)
    assert not a.check("Inspect", pb.InspectRequest(), router, owner).full_view  # engines only
    assert a.check("Inspect", pb.InspectRequest(), operator, owner).full_view
    a.check("KeepAlive", pb.KeepAliveRequest(engine_id="dec-7"), operator, owner)  # operators: every call
    pool = TokenCall(mint(secret, "engine", "kvloop-prefill-*", 1000.0))  # a Deployment's pods
    a.check("KeepAlive", pb.KeepAliveRequest(engine_id="kvloop-prefill-7c9d"), pool, owner)
    with pytest.raises(PermissionDenied):
        a.check("KeepAlive", pb.KeepAliveRequest(engine_id="kvloop-decode-1"), pool, owner)
    for method, request in (("Place", pb.PlaceRequest()), ("PinBlocks", pb.PinBlocksRequest()),
                            ("CompleteTransfer", pb.CompleteTransferRequest())):
        a.check(method, request, router, owner)


def test_a_call_without_a_good_token_is_unauthenticated(tmp_path: Path) -> None:
    a, secret = token_access(tmp_path)
    register = pb.RegisterEngineRequest(engine=pb.Engine(engine_id="dec-1"))
    cases = {None: "no credential", "not-a-token": "not a kvloop token",
             mint(b"another cluster's secret, 32 bytes or more", "engine", "dec-1", 1000.0): "does not verify",
             mint(secret, "engine", "dec-1", 0.0, ttl_s=10): "has expired"}
    for token, why in cases.items():
        with pytest.raises(Unauthenticated, match=why):
            a.check("RegisterEngine", register, TokenCall(token), {}.get)


@given(role=st.sampled_from(ROLES), subject=st.text(min_size=1, max_size=40), now=st.floats(0, 2e9),
       ttl=st.floats(0, 1e6))
def test_a_minted_token_verifies_to_its_claims_and_any_change_breaks_it(role: str, subject: str, now: float,
                                                                         ttl: float) -> None:
    secret = b"s" * 64
    token = mint(secret, role, subject, now, ttl)
    claims = verify([b"old" * 20, secret], token, now)  # any secret of the file verifies (rotation)
    assert (claims.role, claims.subject, claims.issued_at) == (role, subject, int(now))
    head, body, mac = token.split(".")
    flipped = body[:-1] + ("A" if body[-1] != "A" else "B")
    with pytest.raises(Unauthenticated):
        verify([secret], f"{head}.{flipped}.{mac}", now)
    with pytest.raises(Unauthenticated):
        verify([b"t" * 64], token, now)


def test_the_broker_will_not_start_open_without_the_development_switch(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^auth_secret_file: the broker authenticates its callers"):
        BrokerConfig.load({}).require_auth()
    BrokerConfig.load({"dev_no_auth": True}).require_auth()
    short = tmp_path / "short"
    short.write_text("too short\n")
    with pytest.raises(ConfigError, match=r"^auth_secret_file: .*at least 32"):
        BrokerConfig.load({"auth_secret_file": str(short)})


def test_cluster_credentials_are_private_and_reminted_with_a_new_secret(tmp_path: Path) -> None:
    creds = ClusterCredentials(tmp_path / "auth", clock=5.0)
    path = creds.token_file("engine", "dec-1")
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(creds.secret_file.stat().st_mode & 0o777) == "0o600"
    assert verify(read_secrets(creds.secret_file), creds.token("engine", "dec-1"), 6.0).subject == "dec-1"
    creds.secret_file.unlink()
    again = ClusterCredentials(tmp_path / "auth", clock=5.0)
    assert verify(read_secrets(again.secret_file), again.token("engine", "dec-1"), 6.0).subject == "dec-1"
