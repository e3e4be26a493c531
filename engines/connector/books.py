"""The connector's bookkeeping, pure: no vLLM, no I/O, time as an argument. The scheduler side
(:mod:`.scheduler`) keeps these per request; unit tests drive them with fakes."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvloop.shared.protocol import PrefillReport, prefill_report, retainable_blocks


@dataclass
class RetainedRequest:
    """A finished decode request whose full blocks stay allocated for a later turn."""

    token_ids: list[int]
    block_ids: list[int]
    session_id: str


def retain(token_ids: Sequence[int], block_ids: Sequence[int], num_computed_tokens: int, block_size: int,
           session_id: str, prompt_only_tokens: int | None = None) -> RetainedRequest | None:
    """What a finished request can retain: its full blocks (the last sampled token has no KV) with their
    tokens; None when not one block is full. With ``prompt_only_tokens`` (the prompt's length, given when the
    client said the next turn will not repeat this answer) only the prompt's full blocks: a block the answer
    shares with the prompt's end is the answer's, since the next turn's tokens part from this one's there."""
    computed = num_computed_tokens if prompt_only_tokens is None else min(num_computed_tokens, prompt_only_tokens)
    full = retainable_blocks(computed, block_size)
    if full == 0:
        return None
    return RetainedRequest(token_ids=list(token_ids[: full * block_size]), block_ids=list(block_ids[:full]),
                           session_id=session_id)


@dataclass
class PrefillBooks:
    """One prefill request's account: local prefix hit, then at most one pull, then the computed tail."""

    started: float
    local_tokens: int
    queued_s: float = 0.0
    """Time from the request's arrival to ``started``."""
    external_tokens: int = 0
    pull_started: float = 0.0
    pull_s: float = 0.0
    pull_done: bool = False
    pull_failed: bool = False

    def pull_began(self, external_tokens: int, now: float) -> None:
        self.external_tokens = external_tokens
        self.pull_started = now

    def pull_finished(self, failed: bool, now: float) -> None:
        """The receive finished (once: vLLM may report a request again after a reset)."""
        if self.pull_started and not self.pull_done:
            self.pull_done = True
            self.pull_failed = failed
            self.pull_s = now - self.pull_started

    def report(self, prompt_tokens: int, block_size: int, bytes_per_block: int, now: float) -> PrefillReport:
        return prefill_report(prompt_tokens=prompt_tokens, local_tokens=self.local_tokens,
                              external_tokens=self.external_tokens, pull_done=self.pull_done,
                              pull_failed=self.pull_failed, pull_s=self.pull_s, block_size=block_size,
                              bytes_per_block=bytes_per_block, queue_s=self.queued_s, compute_s=self.compute_s(now))

    def compute_s(self, now: float) -> float:
        """Time on the engine that was not the pull: queueing and the tail's compute."""
        return max(0.0, now - self.started - self.pull_s)


def tail_to_free(blocks: list[Any], keep: int) -> list[Any]:
    """Cut a finished request's block list after its first ``keep`` blocks, in place, and return the cut tail in
    allocation order (vLLM frees in reverse, so the last-written block is evicted first)."""
    if keep < 0:
        raise ValueError(f"keep: {keep} is negative")
    tail = blocks[keep:]
    del blocks[keep:]
    return tail


def split_lease_reads(notifs: Mapping[str, list[bytes]], prefix: bytes) -> tuple[dict[str, list[bytes]], int]:
    """NIXL notifications without those of reads of retained blocks (named ``prefix`` + lease id), and how many
    such reads there were. Upstream frees a request's blocks on its reader's notification; retained blocks are
    freed only on the broker's word, so those notifications are counted and dropped."""
    kept: dict[str, list[bytes]] = {}
    reads = 0
    for agent, messages in notifs.items():
        rest = [m for m in messages if not m.startswith(prefix)]
        reads += len(messages) - len(rest)
        if rest:
            kept[agent] = rest
    return kept, reads


def peers_to_rehandshake(failed: Collection[str], invalid: Collection[str], known: Collection[str]) -> list[str]:
    """Peers a read failed from since the last cleanup, known to this agent and not yet marked invalid: each gets a
    fresh handshake (see ``KvloopConnectorWorker._cleanup_remote_engines``)."""
    return sorted(e for e in failed if e not in invalid and e in known)


def split_tier(num_blocks: int, host_tier_blocks: int) -> tuple[int, int]:
    """The KV allocation's ``num_blocks`` split into vLLM's pool and the host tier: ``(pool_blocks, first_id)``,
    the tier being ids ``first_id .. num_blocks - 1`` (so ``first_id == pool_blocks``). ValueError naming the
    setting when the tier would leave the pool empty."""
    if host_tier_blocks < 0 or host_tier_blocks >= num_blocks:
        raise ValueError(f"kvloop_host_tier_blocks: {host_tier_blocks} must be within 0..{num_blocks - 1} (the KV "
                         f"cache holds {num_blocks} blocks and vLLM's pool keeps the rest)")
    return num_blocks - host_tier_blocks, num_blocks - host_tier_blocks


def demotion_copies(block_ids: Sequence[int], to_ids: Sequence[int], first_id: int,
                    tier_blocks: int) -> list[tuple[int, int]] | None:
    """The ``(pool block, tier slot)`` copies that demote a retained request; None when the broker's slots do not
    fit it (one per block, each inside the tier, none twice)."""
    if len(to_ids) != len(block_ids) or len(set(to_ids)) != len(to_ids):
        return None
    if any(not first_id <= s < first_id + tier_blocks for s in to_ids):
        return None
    return list(zip(block_ids, to_ids, strict=True))


def promotion_load(slots: Sequence[int], num_tokens: int, local_tokens: int, block_size: int, first_id: int,
                   tier_blocks: int) -> int:
    """The tokens a promotion loads from the host tier: the prompt's blocks the slots hold beyond the
    ``local_tokens`` vLLM's prefix cache already has, short of the prompt's last token (vLLM computes at least
    one); 0 when a slot lies outside the tier or repeats."""
    if len(set(slots)) != len(slots) or any(not first_id <= s < first_id + tier_blocks for s in slots):
        return 0
    blocks = min(len(slots), (num_tokens - 1) // block_size)
    return max(0, blocks * block_size - local_tokens)


def promotion_copies(slots: Sequence[int], block_ids: Sequence[int], local_tokens: int, load_tokens: int,
                     block_size: int) -> list[tuple[int, int]]:
    """The ``(tier slot, pool block)`` copies of a promotion: the loaded blocks follow the locally cached ones, in
    the request's block list as in the slots."""
    first = local_tokens // block_size
    return [(slots[i], block_ids[i]) for i in range(first, first + load_tokens // block_size)]


def bytes_per_block(tensor_sizes: Sequence[int], num_blocks: int) -> int:
    """KV bytes one block occupies across all layers' cache tensors (0 when unknown)."""
    return sum(int(s) for s in tensor_sizes) // max(1, int(num_blocks)) if tensor_sizes else 0
