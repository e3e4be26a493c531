"""What the shell must persist: the records put or deleted and the eviction commands issued since it last asked.
Every book records into one shared journal, so one store write carries one consistent step of the state."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloop.broker.core.model import EngineRecord, EvictionCommand, Lease, Pin


@dataclass
class Changes:
    """What to persist since the last ``take_changes``: objects to put, ids to delete, commands."""

    engines: dict[str, EngineRecord | None] = field(default_factory=dict)
    leases: dict[str, Lease | None] = field(default_factory=dict)
    pins: dict[str, Pin | None] = field(default_factory=dict)
    commands: list[EvictionCommand] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.engines or self.leases or self.pins or self.commands)

    def merge(self, later: Changes) -> None:
        """Fold ``later`` into this batch: the last write of each record wins."""
        self.engines.update(later.engines)
        self.leases.update(later.leases)
        self.pins.update(later.pins)
        self.commands.extend(later.commands)


class Journal:
    """The changes not taken yet; the books write here, the shell takes a batch at a time."""

    def __init__(self) -> None:
        self.changes = Changes()

    def take(self) -> Changes:
        changes, self.changes = self.changes, Changes()
        return changes

    def put_engine(self, rec: EngineRecord) -> None:
        self.changes.engines[rec.info.engine_id] = rec

    def drop_engine(self, engine_id: str) -> None:
        self.changes.engines[engine_id] = None

    def put_lease(self, lease: Lease) -> None:
        self.changes.leases[lease.lease_id] = lease

    def drop_lease(self, lease_id: str) -> None:
        self.changes.leases[lease_id] = None

    def put_pin(self, pin: Pin) -> None:
        self.changes.pins[pin.pin_id] = pin

    def drop_pin(self, pin_id: str) -> None:
        self.changes.pins[pin_id] = None

    def command(self, cmd: EvictionCommand) -> None:
        self.changes.commands.append(cmd)
