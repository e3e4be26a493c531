"""What one engine's leases hold, by tier: each pool block's lease count, the host-tier slots in use, and the lease
ids. Derived from the leases and never stored, so a restored state rebuilds it by adding its leases again."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloop.broker.core.holders import BlockRefs
from kvloop.broker.core.model import Lease, Tier


class SlotCounts:
    """A host tier's slots as refcounts for :func:`choose_victims`: each slot in use is held once."""

    def __init__(self, slots: set[int]) -> None:
        self._slots = slots

    def get(self, slot: int, default: int = 0) -> int:
        return 1 if slot in self._slots else default

    def __getitem__(self, slot: int) -> int:
        return self.get(slot)

    def __len__(self) -> int:
        return len(self._slots)


@dataclass
class Holdings:
    refs: BlockRefs = field(default_factory=BlockRefs)
    """Pool blocks: how many of the engine's pool-tier leases hold each."""
    lease_ids: set[str] = field(default_factory=set)
    host_slots: set[int] = field(default_factory=set)
    """Host-tier slots in use, by the engine's host-tier leases (one lease per slot: demoted copies are not
    shared)."""

    def add(self, lease: Lease) -> None:
        self.hold(lease)
        self.lease_ids.add(lease.lease_id)

    def remove(self, lease: Lease) -> None:
        self.release(lease)
        self.lease_ids.discard(lease.lease_id)

    def hold(self, lease: Lease) -> None:
        """Count the lease's blocks in its tier."""
        if lease.tier is Tier.POOL:
            self.refs.hold(set(lease.block_ids))
        else:
            self.host_slots.update(lease.block_ids)

    def release(self, lease: Lease) -> None:
        """Uncount the lease's blocks from its tier (before the lease moves tier or goes)."""
        if lease.tier is not Tier.POOL:
            self.host_slots.difference_update(lease.block_ids)
            return
        self.refs.release(set(lease.block_ids))

    def slot_counts(self) -> SlotCounts:
        return SlotCounts(self.host_slots)

    def free_slots(self, first: int, capacity: int, need: int) -> tuple[int, ...]:
        """The lowest ``need`` slots of the tier ``first .. first + capacity - 1`` not in use (fewer if short)."""
        return tuple(s for s, _ in zip((s for s in range(first, first + capacity) if s not in self.host_slots),
                                       range(need), strict=False))
