"""Mooncake's trace format, pure: one request a JSON line with ``timestamp`` (ms from the start), ``input_length``
and ``output_length`` (tokens) and ``hash_ids`` (the prompt's blocks, 512 tokens each in Mooncake's release; equal
ids at the same place are the same KV). Read by ``kvloop bench load --trace`` (which hands it to AIPerf) and
``kvloop analyze`` (which turns it into turn records), both with the same cut and scaling, so an analysis and a
load run of one trace see the same requests.

The trace names no sessions. :func:`conversations` infers them the way the format implies: a request continues the
latest earlier request whose blocks it repeats, all but that request's last (a partial block, which the next turn
extends), from the start, and at least two blocks of it (one shared block is a system prompt, not a conversation).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvloop.shared.errors import ConfigError
from kvloop.shared.hashing import common_prefix_blocks

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MOONCAKE_BLOCK = 512
"""Tokens per hash id in Mooncake's own traces."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps({"timestamp": int(self.timestamp_ms), "input_length": self.input_length,
                           "output_length": self.output_length, "hash_ids": list(self.hash_ids)})


def is_trace_line(raw: object) -> bool:
    return isinstance(raw, dict) and "hash_ids" in raw and "input_length" in raw


def parse_row(raw: object, where: str) -> TraceRow:
    """One line's request; a :class:`ConfigError` naming the line and the field when it is not one."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object", field="trace")
    missing = [f for f in FIELDS if f not in raw]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}", field=missing[0])
    stamp, ids = raw["timestamp"], raw["hash_ids"]
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or not math.isfinite(stamp) or stamp < 0:
        raise ConfigError(f"{where}: timestamp: expected milliseconds >= 0", field="timestamp")
    for name in ("input_length", "output_length"):
        value = raw[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}: {name}: expected a token count >= 0", field=name)
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{where}: hash_ids: expected a list of integers", field="hash_ids")
    return TraceRow(float(stamp), raw["input_length"], raw["output_length"], tuple(ids))


def parse_lines(lines: Sequence[str], where: str = "trace") -> list[TraceRow]:
    """Every non-blank line's request; a :class:`ConfigError` naming the first bad line."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{where}: line {n}: not JSON ({exc})", field="trace") from None
        out.append(parse_row(raw, f"{where}: line {n}"))
    return out


def scaled(rows: Sequence[TraceRow], *, length_scale: float, time_scale: float, seconds: float) -> list[TraceRow]:
    """The requests of the first ``seconds`` (of the trace's own clock), lengths times ``length_scale`` (at least
    one token) and timestamps times ``time_scale`` (3: three times slower). Hash ids are kept: with lengths and
    block size scaled together (512 -> 128 at 0.25) every block keeps its id."""
    return [TraceRow(int(r.timestamp_ms * time_scale), max(1, math.ceil(r.input_length * length_scale)),
                     max(1, math.ceil(r.output_length * length_scale)), r.hash_ids)
            for r in rows if r.timestamp_ms <= seconds * 1000]


def conversations(rows: Sequence[TraceRow]) -> list[int]:
    """Per row (in the given order, which must be arrival order), the index of the conversation it belongs to:
    the conversation of the latest earlier row it continues (see the module's docstring), else a new one."""
    by_first_two: dict[tuple[int, ...], list[int]] = {}
    latest: dict[int, int] = {}  # conversation -> its latest row
    out: list[int] = []
    for i, row in enumerate(rows):
        ids = row.hash_ids
        found = None
        for j in reversed(by_first_two.get(ids[:2], [])):
            earlier = rows[j].hash_ids
            continues = len(ids) >= len(earlier) and common_prefix_blocks(earlier, ids) >= max(2, len(earlier) - 1)
            if continues and latest[out[j]] == j:
                found = out[j]
                break
        conv = found if found is not None else len(latest)
        out.append(conv)
        latest[conv] = i
        if len(ids) >= 2:
            by_first_two.setdefault(ids[:2], []).append(i)
    return out
