"""BrokerClient's failover: UNAVAILABLE moves on to the next replica; with ``from_leader`` a follower's own (empty)
answer does too. Found by the compose cluster: broker-1 led, broker-0 answered the router's Inspect with no engines,
and the router stayed on it with an empty engine list (deploy/README.md)."""

from __future__ import annotations

from typing import Any

from kvloop.shared.client import BrokerClient
from kvloop.v1 import broker_pb2 as pb


class Stub:
    def __init__(self, leader: bool, engines: int) -> None:
        self.reply = pb.InspectResponse(leader=leader, replica_id=f"r-{leader}")
        for _ in range(engines):
            self.reply.engines.add()
        self.calls = 0

    async def Inspect(self, request: Any, **call: Any) -> pb.InspectResponse:
        self.calls += 1
        return self.reply


def client(*stubs: Stub) -> BrokerClient:
    c = BrokerClient(",".join(f"127.0.0.1:{1 + i}" for i in range(len(stubs))))
    c._stubs = list(stubs)  # type: ignore[assignment]
    return c


async def test_from_leader_skips_a_follower() -> None:
    follower, leader = Stub(False, 0), Stub(True, 3)
    c = client(follower, leader)
    reply = await c.call("Inspect", pb.InspectRequest(), from_leader=True)
    assert reply.leader and len(reply.engines) == 3
    # The leader is remembered: the next call goes to it first.
    await c.call("Inspect", pb.InspectRequest(), from_leader=True)
    assert follower.calls == 1 and leader.calls == 2


async def test_without_from_leader_the_first_answer_counts() -> None:
    c = client(Stub(False, 0), Stub(True, 3))
    assert not (await c.call("Inspect", pb.InspectRequest())).leader


async def test_no_leader_returns_a_followers_answer() -> None:
    c = client(Stub(False, 0), Stub(False, 0))
    reply = await c.call("Inspect", pb.InspectRequest(), from_leader=True)
    assert not reply.leader
