"""The state as placement reads it: the leases matching a prompt, the few engines worth pricing, their load as the
routers count it (:mod:`.in_flight`), and the prefix caches of the request's layout (:mod:`.soft_index`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from kvloop.broker.core.engines import Engines
from kvloop.broker.core.in_flight import InFlight
from kvloop.broker.core.index import Match
from kvloop.broker.core.leases import LeaseBook
from kvloop.broker.core.limits import Limits, check_in_flight
from kvloop.broker.core.model import Decision, EngineRecord, Lease, Plan
from kvloop.broker.core.placement import PlaceInput, PlacementPolicy, place
from kvloop.broker.core.soft_index import SoftIndex
from kvloop.shared.vocabulary import Reason


class PlacementView:
    def __init__(self, policy: PlacementPolicy, limits: Limits, engines: Engines, leases: LeaseBook,
                 soft: SoftIndex, in_flight: InFlight) -> None:
        self.policy = policy
        self.limits = limits
        self._engines = engines
        self._leases = leases
        self.soft = soft
        self.in_flight = in_flight

    def place(self, request: PlaceInput, now: float) -> Plan:
        """Plan a checked request (``limits.check_place``)."""
        matches, session_engine = self.lease_matches(request)
        layout = (request.layout_fingerprint, request.block_size)
        members = self._engines.fleet.members(layout)
        cached = {e: n for e, n in self.soft.prefixes(request.keys).items() if e in members}
        candidates = self._candidates(layout, members, matches, session_engine, cached, now)
        return place(request, candidates, matches, self.policy, session_engine, cached=cached,
                     fleet_rate=self._engines.fleet.median_rate(layout))

    def lease_matches(self, request: PlaceInput) -> tuple[list[Match], str]:
        """The leases sharing the longest usable prefix with the request, and the engine of the session's latest
        lease ("" when none)."""
        records, unheard = self._engines.records, self._engines.unheard

        def eligible(lease: Lease) -> bool:
            rec = records.get(lease.engine_id)
            return (rec is not None and lease.pending is None and not lease.demoting_until
                    and lease.engine_id not in unheard and rec.info.block_size == request.block_size
                    and rec.info.layout_fingerprint == request.layout_fingerprint)

        leases, index = self._leases.leases, self._leases.index
        usable = (request.num_tokens - 1) // request.block_size
        return (index.matches(request.keys, usable, leases, eligible),
                index.session_engine(request.session_id, leases))

    def _candidates(self, layout: tuple[str, int], members: set[str], matches: Sequence[Match], session_engine: str,
                    cached: Mapping[str, int], now: float) -> list[EngineRecord]:
        """The engines placement prices, with the load it prices (:meth:`engines_as_placed`): the prefix's holders,
        the session's engine, and the least loaded few of each role that hold nothing. Where routers count their
        requests, every engine they have one on is priced too (its load is theirs), and the few are the idle ones of
        least KV usage, whose placed load is just that. Within a layout group of alike engines this prices the same
        cheapest plan as all of them would (tests/unit/test_core_scale.py checks it against the whole fleet)."""
        chosen = set(cached) | {m.lease.engine_id for m in matches} | {session_engine}
        totals, tokens = self._in_flight_totals(now)
        if totals is not None:
            chosen |= {e for e in (*totals, *tokens) if e in members}
        k = self.policy.least_loaded_candidates
        for role in ("prefill", "decode"):
            # One prefill engine more: the decode engine may be one of them (role both), and placement prices a
            # prompt on it as its decode request's own work, not as a prefill (broker.core.placement).
            n = k + 1 if role == "prefill" else k
            chosen.update(self._engines.fleet.least_loaded(layout, role, n, chosen.__contains__,
                                                           by_kv=totals is not None))
        return self._placed(sorted(e for e in chosen if e in self._engines.records), totals, tokens)

    def report_in_flight(self, router: str, counts: Mapping[str, int], now: float,
                         tokens: Mapping[str, int] | None = None) -> None:
        """A router's requests in flight per engine id, and their prompt tokens not computed yet, at ``now``."""
        check_in_flight(router, tokens or {}, self.limits)
        live = self._engines.records
        self.in_flight.report(router, {e: n for e, n in counts.items() if e in live}, now,
                              {e: n for e, n in (tokens or {}).items() if e in live})

    def count_placement(self, plan: Plan, now: float) -> None:
        """A plan just given to a router that counts its requests: the engine that computes its prompt counts the
        request and its tokens until the router's own counts can. A P/D plan's decode request is not counted (it
        starts when the prefill ends: counted now, it would veto DECODE_LOCAL tails on streams not there yet), nor
        a tail sent to its decode engine by affinity (the router counts it as it starts; counted twice, the tails
        of sessions arriving together would look costlier there than the P/D hop)."""
        if plan.decision is Decision.DECODE_LOCAL and plan.reason is not Reason.PREFILL_QUEUED:
            return
        self.in_flight.placed(plan.prefill.engine_id, plan.recompute_tokens, now)

    def engines_as_placed(self, now: float) -> list[EngineRecord]:
        """The live engines with the load placement prices: where routers count their requests in flight, those
        counts replace the sidecars' (older) running and waiting figures, and their tokens not yet computed are
        the engines' queues; KV usage, pressure and rates stay. All of them: placement's oracle in the tests."""
        return self._placed(list(self._engines.records), *self._in_flight_totals(now))

    def _in_flight_totals(self, now: float) -> tuple[dict[str, int] | None, dict[str, int]]:
        """The routers' requests and prompt tokens in flight per engine; requests None where no router counts."""
        totals = self.in_flight.totals(now)
        return totals, (self.in_flight.token_totals(now) or {}) if totals is not None else {}

    def _placed(self, ids: Iterable[str], totals: dict[str, int] | None,
                tokens: dict[str, int]) -> list[EngineRecord]:
        records = self._engines.records
        if totals is None:
            return [records[e] for e in ids]
        return [dataclasses.replace(records[e], load=dataclasses.replace(
                    records[e].load, running_requests=totals.get(e, 0), waiting_requests=0,
                    queued_prefill_tokens=tokens.get(e, 0)))
                for e in ids]

    def cached_prefixes(self, request: PlaceInput) -> dict[str, int]:
        """Per live engine of the request's layout, how many leading blocks of ``request.keys`` its own prefix
        cache holds (the soft index); engines holding none are left out. Each engine asked in turn: placement walks
        the soft index's key-to-engines map instead (``SoftIndex.prefixes``); this is its oracle in the tests."""
        cached: dict[str, int] = {}
        if not request.keys:
            return cached
        for engine_id, rec in self._engines.records.items():
            if (rec.info.block_size == request.block_size
                    and rec.info.layout_fingerprint == request.layout_fingerprint):
                n = self.soft.cached_prefix(engine_id, request.keys)
                if n:
                    cached[engine_id] = n
        return cached
