"""The router's own count of the engine requests it has in flight, per engine id.

Each placement sends a snapshot to the broker (``PlaceRequest.in_flight``), which prices load and the decode
engine's busy veto on the routers' counts rather than on keep-alive reports seconds old
(:mod:`kvloop.broker.core.in_flight`). A request counts from the moment it is sent to the moment its reply (or
stream) has ended or failed, so the count is exact for this router at the moment it places. Beside the count,
the prompt tokens each engine has yet to compute for this router (``PlaceRequest.in_flight_tokens``): a prefill's
from the moment it is sent to its reply, a DECODE_LOCAL tail's until its first streamed bytes.
Tested in ``tests/unit/test_in_flight.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class InFlightCounts:
    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()

    @contextmanager
    def track(self, engine_id: str, tokens: int = 0) -> Iterator[Callable[[], None]]:
        """Counts one request to ``engine_id`` for as long as the block runs, and its ``tokens`` to compute until
        the block calls the function it is given (the engine has computed them) or ends."""
        self._counts[engine_id] += 1
        pending = [max(0, tokens)]
        self._tokens[engine_id] += pending[0]

        def computed() -> None:
            if pending[0]:
                self._tokens[engine_id] -= pending[0]
                pending[0] = 0
                if self._tokens[engine_id] <= 0:
                    del self._tokens[engine_id]

        try:
            yield computed
        finally:
            computed()
            self._counts[engine_id] -= 1
            if self._counts[engine_id] <= 0:
                del self._counts[engine_id]

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)

    def tokens(self) -> dict[str, int]:
        """Per engine, the prompt tokens of the tracked requests not computed yet."""
        return {e: n for e, n in self._tokens.items() if n > 0}

    def __getitem__(self, engine_id: str) -> int:
        return self._counts.get(engine_id, 0)
