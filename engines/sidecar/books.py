"""The sidecar's bookkeeping, pure: which retained request holds which lease, which eviction commands are
new, what the engine's load report says, and the throughput the broker's cost model learns. No I/O, no
gRPC; the service (:mod:`.service`) calls these and turns their answers into broker calls and connector
commands."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvloop.shared.protocol import BANDWIDTH_SAMPLE_MIN_BYTES

PREFILL_SAMPLE_MIN_TOKENS = 256
"""Prefills shorter than this teach no throughput: their time is mostly the engine step's fixed cost."""


@dataclass
class LeaseBooks:
    """Retained request id <-> lease id for one engine incarnation, the leases on the engine's host tier, and the
    last eviction command applied.

    A lease's life here: ``claim`` -> ``published`` (held: the connector retains its request's pool blocks) ->
    either ``forget`` (released) or ``demoting`` (the connector copies it to the tier) -> ``demoted`` (on the
    tier: no request, nothing the connector frees) -> ``drop_hosted``."""

    held: dict[str, str] = field(default_factory=dict)       # request id -> lease id
    by_lease: dict[str, str] = field(default_factory=dict)   # lease id -> request id
    publishing: set[str] = field(default_factory=set)        # request ids whose PublishLease is in flight
    copying: dict[str, str] = field(default_factory=dict)    # request id -> lease id, its demotion under way
    hosted: set[str] = field(default_factory=set)            # lease ids on the host tier
    contents: dict[str, tuple[str, array[int]]] = field(default_factory=dict)
    """Lease id -> (session id, token ids) of every lease held in either tier: what a promotion asks the engine.
    Packed (4 bytes a token): a decode engine retaining 50,000 blocks of 16 tokens keeps 3.2 MB, not ~29 as lists."""
    last_seq: int = 0

    def claim(self, request_id: str) -> bool:
        """Whether to publish a retained request: False when it already has a lease or one is on its way.

        A connector that re-attaches re-sends every request it retains, and a request that finished while no
        sidecar was attached is also in its queue: the same request came twice, got two leases over the same
        blocks, and when the first was superseded the engine freed the blocks the second still offered (kvloop
        bench chaos counted reads of them as freed while pinned)."""
        if request_id in self.held or request_id in self.publishing:
            return False
        self.publishing.add(request_id)
        return True

    def published(self, request_id: str, lease_id: str, session_id: str = "",
                  token_ids: list[int] | None = None) -> None:
        self.publishing.discard(request_id)
        self.held[request_id] = lease_id
        self.by_lease[lease_id] = request_id
        if token_ids:
            self.contents[lease_id] = (session_id, array("I", token_ids))

    def forget(self, request_ids: Iterable[str]) -> None:
        """The connector is told to free these: they hold no lease any more."""
        for rid in request_ids:
            self.publishing.discard(rid)
            lease = self.held.pop(rid, None)
            if lease is not None:
                self.by_lease.pop(lease, None)
                self.contents.pop(lease, None)

    def not_live(self, live_lease_ids: Iterable[str]) -> list[str]:
        """Requests whose lease the broker no longer lists (after a re-registration or a RESYNC command); host-tier
        leases it no longer lists are forgotten (their slots hold nothing the engine frees)."""
        live = set(live_lease_ids)
        self.hosted &= live
        self.contents = {lease: c for lease, c in self.contents.items() if lease in live}
        return [rid for rid, lease in self.held.items() if lease not in live]

    def known(self) -> set[str]:
        """Every lease this engine holds, in either tier."""
        return set(self.by_lease) | self.hosted | set(self.copying.values())

    def demoting(self, lease_id: str) -> str | None:
        """The broker demotes ``lease_id``: the request whose blocks the connector must copy, or None when this
        engine holds no such request (the demotion has failed)."""
        rid = self.by_lease.pop(lease_id, None)
        if rid is None:
            return None
        del self.held[rid]
        self.copying[rid] = lease_id
        return rid

    def demoted(self, request_id: str, ok: bool) -> str | None:
        """The connector's report of a copy: the lease to report to the broker (None: not one being demoted)."""
        lease = self.copying.pop(request_id, None)
        if lease is not None and ok:
            self.hosted.add(lease)
        elif lease is not None:
            self.contents.pop(lease, None)
        return lease

    def promotion(self, lease_id: str) -> tuple[str, list[int]] | None:
        """The session id and token ids of a host-tier lease to promote; None when this engine holds no such lease
        or does not know its tokens (the promotion then fails)."""
        found = self.contents.get(lease_id) if lease_id in self.hosted else None
        return (found[0], found[1].tolist()) if found is not None else None

    def drop_hosted(self, lease_id: str) -> bool:
        """The broker dropped a host-tier lease (TTL, room, a failed copy): whether this engine had it."""
        self.contents.pop(lease_id, None)
        if lease_id in self.hosted:
            self.hosted.discard(lease_id)
            return True
        return any(self.copying.pop(rid) for rid, lease in list(self.copying.items()) if lease == lease_id)

    def is_new(self, seq: int) -> bool:
        """Whether an eviction command is new (commands come on the stream and with PublishLease replies);
        records its sequence number when it is."""
        if seq and seq <= self.last_seq:
            return False
        self.last_seq = max(self.last_seq, seq)
        return True

    def holder_of(self, lease_id: str) -> str | None:
        return self.by_lease.get(lease_id)

    def freed_by_engine(self, request_id: str) -> str | None:
        """The engine freed a request on its own (its safety hold ran out): the lease to release at the broker,
        or None when the sidecar had asked for it."""
        lease = self.held.pop(request_id, None)
        if lease is not None:
            self.by_lease.pop(lease, None)
            self.contents.pop(lease, None)
        return lease

    def clear(self) -> None:
        self.held.clear()
        self.by_lease.clear()
        self.publishing.clear()
        self.copying.clear()
        self.hosted.clear()
        self.contents.clear()


def ewma(old: float, new: float, weight: float = 0.3) -> float:
    return new if old <= 0 else (1 - weight) * old + weight * new


@dataclass
class Throughput:
    """Moving averages of what the connector measured, reported to the broker's cost model."""

    prefill_tokens_per_s: float = 0.0
    transfer_bytes_per_s: float = 0.0

    def prefill_done(self, computed_tokens: int, compute_s: float, pulled_bytes: int, pull_s: float,
                     pull_failed: bool) -> None:
        if computed_tokens >= PREFILL_SAMPLE_MIN_TOKENS and compute_s > 0:
            self.prefill_tokens_per_s = ewma(self.prefill_tokens_per_s, computed_tokens / compute_s)
        if pulled_bytes >= BANDWIDTH_SAMPLE_MIN_BYTES and pull_s > 0 and not pull_failed:
            self.transfer_bytes_per_s = ewma(self.transfer_bytes_per_s, pulled_bytes / pull_s)


@dataclass(frozen=True)
class Load:
    running_requests: int
    waiting_requests: int
    kv_usage: float
    memory_pressure: bool
    pressure_free_blocks: int


def engine_load(figures: Mapping[str, float], num_blocks: int, pressure_kv_usage: float) -> Load:
    """The load report from the engine's scraped figures: memory pressure when KV usage passes the threshold
    with requests waiting, asking the broker to free the excess (plus 5% of the blocks, at least one)."""
    running, waiting = int(figures.get("running", 0)), int(figures.get("waiting", 0))
    usage = min(1.0, max(0.0, figures.get("kv_usage", 0.0)))
    pressure = usage >= pressure_kv_usage and waiting > 0 and num_blocks > 0
    free = max(1, int(num_blocks * (usage - pressure_kv_usage + 0.05))) if pressure else 0
    return Load(running, waiting, usage, pressure, free)
