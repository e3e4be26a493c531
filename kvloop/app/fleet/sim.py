"""A discrete-event replay of a multi-turn workload through a modelled fleet: every engine is an
:class:`~kvloop.shared.engine_model.EngineSim` (continuous batching, chunked prefill, prefix cache, KV pool,
pulls), and every P/D turn is placed by the broker's real core (:mod:`kvloop.app.fleet.broker`), as
``kvloop analyze``'s retention replay places its records. Deterministic: the same inputs give the same figures.

Configurations (named as ``kvloop bench load`` names them):

- ``kvloop``: P/D with the return path. The router places each turn (its own cost first), then the path runs:
  DECODE_LOCAL, the decode engine computes the tail from what it retained and decodes; PREFILL_LOCAL or
  RECOMPUTE, a prefill engine computes the prompt, the decode engine pulls it (the P/D hop) and decodes;
  TRANSFER, the prefill engine pulls the lease's blocks its cache lacks from their holder, computes the rest, then
  the hop. A decode engine retains each finished turn as a lease (the broker's budgets, TTLs and evictions).
- ``one_way``: the same fleet without retention, the router asking for strict P/D: every turn is prefilled; the
  prefill engines' own prefix caches still count (the soft index).
- ``aggregated``: engines doing both with their own prefix caches; each turn goes to the engine with the longest
  cached prefix, then the least loaded (one engine: the bare engine, no router).

Sessions are closed-loop as the load bench drives them: ``concurrency`` sessions at a time, each sending its
turns one after another, with its think time after each answer; a session holds its place until its last think
ends, then the next session starts.

A sweep's points follow one another on the same fleet (:func:`simulate_points`), as the load bench runs them on the
same engines and broker: what one point leaves cached or retained, the next finds. On a host whose cores the engines
share (``FleetSpec.host``, CPU engines), the client and each engine's API server and EngineCore take a constant share
of the host, and every routed turn charges it the router's, sidecars' and broker's CPU beside the engines' steps
(:mod:`kvloop.shared.engine_model.host`).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from kvloop.app.benchmarks.aiperf import Slo
from kvloop.app.benchmarks.workload import Conversation
from kvloop.app.fleet.broker import BrokerSettings, BrokerSide
from kvloop.app.fleet.figures import TurnResult, actual_path, point
from kvloop.app.fleet.sessions import FINGERPRINT, SessionTokens, Turn
from kvloop.broker.core import PlaceInput
from kvloop.engines.config import DECODE_STEP_TOKENS
from kvloop.shared.engine_model import (
    Account,
    EngineProfile,
    EngineSim,
    Event,
    EventKind,
    HostShare,
    HostSpec,
    SimRequest,
)
from kvloop.shared.errors import ConfigError, ResourceExhausted
from kvloop.shared.protocol import retainable_blocks
from kvloop.shared.vocabulary import Path, Role


class Config(StrEnum):
    KVLOOP = "kvloop"
    ONE_WAY = "one_way"
    AGGREGATED = "aggregated"


class Stage(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    """The engine that streams the answer: a decode engine, or an aggregated one."""


@dataclass(frozen=True, slots=True)
class FleetSpec:
    prefill_engines: int = 2
    decode_engines: int = 1
    aggregated_engines: int = 1
    decode_step_tokens: int = DECODE_STEP_TOKENS
    """A decode engine's step budget, as kvloop's engines set it (0: the profile's)."""
    prefill_pool_blocks: int = 0
    """A prefill engine's KV pool in blocks, where the fleet sizes it apart from the profiled engine's (0: the
    profile's): ``kvloop bench load`` gives its prefill engines room for its highest concurrency's longest prompts."""
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    host: HostSpec = field(default_factory=HostSpec)
    """The cores the engines share with everything beside them (CPU engines); the default: their own hardware."""


@dataclass(slots=True)
class FleetState:
    """What outlives a load point: the engines (their caches and leases), the broker, the host's load."""

    engines: dict[str, tuple[EngineSim, Role]]
    broker: BrokerSide | None
    host: HostShare | None
    now: float = 0.0


def build_fleet(config: Config, fleet: FleetSpec, profile: EngineProfile) -> FleetState:
    host = None
    if fleet.host.shared:
        host = HostShare(fleet.host, engine_cores(config, fleet))
    engines = _engines(config, fleet, profile, host)
    broker = None if config is Config.AGGREGATED else BrokerSide(engines, fleet.broker, 0.0)
    return FleetState(engines, broker, host)


@dataclass(slots=True)
class _Turn:
    turn: Turn
    session: SessionTokens | None
    """None: a scheduled turn (a trace's request), which no next turn follows."""
    arrived: float
    planned: Path = Path.RECOMPUTE
    prefill: str = ""
    decode: str = ""
    pin: str = ""
    known: int = 0
    first_token: float = math.nan
    prefill_account: Account | None = None


class Replay:
    """One configuration's replay of one load point. ``run()`` returns its turns, in the order they finished."""

    def __init__(self, config: Config, conversations: Sequence[Conversation], state: FleetState, fleet: FleetSpec,
                 profile: EngineProfile, concurrency: int, salt: str = "",
                 schedule: Sequence[tuple[float, Turn]] = ()) -> None:
        """``conversations``: closed-loop sessions, ``concurrency`` at a time; ``schedule``: turns sent at their times
        (seconds from the point's start) whatever came back, at most ``concurrency`` in flight (a trace replay, as
        AIPerf's fixed schedule sends it)."""
        self.config, self.profile, self.fleet = config, profile, fleet
        self.engines, self.broker, self.host = state.engines, state.broker, state.host
        self.pending: deque[SessionTokens] = deque(SessionTokens(c, profile.block_size, salt) for c in conversations)
        self.schedule = sorted(schedule, key=lambda item: item[0])
        self.held_back: deque[Turn] = deque()
        """Scheduled turns due while ``concurrency`` were in flight: sent as turns finish."""
        self.scheduled_in_flight = 0
        self.concurrency = concurrency
        self.queue: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self.requests: dict[str, tuple[_Turn, Stage]] = {}
        self.in_flight: Counter[str] = Counter()
        self.results: list[TurnResult] = []
        self.now = state.now
        self.held: list[tuple[float, int]] = [(self.now, self.broker.retained_blocks() if self.broker else 0)]

    def at(self, t: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self.queue, (t, next(self._seq), action))

    def run(self) -> list[TurnResult]:
        for _ in range(min(self.concurrency, len(self.pending))):
            self.at(self.now, self._start_session)
        start = self.now
        for t, turn in self.schedule:
            self.at(start + t, functools.partial(self._due, turn))
        while True:
            t_queue = self.queue[0][0] if self.queue else math.inf
            engine_id, t_engine = min(((e, sim.next_event_time()) for e, (sim, _) in self.engines.items()),
                                      key=lambda pair: pair[1])
            if math.isinf(t_queue) and math.isinf(t_engine):
                if not self.requests:
                    break
                self._unblock()
                continue
            if t_queue <= t_engine:  # arrivals at an instant join the step that starts then
                t, _, action = heapq.heappop(self.queue)
                self.now = t
                action(t)
                continue
            self.now = t_engine
            for event in self.engines[engine_id][0].advance(t_engine):
                self._on_event(engine_id, event)
        return self.results

    def _unblock(self) -> None:
        """Every engine waits for room that only the broker can free (retained leases): the sidecars' next keep-alive
        reports the pressure, the broker evicts. Nothing to evict: the fleet cannot serve the workload."""
        if self.broker is not None:
            self.broker.sync(self.now)
        if all(math.isinf(sim.next_event_time()) for sim, _ in self.engines.values()):
            raise ResourceExhausted(f"fleet: {len(self.requests)} request(s) wait for KV blocks nothing can free")

    # ------------------------------------------------------------------ sessions
    def _start_session(self, now: float) -> None:
        if self.pending:
            self._arrive(self.pending.popleft(), 0, now)

    def _due(self, turn: Turn, now: float) -> None:
        if self.scheduled_in_flight >= self.concurrency:
            self.held_back.append(turn)
            return
        self.scheduled_in_flight += 1
        self._send(_Turn(turn, None, now), now)

    def _arrive(self, session: SessionTokens, index: int, now: float) -> None:
        self._send(_Turn(session.turn(index), session, now), now)

    def _send(self, turn: _Turn, now: float) -> None:
        routed = self.config is not Config.AGGREGATED or len(self.engines) > 1
        delay = self.profile.router_turn_s if routed else 0.0
        if routed:
            self._charge(now, self.fleet.host.turn_cpu_s)
        self.at(now + delay, lambda t: self._route(turn, t))

    def _after_turn(self, turn: _Turn, now: float) -> None:
        """The session thinks, then sends its next turn, or (after its last) gives its place to the next session."""
        session, nxt = turn.session, turn.turn.index + 1
        if session is None:
            self.scheduled_in_flight -= 1
            if self.held_back:
                self._due(self.held_back.popleft(), now)
            return
        if nxt < session.conversation.turns:
            self.at(now + turn.turn.think_s, lambda t: self._arrive(session, nxt, t))
        else:
            self.at(now + turn.turn.think_s, self._start_session)

    # ------------------------------------------------------------------ paths
    def _route(self, turn: _Turn, now: float) -> None:
        if self.config is Config.AGGREGATED:
            turn.decode = _by_affinity(self.engines, turn.turn.prompt_keys)
            self._submit(turn, Stage.DECODE, turn.turn.answer_tokens, 0, now)
            return
        assert self.broker is not None
        t = turn.turn
        request = PlaceInput(t.prompt_keys, t.prompt_tokens, FINGERPRINT, self.profile.block_size, t.session,
                             decode_local=self.config is Config.KVLOOP)
        plan = self.broker.place(request, self.in_flight, now)
        turn.planned, turn.decode = plan.decision, plan.decode.engine_id
        if plan.decision is Path.DECODE_LOCAL:
            self._submit(turn, Stage.DECODE, t.answer_tokens, 0, now)
            return
        turn.prefill = plan.prefill.engine_id
        if plan.decision is Path.TRANSFER:
            turn.pin = self.broker.pin(turn.prefill, plan, now)
            turn.known = plan.matched_tokens if turn.pin else 0  # a refused pin: recomputed, as the router does
        self._submit(turn, Stage.PREFILL, 1, turn.known, now)

    def _submit(self, turn: _Turn, stage: Stage, max_tokens: int, known: int, now: float) -> None:
        """A request to the stage's engine, which takes it after its API server's own cost."""
        t = turn.turn
        engine_id = turn.prefill if stage is Stage.PREFILL else turn.decode
        request_id = f"{t.session}/{t.index}/{stage.value}"
        keys = t.prompt_keys if stage is Stage.PREFILL else t.keys
        request = SimRequest(request_id, t.prompt_tokens, max_tokens, keys, known)
        self.requests[request_id] = (turn, stage)
        self.in_flight[engine_id] += 1
        engine = self.engines[engine_id][0]
        self.at(now + self.profile.api_request_s, lambda at: engine.submit(request, at))

    def _charge(self, now: float, cpu_s: float) -> None:
        if self.host is not None and cpu_s > 0:
            self.host.charge(now, cpu_s)

    def _on_event(self, engine_id: str, event: Event) -> None:
        turn, stage = self.requests[event.request_id]
        if event.kind is EventKind.FIRST_TOKEN:
            if stage is Stage.DECODE:
                turn.first_token = event.t
            return
        assert event.account is not None
        self.in_flight[engine_id] -= 1
        del self.requests[event.request_id]
        if stage is Stage.PREFILL:
            self._prefilled(turn, event.account, event.t)
        else:
            self._answered(turn, event.account, event.t)

    def _prefilled(self, turn: _Turn, account: Account, now: float) -> None:
        """The prefill engine is done: the pin ends with its pull, and the decode engine gets the prompt."""
        turn.prefill_account = account
        if turn.pin and self.broker is not None:
            nbytes = account.pulled_blocks * self.profile.bytes_per_block
            self.broker.complete(turn.pin, nbytes, self.profile.pull_seconds(account.pulled_blocks), now)
        self._submit(turn, Stage.DECODE, turn.turn.answer_tokens, turn.turn.prompt_tokens - 1, now)

    def _answered(self, turn: _Turn, account: Account, now: float) -> None:
        t, bs = turn.turn, self.profile.block_size
        computing = turn.prefill_account or account
        if self.config is Config.AGGREGATED:
            turn.planned = actual_path(Path.RECOMPUTE, computing)
        if self.config is Config.KVLOOP and self.broker is not None:
            reach = retainable_blocks(t.prompt_tokens + account.generated - 1, bs)
            self.broker.publish(turn.decode, t.session, t.keys[:reach], now)
        if self.broker is not None:
            self.held.append((now, self.broker.retained_blocks()))
        pre = turn.prefill_account
        self.results.append(TurnResult(
            t.session, t.index, t.prompt_tokens, turn.arrived, turn.planned, actual_path(turn.planned, computing),
            turn.first_token, now, account.generated, account.max_gap_s, computing.local_tokens,
            computing.pulled_tokens, computing.computed_tokens,
            pre.pulled_blocks * self.profile.bytes_per_block if pre else 0,
            account.pulled_blocks * self.profile.bytes_per_block if pre else 0, turn.prefill, turn.decode))
        self._after_turn(turn, now)


def engine_cores(config: Config, fleet: FleetSpec) -> dict[str, tuple[int, ...]]:
    """Where each engine computes on a shared host, as kvloop binds engines sharing a machine
    (:func:`kvloop.engines.config.role_cores`): prefill engines on the first half of the cores, decode engines on
    the second, an aggregated engine on every core."""
    cores = fleet.host.cores
    half = max(1, cores // 2)
    first, second = tuple(range(half)), tuple(range(cores - half, cores))
    every = tuple(range(cores))
    return {e: every if config is Config.AGGREGATED else first if e.startswith("prefill-") else second
            for e in _engine_ids(config, fleet)}


def _engine_ids(config: Config, fleet: FleetSpec) -> list[str]:
    if config is Config.AGGREGATED:
        if fleet.aggregated_engines < 1:
            raise ConfigError("fleet.aggregated_engines: at least 1", field="aggregated_engines")
        return [f"both-{i}" for i in range(fleet.aggregated_engines)]
    if fleet.prefill_engines < 1 or fleet.decode_engines < 1:
        raise ConfigError("fleet.prefill_engines, decode_engines: at least 1 each", field="prefill_engines")
    return [f"prefill-{i}" for i in range(fleet.prefill_engines)] + [f"decode-{i}" for i in range(fleet.decode_engines)]


def _engines(config: Config, fleet: FleetSpec, profile: EngineProfile,
             host: HostShare | None) -> dict[str, tuple[EngineSim, Role]]:
    ids = _engine_ids(config, fleet)
    if config is Config.AGGREGATED:
        return {e: (EngineSim(e, profile, host), Role.BOTH) for e in ids}
    decode_profile = (replace(profile, max_num_batched_tokens=fleet.decode_step_tokens)
                      if fleet.decode_step_tokens else profile)
    prefill_profile = (replace(profile, kv_pool_blocks=fleet.prefill_pool_blocks) if fleet.prefill_pool_blocks
                       else profile)
    return {e: (EngineSim(e, prefill_profile, host), Role.PREFILL) if e.startswith("prefill-")
            else (EngineSim(e, decode_profile, host), Role.DECODE) for e in ids}


def _by_affinity(engines: dict[str, tuple[EngineSim, Role]], keys: Sequence[bytes]) -> str:
    """The engine whose prefix cache holds the longest prefix of ``keys``, then the one with fewest requests."""
    return min(engines, key=lambda e: (-engines[e][0].cached_prefix_tokens(keys), engines[e][0].requests, e))


def config_of(name: str) -> Config:
    try:
        return Config(name)
    except ValueError:
        raise ConfigError(f"config: {name!r} is not one of {[c.value for c in Config]}", field="config") from None


def simulate_points(config_name: str, points: Sequence[tuple[Sequence[Conversation], int]], fleet: FleetSpec,
                    profile: EngineProfile, slo: Slo) -> list[dict[str, Any]]:
    """A sweep: each point's conversations at its concurrency, one after another on the same fleet (what a point
    leaves cached or retained, the next finds; the sessions' answers differ from point to point, as sampled answers
    do). Each point's figures as :func:`simulate` gives them."""
    config = config_of(config_name)
    state = build_fleet(config, fleet, profile)
    return [_run_point(config, conversations, state, fleet, profile, concurrency, slo, salt=f"point-{i}")
            for i, (conversations, concurrency) in enumerate(points)]


def simulate_schedules(config_name: str, schedules: Sequence[Sequence[tuple[float, Turn]]], concurrency: int,
                       fleet: FleetSpec, profile: EngineProfile, slo: Slo) -> list[dict[str, Any]]:
    """A trace replay's sweep: each point's scheduled turns (seconds from its start), at most ``concurrency`` in
    flight, one point after another on the same fleet. Each point's figures as :func:`simulate` gives them."""
    config = config_of(config_name)
    state = build_fleet(config, fleet, profile)
    return [_run_point(config, (), state, fleet, profile, concurrency, slo, schedule=schedule)
            for schedule in schedules]


def simulate(config_name: str, conversations: Sequence[Conversation], fleet: FleetSpec, profile: EngineProfile,
             concurrency: int, slo: Slo) -> dict[str, Any]:
    """One configuration at one load point (``concurrency`` sessions at a time) on a fresh fleet: a ``kvloop bench
    load`` point's figures, marked ``predicted``, with the profile's provenance and the fleet it modelled."""
    config = config_of(config_name)
    return _run_point(config, conversations, build_fleet(config, fleet, profile), fleet, profile, concurrency, slo)


def _run_point(config: Config, conversations: Sequence[Conversation], state: FleetState, fleet: FleetSpec,
               profile: EngineProfile, concurrency: int, slo: Slo, salt: str = "",
               schedule: Sequence[tuple[float, Turn]] = ()) -> dict[str, Any]:
    if concurrency < 1:
        raise ConfigError("concurrency: at least 1 session", field="concurrency")
    steps_before = {e: sim.steps for e, (sim, _) in state.engines.items()}
    evictions_before = Counter(state.broker.evictions) if state.broker is not None else Counter()
    replay = Replay(config, conversations, state, fleet, profile, concurrency, salt, schedule)
    turns = replay.run()
    state.now = replay.now
    evictions = (state.broker.evictions - evictions_before) if state.broker is not None else Counter()
    figures = point(turns, slo, replay.held, evictions)
    figures.update(load=concurrency, concurrency=concurrency, config=config.value,
                   profile={"name": profile.name, "source": dict(profile.source)},
                   fleet={e: role.value for e, (_, role) in state.engines.items()},
                   engine_steps={e: sim.steps - steps_before[e] for e, (sim, _) in state.engines.items()})
    if fleet.host.shared:
        figures["host"] = {"cores": fleet.host.cores, "client_cores": fleet.host.client_cores,
                           "engine_process_cores": fleet.host.engine_process_cores,
                           "turn_cpu_s": fleet.host.turn_cpu_s, "source": fleet.host.source}
    return figures
