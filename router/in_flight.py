"""The router's own count of the engine requests it has in flight, per engine id.

Each placement sends a snapshot to the broker (``PlaceRequest.in_flight``), which prices load and the decode
engine's busy veto on the routers' counts rather than on keep-alive reports seconds old
(:mod:`kvloop.broker.core.in_flight`). A request counts from the moment it is sent to the moment its reply (or
stream) has ended or failed, so the count is exact for this router at the moment it places.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


class InFlightCounts:
    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    @contextmanager
    def track(self, engine_id: str) -> Iterator[None]:
        """Counts one request to ``engine_id`` for as long as the block runs."""
        self._counts[engine_id] += 1
        try:
            yield
        finally:
            self._counts[engine_id] -= 1
            if self._counts[engine_id] <= 0:
                del self._counts[engine_id]

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)

    def __getitem__(self, engine_id: str) -> int:
        return self._counts.get(engine_id, 0)
