"""The engine's prefix cache as vLLM's KV cache events tell it, in kvloop block keys. Pure: no I/O, no clock.

vLLM 0.32's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``) sends each engine step's events as one
multipart message ``[topic, seq (8 bytes, big-endian, 0, 1, 2, ... per publisher), msgpack payload]``; the
payload is a ``KVEventBatch`` ``[ts, [event, ...], dp_rank]`` whose events are maps tagged by ``type``:

- ``BlockStored``: ``block_hashes`` (vLLM's own hashes, bytes or int), ``parent_block_hash`` (of the block before
  the first, or None at the prompt's start), ``token_ids`` of all the blocks, ``block_size``, ``lora_name``,
  ``medium``, ``extra_keys`` (one entry a block: the LoRA name, multimodal ids, a cache salt, ...), ``group_idx``;
- ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
- ``AllBlocksCleared``: the whole cache was reset.

vLLM's hashes cannot be computed outside the engine, so :class:`CacheMirror` keeps ``vLLM hash -> kvloop key``
and chains each stored block's key from its parent's with :func:`kvloop.shared.hashing.block_key`: the very keys
``block_keys(tokens, block_size, ExtraKeys(fingerprint, lora_name))`` gives the router. What the broker should
learn goes to an :class:`Outbox`, coalesced per key, and leaves in numbered :class:`Batch` es
(``ReportCacheEvents``). :class:`SeqTracker` finds the publisher's gaps; the shell (:mod:`.cache_feed`) asks the
publisher's replay endpoint for them.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvloop.shared.hashing import ROOT_PARENT, ExtraKeys, block_key

Hash = bytes | int
COUNTED_MEDIA: frozenset[str | None] = frozenset({"GPU", None})
"""The engine's own prefix cache. vLLM 0.32 names its device block pool "GPU" on every platform, the CPU build
included (``BlockPool(medium=MEDIUM_GPU)``); None is an older publisher's. "CPU" and "STORAGE" are offloading
tiers (OffloadingConnector, LMCache, a host pool): a prompt found there must be loaded first, so those blocks say
nothing about what the engine itself would hit; they are left out."""


def decode_batch(payload: bytes) -> list[Mapping[str, Any]]:
    """A ``KVEventBatch`` payload's events as plain maps; ``ValueError`` when it is not one."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KVEventBatch [ts, events, ...]")
    events = batch[1]
    if not all(isinstance(e, dict) and isinstance(e.get("type"), str) for e in events):
        raise ValueError("an event is not a map tagged by type")
    return events


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    reset: bool
    cleared: bool
    stored: list[bytes]
    removed: list[bytes]


class Outbox:
    """What the broker has not been told yet. The last word on each key wins (stored, then removed within one
    window, is removed); ``cleared`` and ``reset`` empty what came before them."""

    def __init__(self) -> None:
        self.reset = False
        self.cleared = False
        self.next_seq = 1
        self._pending: OrderedDict[bytes, bool] = OrderedDict()

    def stored(self, key: bytes) -> None:
        self._pending.pop(key, None)
        self._pending[key] = True

    def removed(self, key: bytes) -> None:
        self._pending.pop(key, None)
        self._pending[key] = False

    def clear(self) -> None:
        self.cleared = True
        self._pending.clear()

    def resync(self, keys: Iterable[bytes]) -> None:
        """Tell the broker everything again: a reset, then every key the mirror holds (oldest first)."""
        self.reset, self.cleared = True, False
        self._pending = OrderedDict((key, True) for key in keys)

    def __len__(self) -> int:
        return len(self._pending)

    def __bool__(self) -> bool:
        return self.reset or self.cleared or bool(self._pending)

    def take(self, max_keys: int) -> Batch | None:
        """The next batch, at most ``max_keys`` keys; the flags go with the first."""
        if not self:
            return None
        stored: list[bytes] = []
        removed: list[bytes] = []
        while self._pending and len(stored) + len(removed) < max_keys:
            key, present = self._pending.popitem(last=False)
            (stored if present else removed).append(key)
        batch = Batch(self.next_seq, self.reset, self.cleared, stored, removed)
        self.next_seq += 1
        self.reset = self.cleared = False
        return batch


def needs_resync(batch: Batch, reset: bool, expected_seq: int) -> bool:
    """Whether the broker's ack means it lost the thread: it reset without being asked, or expects another seq."""
    return (reset and not batch.reset) or expected_seq != batch.seq + 1


class Verdict(enum.Enum):
    APPLY = "apply"
    DUPLICATE = "duplicate"
    GAP = "gap"
    RESTART = "restart"


class SeqTracker:
    """The publisher's sequence: 0, 1, 2, ... from its start. ``expected`` starts at 0."""

    def __init__(self) -> None:
        self.expected = 0

    def check(self, seq: int) -> Verdict:
        if seq == self.expected:
            return Verdict.APPLY
        if seq > self.expected:
            return Verdict.GAP  # missed [expected, seq): ask the replay endpoint
        if seq == 0:
            return Verdict.RESTART  # a new publisher (the engine restarted) counts from 0 again
        return Verdict.DUPLICATE  # already applied, from a replay

    def applied(self, seq: int) -> None:
        self.expected = seq + 1


@dataclass(slots=True)
class _Block:
    key: bytes | None
    """None: content kvloop keys cannot name (a cache salt, multimodal data), or a descendant of such a block."""
    copies: int = 1
    """vLLM does not deduplicate: equal content in two physical blocks is stored (and removed) twice."""


class CacheMirror:
    """vLLM hash -> kvloop key for one engine incarnation, feeding an :class:`Outbox`.

    *Complete* (from the publisher's first batch, or since a clear), every stored block's parent is known, so an
    unknown parent means events were missed: the mirror then loses track (empties itself and tells the broker
    ``reset``). After that it is incomplete until the next clear: blocks whose parent it never saw are kept as
    unnamed, so their children chain to nothing instead of resetting again at every step."""

    MAX_LORAS = 64

    def __init__(self, block_size: int, fingerprint: str, max_blocks: int, outbox: Outbox | None = None) -> None:
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.max_blocks = max_blocks
        self.outbox = outbox if outbox is not None else Outbox()  # not `or`: an empty Outbox is falsy
        self.complete = True
        self._blocks: dict[Hash, _Block] = {}
        self._keys: dict[bytes, int] = {}  # key -> vLLM hashes naming it; insertion order = oldest first
        self._digests: dict[str, bytes] = {}

    def keys(self) -> list[bytes]:
        return list(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def apply(self, events: Iterable[Mapping[str, Any]]) -> list[str]:
        """Apply one batch's events in order; returns why the mirror lost track, if it did (normally nothing)."""
        lost: list[str] = []
        for event in events:
            kind = event.get("type")
            if kind == "AllBlocksCleared":
                self._forget(complete=True)
                self.outbox.clear()
            elif kind == "BlockStored" and self._counts(event):
                self._stored(event, lost)
            elif kind == "BlockRemoved" and self._counts(event):
                for h in event.get("block_hashes") or ():
                    self._removed(h)
        return lost

    def lose_track(self, reason: str, lost: list[str] | None = None) -> None:
        """Events were missed: what the mirror holds may be stale. Empty it and have the broker reset."""
        self._forget(complete=False)
        self.outbox.resync(())
        if lost is not None:
            lost.append(reason)

    def restart(self) -> None:
        """A new publisher (the engine restarted): its cache starts empty, and the mirror with it."""
        self._forget(complete=True)
        self.outbox.resync(())

    def _forget(self, *, complete: bool) -> None:
        self._blocks.clear()
        self._keys.clear()
        self.complete = complete

    @staticmethod
    def _counts(event: Mapping[str, Any]) -> bool:
        # Only the first KV cache group: kvloop serves single-group (full attention) models; other groups'
        # blocks repeat the same hashes with another layout.
        return event.get("medium") in COUNTED_MEDIA and event.get("group_idx") in (None, 0)

    def _digest(self, lora: str) -> bytes:
        digest = self._digests.get(lora)
        if digest is None:
            if len(self._digests) >= self.MAX_LORAS:
                self._digests.clear()
            digest = self._digests[lora] = ExtraKeys(self.fingerprint, lora).digest()
        return digest

    def _stored(self, event: Mapping[str, Any], lost: list[str]) -> None:
        hashes: Sequence[Hash] = event.get("block_hashes") or ()
        tokens: Sequence[int] = event.get("token_ids") or ()
        size = event.get("block_size")
        lora: str = event.get("lora_name") or ""
        extras = event.get("extra_keys") or [None] * len(hashes)
        if size != self.block_size or len(tokens) != len(hashes) * self.block_size or len(extras) != len(hashes):
            # A partial-block entry (hybrid models hash at a finer grain than their blocks): no kvloop block, and
            # never the parent of a full block's event (those chain from full blocks), so leaving it out is safe.
            return
        parent_hash = event.get("parent_block_hash")
        parent: bytes | None = ROOT_PARENT
        if parent_hash is not None:
            known = self._blocks.get(parent_hash)
            if known is None and self.complete:
                self.lose_track("unknown_parent", lost)
            parent = known.key if known is not None else None
        for i, h in enumerate(hashes):
            extra = extras[i]
            plain = extra is None or (bool(lora) and list(extra) == [lora])  # anything more: salt, multimodal data
            key = None
            if parent is not None and plain:
                key = block_key(parent, tokens[i * self.block_size:(i + 1) * self.block_size], self._digest(lora))
            self._store(h, key, lost)
            parent = key

    def _store(self, h: Hash, key: bytes | None, lost: list[str]) -> None:
        block = self._blocks.get(h)
        if block is not None:
            block.copies += 1
            return
        if len(self._blocks) >= self.max_blocks:
            self.lose_track("mirror_full", lost)  # more than any engine this sidecar serves holds: events are off
        self._blocks[h] = _Block(key)
        if key is not None:
            refs = self._keys.get(key, 0)
            self._keys[key] = refs + 1
            if refs == 0:
                self.outbox.stored(key)

    def _removed(self, h: Hash) -> None:
        block = self._blocks.get(h)
        if block is None:
            return  # stored before the mirror started, or a partial entry: nothing to take back
        block.copies -= 1
        if block.copies > 0:
            return
        del self._blocks[h]
        if block.key is None:
            return
        refs = self._keys[block.key] - 1
        if refs > 0:
            self._keys[block.key] = refs  # another vLLM hash still names the same content
        else:
            del self._keys[block.key]
            self.outbox.removed(block.key)
