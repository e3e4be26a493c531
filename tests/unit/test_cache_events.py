"""The sidecar's translation of vLLM's KV cache events into kvloop keys (engines/sidecar/cache_events.py), fed by a
fake publisher that encodes events the way vLLM 0.32's ZmqEventPublisher does (msgpack, maps tagged by type)."""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvloop.engines.sidecar.cache_events import (
    Batch,
    CacheMirror,
    Outbox,
    SeqTracker,
    Verdict,
    decode_batch,
    needs_resync,
)
from kvloop.shared.hashing import ExtraKeys, block_keys

FP = "fp-events"
BS = 4


class FakePublisher:
    """A stand-in (fake) for vLLM's engine and publisher: a prefix cache of vLLM-style hashes that emits
    BlockStored / BlockRemoved / AllBlocksCleared the way vLLM's BlockPool does, as msgpack payloads."""

    def __init__(self, block_size: int = BS, medium: str | None = "GPU") -> None:
        self.block_size = block_size
        self.medium = medium
        self.cached: dict[bytes, list[int]] = {}  # vLLM hash -> the tokens from the prompt's start to its block's end
        self.copies: Counter[bytes] = Counter()  # physical blocks holding it: a miss recomputes cached later blocks

    def vllm_hash(self, prefix: list[int], salt: str = "") -> bytes:
        return hashlib.sha256(repr((salt, prefix)).encode()).digest()  # any scheme kvloop cannot recompute

    def run(self, tokens: list[int], *, lora: str = "", salt: str = "") -> dict[str, Any] | None:
        """A request: its leading cached blocks are hits; the rest of its full blocks get stored (one event)."""
        bs, n = self.block_size, len(tokens) // self.block_size
        hashes = [self.vllm_hash(tokens[: (i + 1) * bs], salt + lora) for i in range(n)]
        hit = 0
        while hit < n and hashes[hit] in self.cached:
            hit += 1
        if hit == n:
            return None
        for i in range(hit, n):
            self.cached[hashes[i]] = tokens[: (i + 1) * bs]
            self.copies[hashes[i]] += 1
        extras: list[Any] = [None] * (n - hit)
        if lora:
            extras = [[lora]] * (n - hit)
        if salt and hit == 0:
            extras[0] = [*(extras[0] or []), salt]
        return {"type": "BlockStored", "block_hashes": hashes[hit:],
                "parent_block_hash": hashes[hit - 1] if hit else None, "token_ids": tokens[hit * bs: n * bs],
                "block_size": bs, "lora_id": None, "medium": self.medium, "lora_name": lora or None,
                "extra_keys": extras if (lora or salt) else None}

    def evict(self, h: bytes) -> dict[str, Any]:
        """One physical block holding ``h`` is reused for something else."""
        self.copies[h] -= 1
        if not self.copies[h]:
            del self.cached[h], self.copies[h]
        return {"type": "BlockRemoved", "block_hashes": [h], "medium": self.medium}

    @staticmethod
    def payload(*events: dict[str, Any] | None) -> bytes:
        return msgspec.msgpack.encode([1.0, [e for e in events if e is not None], None])


def mirror(max_blocks: int = 1000) -> CacheMirror:
    return CacheMirror(BS, FP, max_blocks)


def sent(box: Outbox) -> list[Batch]:
    out = []
    while (batch := box.take(3)) is not None:
        out.append(batch)
    return out


def test_keys_are_the_routers_block_keys() -> None:
    pub, m = FakePublisher(), mirror()
    first = list(range(100, 114))  # 3 full blocks and a partial one
    second = [*first[:8], 7, 7, 7, 7, 8, 8, 8, 8]  # shares two blocks, then its own two
    assert m.apply(decode_batch(pub.payload(pub.run(first)))) == []
    assert m.apply(decode_batch(pub.payload(pub.run(second)))) == []
    expected = block_keys(first, BS, ExtraKeys(FP))
    assert m.keys() == [*expected, *block_keys(second, BS, ExtraKeys(FP))[2:]]
    batches = sent(m.outbox)
    assert batches[0].seq == 1 and [b.seq for b in batches] == list(range(1, len(batches) + 1))
    assert [k for b in batches for k in b.stored] == m.keys() and not any(b.removed for b in batches)


def test_removal_and_duplicate_copies() -> None:
    pub, m = FakePublisher(), mirror()
    toks = list(range(8))
    stored = pub.run(toks)
    m.apply([stored, stored])  # two physical copies of the same content (vLLM does not deduplicate)
    sent(m.outbox)
    h = stored["block_hashes"][1]  # type: ignore[index]
    m.apply([{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"}])
    assert len(m) == 2 and not m.outbox  # one copy left: still cached
    m.apply([{"type": "BlockRemoved", "block_hashes": [h, b"never-seen"], "medium": "GPU"}])
    assert m.keys() == block_keys(toks, BS, ExtraKeys(FP))[:1]
    assert sent(m.outbox)[0].removed == block_keys(toks, BS, ExtraKeys(FP))[1:]


def test_unknown_parent_resets_once_until_a_clear() -> None:
    pub, m = FakePublisher(), mirror()
    m.apply([pub.run(list(range(8)))])
    sent(m.outbox)
    other = FakePublisher()
    other.run(list(range(50, 58)))  # the mirror never saw these blocks stored: missed events
    child = other.run(list(range(50, 62)))
    assert m.apply([child]) == ["unknown_parent"]
    assert len(m) == 0 and not m.complete
    (batch,) = sent(m.outbox)
    assert batch.reset and not batch.stored  # the broker forgets this engine's index
    grandchild = other.run(list(range(50, 66)))
    assert m.apply([grandchild]) == [] and len(m) == 0  # children of unnamed blocks stay unnamed: no more resets
    assert m.apply([pub.run(list(range(200, 204)))]) == [] and len(m) == 1  # new prompts are named again
    m.apply([{"type": "AllBlocksCleared"}])
    assert m.complete and len(m) == 0
    batches = sent(m.outbox)
    assert batches[-1].cleared and not batches[-1].reset


def test_salted_blocks_are_unnamed_and_loras_named_with_their_adapter() -> None:
    pub, m = FakePublisher(), mirror()
    assert m.apply([pub.run(list(range(12)), salt="secret")]) == []
    assert len(m) == 0  # a cache salt changes vLLM's hash but no kvloop key: leave it out, children too
    assert m.apply([pub.run(list(range(12)), lora="adapter-1")]) == []
    assert m.keys() == block_keys(list(range(12)), BS, ExtraKeys(FP, "adapter-1"))


def test_other_media_groups_and_sizes_are_left_out() -> None:
    offload, m = FakePublisher(medium="CPU"), mirror()
    m.apply([offload.run(list(range(8)))])
    group1 = FakePublisher().run(list(range(8)))
    assert group1 is not None
    m.apply([{**group1, "group_idx": 1}])
    partial = FakePublisher(block_size=2).run(list(range(8)))
    assert partial is not None
    assert m.apply([partial]) == []
    assert len(m) == 0 and m.complete
    legacy = FakePublisher(medium=None)  # an older publisher that names no medium
    m.apply([legacy.run(list(range(8)))])
    assert len(m) == 2


def test_the_mirror_fills_the_outbox_it_is_given() -> None:
    box = Outbox()  # empty, so falsy: the mirror must still use it
    m = CacheMirror(BS, FP, 10, box)
    m.apply([FakePublisher().run(list(range(8)))])
    assert box.take(10) == Batch(1, False, False, m.keys(), [])


def test_a_full_mirror_starts_over() -> None:
    pub, m = FakePublisher(), mirror(max_blocks=3)
    assert m.apply([pub.run(list(range(16)))]) == ["mirror_full"]
    assert len(m) == 1 and m.outbox.reset


def test_outbox_coalesces_and_splits() -> None:
    box = Outbox()
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    box.stored(a)
    box.stored(b)
    box.removed(a)  # stored then removed within one window: removed
    box.stored(c)
    box.stored(d)
    first, second = box.take(2), box.take(2)
    assert first == Batch(1, False, False, [b], [a]) and second == Batch(2, False, False, [c, d], [])
    assert box.take(2) is None
    box.stored(a)
    box.clear()  # what came before a clear does not matter
    box.stored(b)
    assert box.take(10) == Batch(3, False, True, [b], [])
    box.resync([c, d])
    assert box.take(1) == Batch(4, True, False, [c], []) and box.take(1) == Batch(5, False, False, [d], [])
    box.resync([])
    assert box.take(1) == Batch(6, True, False, [], [])


def test_acks_that_need_a_resync() -> None:
    plain, asked = Batch(4, False, False, [], []), Batch(4, True, False, [], [])
    assert not needs_resync(plain, False, 5)
    assert needs_resync(plain, True, 5)  # the broker reset on its own (a gap, a new leader)
    assert not needs_resync(asked, True, 5)  # it reset because we asked
    assert needs_resync(plain, False, 9)


def test_publisher_sequence() -> None:
    t = SeqTracker()
    assert t.check(0) is Verdict.APPLY
    t.applied(0)
    assert t.check(3) is Verdict.GAP and t.check(1) is Verdict.APPLY
    t.applied(1)
    t.applied(2)
    assert t.check(1) is Verdict.DUPLICATE and t.check(0) is Verdict.RESTART
    assert SeqTracker().check(5) is Verdict.GAP  # subscribed late: ask for 0..4


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1.0, [3]])])
def test_malformed_payloads(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload)


ops = st.lists(st.one_of(
    st.tuples(st.just("run"), st.lists(st.integers(0, 2), min_size=0, max_size=4)),
    st.tuples(st.just("evict"), st.integers(0, 1000)),
    st.tuples(st.just("clear"), st.just(0)),
), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_mirror_names_exactly_what_the_engine_caches(script: list[tuple[str, Any]]) -> None:
    """Whatever the order of requests and evictions, the mirror names the block keys of every cached block."""
    pub, m = FakePublisher(block_size=1), CacheMirror(1, FP, 1000)
    for op, arg in script:
        if op == "run":
            event = pub.run([10 + t for t in arg])
            m.apply([event] if event else [])
        elif op == "evict" and pub.cached:
            m.apply([pub.evict(sorted(pub.cached)[arg % len(pub.cached)])])
        elif op == "clear":
            pub.cached.clear()
            pub.copies.clear()
            m.apply([{"type": "AllBlocksCleared"}])
        assert m.complete
        assert set(m.keys()) == {block_keys(prefix, 1, ExtraKeys(FP))[-1] for prefix in pub.cached.values()}
