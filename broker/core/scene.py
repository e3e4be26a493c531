"""Placement's first step: what one request finds in the fleet, before anything is priced.

The engines of its layout, its prefill engines (least loaded first), the lease it could reuse, how many blocks
each engine holds of it, and the decode engine that will stream its answer. Pure, read by every later step
(:mod:`.pricing`, :mod:`.vetoes`, :mod:`.choice`), changed by none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvloop.broker.core.index import Match
from kvloop.broker.core.model import EngineRecord, Tier
from kvloop.shared.errors import FailedPrecondition

if TYPE_CHECKING:
    from kvloop.broker.core.placement import PlaceInput, PlacementPolicy


@dataclass(frozen=True, slots=True)
class Scene:
    """One request and what it finds: built by :func:`read_scene`, never changed."""

    request: PlaceInput
    policy: PlacementPolicy
    fit: tuple[EngineRecord, ...]
    """The engines priced that serve the request's layout fingerprint and block size."""
    by_id: Mapping[str, EngineRecord]
    prefills: tuple[EngineRecord, ...]
    """The fitting engines that can prefill, least loaded first."""
    least_loaded_decode: EngineRecord
    fleet_rate: float
    """The layout group's median prefill rate (tokens/s; 0: none reported)."""
    usable: tuple[Match, ...]
    """The lease matches on fitting engines that no pending eviction holds."""
    match: Match | None
    """The best of them (:func:`best_match`)."""
    source: EngineRecord | None
    """The engine holding ``match``'s lease."""
    matched: int
    """Blocks of ``match`` reusable: never the block holding the prompt's last token."""
    max_blocks: int
    """The most blocks of the prompt any path may reuse: the last token must be computed to produce logits."""
    min_blocks: int
    """The fewest blocks worth reusing (``threshold_tokens``)."""
    cached: Mapping[str, int]
    """Per engine id, the leading blocks of the prompt its own prefix cache holds (the soft index)."""

    @property
    def block_size(self) -> int:
        return self.request.block_size

    def pd_residual(self, prefill: EngineRecord) -> float:
        """The caller's measure of what a P/D path on ``prefill`` costs beyond its estimate under the present load
        (its engine's own where the caller measures per engine), where the policy applies it, within
        ``residual_bound_s``."""
        return self._residual(self.request.pd_residual_by_engine, self.request.pd_residual_s, prefill)

    def local_residual(self, decode: EngineRecord) -> float:
        """The same for DECODE_LOCAL on ``decode``."""
        return self._residual(self.request.decode_local_residual_by_engine, self.request.decode_local_residual_s,
                              decode)

    def _residual(self, by_engine: Mapping[str, float], kind_s: float, engine: EngineRecord) -> float:
        if not self.policy.measured_residuals:
            return 0.0
        value = by_engine.get(engine.info.engine_id, 0.0) if by_engine else kind_s
        bound = self.policy.residual_bound_s
        return max(-bound, min(bound, value))

    @property
    def seen(self) -> int:
        """The longest prefix any engine holds, usable or not: the reuse that was available to this turn."""
        return min(max([self.matched, *(self.cached.get(e.info.engine_id, 0) for e in self.fit)]), self.max_blocks)

    def held(self, engine: EngineRecord) -> int:
        """Blocks of the prompt this engine holds itself: its lease match in its pool, or its prefix cache. A
        lease on its host tier is not local: it is pulled, by a prefill engine, as from any source."""
        lease = (self.matched if self.source is not None and self.source.info.engine_id == engine.info.engine_id
                 and self.match is not None and self.match.lease.tier is Tier.POOL else 0)
        return max(lease, min(self.cached.get(engine.info.engine_id, 0), self.max_blocks))

    def local(self, engine: EngineRecord) -> int:
        """What this engine holds, when it is worth reusing (else 0)."""
        blocks = self.held(engine)
        return blocks if blocks >= self.min_blocks else 0


def best_match(matches: Iterable[Match], session_id: str) -> Match | None:
    """Longest match; ties go to the same session, then the most recently used lease."""
    return max(
        matches,
        key=lambda m: (m.blocks, bool(session_id) and m.lease.session_id == session_id, m.lease.last_used,
                       m.lease.lease_id),
        default=None,
    )


def median_rate(engines: Iterable[EngineRecord]) -> float:
    """The median prefill rate the engines reported (the upper one of an even count; 0: none reported)."""
    reported = sorted(e.load.prefill_tokens_per_s for e in engines if e.load.prefill_tokens_per_s > 0)
    return reported[len(reported) // 2] if reported else 0.0


def _least_loaded(engines: Iterable[EngineRecord]) -> EngineRecord | None:
    return min(engines, key=lambda e: (e.load.score, e.info.engine_id), default=None)


def read_scene(request: PlaceInput, engines: Sequence[EngineRecord], matches: Sequence[Match],
               policy: PlacementPolicy, cached: Mapping[str, int] | None, fleet_rate: float | None) -> Scene:
    """The request's scene; FailedPrecondition where no live engine of its layout can prefill, or decode, it."""
    fit = tuple(e for e in engines if e.info.layout_fingerprint == request.layout_fingerprint
                and e.info.block_size == request.block_size)
    by_id = {e.info.engine_id: e for e in fit}
    prefills = tuple(sorted((e for e in fit if e.info.role.can_prefill),
                            key=lambda e: (e.load.score, e.info.engine_id)))
    decode = _least_loaded(e for e in fit if e.info.role.can_decode)
    if not prefills or decode is None:
        missing = "prefill" if not prefills else "decode"
        raise FailedPrecondition(
            f"layout_fingerprint: no live {missing} engine with fingerprint {request.layout_fingerprint!r} "
            f"and block size {request.block_size}",
            field="layout_fingerprint",
        )
    usable = tuple(m for m in matches if m.lease.engine_id in by_id and m.lease.pending is None)
    match = best_match(usable, request.session_id)
    max_blocks = max(0, (request.num_tokens - 1) // request.block_size)
    return Scene(
        request=request, policy=policy, fit=fit, by_id=by_id, prefills=prefills, least_loaded_decode=decode,
        fleet_rate=median_rate(fit) if fleet_rate is None else fleet_rate,
        usable=usable, match=match, source=by_id[match.lease.engine_id] if match else None,
        matched=min(match.blocks, max_blocks) if match else 0, max_blocks=max_blocks,
        min_blocks=-(-policy.threshold_tokens // request.block_size) if policy.threshold_tokens else 1,
        cached=cached or {},
    )


def pick_decode(scene: Scene, session_engine_id: str) -> tuple[EngineRecord, bool]:
    """The decode engine, and whether it was kept for what it holds (sticky): the one that holds most of the prompt
    (lease or cache), else the session's last engine, unless it is busier than the least loaded by more than
    ``sticky_load_gap`` (the session's own history) or ``shared_prefix_load_gap`` (a prefix others share)."""
    decode = scene.least_loaded_decode
    holders = [e for e in scene.fit if e.info.role.can_decode and scene.held(e)]
    candidate = max(holders, key=lambda e: (scene.held(e), -e.load.score, e.info.engine_id), default=None)
    by_id = scene.by_id
    if candidate is None and session_engine_id in by_id and by_id[session_engine_id].info.role.can_decode:
        candidate = by_id[session_engine_id]
    if candidate is None:
        return decode, False
    match, session_id = scene.match, scene.request.session_id
    affinity = candidate.info.engine_id == session_engine_id or (
        bool(session_id) and match is not None and scene.source is candidate
        and match.lease.session_id == session_id)
    gap = scene.policy.sticky_load_gap if affinity else scene.policy.shared_prefix_load_gap
    if candidate.load.score - decode.load.score <= gap:
        return candidate, True
    return decode, False
