"""``kvloop bench chaos``'s faults: what each does, a seeded schedule, and the arithmetic of its results. Pure.

Faults come one after another: each waits a seeded delay once the previous one has been repaired, is injected at
a moment that lands inside a turn (a stream in flight on its target, or a pull about to start), stays for a
bounded time, and is repaired (restarted, resumed); the run then waits for the part to be back before the next.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvloop.shared.vocabulary import NO_PLAN

KINDS = ("decode_kill", "prefill_kill_mid_pull", "sidecar_kill", "broker_leader_kill", "decode_stop", "etcd_stop",
         "pull_source_kill")
"""- ``decode_kill``: SIGKILL a decode engine while it streams an answer; restart it.
- ``prefill_kill_mid_pull``: SIGKILL the prefill engine a TRANSFER turn's pull is starting on; restart it.
- ``sidecar_kill``: SIGKILL a decode engine's sidecar (the engine runs on, unsupervised); restart it.
- ``broker_leader_kill``: SIGKILL the leader broker replica; restart it (it comes back as the follower).
- ``decode_stop``: SIGSTOP a decode engine while it streams, for longer than its safety hold and than its sidecar's
  patience (``engine_unresponsive_s``); SIGCONT.
- ``etcd_stop``: SIGSTOP etcd for a few seconds (the brokers' writes and leader lease stall); SIGCONT.
- ``pull_source_kill``: SIGKILL the decode engine a TRANSFER turn is pulling from, as the pull starts (the
  data plane fails mid-read); restart it."""

BROKER_FAULTS = frozenset({"broker_leader_kill", "etcd_stop"})
"""Faults whose part is the control plane: recovered at the first turn the broker plans again."""


@dataclass(frozen=True)
class Fault:
    kind: str
    delay_s: float
    """Wait after the previous repair before arming this fault."""
    target: int
    """Which engine of the role (modulo their number)."""
    down_s: float
    """How long the part stays down or stopped before its repair."""


def schedule(seed: int, rounds: int, *, hold_s: float, unresponsive_s: float,
             kinds: Sequence[str] = KINDS) -> list[Fault]:
    """Every kind once per round, in a seeded order, with seeded delays, targets and durations."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"faults: unknown kind(s) {sorted(unknown)}; known: {', '.join(KINDS)}")
    rng = random.Random(seed)
    out: list[Fault] = []
    for _ in range(rounds):
        order = list(kinds)
        rng.shuffle(order)
        for kind in order:
            if kind == "decode_stop":
                down = max(hold_s, unresponsive_s) + rng.uniform(2.0, 4.0)
            elif kind == "etcd_stop":
                down = rng.uniform(2.0, 5.0)
            else:
                down = rng.uniform(0.5, 2.0)
            out.append(Fault(kind, round(rng.uniform(1.0, 4.0), 2), rng.randrange(1 << 16), round(down, 2)))
    return out


@dataclass
class FaultRecord:
    kind: str
    target: str
    injected: float
    """When the fault hit (seconds since the run began)."""
    repaired: float = 0.0
    """When the repair was done: the part restarted and registered, or resumed."""
    recovered: float | None = None
    """When the first good turn that used the repaired part ended (None: none did before the run ended)."""
    fired: bool = True
    note: str = ""

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered is None else round(self.recovered - self.injected, 3)


@dataclass
class RequestRecord:
    session: str
    turn: int
    attempt: int
    start: float
    end: float = 0.0
    status: str = ""
    """ok, http_<code>, stream_error, timeout (a hang: past the client's deadline), client_error."""
    error: str = ""
    ttft_s: float | None = None
    prompt: list[int] | None = None
    output: list[int] | None = None
    max_tokens: int = 0
    path: str = ""
    reason: str = ""
    prefill_engine: str = ""
    decode_engine: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def uses(self, engine_id: str) -> bool:
        return engine_id in (self.prefill_engine, self.decode_engine)


def recovered_at(fault: FaultRecord, requests: Sequence[RequestRecord]) -> float | None:
    """The end of the first good turn that started after the repair and used the repaired part: the engine (its
    prefill or decode), or, for the control plane, a turn the broker planned (no fallback)."""
    good = sorted((r for r in requests if r.ok and r.start >= fault.repaired), key=lambda r: r.end)
    for r in good:
        if fault.kind in BROKER_FAULTS:
            if r.reason and r.reason not in NO_PLAN:
                return r.end
        elif r.uses(fault.target):
            return r.end
    return None


def in_window(r: RequestRecord, faults: Sequence[FaultRecord]) -> bool:
    """Whether a request overlapped a fault, from its injection to its repair."""
    return any(f.fired and r.start <= f.repaired and r.end >= f.injected for f in faults)


def first_divergence(got: Sequence[int], want: Sequence[int]) -> int | None:
    """The first position where two greedy outputs differ (None: equal)."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))
