"""What one engine costs, as figures a profiling bench can fit: the step time of continuous batching, the KV pool,
a NIXL pull, and the fixed costs of the router and the API server. Every figure is in seconds, tokens or bytes,
and every group of figures says where it came from (``source``), so that a prediction never rests on a guess it
does not name.

The step time is linear in its coefficients, so least squares over measured steps fits it directly::

    step_s = step_base_s
           + prefill_token_s * P + attention_token_s * A / 1000      (prefill chunks)
           + decode_stream_s * S + decode_context_s * C             (decode streams)

``P``: the step's prefill tokens; ``A``: the sum over its chunks of chunk tokens times the mean context each chunk
token attends to (its start position plus half the chunk), i.e. ``P * mean_context``; ``S``: decode streams in
the step; ``C``: their total context (prompt plus tokens generated). A pull of ``b`` blocks takes
``pull_latency_s + b * bytes_per_block / pull_bytes_per_s``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvloop.shared.errors import ConfigError

PROFILE_VERSION = 1

FIGURE_GROUPS: dict[str, tuple[str, ...]] = {
    "prefill": ("step_base_s", "prefill_token_s", "attention_token_s"),
    "decode": ("decode_stream_s", "decode_context_s"),
    "scheduler": ("max_num_batched_tokens", "max_num_seqs"),
    "pool": ("block_size", "kv_pool_blocks", "bytes_per_block"),
    "pull": ("pull_latency_s", "pull_bytes_per_s"),
    "router": ("router_turn_s",),
    "api": ("api_request_s",),
}
"""Each group of figures has one source: the figures of a group are measured (or published) together."""

SOURCE_KINDS = ("measured here:", "public:", "fitted:", "derived:", "fake:")
"""How a source begins: measured on this machine (the command, commit and machine follow), published (the URL or
paper follows), fitted or derived from other figures (how follows), or a test's fake."""

_POSITIVE = ("prefill_token_s", "pull_bytes_per_s", "max_num_batched_tokens", "max_num_seqs", "block_size",
             "kv_pool_blocks", "bytes_per_block")
"""Figures that cannot be zero: prefill is never free, a pull always moves bytes at some rate, and each count
bounds something that exists."""


@dataclass(frozen=True)
class EngineProfile:
    """One engine's costs (see the module's formula) and where each group of them came from."""

    name: str
    step_base_s: float
    prefill_token_s: float
    attention_token_s: float
    decode_stream_s: float
    decode_context_s: float
    max_num_batched_tokens: int
    """The step's token budget: decode tokens and prefill chunks together (vLLM's chunked prefill)."""
    max_num_seqs: int
    block_size: int
    kv_pool_blocks: int
    bytes_per_block: int
    pull_latency_s: float
    pull_bytes_per_s: float
    router_turn_s: float
    """The router's own cost per turn (tokenizing, placement, its HTTP hops)."""
    api_request_s: float
    """The engine API server's cost per request it takes (parsing, detokenizing, its HTTP hop)."""
    source: Mapping[str, str] = field(default_factory=dict)
    """Per figure group (:data:`FIGURE_GROUPS`), where its figures came from (:data:`SOURCE_KINDS`)."""

    def __post_init__(self) -> None:
        _check_figures(self)
        _check_sources(self.source)

    def step_seconds(self, prefill_tokens: int, attention_pairs: float, decode_streams: int,
                     decode_context: int) -> float:
        """One step's time; ``attention_pairs``: sum of chunk tokens times their mean context (the module's A)."""
        return (self.step_base_s + self.prefill_token_s * prefill_tokens
                + self.attention_token_s * attention_pairs / 1000.0
                + self.decode_stream_s * decode_streams + self.decode_context_s * decode_context)

    def pull_seconds(self, blocks: int) -> float:
        """A NIXL pull of ``blocks``; no pull (0 blocks) costs nothing."""
        if blocks <= 0:
            return 0.0
        return self.pull_latency_s + blocks * self.bytes_per_block / self.pull_bytes_per_s

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens (the last one partly filled)."""
        return -(-max(0, tokens) // self.block_size)


def _check_figures(profile: EngineProfile) -> None:
    for f in fields(profile):
        if f.name in ("name", "source"):
            continue
        value = getattr(profile, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ConfigError(f"profile.{f.name}: must be a number (got {value!r})", field=f.name)
        if f.name in _POSITIVE and value <= 0:
            raise ConfigError(f"profile.{f.name}: must be positive (got {value})", field=f.name)
        if value < 0:
            raise ConfigError(f"profile.{f.name}: must not be negative (got {value})", field=f.name)
    for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "kv_pool_blocks", "bytes_per_block"):
        if not isinstance(getattr(profile, name), int):
            raise ConfigError(f"profile.{name}: must be a whole number", field=name)
    if profile.step_base_s + profile.decode_stream_s <= 0:
        # A decode step that takes no time would let a stream generate without end at one instant.
        raise ConfigError("profile.step_base_s, decode_stream_s: a decode step must take some time",
                          field="decode_stream_s")


def _check_sources(source: Mapping[str, str]) -> None:
    unknown = sorted(set(source) - set(FIGURE_GROUPS))
    if unknown:
        raise ConfigError(f"profile.source: unknown groups {unknown}; the groups are {sorted(FIGURE_GROUPS)}",
                          field="source")
    for group in FIGURE_GROUPS:
        text = source.get(group, "")
        if not isinstance(text, str) or not text.startswith(SOURCE_KINDS):
            raise ConfigError(f"profile.source[{group!r}]: must say where its figures came from, beginning with one "
                              f"of {list(SOURCE_KINDS)} (got {text!r})", field="source")


def profile_to_dict(profile: EngineProfile) -> dict[str, Any]:
    figures = {f.name: getattr(profile, f.name) for f in fields(profile) if f.name not in ("name", "source")}
    return {"version": PROFILE_VERSION, "name": profile.name, "figures": figures, "source": dict(profile.source)}


def profile_from_dict(raw: Mapping[str, Any]) -> EngineProfile:
    """A profile from its JSON form; ``ConfigError`` naming what is wrong."""
    if raw.get("version") != PROFILE_VERSION:
        raise ConfigError(f"profile.version: {raw.get('version')!r} is not {PROFILE_VERSION}", field="version")
    figures, source = raw.get("figures"), raw.get("source")
    if not isinstance(figures, dict) or not isinstance(source, dict):
        raise ConfigError("profile: needs 'figures' and 'source' objects", field="figures")
    known = {f.name for f in fields(EngineProfile)} - {"name", "source"}
    if set(figures) != known:
        missing, extra = sorted(known - set(figures)), sorted(set(figures) - known)
        raise ConfigError(f"profile.figures: missing {missing}, unknown {extra}", field="figures")
    return EngineProfile(name=str(raw.get("name", "")), source=source, **figures)


def load_profile(path: Path) -> EngineProfile:
    try:
        raw = json.loads(Path(path).read_text())
    except ValueError as exc:
        raise ConfigError(f"profile {path}: not JSON ({exc})", field="profile") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"profile {path}: not a JSON object", field="profile")
    return profile_from_dict(raw)


def dump_profile(profile: EngineProfile, path: Path) -> None:
    Path(path).write_text(json.dumps(profile_to_dict(profile), indent=1, sort_keys=True) + "\n")
