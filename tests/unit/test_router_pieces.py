"""Pure pieces of the router and the turn protocol: request validation, the engine directory, the prefill's
transfer params, the CompleteTransfer report, short socket paths, the router's config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvloop.engines.launcher import pick_port, rpc_dir, short_path
from kvloop.router.config import RouterConfig
from kvloop.router.directory import Directory
from kvloop.router.server import validate
from kvloop.router.turn import TurnError
from kvloop.shared.client import complete_request, transfer_params
from kvloop.shared.errors import ConfigError
from kvloop.shared.protocol import BANDWIDTH_SAMPLE_MIN_BYTES, LEASE_READ_PREFIX, PrefillReport
from kvloop.shared.vocabulary import Role
from kvloop.v1 import broker_pb2 as pb

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("kind", "body", "status", "param"), [
    ("chat", [], 400, None),
    ("chat", {"messages": CHAT["messages"]}, 400, "model"),
    ("chat", {**CHAT, "model": "other"}, 404, "model"),
    ("chat", {**CHAT, "messages": []}, 400, "messages"),
    ("chat", {**CHAT, "messages": [{"content": "no role"}]}, 400, "messages"),
    ("chat", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": True}, 400, "max_tokens"),
    ("chat", {**CHAT, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("chat", {**CHAT, "n": 3}, 400, "n"),
    ("chat", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("completion", {"model": "m", "prompt": ""}, 400, "prompt"),
    ("completion", {"model": "m", "prompt": [1, -2]}, 400, "prompt"),
    ("completion", {"model": "m", "prompt": [1, True]}, 400, "prompt"),
])
def test_validate_refuses_with_openai_errors(kind: str, body: Any, status: int, param: str | None) -> None:
    with pytest.raises(TurnError) as info:
        validate(kind, body, "m")
    assert info.value.status == status and info.value.param == param
    error = info.value.body()["error"]
    assert error["code"] == status and error["type"] == "invalid_request_error" and error["message"]


def test_validate_accepts_good_requests() -> None:
    assert validate("chat", {**CHAT, "stream": True, "max_tokens": 5}, "m")["stream"] is True
    assert validate("completion", {"model": "x", "prompt": [1, 2, 3]}, "")["prompt"] == [1, 2, 3]
    assert validate("completion", {"model": "x", "prompt": "text"}, "")


def inspect_reply(*engines: tuple[str, int, str]) -> pb.InspectResponse:
    return pb.InspectResponse(engines=[pb.EngineStatus(engine=pb.Engine(
        engine_id=eid, role=role, block_size=128, layout_fingerprint="fp",
        addresses=pb.EngineAddresses(http=url, nixl="127.0.0.1:5600"))) for eid, role, url in engines])


def test_directory_prefers_the_broker_list_and_round_robins() -> None:
    config = RouterConfig(broker="127.0.0.1:1", prefill_urls="http://static-p:1", decode_urls="http://static-d:1")
    d = Directory(config)
    assert [e.http for e in d.of_role(Role.PREFILL)] == ["http://static-p:1"]  # nothing learned yet
    assert d.layout() is None
    d.update(inspect_reply(("p1", pb.ENGINE_ROLE_PREFILL, "http://p1:8000"), ("p2", pb.ENGINE_ROLE_PREFILL,
                                                                              "http://p2:8000/"),
                           ("d1", pb.ENGINE_ROLE_DECODE, "http://d1:8000"), ("b1", pb.ENGINE_ROLE_BOTH, "http://b1:1")),
             now=0.0)
    assert {e.engine_id for e in d.of_role(Role.PREFILL)} == {"p1", "p2", "b1"}
    assert {e.engine_id for e in d.of_role(Role.DECODE)} == {"d1", "b1"}
    picks = {d.pick(Role.PREFILL).engine_id for _ in range(6)}  # type: ignore[union-attr]
    assert picks == {"p1", "p2", "b1"}
    assert d.pick(Role.DECODE, exclude={"d1", "b1"}) is None
    # Alternating picks of the two roles still spread over both decode engines (one counter per role).
    decodes = set()
    for _ in range(4):
        d.pick(Role.PREFILL)
        decodes.add(d.pick(Role.DECODE).engine_id)  # type: ignore[union-attr]
    assert decodes == {"d1", "b1"}
    assert d.engines["p2"].http == "http://p2:8000" and d.layout() == ("fp", 128)


def test_directory_places_each_model_with_its_own_engines_and_layout() -> None:
    """Two models behind one router, and a registration of a made-up layout that names no model (issue 13: the
    router used the first engine's layout for every request)."""
    def engine(eid: str, role: int, fp: str, model: str, bs: int = 128) -> pb.EngineStatus:
        return pb.EngineStatus(engine=pb.Engine(engine_id=eid, role=role, block_size=bs, layout_fingerprint=fp,
                                                model=model, addresses=pb.EngineAddresses(http=f"http://{eid}:1")))

    d = Directory(RouterConfig(broker="127.0.0.1:1"))
    d.update(pb.InspectResponse(engines=[
        engine("bogus", pb.ENGINE_ROLE_DECODE, "made-up", "", bs=4096),
        engine("a-p", pb.ENGINE_ROLE_PREFILL, "fp-a", "model-a"),
        engine("a-d", pb.ENGINE_ROLE_DECODE, "fp-a", "model-a"),
        engine("b-p", pb.ENGINE_ROLE_PREFILL, "fp-b", "model-b", 16),
        engine("b-d", pb.ENGINE_ROLE_DECODE, "fp-b", "model-b", 16)]), now=0.0)
    assert d.layout("model-a") == ("fp-a", 128) and d.layout("model-b") == ("fp-b", 16)
    assert {e.engine_id for e in d.of_role(Role.PREFILL, "model-a")} == {"a-p"}
    assert {e.engine_id for e in d.of_role(Role.DECODE, "model-b")} == {"b-d", "bogus"}  # said nothing: any model
    assert d.models() == {"model-a", "model-b"} and d.knows("model-a") and d.knows("model-c")  # bogus serves any
    d.update(pb.InspectResponse(engines=[engine("a-p", pb.ENGINE_ROLE_PREFILL, "fp-a", "model-a")]), now=1.0)
    assert not d.knows("model-c") and d.layout("model-c") is None and d.of_role(Role.PREFILL, "model-c") == []
    assert d.of_role(Role.DECODE, "model-a") == []  # the broker lists no decode engine: the configured URLs (none)


def test_an_engine_the_broker_stops_listing_stays_a_last_resort_for_a_while() -> None:
    d = Directory(RouterConfig(broker="127.0.0.1:1", unlisted_grace_s=30.0))
    both = inspect_reply(("d1", pb.ENGINE_ROLE_DECODE, "http://d1:1"), ("d2", pb.ENGINE_ROLE_DECODE, "http://d2:1"),
                         ("p1", pb.ENGINE_ROLE_PREFILL, "http://p1:1"))
    d.update(both, now=0.0)
    assert d.last_resort(Role.DECODE) == []
    # d2's sidecar restarts: the broker lists d1 and p1 only; d2 is a last resort, not a listed engine.
    d.update(inspect_reply(("d1", pb.ENGINE_ROLE_DECODE, "http://d1:1"), ("p1", pb.ENGINE_ROLE_PREFILL,
                                                                           "http://p1:1")), now=10.0)
    assert [e.engine_id for e in d.of_role(Role.DECODE)] == ["d1"] and d.pick(Role.DECODE).engine_id == "d1"  # type: ignore[union-attr]
    assert [e.engine_id for e in d.last_resort(Role.DECODE)] == ["d2"] and d.last_resort(Role.PREFILL) == []
    assert d.pick(Role.DECODE, exclude={"d1"}).engine_id == "d2"  # type: ignore[union-attr]  # every listed one failed
    d.update(inspect_reply(("p1", pb.ENGINE_ROLE_PREFILL, "http://p1:1")), now=11.0)  # d1 goes too, later
    assert [e.engine_id for e in d.last_resort(Role.DECODE)] == ["d1", "d2"]  # the latest first
    assert d.pick(Role.DECODE).engine_id == "d1"  # type: ignore[union-attr]  # none listed: a turn starts on one
    assert d.pick(Role.DECODE, exclude={"d1", "d2"}) is None
    d.update(both, now=20.0)  # listed again: no longer a last resort
    assert d.last_resort(Role.DECODE) == []
    d.update(inspect_reply(("p1", pb.ENGINE_ROLE_PREFILL, "http://p1:1")), now=30.0)
    assert len(d.last_resort(Role.DECODE)) == 2
    d.update(inspect_reply(("p1", pb.ENGINE_ROLE_PREFILL, "http://p1:1")), now=61.0)  # past the grace: forgotten
    assert d.last_resort(Role.DECODE) == [] and d.unlisted == {} and d.pick(Role.DECODE) is None
    never = Directory(RouterConfig(broker="127.0.0.1:1", unlisted_grace_s=0.0))
    never.update(both, now=0.0)
    never.update(inspect_reply(), now=1.0)
    assert never.last_resort(Role.DECODE) == []


def test_transfer_params_name_the_pinned_prefix() -> None:
    plan = pb.Plan(source_engine_id="dec", source_lease_id="L1", matched_blocks=2, matched_tokens=256,
                   source_addresses=pb.EngineAddresses(nixl="10.0.0.7:5601"))
    pin = pb.PinBlocksResponse(pin_id="P", block_ids=[7, 8, 9])
    params = transfer_params(plan, pin)
    assert params["remote_block_ids"] == [[7, 8]] and params["remote_num_tokens"] == 256
    assert params["remote_host"] == "10.0.0.7" and params["remote_port"] == 5601
    assert params["remote_request_id"] == LEASE_READ_PREFIX + "L1" and params["do_remote_decode"] is True


def test_complete_request_learns_bandwidth_only_from_big_pulls() -> None:
    pin = pb.PinBlocksResponse(pin_id="P")
    small = complete_request(pin, PrefillReport(pulled_bytes=1000, pull_ms=50.0, pull_failed=False))
    assert small.success and small.bytes == 1000 and small.duration_s == 0.0
    big = complete_request(pin, PrefillReport(pulled_bytes=BANDWIDTH_SAMPLE_MIN_BYTES, pull_ms=4.0, pull_failed=False))
    assert big.duration_s == pytest.approx(0.004)
    assert not complete_request(pin, PrefillReport(pulled_bytes=0, pull_failed=True)).success
    assert not complete_request(pin, None).success  # no report: the pull did not happen


def test_short_paths_fit_unix_sockets(tmp_path: Path) -> None:
    deep = Path("/tmp") / ("x" * 90) / "run" / "engine"
    assert len(str(rpc_dir(deep))) + 38 < 108 and str(rpc_dir(deep)).startswith("/tmp/kvloop-rpc-")
    assert rpc_dir(deep) == rpc_dir(deep) != rpc_dir(deep / "other")
    shallow = Path("/tmp/e")
    assert rpc_dir(shallow) == shallow / "rpc" and short_path(shallow / "s.sock", 0, "k") == shallow / "s.sock"


def test_picked_ports_are_never_handed_out_twice() -> None:
    # Each pick only probes that a port is free now; the engines bind theirs much later, so a process's picks
    # must differ among themselves (a chaos cluster once gave one port to a vLLM server and a metrics server).
    picks = [pick_port() for _ in range(150)]
    assert len(set(picks)) == len(picks)
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    assert all(p < low for p in picks)


def test_router_config_names_the_bad_field() -> None:
    with pytest.raises(ConfigError, match=r"^broker"):
        RouterConfig.load({}, env={})
    with pytest.raises(ConfigError, match=r"^decode_urls"):
        RouterConfig.load({}, env={"KVLOOP_ROUTER_PREFILL_URLS": "http://p:1", "KVLOOP_ROUTER_DECODE_URLS": "d:1"})
    with pytest.raises(ConfigError, match=r"^broker_timeout_s"):
        RouterConfig.load({}, env={"KVLOOP_ROUTER_BROKER": "127.0.0.1:1", "KVLOOP_ROUTER_BROKER_TIMEOUT_S": "0"})
    assert RouterConfig.load({}, env={"KVLOOP_ROUTER_BROKER": "127.0.0.1:1"}).listen == "127.0.0.1:8080"
    with pytest.raises(ConfigError, match=r"^residual_samples"):
        RouterConfig.load({}, env={"KVLOOP_ROUTER_BROKER": "127.0.0.1:1", "KVLOOP_ROUTER_RESIDUAL_SAMPLES": "2"})
    with pytest.raises(ConfigError, match=r"^residual_window_s"):
        RouterConfig.load({}, env={"KVLOOP_ROUTER_BROKER": "127.0.0.1:1", "KVLOOP_ROUTER_RESIDUAL_WINDOW_S": "-1"})
    with pytest.raises(ConfigError, match=r"^tokenizer_sessions"):
        RouterConfig.load({}, env={"KVLOOP_ROUTER_BROKER": "127.0.0.1:1", "KVLOOP_ROUTER_TOKENIZER_SESSIONS": "-1"})


def test_recent_turns_expect_the_longest_answered_prompt_this_one_extends() -> None:
    from kvloop.router.recent import RecentTurns

    keys = [bytes([i]) * 32 for i in range(10)]
    recent = RecentTurns(window_s=0.5)
    assert recent.expected(keys, now=0.0) == (0, 0.0)
    recent.answered(keys[:3], now=1.0)
    recent.answered(keys[:6], now=1.2)
    assert recent.expected(keys, now=1.3) == (6, 1.7)  # the longer answered prompt wins
    assert recent.expected(keys[:5], now=1.3) == (3, 1.5)  # does not reach the second prompt's last block
    edited = keys[:2] + [b"x" * 32] * 5  # diverges before either answered prompt ends: nothing is due
    assert recent.expected(edited, now=1.3) == (0, 1.3)
    assert recent.expected(keys, now=1.65) == (6, 1.7)
    assert recent.expected(keys, now=1.8) == (0, 1.8) and len(recent) == 0  # both windows have passed


def test_recent_turns_key_position_must_match_and_capacity_holds() -> None:
    from kvloop.router.recent import RecentTurns

    keys = [bytes([i]) * 32 for i in range(4)]
    recent = RecentTurns(window_s=1.0, capacity=2)
    recent.answered(keys[:2], now=0.0)
    # The same key at another position is another prompt (chained keys make this practically impossible, but the
    # block count is checked all the same).
    assert recent.expected([keys[1]], now=0.1) == (0, 0.1)
    recent.answered(keys[:3], now=0.1)
    recent.answered(keys[:4], now=0.2)
    assert len(recent) == 2 and recent.expected(keys[:2], now=0.3) == (0, 0.3)  # the oldest was dropped
    assert RecentTurns(window_s=0).expected(keys, now=0.0) == (0, 0.0)


def test_a_tokenizer_that_cannot_load_is_a_config_error_naming_the_field(tmp_path: Path) -> None:
    from kvloop.router.tokenizer import RouterTokenizer  # imports transformers: only here

    with pytest.raises(ConfigError) as exc:
        RouterTokenizer(str(tmp_path / "no-such-model"))
    assert exc.value.field == "tokenizer" and "no-such-model" in exc.value.message


def test_the_prompt_length_that_decides_where_the_router_tokenizes() -> None:
    from kvloop.router.turn import prompt_chars

    assert prompt_chars({"prompt": "abc"}) == 3
    assert prompt_chars({"messages": [{"role": "user", "content": "ab"}, {"role": "x", "content": "cde"}]}) == 5
    # Content parts and odd shapes count nothing here: the tokenizer then hands the request to an engine anyway.
    assert prompt_chars({"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}, "x"]}) == 0
    assert prompt_chars({"prompt": [1, 2, 3]}) == 0 and prompt_chars({}) == 0
