"""The shared vocabulary: every path, reason, veto and fallback documented, and the proto's Decision the same paths."""

from __future__ import annotations

from pathlib import Path as FilePath

import pytest

from kvloop.broker.core import Decision
from kvloop.shared.vocabulary import NO_PLAN, Fallback, Path, Reason, Veto
from kvloop.v1 import broker_pb2 as pb

ARCHITECTURE = (FilePath(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()


@pytest.mark.parametrize("word", [*Path, *Reason, *Veto, *Fallback], ids=str)
def test_every_word_is_documented(word: str) -> None:
    assert f"`{word}`" in ARCHITECTURE, f"{word!r} is not documented in docs/architecture.md"


def test_the_wire_decisions_are_the_paths() -> None:
    wire = {name.removeprefix("DECISION_") for name in pb.Decision.DESCRIPTOR.values_by_name} - {"UNSPECIFIED"}
    assert wire == {p.value for p in Path} and Decision is Path


def test_the_words_are_their_strings() -> None:
    assert Reason.LOCAL_PREFIX == "local_prefix" and f"{Veto.DECODE_BUSY}" == "decode_busy"
    assert set(Fallback) > NO_PLAN
