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
Tested in ``tests/unit/test_core_state.py`` (placement) and ``tests/unit/test_core_properties.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvloop.broker.core.index import Match
from kvloop.broker.core.model import CostEstimate, Decision, EngineRecord, Plan, Tier
from kvloop.shared.errors import FailedPrecondition
from kvloop.shared.vocabulary import Reason, Veto


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    threshold_tokens: int = 64
    """Below this many reusable tokens, recompute (upstream's kv_recompute_threshold)."""
    default_bandwidth_bytes_per_s: float = 1e9
    """Stands in for a NIXL bandwidth no engine has reported yet."""
    default_prefill_tokens_per_s: float = 5000.0
    """Stands in for a prefill throughput no engine has reported yet."""
    default_bytes_per_block: int = 262144
    """Stands in for KV bytes per block when the source has not reported it."""
    transfer_overhead_s: float = 0.005
    """Fixed cost of a pull: handshake, notifications, the extra engine step."""
    sticky_load_gap: float = 4.0
    """Keep a session on the decode engine holding its own history (its lease, or its last engine) unless that
    engine is this much busier than the least loaded."""
    shared_prefix_load_gap: float = 1.0
    """... and on one holding only a prefix other sessions share (a system prompt) unless it is this much busier:
    the least loaded engine then computes that prefix once and holds it too, instead of every new session
    following the first engine that held it."""
    pd_hop_s: float = 0.08
    """Fixed cost of the disaggregated hop: the prefill request's round trip, the decode's read of the new
    blocks and its first step (the benchmark's prefill_http + decode_first on this machine: ~25 + ~55 ms)."""
    queue_penalty_s: float = 0.05
    """Estimated wait per request running or queued on an engine, where no router counts its queued tokens."""
    decode_local: bool = True
    """Allow DECODE_LOCAL at all (off: strict disaggregation)."""
    decode_local_max_tokens: int = 512
    """DECODE_LOCAL only when the uncached tail is at most this many tokens."""
    decode_local_max_share: float = 0.5
    """... and at most this share of the prompt."""
    decode_local_stall_budget_s: float = 2.0
    """... and the tail's compute time on the decode engine, times the streams it is decoding, is at most this
    many stream-seconds, with none queued (the busy veto). Each stream waits once, for about the tail's time
    (less with ``step_tokens``), so the veto guards a token gap, not the mean inter-token latency an SLO counts. At
    0.5 it sent the agent workload's ~330-token tails over the P/D hop from ~8 streams on, which cost those turns
    3-4x the TTFT and the streams more than the stall did: 2.0 carried 4.78 against 3.74 requests/s within the
    SLO at 8 sessions and 4.36 against 2.61 at 16, with a lower ITL p99 (19.0 / 33.0 against 25.8 / 43.9 ms;
    ``kvloop bench load``, docs/benchmarks.md)."""
    relief_stall_budget_s: float = 0.5
    """The busy veto's budget for a prompt only prefill relief lets on the decode engine: work that belongs to the
    prefill engines is held to a stricter budget than a session's own short tail. At 2 (the tails' budget) relief
    put 38% of the Mooncake replay's prompt tokens on the decode engine at speed 8, where 0.5 put 17%, and kvloop's
    goodput fell from 0.91-0.99x the aggregated engine's to 0.71x (``kvloop bench load --trace``)."""
    prefill_relief: bool = True
    """Let the decode engine compute a prompt of any length, or one it holds nothing of, when every other prefill
    engine's counted queue alone outlasts its compute there (conditional disaggregation by queue, as Dynamo's
    router sends a prefill remote only while the prefill queue has room): the stall and step vetoes still apply.
    Two prefill engines share one core in ``kvloop up``; on a trace of long, rarely reused prompts they queued
    while the decode engine's core idled (``kvloop bench load --trace``, docs/benchmarks.md)."""
    decode_stall_weight: float = 0.25
    """DECODE_LOCAL's price per stream-second its tail holds up the decode engine's streams (0: its own time
    alone). Weight 1 (every stream's delay as much as the turn's own) measured worse: at 8 sessions it sent a
    third of the turns over the P/D hop, which costs far more than ``pd_hop_s`` while the decode engine is busy
    (``kvloop bench load``: goodput 4.04/s against 6.08/s at 0.25)."""
    least_loaded_candidates: int = 4
    """Besides the engines holding a prompt's prefix, placement prices this many of the least loaded engines of each
    role (not the whole fleet). Within one layout group engines are alike (same model, same hardware), so the
    least loaded is the cheapest of those holding nothing; the few more cover differing measured rates."""
    in_flight_ttl_s: float = 10.0
    """A router's counts of its requests in flight stand for this long after its last Place (see .in_flight)."""
    placed_s: float = 0.2
    """A placement counts on its engines for this long, until the router that asked has sent the request and its
    own counts hold it: each Place of a burst sees the ones before it (see .in_flight)."""
    measured_residuals: bool = True
    """Add the caller's measured residuals (``PlaceInput.pd_residual_s``, ``decode_local_residual_s``) to the
    paths of their kind. The idle figures (``pd_hop_s``, the measured rates) miss what load adds: on the agent
    workload a P/D turn's prefill request and first decode took 0.4-0.7 s at 4 sessions against an estimate near
    0.1 s, a DECODE_LOCAL turn's first token ~0.1 s more than its estimate (``kvloop bench load``, router
    records), so the hop was chosen as "cheaper" for a quarter of the turns and cost them 3-4x the TTFT."""


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


def step_room(step_tokens: int, streams: int, tail: int) -> int:
    """Tokens of a tail one engine step computes: vLLM schedules its running streams' decode tokens first and
    chunks a prompt into what is left of the step (``step_tokens`` 0: not reported, the whole tail at once)."""
    return min(tail, step_tokens - streams) if step_tokens else tail


def _least_loaded(engines: Iterable[EngineRecord]) -> EngineRecord | None:
    return min(engines, key=lambda e: (e.load.score, e.info.engine_id), default=None)


def best_match(matches: Iterable[Match], session_id: str) -> Match | None:
    """Longest match; ties go to the same session, then the most recently used lease."""
    return max(
        matches,
        key=lambda m: (m.blocks, bool(session_id) and m.lease.session_id == session_id, m.lease.last_used,
                       m.lease.lease_id),
        default=None,
    )


def _tps(engine: EngineRecord, policy: PlacementPolicy, fleet: float = 0.0) -> tuple[float, bool]:
    """The engine's measured prefill rate; else the median of its peers' (same model and layout: decode engines
    report none, as their connector measures only prefill requests); else the configured default."""
    tps = engine.load.prefill_tokens_per_s or fleet
    return (tps, True) if tps > 0 else (policy.default_prefill_tokens_per_s, False)


def estimate_cost(
    matched_blocks: int, block_size: int, source: EngineRecord, prefill: EngineRecord, policy: PlacementPolicy
) -> CostEstimate:
    """A pull of ``matched_blocks`` from ``source`` against recomputing them on ``prefill``."""
    measured = True
    bytes_per_block = source.load.bytes_per_block or prefill.load.bytes_per_block
    if not bytes_per_block:
        bytes_per_block, measured = policy.default_bytes_per_block, False
    reported = [b for b in (source.learned_bandwidth, source.load.transfer_bytes_per_s,
                            prefill.load.transfer_bytes_per_s) if b > 0]
    bandwidth = reported[0] if reported else policy.default_bandwidth_bytes_per_s
    tps, tps_measured = _tps(prefill, policy)
    transfer_s = policy.transfer_overhead_s + matched_blocks * bytes_per_block / bandwidth
    recompute_s = matched_blocks * block_size / tps
    return CostEstimate(transfer_s, recompute_s, bandwidth, tps, bytes_per_block,
                        measured and bool(reported) and tps_measured)


@dataclass(frozen=True, slots=True)
class _Option:
    seconds: float
    decision: Decision
    prefill: EngineRecord
    local_blocks: int
    """Blocks the serving engine holds itself."""
    reused_blocks: int
    """Blocks not computed: local ones, plus pulled ones on TRANSFER."""
    pull: CostEstimate | None = None
    """TRANSFER: the pull against recomputing the pulled blocks."""


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
    fit = [
        e for e in engines
        if e.info.layout_fingerprint == request.layout_fingerprint and e.info.block_size == request.block_size
    ]
    by_id = {e.info.engine_id: e for e in fit}
    if fleet_rate is None:
        reported = sorted(e.load.prefill_tokens_per_s for e in fit if e.load.prefill_tokens_per_s > 0)
        fleet_rate = reported[len(reported) // 2] if reported else 0.0
    fleet = fleet_rate
    prefills = sorted((e for e in fit if e.info.role.can_prefill), key=lambda e: (e.load.score, e.info.engine_id))
    decode = _least_loaded(e for e in fit if e.info.role.can_decode)
    if not prefills or decode is None:
        missing = "prefill" if not prefills else "decode"
        raise FailedPrecondition(
            f"layout_fingerprint: no live {missing} engine with fingerprint {request.layout_fingerprint!r} "
            f"and block size {request.block_size}",
            field="layout_fingerprint",
        )
    usable = [m for m in matches if m.lease.engine_id in by_id and m.lease.pending is None]
    match = best_match(usable, request.session_id)
    bs = request.block_size
    # The last prompt token must be computed to produce logits: never reuse the block holding it.
    max_blocks = max(0, (request.num_tokens - 1) // bs)
    min_blocks = -(-policy.threshold_tokens // bs) if policy.threshold_tokens else 1
    matched = min(match.blocks, max_blocks) if match else 0
    source = by_id[match.lease.engine_id] if match else None

    def held(engine: EngineRecord) -> int:
        """Blocks of the prompt this engine holds itself: its lease match in its pool, or its prefix cache. A
        lease on its host tier is not local: it is pulled, by a prefill engine, as from any source."""
        lease = (matched if source is not None and source.info.engine_id == engine.info.engine_id
                 and match is not None and match.lease.tier is Tier.POOL else 0)
        return max(lease, min((cached or {}).get(engine.info.engine_id, 0), max_blocks))

    def local(engine: EngineRecord) -> int:
        """What this engine holds, when it is worth reusing."""
        blocks = held(engine)
        return blocks if blocks >= min_blocks else 0

    # The decode engine: the one that holds the prefix (lease or cache) or the session's, unless much busier.
    sticky = False
    holders = [e for e in fit if e.info.role.can_decode and held(e)]
    candidate = max(holders, key=lambda e: (held(e), -e.load.score, e.info.engine_id), default=None)
    if candidate is None and session_engine_id in by_id and by_id[session_engine_id].info.role.can_decode:
        candidate = by_id[session_engine_id]
    if candidate is not None:
        affinity = candidate.info.engine_id == session_engine_id or (
            bool(request.session_id) and match is not None and source is candidate
            and match.lease.session_id == request.session_id)
        gap = policy.sticky_load_gap if affinity else policy.shared_prefix_load_gap
        if candidate.load.score - decode.load.score <= gap:
            decode, sticky = candidate, True

    def queue_s(engine: EngineRecord, flat: bool = True) -> float:
        """The wait before ``engine`` starts a new prompt: its queued tokens at its rate; else (``flat``) the
        flat penalty per request."""
        queued = engine.load.queued_prefill_tokens
        if queued is not None:
            return queued / _tps(engine, policy, fleet)[0]
        return engine.load.score * policy.queue_penalty_s if flat else 0.0

    # The caller's measure of what each kind of path costs beyond its estimate under the present load.
    pd_residual, local_residual = ((request.pd_residual_s, request.decode_local_residual_s)
                                   if policy.measured_residuals else (0.0, 0.0))

    def hop(engine: EngineRecord, compute_tokens: int) -> float:
        hop_s = max(0.0, policy.pd_hop_s + pd_residual)
        return hop_s + queue_s(engine) + compute_tokens / _tps(engine, policy, fleet)[0]

    # A decode engine that can prefill too (role both) computes a prompt it is to decode in the decode request
    # itself: a prefill request to it would stall the same streams, plus a hop (two requests to one engine).
    self_serve = decode.info.role.can_prefill and policy.decode_local and request.decode_local
    options: list[_Option] = []
    for p in prefills:
        own = local(p)
        if self_serve and p is decode:
            pass  # priced below, as one request
        elif own:
            options.append(_Option(hop(p, request.num_tokens - own * bs), Decision.PREFILL_LOCAL, p, own, own))
        else:
            options.append(_Option(hop(p, request.num_tokens), Decision.RECOMPUTE, p, 0, 0))
        if source is not None and matched >= min_blocks and matched > own and source is not p:
            pull = estimate_cost(matched - own, bs, source, p, policy)
            seconds = hop(p, request.num_tokens - matched * bs) + pull.transfer_s
            options.append(_Option(seconds, Decision.TRANSFER, p, own, matched, pull))
    veto: Veto | str = ""
    stall_s = 0.0
    forced = False
    decode_own = local(decode) if decode.info.role.can_decode else 0
    tail = request.num_tokens - decode_own * bs
    tail_s = tail / _tps(decode, policy, fleet)[0]
    # Conditional disaggregation by queue: where every other prefill engine's counted queue alone outlasts the
    # decode engine's compute of the whole tail, the decode engine may take it whatever its length (the length
    # vetoes keep long prompts off the streams' engine only while a prefill engine can start them sooner).
    others = [queue_s(p, flat=False) for p in prefills if p is not decode]
    relief = (policy.prefill_relief and policy.decode_local and request.decode_local
              and bool(others) and min(others) > tail_s)
    lengthy = tail > policy.decode_local_max_tokens or tail > policy.decode_local_max_share * request.num_tokens
    by_relief = relief and (lengthy or not (decode_own or self_serve))  # only relief lets it on the decode engine
    relieved = False
    if decode_own or self_serve or relief:
        d_load = decode.load
        streams = d_load.running_requests
        chunk = step_room(decode.info.step_tokens, streams, tail)
        blocked: Veto | str = ""
        if not (policy.decode_local and request.decode_local):
            blocked = Veto.DISABLED
        elif lengthy and not relief:
            blocked = Veto.TAIL_TOKENS if tail > policy.decode_local_max_tokens else Veto.TAIL_SHARE
        elif d_load.waiting_requests > 0 or streams * tail_s > (
                policy.relief_stall_budget_s if by_relief else policy.decode_local_stall_budget_s):
            blocked = Veto.DECODE_BUSY
        elif chunk <= 0:
            blocked = Veto.STEP_FULL
        elif by_relief and not 0 < decode.info.step_tokens <= policy.decode_local_max_tokens:
            blocked = Veto.STEP_BUDGET
        # A vetoed prompt goes to another prefill engine; where none can take it, the decode engine (role both)
        # computes it anyway, in one request (a prefill request to it would stall the same streams).
        forced = bool(blocked) and self_serve and not options
        relieved = by_relief and not blocked
        if not blocked or forced:
            # Its own wait and compute (the decode engine's queued tails: no flat penalty, its running requests
            # are streams, priced as the stall instead), plus what the tail costs the streams it holds up.
            stall_s = policy.decode_stall_weight * streams * tail_s
            # A residual can take away waits the model priced, never the compute itself.
            seconds = max(tail_s, queue_s(decode, flat=False) + tail_s + stall_s + local_residual)
            options.append(_Option(seconds, Decision.DECODE_LOCAL, decode, decode_own, decode_own))
        elif decode_own:
            veto = blocked
    rank = {Decision.DECODE_LOCAL: 0, Decision.PREFILL_LOCAL: 1, Decision.TRANSFER: 2, Decision.RECOMPUTE: 3}
    best = min(options, key=lambda o: (o.seconds, rank[o.decision], o.prefill.load.score, o.prefill.info.engine_id))
    if veto == "" and decode_own and best.decision is not Decision.DECODE_LOCAL:
        veto = Veto.COSTLIER

    def cheapest(decision: Decision) -> float:
        return min((o.seconds for o in options if o.decision is decision), default=0.0)

    # The pull figures of the cheapest TRANSFER option, whether or not it won (the trace shows why it lost).
    transfers = [o for o in options if o.pull is not None]
    cost = min(transfers, key=lambda o: o.seconds).pull if transfers else None
    cost = cost or CostEstimate()
    # A DECODE_LOCAL option's engine is the decode engine: best.prefill is the engine that computes the prompt.
    tps, tps_measured = _tps(best.prefill, policy, fleet)
    cost = CostEstimate(cost.transfer_s, cost.recompute_s, cost.bandwidth_bytes_per_s, tps, cost.bytes_per_block,
                        cost.measured if best.decision is Decision.TRANSFER else tps_measured,
                        decode_local_s=cheapest(Decision.DECODE_LOCAL),
                        prefill_local_s=cheapest(Decision.PREFILL_LOCAL),
                        transfer_path_s=cheapest(Decision.TRANSFER),
                        recompute_path_s=cheapest(Decision.RECOMPUTE),
                        prefill_queue_s=queue_s(best.prefill, flat=best.decision is not Decision.DECODE_LOCAL),
                        decode_stall_s=stall_s, pd_residual_s=pd_residual,
                        decode_local_residual_s=local_residual)
    reason = {
        Decision.DECODE_LOCAL: Reason.PREFILL_QUEUED if relieved else (
            Reason.DECODE_ENGINE_COMPUTES if forced else Reason.SHORT_TAIL_ON_DECODE) if decode_own else None,
        Decision.PREFILL_LOCAL: Reason.LOCAL_PREFIX,
        Decision.TRANSFER: Reason.TRANSFER_CHEAPER,
    }.get(best.decision)
    # The longest prefix any engine holds, usable or not: the reuse that was available to this turn.
    seen = min(max([matched, *((cached or {}).get(e.info.engine_id, 0) for e in fit)]), max_blocks)
    if reason is None:
        if best.decision is Decision.DECODE_LOCAL:  # the whole prompt, on the decode engine (role both)
            reason = Reason.NO_MATCH if not seen else Reason.BELOW_THRESHOLD
        elif len({o.decision for o in options}) > 1:
            reason = Reason.RECOMPUTE_CHEAPER  # a reuse path existed and cost more
        elif veto:
            reason = Reason.DECODE_LOCAL_VETOED  # only the decode engine held the prefix (decode_local_veto says why)
        else:
            reason = Reason.NO_MATCH if not seen else Reason.BELOW_THRESHOLD
    transfer = best.decision is Decision.TRANSFER
    return Plan(
        decision=best.decision,
        reason=reason,
        prompt_blocks=len(request.keys),
        threshold_tokens=policy.threshold_tokens,
        prefill=best.prefill.info,
        decode=decode.info,
        decode_sticky=sticky,
        session_id=request.session_id,
        source=source.info if source is not None else None,
        source_lease_id=match.lease.lease_id if match else "",
        source_block_ids=tuple(match.lease.block_ids[:matched]) if match else (),
        source_tier=match.lease.tier if match else Tier.POOL,
        matched_blocks=matched,
        matched_tokens=matched * bs,
        recompute_tokens=request.num_tokens - best.reused_blocks * bs,
        candidates=len(usable),
        cost=cost,
        local_tokens=best.local_blocks * bs,
        pull_tokens=(matched - best.local_blocks) * bs if transfer else 0,
        decode_local_veto=veto,
        cached_tokens_seen=seen * bs,
    )
