"""Retention: the records replayed through the broker's real core (``BrokerState``: its index, leases, TTLs,
budgets, eviction policy and placement), with the time the records give.

Each turn is placed when it arrives and published as a lease by the decode engine the plan chose when it ends, as
a decode engine with kvloop's connector does. The replay feeds the engines' loads with the turns in flight, so
sessions spread over decode engines the way the broker spreads them. What is not replayed: the engines' own
prefix caches (the soft index; a lower bound on reuse) and pins (a pull never blocks an eviction here). The
records carry no keys for a turn's answer; the replay takes them from the session's next prompt when it extends
this one (an agent loop resends the history), as far as the answer's length reaches, so a lease holds the prompt
and the answer the way a decode engine's does.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvloop.broker.core import (
    Addresses,
    BrokerState,
    EngineInfo,
    EngineLoad,
    Limits,
    PlaceInput,
    PlacementPolicy,
    Plan,
    Role,
    make_policy,
)
from kvloop.router.records import TurnRecord
from kvloop.shared.errors import ConfigError, ResourceExhausted
from kvloop.shared.hashing import KEY_BYTES
from kvloop.shared.protocol import retainable_blocks
from kvloop.shared.vocabulary import Path

FINGERPRINT = "analyze"
UNLIMITED_BUDGET = Limits().max_retention_budget_blocks
LONGEST_TTL_S = Limits().max_ttl_s


@dataclass(frozen=True, slots=True)
class Fleet:
    """The engines the replay registers and the rates they report (which the broker's placement prices)."""

    decode_engines: int = 1
    prefill_engines: int = 1
    prefill_tokens_per_s: float = 5000.0
    bandwidth_bytes_per_s: float = 1e9
    bytes_per_block: int = 262144
    pd_hop_s: float = 0.08
    decode_local: bool = True
    eviction_policy: str = "lru"


@dataclass(frozen=True, slots=True)
class Setting:
    ttl_s: float
    budget_blocks: int
    """Per decode engine."""


@dataclass(frozen=True, slots=True)
class Outcome:
    decision: str
    matched_blocks: int
    """Leading blocks of the prompt a lease held when the turn arrived (usable: never the last token's)."""
    recompute_tokens: int
    pull_tokens: int


@dataclass
class Replay:
    setting: Setting
    outcomes: list[Outcome]
    """One per record, in the records' order."""
    held: list[tuple[float, int]] = field(default_factory=list)
    """(time, blocks retained over all engines) after each event."""
    evictions: Counter[str] = field(default_factory=Counter)
    refused: int = 0
    """Turns too large for one engine's budget: not retained at all."""


def _key(digest: str) -> bytes:
    return bytes.fromhex(digest).ljust(KEY_BYTES, b"\0")


def block_size_of(records: Sequence[TurnRecord]) -> int:
    sizes = {r.block_size for r in records if r.keys}
    if len(sizes) > 1:
        raise ConfigError(f"records: more than one block size ({sorted(sizes)}); analyze one layout at a time",
                          field="block_size")
    return sizes.pop() if sizes else 0


def replay_state(eviction_policy: str, policy: PlacementPolicy) -> BrokerState:
    """The broker's core for a replay: engines never expire (the replay reports no keep-alive period), any TTL is
    allowed, prompts of any length; lease ids in order, so the same replay gives the same ids."""
    limits = Limits(engine_ttl_s=float("inf"), min_ttl_s=0.001, max_block_keys=1 << 20)
    ids = itertools.count()
    return BrokerState(make_policy(eviction_policy), policy, limits, new_id=lambda: f"l{next(ids)}")


def replay(records: Sequence[TurnRecord], setting: Setting, fleet: Fleet) -> Replay:
    bs = block_size_of(records)
    policy = PlacementPolicy(pd_hop_s=fleet.pd_hop_s, decode_local=fleet.decode_local,
                             default_prefill_tokens_per_s=fleet.prefill_tokens_per_s,
                             default_bandwidth_bytes_per_s=fleet.bandwidth_bytes_per_s,
                             default_bytes_per_block=fleet.bytes_per_block)
    state = replay_state(fleet.eviction_policy, policy)
    engines = [(f"decode-{i}", Role.DECODE, setting.budget_blocks) for i in range(fleet.decode_engines)]
    engines += [(f"prefill-{i}", Role.PREFILL, 0) for i in range(fleet.prefill_engines)]
    running: Counter[str] = Counter()

    def report(engine_id: str, now: float) -> None:
        state.keepalive(engine_id, EngineLoad(running_requests=running[engine_id],
                                              prefill_tokens_per_s=fleet.prefill_tokens_per_s,
                                              transfer_bytes_per_s=fleet.bandwidth_bytes_per_s,
                                              bytes_per_block=fleet.bytes_per_block), now)

    start = min((r.t for r in records), default=0.0)
    for engine_id, role, budget in engines:
        state.register(EngineInfo(engine_id, role, max(bs, 1), FINGERPRINT, budget, Addresses(), "replay"), start)
        report(engine_id, start)
    # Ends before arrivals at the same instant: a turn that starts as the previous one ends finds its lease.
    events = sorted([(r.t, 1, i) for i, r in enumerate(records)] + [(r.t_end, 0, i) for i, r in enumerate(records)])
    plans: dict[int, Plan] = {}
    retained = retained_keys(records)
    block_ids: dict[str, dict[bytes, int]] = {e: {} for e, _, _ in engines}
    result = Replay(setting, [])
    for now, arrival, i in events:
        rec = records[i]
        state.tick(now)
        keys = [_key(k) for k in rec.keys]
        if arrival:
            if keys:
                plan = state.place(PlaceInput(keys, rec.prompt_tokens, FINGERPRINT, bs, rec.session), now)
                plans[i] = plan
                running[plan.decode.engine_id] += 1
                report(plan.decode.engine_id, now)
        elif i in plans:
            engine_id = plans[i].decode.engine_id
            running[engine_id] -= 1
            report(engine_id, now)
            if not rec.error:
                ids_of = block_ids[engine_id]
                held = [_key(k) for k in retained[i]]
                blocks = [ids_of.setdefault(k, len(ids_of)) for k in held]
                try:
                    state.publish(engine_id, rec.session, held, blocks, len(held) * bs, setting.ttl_s, now)
                except ResourceExhausted:
                    result.refused += 1
        for change in state.take_changes().commands:
            result.evictions[change.reason.value] += 1
        result.held.append((now, sum(state.retained_blocks(e) for e, _, _ in engines)))
    for i, rec in enumerate(records):
        placed = plans.get(i)
        result.outcomes.append(Outcome(placed.decision.value, placed.matched_blocks, placed.recompute_tokens,
                                       placed.pull_tokens) if placed
                               else Outcome(Path.RECOMPUTE, 0, rec.prompt_tokens, 0))
    return result


def retained_keys(records: Sequence[TurnRecord]) -> list[tuple[str, ...]]:
    """Per record, the block keys its decode engine retains: its prompt's, and as many more of the session's next
    prompt as its answer fills (``retainable_blocks`` of prompt plus answer), when that prompt starts with this
    one's keys. Without a next prompt, or when it does not extend this one, the prompt's keys only."""
    following: dict[int, int] = {}
    last: dict[str, int] = {}
    for i in sorted(range(len(records)), key=lambda i: records[i].t):
        session = records[i].session
        if session and session in last:
            following[last[session]] = i
        if session:
            last[session] = i
    out = []
    for i, rec in enumerate(records):
        keys = rec.keys
        nxt = records[following[i]] if i in following else None
        if nxt is not None and nxt.keys[:len(keys)] == keys and rec.output_tokens > 0:
            reach = retainable_blocks(rec.prompt_tokens + rec.output_tokens - 1, max(rec.block_size, 1))
            keys = nxt.keys[:max(len(keys), reach)]
        out.append(keys)
    return out


def ideal(records: Sequence[TurnRecord], fleet: Fleet) -> Replay:
    """Nothing expires and nothing is evicted: the reuse the workload holds."""
    return replay(records, Setting(LONGEST_TTL_S, UNLIMITED_BUDGET), fleet)


@dataclass(frozen=True, slots=True)
class Hits:
    setting: Setting
    turns_needing: int
    """Turns whose prefix a lease held in the ideal replay."""
    turns_found: int
    """... of which this setting still held all of it."""
    tokens_found: int
    tokens_ideal: int
    peak_blocks: int

    @property
    def turn_share(self) -> float:
        return self.turns_found / self.turns_needing if self.turns_needing else 0.0

    @property
    def token_share(self) -> float:
        return self.tokens_found / self.tokens_ideal if self.tokens_ideal else 0.0


def hits(run: Replay, best: Replay, block_size: int) -> Hits:
    pairs = [(o.matched_blocks, b.matched_blocks) for o, b in zip(run.outcomes, best.outcomes, strict=True)]
    return Hits(run.setting, sum(1 for _, b in pairs if b), sum(1 for o, b in pairs if b and o >= b),
                sum(min(o, b) for o, b in pairs) * block_size, sum(b for _, b in pairs) * block_size,
                max((n for _, n in run.held), default=0))
