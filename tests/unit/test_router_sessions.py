"""The router's reading of session hints (router.sessions): where a client may say them, which place wins, what is
taken from the body before the engines see it, and the field each refusal names."""

from __future__ import annotations

from typing import Any

import pytest

from kvloop.router.config import RouterConfig, key_tenant
from kvloop.router.sessions import SessionError, SessionHints, rest_hints, session_call
from kvloop.shared import headers as hdr
from kvloop.shared.errors import ConfigError


def test_headers_win_over_metadata_and_metadata_over_the_body() -> None:
    body: dict[str, Any] = {"session_id": "body", "user": "user",
                            "metadata": {"session_id": "meta", "session_pause_s": "7", "session_end": "false",
                                         "session_priority": "HIGH", "other": "x"}}
    call = session_call({hdr.SESSION_PAUSE: "40"}, body, "t1")
    assert (call.session_id, call.scoped_id, call.owner) == ("meta", "t1/meta", "t1")
    assert call.hints == SessionHints(pause_s=40.0, end=False, priority="high")
    assert body["metadata"] == {"other": "x"}  # the session keys never reach the engines
    call = session_call({hdr.SESSION_ID: "hdr"}, {"session_id": "body"}, "")
    assert (call.session_id, call.scoped_id, call.hints) == ("hdr", "hdr", None)


def test_the_body_and_user_name_a_session_without_hints_and_empty_metadata_goes() -> None:
    body: dict[str, Any] = {"user": "u-1", "metadata": {"session_keep_generated": "false", "session_id": "m"}}
    call = session_call({}, body, "t")
    assert call.session_id == "m" and call.hints == SessionHints(keep_generated=False)
    assert "metadata" not in body
    assert session_call({}, {"user": "u-1"}, "t").scoped_id == "t/u-1"
    assert session_call({}, {}, "t").session_id == ""


@pytest.mark.parametrize(("headers", "body", "field"), [
    ({hdr.SESSION_ID: "s", hdr.SESSION_PAUSE: "-1"}, {}, hdr.SESSION_PAUSE),
    ({hdr.SESSION_ID: "s", hdr.SESSION_PAUSE: "nan"}, {}, hdr.SESSION_PAUSE),
    ({}, {"metadata": {"session_id": "s", "session_pause_s": True}}, "metadata.session_pause_s"),
    ({hdr.SESSION_ID: "s", hdr.SESSION_END: "maybe"}, {}, hdr.SESSION_END),
    ({hdr.SESSION_ID: "s", hdr.SESSION_PRIORITY: "urgent"}, {}, hdr.SESSION_PRIORITY),
    ({hdr.SESSION_PAUSE: "5"}, {}, hdr.SESSION_ID),
    ({hdr.SESSION_ID: "x" * 201}, {}, hdr.SESSION_ID),
    ({}, {"session_id": 12}, "session_id"),
    ({}, {"metadata": ["session_id"]}, "metadata"),
])
def test_each_refusal_names_the_field_as_the_client_sent_it(headers: dict[str, str], body: dict[str, Any],
                                                             field: str) -> None:
    with pytest.raises(SessionError) as err:
        session_call(headers, body, "t")
    assert err.value.field == field


def test_the_rest_body_takes_only_hints() -> None:
    assert rest_hints({"pause_s": 3, "priority": "low"}) == SessionHints(pause_s=3.0, priority="low")
    for bad, field in (({}, "body"), ({"pause": 3}, "pause"), ("x", "body"), ({"end": True, "pause_s": 1}, "end")):
        with pytest.raises(SessionError) as err:
            rest_hints(bad)
        assert err.value.field == field


def test_api_keys_name_their_tenant_or_go_by_fingerprint(tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# rotation: two keys, one tenant\nk-old team-a\nk-new\tteam-a\nk-solo\n")
    config = RouterConfig(prefill_urls="http://p:1", decode_urls="http://d:1", api_key="k-env", api_key_file=keys)
    tenants = dict(config.api_key_tenants())
    assert tenants == {b"k-env": key_tenant("k-env"), b"k-old": "team-a", b"k-new": "team-a",
                       b"k-solo": key_tenant("k-solo")}
    assert "k-solo" not in key_tenant("k-solo") and key_tenant("k-solo") != key_tenant("k-env")
    keys.write_text("k-1 two words\n")
    with pytest.raises(ConfigError) as err:
        RouterConfig(prefill_urls="http://p:1", decode_urls="http://d:1", api_key_file=keys).validate()
    assert err.value.field == "api_key_file"
