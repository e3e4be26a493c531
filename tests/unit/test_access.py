"""The broker's authorization tables (broker/access.py) and the launcher's TLS pass-through to the sidecar."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvloop.broker.access import CLIENT_RPCS, ENGINE_RPCS, LEASE_RPCS, Access
from kvloop.broker.config import BrokerConfig
from kvloop.engines.config import EngineConfig
from kvloop.engines.sidecar import SidecarConfig
from kvloop.shared.errors import PermissionDenied
from kvloop.v1 import broker_pb2 as pb


def test_every_broker_rpc_is_classified_once() -> None:
    methods = set(pb.DESCRIPTOR.services_by_name["KVBroker"].methods_by_name)
    tables = [set(ENGINE_RPCS), set(LEASE_RPCS), set(CLIENT_RPCS)]
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
    a.enabled = True  # as with tls_cert, tls_key and tls_ca set
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
    with pytest.raises(PermissionDenied, match="not open to any certificate"):
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
