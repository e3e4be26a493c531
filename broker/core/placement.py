"""Placement: for a new prompt, which of four paths serves it, on which engines, and why.

Pure function of the request, the lease index's matches, the soft index's cached prefixes and the engines'
reported figures. One cost model prices every possible path in estimated seconds to the first token:

- **DECODE_LOCAL** (conditional disaggregation): the decode engine that holds the prefix computes the tail
  itself: tail tokens / its prefill rate. No prefill request, no pull, no P/D hop. Allowed only while the tail
  is short (``decode_local_max_tokens``), a small share of the prompt (``decode_local_max_share``) and its
  stall of the decode engine's streams is within budget: the tail's compute time, times the streams it holds
  up, at most ``decode_local_stall_budget_s`` (the busy veto), and none queued. Inside the budget the stall is
  still priced: ``decode_stall_weight`` per stream-second. The engine's step size (``EngineInfo.step_tokens``,
  vLLM's chunked prefill) splits the tail over steps, each carrying what the streams' decodes leave of it, so a
  step is lengthened by at most that much (the budget, set on the engine): no room left is the ``step_full``
  veto. A prompt only prefill relief lets on the decode engine (below) needs an engine whose step is at most
  ``decode_local_max_tokens``, so it holds no step up longer than a short tail may (``step_budget``). The step is
  counted in tokens, set on the engine where its hardware is known: the rate placement has for a decode engine
  is its prefill engines' (it measures none), which on shared cores is half its own. ``decode_local=False`` gives strict
  P/D. A decode engine of role both computes any prompt it is to decode this way (a prefill request to itself
  would be a second request and a hop on the same streams); a vetoed one goes to another prefill engine, or
  stays when none can. **Prefill relief**: where every other prefill engine's counted queue alone outlasts the
  decode engine's compute of the whole tail, the length vetoes are lifted, and a decode engine may take a prompt
  it holds nothing of (``prefill_queued``).
- **PREFILL_LOCAL**: a prefill engine's own cache (a lease or its prefix cache) holds the prefix: the P/D hop
  plus its tail.
- **TRANSFER**: the P/D hop, plus a pull of the blocks beyond the prefill engine's own prefix from the lease
  holder, plus the tail.
- **RECOMPUTE**: the P/D hop plus the whole prompt.

Each prefill engine is priced with its own cached prefix and queue, so the chosen one is the one that minimises
pull plus compute, not merely the least loaded. The queue is the prompt tokens the routers have sent an engine
that it has not computed yet, at its rate (``EngineLoad.queued_prefill_tokens``); where no router counts them,
a flat ``queue_penalty_s`` per request stands in. A prefix under ``threshold_tokens`` is not worth reusing.

Read in the order it runs: :mod:`.scene` (the engines of the request's layout, its best lease match, what each
engine holds, the decode engine), :mod:`.pricing` (each option's price, and the facts of the tail on the decode
engine), :mod:`.vetoes` (the named rules that keep a tail off the decode engine), :mod:`.choice` (the cheapest
option, its reason and veto), then :func:`place` builds the plan. Tested in ``tests/unit/test_core_state.py``
(placement), ``tests/unit/test_paths.py``, ``tests/unit/test_placement_pieces.py`` and
``tests/unit/test_core_properties.py``; the figures behind the defaults are in CHANGELOG.md and docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvloop.broker.core.choice import Choice, cheapest_s, choose
from kvloop.broker.core.index import Match
from kvloop.broker.core.model import CostEstimate, Decision, EngineRecord, Plan, Tier
from kvloop.broker.core.pricing import (
    Option,
    decode_local_option,
    estimate_cost,
    prefill_options,
    prefill_rate,
    queue_s,
    read_tail,
    step_room,
)
from kvloop.broker.core.scene import Scene, best_match, pick_decode, read_scene
from kvloop.broker.core.vetoes import judge

__all__ = ["PlaceInput", "PlacementPolicy", "best_match", "estimate_cost", "place", "step_room"]


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    """The knobs of placement's cost model and vetoes; each is also a broker setting (broker/config.py)."""

    threshold_tokens: int = 64
    """The fewest reusable prompt tokens worth reusing; a shorter prefix is recomputed (upstream's
    kv_recompute_threshold)."""
    default_bandwidth_bytes_per_s: float = 1e9
    """Pull bandwidth, bytes/s, assumed until an engine reports one (NIXL's, or learned from its pulls)."""
    default_prefill_tokens_per_s: float = 5000.0
    """Prefill rate, prompt tokens/s, assumed where neither the engine nor its layout group has reported one."""
    default_bytes_per_block: int = 262144
    """KV bytes per block assumed where neither the source nor the reader has reported it."""
    transfer_overhead_s: float = 0.005
    """Seconds a pull costs besides its bytes: handshake, notifications, the extra engine step."""
    sticky_load_gap: float = 4.0
    """How much busier (``EngineLoad.score``: requests, plus KV usage) than the least loaded a decode engine holding
    the session's own history (its lease, or its last engine) may be and keep the session."""
    shared_prefix_load_gap: float = 1.0
    """The same for a decode engine holding only a prefix other sessions share (a system prompt): smaller, so the
    least loaded engine computes and holds that prefix too, rather than every new session following its first
    holder."""
    pd_hop_s: float = 0.08
    """Seconds of the disaggregated hop, idle: the prefill request's round trip, the decode engine's read of the new
    blocks and its first step, as measured on the benchmark machine (what load adds: ``measured_residuals``)."""
    queue_penalty_s: float = 0.05
    """Seconds of wait priced per request running or queued on an engine, where no router counts its queued
    prompt tokens."""
    decode_local: bool = True
    """Allow DECODE_LOCAL at all (False: strict disaggregation; the plans say ``disabled``)."""
    decode_local_max_tokens: int = 512
    """The longest uncached tail, in tokens, DECODE_LOCAL computes on the decode engine (veto ``tail_tokens``);
    also the largest step (``EngineInfo.step_tokens``) of a decode engine taking a prompt by prefill relief (veto
    ``step_budget``)."""
    decode_local_max_share: float = 0.5
    """The largest share of the prompt (0-1) that tail may be (veto ``tail_share``)."""
    decode_local_stall_budget_s: float = 2.0
    """The busy veto's budget (``decode_busy``), in stream-seconds: the tail's compute time on the decode engine
    times the streams it holds up; any request waiting there vetoes too. Each stream waits about once, for about the
    tail's time, so the budget bounds a token gap, not the mean inter-token latency an SLO counts."""
    relief_stall_budget_s: float = 0.5
    """The busy veto's budget, in stream-seconds, for a prompt only prefill relief puts on the decode engine:
    stricter than a session's own short tail's, since that work belongs to the prefill engines."""
    prefill_relief: bool = True
    """Lift the length vetoes, and let the decode engine take a prompt it holds nothing of, while every other
    prefill engine's counted queue alone outlasts its compute there (conditional disaggregation by queue)."""
    decode_stall_weight: float = 0.25
    """DECODE_LOCAL's price per stream-second its tail holds up the decode engine's streams, in seconds (0: the
    tail's own time alone; 1, each stream as much as the turn itself, measured worse)."""
    least_loaded_candidates: int = 4
    """How many of each role's least loaded engines placement prices besides those holding the prompt's prefix
    (not the whole fleet): engines of one layout group are alike, so a few cover their differing measured rates."""
    in_flight_ttl_s: float = 10.0
    """Seconds a router's counts of its requests in flight stand after its last Place (see .in_flight)."""
    placed_s: float = 0.2
    """Seconds a placement counts on its engines, until the router's own counts hold it: each Place of a burst
    sees the ones before it (see .in_flight)."""
    measured_residuals: bool = True
    """Add the caller's measured residuals (``PlaceInput.pd_residual_s``, ``decode_local_residual_s``) to the
    paths of their kind: the idle figures (``pd_hop_s``, the measured rates) miss what load adds."""
    residual_bound_s: float = 2.0
    """The most a caller's residual moves a path's price, either way: a correction of the model, not the price
    itself. Measured residuals under load were 0.3-0.6 s on the P/D hop (docs/placement.md); one engine's stall held
    a kind's turns 3-5 s, which unbounded would price that kind out of the fleet. Past the bound the model is off,
    which the routers' drift log line and gauge show (router/residuals.py), and the broker counts."""


@dataclass(frozen=True, slots=True)
class PlaceInput:
    keys: Sequence[bytes]
    num_tokens: int
    layout_fingerprint: str
    block_size: int
    session_id: str = ""
    decode_local: bool = True
    """False: the caller wants strict disaggregation for this request."""
    pd_residual_s: float = 0.0
    """How much longer than estimated the caller's recent turns over the P/D hop took to their first token (its
    router measures it: router/residuals.py); added to every P/D path's price. 0: none measured."""
    decode_local_residual_s: float = 0.0
    """The same for its DECODE_LOCAL turns, added to DECODE_LOCAL's price."""
    pd_residual_by_engine: Mapping[str, float] = field(default_factory=dict)
    """Per prefill engine, the same as ``pd_residual_s``; where given, each prefill engine is priced by its own entry
    (absent: no correction) instead of the kind's figure: one engine's stall does not reprice every P/D path."""
    decode_local_residual_by_engine: Mapping[str, float] = field(default_factory=dict)
    """Per decode engine, the same for DECODE_LOCAL."""


def place(
    request: PlaceInput,
    engines: Sequence[EngineRecord],
    matches: Sequence[Match],
    policy: PlacementPolicy,
    session_engine_id: str = "",
    cached: Mapping[str, int] | None = None,
    fleet_rate: float | None = None,
) -> Plan:
    """``engines`` are the engines to price: all the live ones, or (as ``BrokerState.place`` passes them) those
    holding a prefix, the session's, and the least loaded few of each role; ``matches`` come from the lease index
    (any engine); ``cached`` is, per engine id, how many leading blocks of ``request.keys`` the engine's own prefix
    cache holds (the soft index); ``fleet_rate`` is the median prefill rate the request's layout group reported,
    where ``engines`` are not the whole group (None: the median of ``engines``)."""
    scene = read_scene(request, engines, matches, policy, cached, fleet_rate)
    decode, sticky = pick_decode(scene, session_engine_id)
    tail = read_tail(scene, decode)
    options = prefill_options(scene, decode, tail.self_serve)
    verdict = judge(tail, policy, others=bool(options))
    if verdict.priced:
        options.append(decode_local_option(scene, tail))
    choice = choose(options, tail, verdict, scene.seen)
    cost = _cost(scene, options, choice.best, decode, tail.stall_s if verdict.priced else 0.0)
    return _plan(scene, decode, sticky, choice, cost)


def _cost(scene: Scene, options: Sequence[Option], best: Option, decode: EngineRecord, stall_s: float
          ) -> CostEstimate:
    """The plan's cost figures: each path's cheapest price, the chosen engine's rate and queue, and the pull figures
    of the cheapest TRANSFER option, whether or not it won (the trace shows why it lost)."""
    transfers = [o for o in options if o.pull is not None]
    pull = min(transfers, key=lambda o: o.seconds).pull if transfers else None
    pull = pull or CostEstimate()
    # A DECODE_LOCAL option's engine is the decode engine: best.prefill is the engine that computes the prompt.
    tps, tps_measured = prefill_rate(best.prefill, scene.policy, scene.fleet_rate)
    # The residuals in the chosen path's price (the router measures the path it ran against them); where
    # DECODE_LOCAL won, the cheapest P/D option's.
    pd_option = best if best.decision is not Decision.DECODE_LOCAL else \
        min((o for o in options if o.decision is not Decision.DECODE_LOCAL), key=lambda o: o.seconds, default=None)
    pd_residual = scene.pd_residual(pd_option.prefill) if pd_option is not None else 0.0
    local_residual = scene.local_residual(decode)
    return CostEstimate(
        pull.transfer_s, pull.recompute_s, pull.bandwidth_bytes_per_s, tps, pull.bytes_per_block,
        pull.measured if best.decision is Decision.TRANSFER else tps_measured,
        decode_local_s=cheapest_s(options, Decision.DECODE_LOCAL),
        prefill_local_s=cheapest_s(options, Decision.PREFILL_LOCAL),
        transfer_path_s=cheapest_s(options, Decision.TRANSFER),
        recompute_path_s=cheapest_s(options, Decision.RECOMPUTE),
        prefill_queue_s=queue_s(scene, best.prefill, flat=best.decision is not Decision.DECODE_LOCAL),
        decode_stall_s=stall_s, pd_residual_s=pd_residual, decode_local_residual_s=local_residual,
    )


def _plan(scene: Scene, decode: EngineRecord, sticky: bool, choice: Choice, cost: CostEstimate) -> Plan:
    best, bs, matched, match = choice.best, scene.block_size, scene.matched, scene.match
    return Plan(
        decision=best.decision,
        reason=choice.reason,
        prompt_blocks=len(scene.request.keys),
        threshold_tokens=scene.policy.threshold_tokens,
        prefill=best.prefill.info,
        decode=decode.info,
        decode_sticky=sticky,
        session_id=scene.request.session_id,
        source=scene.source.info if scene.source is not None else None,
        source_lease_id=match.lease.lease_id if match else "",
        source_block_ids=tuple(match.lease.block_ids[:matched]) if match else (),
        source_tier=match.lease.tier if match else Tier.POOL,
        matched_blocks=matched,
        matched_tokens=matched * bs,
        recompute_tokens=scene.request.num_tokens - best.reused_blocks * bs,
        candidates=len(scene.usable),
        cost=cost,
        local_tokens=best.local_blocks * bs,
        pull_tokens=(matched - best.local_blocks) * bs if best.decision is Decision.TRANSFER else 0,
        decode_local_veto=choice.veto or "",
        cached_tokens_seen=scene.seen * bs,
    )
