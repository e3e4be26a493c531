"""The header names in one module: the router writes exactly those, spelled as they always were on the wire."""

from __future__ import annotations

from kvloop.router.config import RouterConfig
from kvloop.router.directory import Directory
from kvloop.router.outcome import Turn
from kvloop.router.plan import Placement, plan_turn
from kvloop.router.server import decision_headers, measured_comment
from kvloop.shared import headers as hdr
from kvloop.shared.http import sse_measured
from kvloop.shared.protocol import PrefillReport
from kvloop.v1 import broker_pb2 as pb

REQUEST_HEADERS = {"SESSION_ID": "x-session-id", "SESSION_PAUSE": "x-session-pause-s", "SESSION_END": "x-session-end",
                   "SESSION_PRIORITY": "x-session-priority", "SESSION_KEEP_GENERATED": "x-session-keep-generated"}
"""What a client sends (docs/sessions.md): its session and its hints."""
REPLY_HEADERS = {name: value for name, value in vars(hdr).items()
                 if name.isupper() and name != "PREFIX" and name not in REQUEST_HEADERS}

WIRE = {  # the spelling clients have always read: changing one breaks them
    "x-kvloop-decision", "x-kvloop-planned", "x-kvloop-reason", "x-kvloop-decode-local-veto",
    "x-kvloop-plan-outcome", "x-kvloop-measured", "x-kvloop-prefill-engine", "x-kvloop-decode-engine",
    "x-kvloop-timing", "x-kvloop-prompt-tokens", "x-kvloop-available-tokens", "x-kvloop-matched-tokens",
    "x-kvloop-pulled-tokens", "x-kvloop-local-tokens", "x-kvloop-computed-tokens", "x-kvloop-pull-ms",
    "x-kvloop-engine-request",
}


def a_turn() -> Turn:
    d = Directory(RouterConfig(broker="127.0.0.1:1"))
    d.update(pb.InspectResponse(engines=[pb.EngineStatus(engine=pb.Engine(
        engine_id=eid, role=role, block_size=4, layout_fingerprint="fp",
        addresses=pb.EngineAddresses(http=f"http://{eid}"))) for eid, role in (
            ("p0", pb.ENGINE_ROLE_PREFILL), ("d0", pb.ENGINE_ROLE_DECODE))]), now=0.0)
    plan = pb.Plan(decision=pb.DECISION_TRANSFER, reason="transfer_cheaper", decode_local_veto="decode_busy",
                   prefill_engine_id="p0", decode_engine_id="d0", matched_tokens=8, pull_tokens=8)
    turn = Turn(body={}, plan=plan_turn(d, "chat", "s", "m", 16, Placement(plan)), span=None, started=0.0)
    turn.outcome.prefill_engine = "p0"
    turn.outcome.report = PrefillReport(pulled_tokens=8, computed_tokens=8)
    return turn


def test_the_names_are_the_wire_spelling_once_each() -> None:
    assert set(REPLY_HEADERS.values()) == WIRE and len(REPLY_HEADERS) == len(WIRE)
    assert all(name.startswith(hdr.PREFIX) and name == name.lower() for name in WIRE)
    assert {name: getattr(hdr, name) for name in REQUEST_HEADERS} == REQUEST_HEADERS
    assert hdr.field("X-Kvloop-Pulled-Tokens") == "pulled-tokens" and hdr.header("pulled-tokens") == hdr.PULLED_TOKENS
    assert hdr.of_reply({"X-Kvloop-Decision": "TRANSFER", "content-type": "x"}) == {"decision": "TRANSFER"}


def test_the_router_writes_these_headers_and_their_words() -> None:
    turn = a_turn()
    headers = decision_headers(turn)
    assert set(headers) == WIRE
    assert (headers[hdr.DECISION], headers[hdr.PLANNED], headers[hdr.REASON], headers[hdr.DECODE_LOCAL_VETO],
            headers[hdr.PLAN_OUTCOME], headers[hdr.MEASURED]) == (
        "TRANSFER", "TRANSFER", "transfer_cheaper", "decode_busy", "as_planned", "true")
    comment = measured_comment(turn).decode()
    measured = sse_measured(comment.strip())
    assert measured is not None
    assert {hdr.header(k) for k in measured} == WIRE - {hdr.REASON, hdr.DECODE_LOCAL_VETO, hdr.PREFILL_ENGINE,
                                                          hdr.DECODE_ENGINE, hdr.TIMING, hdr.ENGINE_REQUEST}
    assert measured["decision"] == "TRANSFER" and measured["pulled-tokens"] == 8
