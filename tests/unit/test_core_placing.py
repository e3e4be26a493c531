"""Properties of placement's view of the state (broker/core/placing.py) on random fleets, prefix caches and router
counts: the soft index's walk finds what asking each engine finds, the routers' counts replace the sidecars' for the
live engines only, and the engines priced include every holder of the prompt's prefix."""

from __future__ import annotations

import itertools
from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from kvloop.broker.core import EngineInfo, EngineLoad, Limits, LruPolicy, PlaceInput, PlacementPolicy, Role
from kvloop.broker.core.changes import Journal
from kvloop.broker.core.engines import Engines
from kvloop.broker.core.in_flight import InFlight
from kvloop.broker.core.leases import LeaseBook
from kvloop.broker.core.pins import PinBook
from kvloop.broker.core.placing import PlacementView
from kvloop.broker.core.soft_index import SoftIndex
from kvloop.shared.hashing import ExtraKeys, block_keys

PROPS = settings(max_examples=60, deadline=None)
EXTRA = ExtraKeys("fp")


@cache
def chain(path: tuple[int, ...]) -> tuple[bytes, ...]:
    return tuple(block_keys(list(path), 1, EXTRA))


paths = st.lists(st.integers(0, 1), min_size=1, max_size=4).map(tuple)
fleet = st.lists(st.tuples(st.sampled_from([Role.PREFILL, Role.DECODE, Role.BOTH]), st.sampled_from(["fp", "other"]),
                           st.integers(0, 5), st.lists(paths, max_size=3), st.lists(paths, max_size=2)),
                 min_size=1, max_size=6)
counts = st.dictionaries(st.sampled_from(["e0", "e1", "e2", "gone"]), st.integers(0, 3), max_size=3)


@PROPS
@given(fleet, paths, st.one_of(st.none(), st.tuples(counts, counts)))
def test_placement_reads_the_live_engines_caches_and_counts(engines: list[tuple], query: tuple[int, ...],
                                                            report: tuple[dict[str, int], dict[str, int]] | None
                                                            ) -> None:
    journal, ids = Journal(), itertools.count()
    book, soft, in_flight = Engines(Limits(), journal), SoftIndex(64), InFlight()
    leases = LeaseBook(LruPolicy(), Limits(), book, PinBook(Limits(), journal, lambda: ""), journal,
                       lambda: f"l{next(ids)}")
    view = PlacementView(PlacementPolicy(least_loaded_candidates=1), Limits(), book, leases, soft, in_flight)
    for i, (role, fp, running, published, cached) in enumerate(engines):
        rec = book.admit(EngineInfo(f"e{i}", role, 1, fp, 100), 0.0, 0)
        rec.load = EngineLoad(running_requests=running)
        leases.open(f"e{i}")
        for path in published:
            leases.publish(rec, "", chain(path), range(len(path)), len(path), 60.0, 0.0)
        soft.apply(f"e{i}", "", 1, reset=False, cleared=False, stored=[k for p in cached for k in chain(p)],
                   removed=[])
    if report is not None:
        view.report_in_flight("r", report[0], 0.0, report[1])
    request = PlaceInput(chain(query), len(query) + 1, "fp", 1)

    members = book.fleet.members(("fp", 1))
    assert view.cached_prefixes(request) == {e: n for e, n in soft.prefixes(request.keys).items() if e in members}
    placed = {r.info.engine_id: r.load for r in view.engines_as_placed(0.0)}
    assert set(placed) == set(book.records)
    for engine_id, load in placed.items():
        if report is None:
            assert load == book.records[engine_id].load
        else:
            assert (load.running_requests, load.queued_prefill_tokens) == (report[0].get(engine_id, 0),
                                                                           report[1].get(engine_id, 0))
    matches, _ = view.lease_matches(request)
    holders = {m.lease.engine_id for m in matches} | set(view.cached_prefixes(request))
    candidates = view._candidates(("fp", 1), members, matches, "", view.cached_prefixes(request), 0.0)
    assert holders <= {r.info.engine_id for r in candidates} <= members
