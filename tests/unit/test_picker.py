"""The endpoint picker's pure parts (router.picker): the destination as the gateway spells it, the gateway's subset,
the answer's shape (the destination in the header and the metadata alike, the body in bounded chunks), refusals in
OpenAI's shape, and the config's rule that the picker checks its caller."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import struct_pb2

from kvloop.app.gateway import envoy_config
from kvloop.router.config import RouterConfig
from kvloop.router.errors import TurnError
from kvloop.router.picker import (
    BODY_CHUNK,
    DESTINATION,
    LB_NAMESPACE,
    SUBSET,
    SUBSET_NAMESPACE,
    endpoint_of,
    immediate,
    pick_responses,
    subset_of,
)
from kvloop.shared.errors import ConfigError
from kvloop.v1 import ext_proc_pb2 as ep


def test_an_engines_url_is_a_host_and_port() -> None:
    assert endpoint_of("http://10.0.0.7:8000") == "10.0.0.7:8000"
    assert endpoint_of("http://engine-0.svc") == "engine-0.svc:80"
    assert endpoint_of("https://[fd00::1]:8443/") == "[fd00::1]:8443"


def test_the_gateways_subset_is_read_from_its_metadata() -> None:
    request = ep.ProcessingRequest()
    assert subset_of(request) is None
    hint = struct_pb2.Struct()
    hint.update({SUBSET: ["10.0.0.1:8000", "10.0.0.2:8000"]})
    request.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    assert subset_of(request) == {"10.0.0.1:8000", "10.0.0.2:8000"}


def test_the_answer_names_one_destination_twice_and_streams_the_body_in_chunks() -> None:
    body = {"model": "m", "prompt": "x" * (2 * BODY_CHUNK + 5)}
    headers, *chunks = pick_responses("10.0.0.9:8000", body)
    mutation = headers.request_headers.response.header_mutation.set_headers
    assert {h.header.key: h.header.raw_value.decode() for h in mutation}[DESTINATION] == "10.0.0.9:8000"
    assert headers.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value == \
        "10.0.0.9:8000"
    assert headers.request_headers.response.clear_route_cache
    parts = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert len(parts) == 3 and all(len(p.body) <= BODY_CHUNK for p in parts)
    assert [p.end_of_stream for p in parts] == [False, False, True]
    assert json.loads(b"".join(p.body for p in parts)) == body


def test_a_refusal_is_an_openai_error_envoy_answers_itself() -> None:
    reply = immediate(TurnError(400, "max_tokens: must be a positive integer", "invalid_request_error",
                                "max_tokens")).immediate_response
    assert reply.status.code == 400 and json.loads(reply.body)["error"]["param"] == "max_tokens"


def test_the_picker_checks_its_caller_unless_opened_for_development(tmp_path: Path) -> None:
    base = {"broker": "127.0.0.1:1", "ext_proc_listen": "127.0.0.1:0"}
    with pytest.raises(ConfigError) as err:
        RouterConfig(**base).validate()
    assert err.value.field == "ext_proc_token_file"
    RouterConfig(**base, dev_open_ext_proc=True).validate()
    (tmp_path / "short").write_text("abc")
    with pytest.raises(ConfigError):
        RouterConfig(**base, ext_proc_token_file=tmp_path / "short").validate()
    (tmp_path / "token").write_text("0123456789abcdef\n")
    assert RouterConfig(**base, ext_proc_token_file=tmp_path / "token").ext_proc_token() == b"0123456789abcdef"


def test_envoys_config_strips_the_destination_and_fails_closed() -> None:
    config = envoy_config("127.0.0.1:9002", "t" * 16)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in manager["http_filters"]]
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    assert manager["http_filters"][0]["typed_config"]["mutations"]["request_mutations"] == [{"remove": DESTINATION}]
    ext_proc = manager["http_filters"][1]["typed_config"]
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["grpc_service"]["initial_metadata"] == [{"key": "authorization", "value": "Bearer " + "t" * 16}]


def test_the_bootstrap_command_makes_the_token_once_and_refuses_a_short_one(tmp_path: Path) -> None:
    """``kvloop gateway config``: a token made where there is none (owner-only), kept on the next run, its bootstrap
    sending it; a picker by host name is looked up, by address taken as it is."""
    import argparse

    import yaml

    from kvloop.app.gateway import write_bootstrap

    def run(picker: str, token_file: Path) -> dict[str, Any]:
        args = argparse.Namespace(picker=picker, listen="0.0.0.0:8081", admin="127.0.0.1:9901",
                                  token_file=str(token_file), out=str(tmp_path / "envoy.yaml"), owner="")
        assert write_bootstrap(args) == 0
        assert (tmp_path / "envoy.yaml").stat().st_mode & 0o077 == 0
        return dict(yaml.safe_load((tmp_path / "envoy.yaml").read_text()))

    token_file = tmp_path / "secret" / "token"
    first = run("router:9002", token_file)
    token = token_file.read_text().strip()
    assert len(token) >= 16 and token_file.stat().st_mode & 0o077 == 0
    picker = first["static_resources"]["clusters"][1]
    assert picker["type"] == "STRICT_DNS"
    assert first["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] == 8081
    again = run("10.0.0.7:9002", token_file)
    assert token_file.read_text().strip() == token and again["static_resources"]["clusters"][1]["type"] == "STATIC"
    ext_proc = again["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "http_filters"][1]["typed_config"]
    assert ext_proc["grpc_service"]["initial_metadata"] == [{"key": "authorization", "value": f"Bearer {token}"}]
    token_file.write_text("short\n")
    with pytest.raises(ConfigError, match="token_file"):
        run("router:9002", token_file)
