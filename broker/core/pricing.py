"""Placement's cost model: each path a prompt could take, priced in estimated seconds to its first token.

Pure functions of a :class:`~kvloop.broker.core.scene.Scene`. :func:`prefill_options` prices the P/D paths on
every prefill engine (PREFILL_LOCAL or RECOMPUTE, and TRANSFER where a lease elsewhere holds more);
:func:`read_tail` states the facts of the prompt's tail on the decode engine, which :mod:`.vetoes` judges and
:func:`decode_local_option` prices. Which option wins is :mod:`.choice`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvloop.broker.core.model import CostEstimate, Decision, EngineRecord
from kvloop.broker.core.scene import Scene

if TYPE_CHECKING:
    from kvloop.broker.core.placement import PlacementPolicy


@dataclass(frozen=True, slots=True)
class Option:
    """One priced path: where the prompt is computed, and what it reuses."""

    seconds: float
    decision: Decision
    prefill: EngineRecord
    """The engine that computes the prompt (the decode engine itself on DECODE_LOCAL)."""
    local_blocks: int
    """Blocks the serving engine holds itself."""
    reused_blocks: int
    """Blocks not computed: local ones, plus pulled ones on TRANSFER."""
    pull: CostEstimate | None = None
    """TRANSFER: the pull against recomputing the pulled blocks."""


@dataclass(frozen=True, slots=True)
class Tail:
    """The prompt on the decode engine: what DECODE_LOCAL would compute there, and what it would hold up."""

    decode: EngineRecord
    own: int
    """Blocks of the prompt the decode engine holds, worth reusing (0: none)."""
    tokens: int
    """The tail: prompt tokens beyond ``own``."""
    seconds: float
    """The tail's compute time at the decode engine's rate."""
    prompt_tokens: int
    enabled: bool
    """DECODE_LOCAL allowed by the policy and by the caller."""
    self_serve: bool
    """The decode engine can prefill (role both): it computes a prompt it decodes in its decode request."""
    relief: bool
    """Every other prefill engine's counted queue alone outlasts ``seconds`` (``prefill_relief``)."""
    lengthy: bool
    """Longer than ``decode_local_max_tokens``, or than ``decode_local_max_share`` of the prompt."""
    by_relief: bool
    """Only prefill relief would put it on the decode engine (lengthy, or nothing held and not self-serving)."""
    stall_s: float
    """DECODE_LOCAL's price for the streams it holds up: ``decode_stall_weight`` x streams x ``seconds``."""

    @property
    def possible(self) -> bool:
        """DECODE_LOCAL is worth judging: the decode engine holds the prefix, serves itself, or relief applies."""
        return bool(self.own or self.self_serve or self.relief)

    @property
    def streams(self) -> int:
        return self.decode.load.running_requests

    @property
    def chunk(self) -> int:
        """Tokens of the tail the decode engine's next step computes (:func:`step_room`)."""
        return step_room(self.decode.info.step_tokens, self.streams, self.tokens)


def step_room(step_tokens: int, streams: int, tail: int) -> int:
    """Tokens of a tail one engine step computes: vLLM schedules its running streams' decode tokens first and
    chunks a prompt into what is left of the step (``step_tokens`` 0: not reported, the whole tail at once)."""
    return min(tail, step_tokens - streams) if step_tokens else tail


def prefill_rate(engine: EngineRecord, policy: PlacementPolicy, fleet: float = 0.0) -> tuple[float, bool]:
    """The engine's measured prefill rate, and whether it was measured; else ``fleet``, the median of its peers'
    (same model and layout: decode engines report none, as their connector measures only prefill requests); else
    the configured default."""
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
    tps, tps_measured = prefill_rate(prefill, policy)
    transfer_s = policy.transfer_overhead_s + matched_blocks * bytes_per_block / bandwidth
    recompute_s = matched_blocks * block_size / tps
    return CostEstimate(transfer_s, recompute_s, bandwidth, tps, bytes_per_block,
                        measured and bool(reported) and tps_measured)


def rate(scene: Scene, engine: EngineRecord) -> float:
    """The engine's prefill rate, tokens/s (:func:`prefill_rate`, its layout group's median standing in)."""
    return prefill_rate(engine, scene.policy, scene.fleet_rate)[0]


def queue_s(scene: Scene, engine: EngineRecord, flat: bool = True) -> float:
    """The wait before ``engine`` starts a new prompt: its queued tokens at its rate; else (``flat``) the flat
    penalty per request."""
    queued = engine.load.queued_prefill_tokens
    if queued is not None:
        return queued / rate(scene, engine)
    return engine.load.score * scene.policy.queue_penalty_s if flat else 0.0


def hop_s(scene: Scene, engine: EngineRecord, compute_tokens: int) -> float:
    """A P/D path on prefill engine ``engine``: the hop (with the caller's residual), its queue, its compute."""
    hop = max(0.0, scene.policy.pd_hop_s + scene.pd_residual(engine))
    return hop + queue_s(scene, engine) + compute_tokens / rate(scene, engine)


def _own_path(scene: Scene, prefill: EngineRecord, own: int) -> Option:
    """PREFILL_LOCAL on what ``prefill`` holds worth reusing; RECOMPUTE where it holds nothing."""
    n = scene.request.num_tokens
    if own:
        return Option(hop_s(scene, prefill, n - own * scene.block_size), Decision.PREFILL_LOCAL, prefill, own, own)
    return Option(hop_s(scene, prefill, n), Decision.RECOMPUTE, prefill, 0, 0)


def _transfer_path(scene: Scene, prefill: EngineRecord, own: int) -> Option | None:
    """TRANSFER: ``prefill`` pulls the matched lease's blocks beyond its own; None where there is nothing worth
    pulling (no match, one under the threshold, one it holds itself or no longer than its own prefix)."""
    source, matched = scene.source, scene.matched
    if source is None or matched < scene.min_blocks or matched <= own or source is prefill:
        return None
    pull = estimate_cost(matched - own, scene.block_size, source, prefill, scene.policy)
    seconds = hop_s(scene, prefill, scene.request.num_tokens - matched * scene.block_size) + pull.transfer_s
    return Option(seconds, Decision.TRANSFER, prefill, own, matched, pull)


def prefill_options(scene: Scene, decode: EngineRecord, self_serve: bool) -> list[Option]:
    """Every P/D path on every prefill engine, each priced with the engine's own prefix and queue. A decode engine
    that serves itself (``self_serve``) is left out: a prefill request to it would stall the same streams, plus a
    hop (two requests to one engine); it is priced as DECODE_LOCAL instead."""
    options: list[Option] = []
    for p in scene.prefills:
        own = scene.local(p)
        if not (self_serve and p is decode):
            options.append(_own_path(scene, p, own))
        transfer = _transfer_path(scene, p, own)
        if transfer is not None:
            options.append(transfer)
    return options


def read_tail(scene: Scene, decode: EngineRecord) -> Tail:
    """The facts of the prompt's tail on ``decode``, for the vetoes and DECODE_LOCAL's price."""
    policy, request = scene.policy, scene.request
    enabled = policy.decode_local and request.decode_local
    own = scene.local(decode)
    tokens = request.num_tokens - own * scene.block_size
    seconds = tokens / rate(scene, decode)
    self_serve = decode.info.role.can_prefill and enabled
    # Conditional disaggregation by queue: where every other prefill engine's counted queue alone outlasts the
    # decode engine's compute of the whole tail, the decode engine may take it whatever its length (the length
    # vetoes keep long prompts off the streams' engine only while a prefill engine can start them sooner).
    others = [queue_s(scene, p, flat=False) for p in scene.prefills if p is not decode]
    relief = policy.prefill_relief and enabled and bool(others) and min(others) > seconds
    lengthy = tokens > policy.decode_local_max_tokens or tokens > policy.decode_local_max_share * request.num_tokens
    return Tail(
        decode=decode, own=own, tokens=tokens, seconds=seconds, prompt_tokens=request.num_tokens, enabled=enabled,
        self_serve=self_serve, relief=relief, lengthy=lengthy,
        by_relief=relief and (lengthy or not (own or self_serve)),
        stall_s=policy.decode_stall_weight * decode.load.running_requests * seconds,
    )


def decode_local_option(scene: Scene, tail: Tail) -> Option:
    """DECODE_LOCAL: the decode engine's own wait and compute (its queued tails: no flat penalty, its running
    requests are streams, priced as the stall instead), plus what the tail costs the streams it holds up, plus the
    caller's residual, which can take away waits the model priced, never the compute itself."""
    local_residual = scene.local_residual(tail.decode)
    seconds = max(tail.seconds, queue_s(scene, tail.decode, flat=False) + tail.seconds + tail.stall_s + local_residual)
    return Option(seconds, Decision.DECODE_LOCAL, tail.decode, tail.own, tail.own)
