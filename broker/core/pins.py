"""The pins: a reader's hold on a lease while it pulls the lease's blocks. A pin defers the lease's end (the lease
book carries it out when the last pin goes), so every pin has a timeout."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvloop.broker.core.changes import Journal
from kvloop.broker.core.limits import Limits
from kvloop.broker.core.model import EngineRecord, Lease, Pin
from kvloop.shared.errors import FailedPrecondition, InvalidArgument, NotFound


def check_pinnable(lease: Lease, source_unheard: bool) -> None:
    """A lease a reader may pull now: not being evicted or copied, and its engine heard by this leader."""
    lease_id = lease.lease_id
    if lease.pending is not None:
        raise FailedPrecondition(f"lease_id: lease {lease_id!r} is being evicted ({lease.pending.value})",
                                 field="lease_id")
    if lease.demoting_until:
        raise FailedPrecondition(f"lease_id: lease {lease_id!r} is being copied to its engine's host tier",
                                 field="lease_id")
    if source_unheard:
        raise FailedPrecondition(f"lease_id: lease {lease_id!r} is on engine {lease.engine_id!r}, which has not "
                                 "kept alive with this leader yet (its safety hold may be running out)",
                                 field="lease_id")


class PinBook:
    def __init__(self, limits: Limits, journal: Journal, new_id: Callable[[], str]) -> None:
        self.limits = limits
        self._journal = journal
        self._new_id = new_id
        self.pins: dict[str, Pin] = {}

    def open(self, reader: EngineRecord, lease: Lease, source: EngineRecord, source_unheard: bool, num_blocks: int,
             timeout_s: float, now: float) -> Pin:
        """Pin ``lease`` (on engine ``source``) for ``reader`` to pull its first ``num_blocks`` blocks."""
        check_pinnable(lease, source_unheard)
        if not reader.info.same_layout(source.info):
            raise FailedPrecondition(
                f"reader_engine_id: engine {reader.info.engine_id!r} has a different KV layout fingerprint or block "
                f"size than the lease's engine {lease.engine_id!r}",
                field="reader_engine_id",
            )
        if not 1 <= num_blocks <= len(lease.block_ids):
            raise InvalidArgument(f"num_blocks: must be within 1..{len(lease.block_ids)}", field="num_blocks")
        timeout = timeout_s or self.limits.default_pin_timeout_s
        if not 0 < timeout <= self.limits.max_pin_timeout_s:
            raise InvalidArgument(f"timeout_s: must be within 0..{self.limits.max_pin_timeout_s}",
                                  field="timeout_s")
        pin = Pin(pin_id=self._new_id(), lease_id=lease.lease_id, reader_engine_id=reader.info.engine_id,
                  num_blocks=num_blocks, expires_at=now + timeout)
        self.pins[pin.pin_id] = pin
        lease.pin_ids.add(pin.pin_id)
        self._journal.put_pin(pin)
        self._journal.put_lease(lease)
        return pin

    def restore(self, pin: Pin, lease: Lease) -> None:
        """A pin loaded from a store, onto its (loaded) lease."""
        self.pins[pin.pin_id] = pin
        lease.pin_ids.add(pin.pin_id)

    def get(self, pin_id: str) -> Pin:
        pin = self.pins.get(pin_id)
        if pin is None:
            raise NotFound(f"pin_id: pin {pin_id!r} does not exist (completed or timed out)", field="pin_id")
        return pin

    def pop(self, pin_id: str) -> Pin:
        """End a pin; its lease's ``pin_ids`` are the lease book's to update."""
        pin = self.pins.pop(pin_id)
        self._journal.drop_pin(pin_id)
        return pin

    def drop(self, pin_ids: Iterable[str]) -> None:
        """Forget the pins of a lease that is gone."""
        for pin_id in list(pin_ids):
            self.pins.pop(pin_id, None)
            self._journal.drop_pin(pin_id)

    def due(self, now: float) -> list[Pin]:
        """The pins timed out at ``now``."""
        return [p for p in self.pins.values() if p.expires_at <= now]

    def of_reader(self, engine_id: str) -> list[Pin]:
        return [p for p in self.pins.values() if p.reader_engine_id == engine_id]

    def hold_until(self, lease: Lease) -> float:
        """When the lease may disappear from a store at the latest: its expiry or its last pin's."""
        pins = [self.pins[p].expires_at for p in lease.pin_ids if p in self.pins]
        return max([lease.expires_at, *pins])
