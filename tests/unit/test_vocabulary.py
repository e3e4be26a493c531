"""The shared vocabulary: every path, reason, veto and fallback documented, the proto's Decision the same paths, the
broker's roles the same words, and the wire's strings decoded into members."""

from __future__ import annotations

from pathlib import Path as FilePath

import pytest

from kvloop.broker.core import Decision
from kvloop.broker.core import Role as BrokerRole
from kvloop.shared.vocabulary import (
    NO_PLAN,
    Fallback,
    Path,
    PlanOutcome,
    Reason,
    Role,
    Veto,
    reason_from_wire,
    veto_from_wire,
)
from kvloop.v1 import broker_pb2 as pb

ARCHITECTURE = (FilePath(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()


@pytest.mark.parametrize("word", [*Path, *Reason, *Veto, *Fallback], ids=str)
def test_every_word_is_documented(word: str) -> None:
    assert f"`{word}`" in ARCHITECTURE, f"{word!r} is not documented in docs/architecture.md"


def test_the_wire_decisions_are_the_paths() -> None:
    wire = {name.removeprefix("DECISION_") for name in pb.Decision.DESCRIPTOR.values_by_name} - {"UNSPECIFIED"}
    assert wire == {p.value for p in Path} and Decision is Path


def test_the_wire_roles_are_the_roles_and_the_brokers() -> None:
    wire = {name.removeprefix("ENGINE_ROLE_").lower() for name in pb.EngineRole.DESCRIPTOR.values_by_name}
    assert wire - {"unspecified"} == {r.value for r in Role} and BrokerRole is Role  # one definition


def test_the_words_are_their_strings() -> None:
    assert Reason.LOCAL_PREFIX == "local_prefix" and f"{Veto.DECODE_BUSY}" == "decode_busy"
    assert set(Fallback) > NO_PLAN
    assert [o.value for o in PlanOutcome] == ["as_planned", "other_path", "less_reused"]
    assert Role.PREFILL == "prefill" and f"{Role.BOTH}-0" == "both-0"


def test_the_wires_strings_decode_into_members_and_unknown() -> None:
    assert reason_from_wire("transfer_cheaper") is Reason.TRANSFER_CHEAPER
    assert reason_from_wire("a_newer_reason") is Reason.UNKNOWN and reason_from_wire("") is Reason.UNKNOWN
    assert veto_from_wire("step_full") is Veto.STEP_FULL and veto_from_wire("") == ""
    assert veto_from_wire("a_newer_veto") is Veto.UNKNOWN
    assert all(reason_from_wire(r.value) is r for r in Reason) and all(veto_from_wire(v.value) is v for v in Veto)
