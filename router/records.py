"""Per-turn records: one JSON line per finished turn, for ``kvloop analyze`` (off by default: ``records_path``).

A record carries what the analysis needs and nothing a user typed: lengths, the prompt's block keys as a digest
chain (each key's first ``KEY_HEX`` hex digits; keys are chained hashes, so two prompts share a prefix of
digests exactly when they share that prefix of blocks, up to a 64-bit collision), the plan and the path, the
engines' own token accounts, the pull, TTFT and the engines. Never token ids or text.

The line is written and flushed in the event loop: a few hundred bytes to a buffered file, no await, so a
crashed router loses at most the turn it was finishing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

from kvloop.shared.errors import ConfigError

RECORD_VERSION = 1
KEY_HEX = 16
"""Hex digits kept of each 32-byte block key (64 bits): enough to tell blocks apart in any one workload."""


@dataclass(frozen=True, slots=True)
class TurnRecord:
    t: float
    """Wall-clock seconds (Unix) when the turn arrived."""
    t_end: float
    """When it finished (the decode engine retains and publishes the turn then)."""
    session: str
    prompt_tokens: int
    block_size: int
    keys: tuple[str, ...]
    """The prompt's full blocks' keys, ``KEY_HEX`` hex digits each (empty: no layout was known)."""
    output_tokens: int = 0
    planned: str = ""
    """The broker's plan (``RECOMPUTE`` without one); "" for records made from conversations."""
    path: str = ""
    """The path the turn took by the engines' own accounts; "" when unknown."""
    reason: str = ""
    veto: str = ""
    """Why DECODE_LOCAL was not taken although the decode engine held the prefix ("" when taken or none held it)."""
    local_tokens: int = 0
    pulled_tokens: int = 0
    pulled_blocks: int = 0
    computed_tokens: int = 0
    pulled_bytes: int = 0
    pull_ms: float = 0.0
    ttft_ms: float | None = None
    """Time to the first token as the router saw it; None when not measured."""
    prefill_engine: str = ""
    decode_engine: str = ""
    model: str = ""
    error: str = ""
    v: int = RECORD_VERSION
    timings_ms: dict[str, float] = field(default_factory=dict)
    hints: dict[str, Any] = field(default_factory=dict)
    """What the client said of its session with this turn (``router.sessions.SessionHints.said``): sent to the
    broker as the turn ended."""
    prefetch: str = ""
    """Whether the broker had promoted the session's blocks before this turn and the plan used them ("used",
    "unused"; "" when there was no prefetch): the plan's ``prefetch``."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "record") -> TurnRecord:
        names = {f.name for f in fields(cls)}
        missing = [n for n in ("t", "t_end", "session", "prompt_tokens", "block_size", "keys") if n not in raw]
        if missing:
            raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}", field=missing[0])
        if raw.get("v", RECORD_VERSION) != RECORD_VERSION:
            raise ConfigError(f"{where}: record version {raw.get('v')!r}, expected {RECORD_VERSION}", field="v")
        try:
            record = cls(**{**{k: v for k, v in raw.items() if k in names}, "keys": tuple(raw["keys"])})
            checks = (("prompt_tokens", record.prompt_tokens >= 0), ("block_size", record.block_size >= 0),
                      ("t_end", float(record.t_end) >= float(record.t)),
                      ("keys", all(isinstance(k, str) and len(k) == KEY_HEX for k in record.keys)
                       and len(record.keys) * record.block_size <= record.prompt_tokens))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}", field="record") from None
        for name, ok in checks:
            if not ok:
                raise ConfigError(f"{where}: {name}: out of range or inconsistent", field=name)
        return record


def key_digests(keys: list[bytes]) -> tuple[str, ...]:
    return tuple(key.hex()[:KEY_HEX] for key in keys)


class RecordWriter:
    """Appends records to ``path`` (created with its folder; appended to if it exists)."""

    def __init__(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[str] = path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"records_path: cannot open {path}: {exc.strerror}", field="records_path") from None

    def write(self, record: TurnRecord) -> None:
        self._file.write(record.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def turn_record(turn: Any, *, now: float, elapsed_s: float, output_tokens: int, ttft_s: float,
                error: str, hints: dict[str, Any] | None = None) -> TurnRecord:
    """The record of a finished turn (``router.outcome.Turn``; typed ``Any`` so this module needs nothing of the
    turn's modules). ``now``: wall-clock seconds at the end; ``elapsed_s``: the turn's duration."""
    plan, report = turn.plan, turn.done
    return TurnRecord(
        t=round(now - elapsed_s, 6), t_end=round(now, 6), session=plan.session,
        prompt_tokens=plan.prompt_tokens, block_size=plan.block_size,
        keys=key_digests(list(plan.keys)), output_tokens=output_tokens, planned=plan.path,
        path=turn.path, reason=plan.reason, veto=plan.veto, local_tokens=report.local_tokens,
        pulled_tokens=report.pulled_tokens, pulled_blocks=report.pulled_blocks,
        computed_tokens=report.computed_tokens, pulled_bytes=report.pulled_bytes, pull_ms=report.pull_ms,
        ttft_ms=round(ttft_s * 1e3, 3), prefill_engine=turn.outcome.prefill_engine,
        decode_engine=turn.decode.engine_id, model=plan.model, error=error,
        timings_ms=dict(turn.outcome.timings_ms), hints=dict(hints or {}),
        prefetch=turn.plan.broker_plan.prefetch if turn.plan.broker_plan is not None else "")
