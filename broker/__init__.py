"""kvloop's KV-cache broker: a standalone gRPC service that owns session-to-block leases, retention
TTLs and eviction, and answers placement queries. ``kvloop.broker.core`` is pure; the rest is its shell."""
