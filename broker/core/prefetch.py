"""Prefetch: a paused session's host-tier lease promoted back into its decode engine's pool before the session's
stated resume. Pure: time is an argument.

Demotion under pressure moves a paused session's lease to the host tier, where its next turn can only be served by a
pull into a prefill engine and the P/D hop. Promoted back before the resume, the turn can run on the decode engine
that holds it (DECODE_LOCAL): its tail alone, no hop. The engine does the promotion as a one-token request of the
lease's own tokens whose KV its connector copies from the host slots (``engines/connector/scheduler.py``); the
pool copy, retained and published, supersedes the host lease.

The price of a promotion is the pool room it takes and one engine step of one token. So a promotion takes only room
the engine's retention budget has free or that leases lower in the eviction order hold (a lower priority, no pause,
a later resume: ``BrokerState._ranks_below``), never the room of a session that resumes sooner; an order that every
move follows cannot demote a lease and promote it back while nothing changed (no ping-pong). The lead
(``Limits.session_prefetch_lead_s``) is how early: long enough for the copy and the engine's queue, short enough
that the room is not held for a turn that is still far off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvloop.broker.core.model import Lease, Tier


def promotable(lease: Lease) -> bool:
    """A host-tier lease a promotion may read now: its copy to the tier done, no eviction pending on it, not
    already being promoted (a promotion pins it)."""
    return lease.tier is Tier.HOST and not lease.demoting_until and lease.pending is None and not lease.pinned


def choose_promotion(leases: Iterable[Lease], room: Callable[[str], int]) -> Lease | None:
    """Of a session's leases, the one to promote: the longest promotable host-tier lease (the session's latest
    turn), if its engine's retention budget has room for all its blocks (``room(engine_id)``); None otherwise."""
    hosted = [lease for lease in leases if promotable(lease)]
    if not hosted:
        return None
    best = max(hosted, key=lambda lease: (lease.num_tokens, lease.created_at))
    return best if len(best.block_ids) <= room(best.engine_id) else None
