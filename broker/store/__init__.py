"""Where the broker's state survives: one small interface, two backends.

``memory`` keeps nothing (the embedded default: a restart forgets every lease). ``etcd`` writes every
change through to etcd, with TTLs riding on etcd leases, and elects one leader among replicas.
"""

from kvloop.broker.store.base import Election, Snapshot, Store
from kvloop.broker.store.memory import MemoryStore, SoloElection

__all__ = ["Election", "MemoryStore", "Snapshot", "SoloElection", "Store"]
