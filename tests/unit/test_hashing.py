"""Block keys (kvloop.shared.hashing) against the specification in docs/block-keys.md."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvloop.shared.hashing import (
    KEY_BYTES,
    KEY_VERSION,
    ROOT_PARENT,
    ExtraKeys,
    block_key,
    block_keys,
    common_prefix_blocks,
    layout_fingerprint,
)

REPO = Path(__file__).resolve().parents[2]
PROPS = settings(max_examples=150, deadline=None)

token_ids = st.integers(min_value=0, max_value=2**32 - 1)
small_tokens = st.integers(min_value=0, max_value=3)  # a small alphabet makes equal blocks likely
texts = st.text(max_size=12)
extras = st.builds(ExtraKeys, layout_fingerprint=texts, lora_id=texts, cache_dtype=texts)

EXAMPLE_EXTRA = ExtraKeys("example-fingerprint")
EXAMPLE_TOKENS = list(range(1, 11))  # block size 4: two full blocks and a partial [9, 10]
# Known answers, also printed in docs/block-keys.md. They change only with KEY_VERSION.
EXAMPLE_EXTRA_DIGEST_HEX = "8609d4544ea1d31b9b447c3071c4f01386bdb0f0681ae4d9aeac80cd2ad35a30"
EXAMPLE_KEY0_HEX = "21a44ea679dd08e7f7e5e38645ffbd8e26ad451f1abac6d36a2a180de55e97b3"
EXAMPLE_KEY1_HEX = "771dc209d59b220fe1506ebde5454b3260787d08b5cf018af13ae0b6284c5ab5"


def spec_extra_digest(fingerprint: str, lora: str, dtype: str) -> bytes:
    """The extra-keys digest re-derived from the byte layout in the spec, not from the module."""
    raw = b"kvloop-block-v1" + b"/extra"
    for part in (fingerprint, lora, dtype):
        enc = part.encode("utf-8")
        raw += len(enc).to_bytes(4, "little") + enc
    return hashlib.sha256(raw).digest()


def spec_keys(tokens: list[int], block_size: int, fingerprint: str, lora: str = "", dtype: str = "auto") -> list[bytes]:
    extra = spec_extra_digest(fingerprint, lora, dtype)
    parent = b"\x00" * 32
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        raw = (
            b"kvloop-block-v1"
            + parent
            + len(block).to_bytes(4, "little")
            + b"".join(t.to_bytes(4, "little") for t in block)
            + extra
        )
        parent = hashlib.sha256(raw).digest()
        out.append(parent)
    return out


# ---------------------------------------------------------------- known answers


def test_constants_match_the_spec() -> None:
    assert KEY_VERSION == b"kvloop-block-v1"
    assert KEY_BYTES == 32
    assert ROOT_PARENT == b"\x00" * 32


def test_known_answer_vector() -> None:
    assert spec_extra_digest("example-fingerprint", "", "auto").hex() == EXAMPLE_EXTRA_DIGEST_HEX
    assert EXAMPLE_EXTRA.digest().hex() == EXAMPLE_EXTRA_DIGEST_HEX
    expected = spec_keys(EXAMPLE_TOKENS, 4, "example-fingerprint")
    assert [k.hex() for k in expected] == [EXAMPLE_KEY0_HEX, EXAMPLE_KEY1_HEX]
    assert block_keys(EXAMPLE_TOKENS, 4, EXAMPLE_EXTRA) == expected


def test_block_key_is_the_documented_sha256() -> None:
    extra = EXAMPLE_EXTRA.digest()
    parent = bytes(range(32))
    tokens = [0, 1, 2**32 - 1, 70000]
    raw = KEY_VERSION + parent + struct.pack("<I", 4) + struct.pack("<4I", *tokens) + extra
    assert block_key(parent, tokens, extra) == hashlib.sha256(raw).digest()


@PROPS
@given(
    tokens=st.lists(token_ids, max_size=40),
    block_size=st.integers(1, 9),
    fingerprint=texts,
    lora=texts,
    dtype=texts,
)
def test_block_keys_match_an_independent_derivation(
    tokens: list[int], block_size: int, fingerprint: str, lora: str, dtype: str
) -> None:
    extra = ExtraKeys(fingerprint, lora, dtype)
    assert block_keys(tokens, block_size, extra) == spec_keys(tokens, block_size, fingerprint, lora, dtype)


def test_keys_are_stable_across_processes() -> None:
    code = (
        "from kvloop.shared.hashing import ExtraKeys, block_keys\n"
        "keys = block_keys(list(range(1, 11)), 4, ExtraKeys('example-fingerprint'))\n"
        "print(' '.join(k.hex() for k in keys))\n"
    )
    results = set()
    for seed in ("0", "12345"):  # str hashing differs between these; block keys must not
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=60
        )
        results.add(out.stdout.strip())
    assert results == {f"{EXAMPLE_KEY0_HEX} {EXAMPLE_KEY1_HEX}"}
    here = block_keys(EXAMPLE_TOKENS, 4, EXAMPLE_EXTRA)
    assert " ".join(k.hex() for k in here) in results


# ---------------------------------------------------------------- structure


@PROPS
@given(tokens=st.lists(small_tokens, max_size=30), block_size=st.integers(1, 6), extra=extras)
def test_deterministic_one_key_per_full_block(tokens: list[int], block_size: int, extra: ExtraKeys) -> None:
    keys = block_keys(tokens, block_size, extra)
    assert keys == block_keys(tuple(tokens), block_size, ExtraKeys(*_fields(extra)))
    assert len(keys) == len(tokens) // block_size
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    # Chained: each key is the block key of its block over the previous key.
    parent = ROOT_PARENT
    for i, key in enumerate(keys):
        assert key == block_key(parent, tokens[i * block_size : (i + 1) * block_size], extra.digest())
        parent = key


def _fields(extra: ExtraKeys) -> tuple[str, str, str]:
    return extra.layout_fingerprint, extra.lora_id, extra.cache_dtype


@PROPS
@given(
    tokens=st.lists(small_tokens, max_size=30),
    tail=st.lists(small_tokens, max_size=8),
    block_size=st.integers(1, 6),
    extra=extras,
)
def test_trailing_partial_block_gets_no_key(
    tokens: list[int], tail: list[int], block_size: int, extra: ExtraKeys
) -> None:
    full = tokens[: len(tokens) // block_size * block_size]
    partial = tail[: block_size - 1]
    keys = block_keys(full, block_size, extra)
    assert block_keys(full + partial, block_size, extra) == keys
    # Completing the partial block adds exactly one key and keeps the earlier ones.
    completed = full + (partial + [0] * block_size)[:block_size]
    longer = block_keys(completed, block_size, extra)
    assert longer[:-1] == keys and len(longer) == len(keys) + 1


@PROPS
@given(tokens=st.lists(small_tokens, max_size=30), block_size=st.integers(1, 6), extra=extras, k=st.integers(0, 8))
def test_prefix_of_tokens_gives_prefix_of_keys(tokens: list[int], block_size: int, extra: ExtraKeys, k: int) -> None:
    assert block_keys(tokens[: k * block_size], block_size, extra) == block_keys(tokens, block_size, extra)[:k]


def test_short_inputs_have_no_keys() -> None:
    assert block_keys([], 4, EXAMPLE_EXTRA) == []
    assert block_keys([1, 2, 3], 4, EXAMPLE_EXTRA) == []
    assert len(block_keys([1, 2, 3, 4], 4, EXAMPLE_EXTRA)) == 1


# ---------------------------------------------------------------- sensitivity


@PROPS
@given(data=st.data(), tokens=st.lists(small_tokens, min_size=1, max_size=30), block_size=st.integers(1, 6))
def test_changing_one_token_changes_its_block_and_every_later_key(
    data: st.DataObject, tokens: list[int], block_size: int
) -> None:
    i = data.draw(st.integers(0, len(tokens) - 1), label="index")
    new = data.draw(token_ids.filter(lambda t: t != tokens[i]), label="new token")
    edited = [*tokens[:i], new, *tokens[i + 1 :]]
    a = block_keys(tokens, block_size, EXAMPLE_EXTRA)
    b = block_keys(edited, block_size, EXAMPLE_EXTRA)
    block = i // block_size
    assert len(a) == len(b)
    assert a[:block] == b[:block]
    # Every key from the edited block on differs (a key fixes its whole prefix) and none collide.
    assert not set(a[block:]) & set(b[block:])
    assert common_prefix_blocks(a, b) == min(block, len(a))


@PROPS
@given(
    tokens=st.lists(small_tokens, max_size=40),
    sizes=st.lists(st.integers(1, 8), min_size=2, max_size=2, unique=True),
)
def test_different_block_size_split_never_shares_a_key(tokens: list[int], sizes: list[int]) -> None:
    a = block_keys(tokens, sizes[0], EXAMPLE_EXTRA)
    b = block_keys(tokens, sizes[1], EXAMPLE_EXTRA)
    assert not set(a) & set(b)


@PROPS
@given(
    tokens=st.lists(small_tokens, min_size=1, max_size=20),
    block_size=st.integers(1, 4),
    a=extras,
    b=extras,
)
def test_any_extra_keys_field_difference_changes_every_key(
    tokens: list[int], block_size: int, a: ExtraKeys, b: ExtraKeys
) -> None:
    assume(len(tokens) >= block_size)
    ka = block_keys(tokens, block_size, a)
    kb = block_keys(tokens, block_size, b)
    if a == b:
        assert ka == kb and a.digest() == b.digest()
    else:
        assert a.digest() != b.digest()
        assert not set(ka) & set(kb)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (ExtraKeys("fp"), ExtraKeys("fp2")),
        (ExtraKeys("fp"), ExtraKeys("fp", lora_id="adapter")),
        (ExtraKeys("fp"), ExtraKeys("fp", cache_dtype="fp8")),
        # Length prefixes: moving a boundary between fields must change the digest.
        (ExtraKeys("ab", "c", "auto"), ExtraKeys("a", "bc", "auto")),
        (ExtraKeys("fp", "", "xauto"), ExtraKeys("fp", "x", "auto")),
    ],
)
def test_extra_keys_fields_are_length_prefixed(a: ExtraKeys, b: ExtraKeys) -> None:
    assert a.digest() != b.digest()
    assert block_keys([1, 2], 2, a) != block_keys([1, 2], 2, b)


def test_default_extra_fields() -> None:
    assert ExtraKeys("fp") == ExtraKeys("fp", "", "auto")
    assert ExtraKeys("fp").digest() == spec_extra_digest("fp", "", "auto")


def test_layout_fingerprint_is_canonical() -> None:
    a = layout_fingerprint(model="m", layers=2, kv_heads=8, head_dim=128, dtype="bf16", block_size=16)
    b = layout_fingerprint(block_size=16, dtype="bf16", head_dim=128, kv_heads=8, layers=2, model="m")
    assert a == b and len(a) == 24 and int(a, 16) >= 0
    expected = hashlib.sha256(
        b'{"block_size":16,"dtype":"bf16","head_dim":128,"kv_heads":8,"layers":2,"model":"m"}'
    ).hexdigest()[:24]
    assert a == expected
    assert layout_fingerprint(model="m", layers=2, kv_heads=8, head_dim=128, dtype="bf16", block_size=32) != a
    assert layout_fingerprint(model="m", layers=3, kv_heads=8, head_dim=128, dtype="bf16", block_size=16) != a


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, 1.5, "7", None])
def test_invalid_token_ids_raise_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match="token ids"):
        block_keys([1, 2, bad, 4], 2, EXAMPLE_EXTRA)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="token ids"):
        block_key(ROOT_PARENT, [bad], EXAMPLE_EXTRA.digest())  # type: ignore[list-item]


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5])
def test_invalid_token_in_trailing_partial_block_raises_too(bad: object) -> None:
    # Validity of the input must not depend on where the partial block starts.
    with pytest.raises(ValueError, match="token ids"):
        block_keys([1, 2, 3, 4, bad], 4, EXAMPLE_EXTRA)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="token ids"):
        block_keys([bad], 4, EXAMPLE_EXTRA)  # type: ignore[list-item]


def test_token_id_bounds_are_inclusive() -> None:
    assert len(block_keys([0, 2**32 - 1], 2, EXAMPLE_EXTRA)) == 1


@pytest.mark.parametrize("bad", [0, -1, -16])
def test_non_positive_block_size_raises_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1, 2, 3, 4], bad, EXAMPLE_EXTRA)
    with pytest.raises(ValueError, match="block_size"):
        block_keys([], bad, EXAMPLE_EXTRA)


@pytest.mark.parametrize("size", [0, 31, 33])
def test_parent_must_be_32_bytes(size: int) -> None:
    with pytest.raises(ValueError, match="parent"):
        block_key(b"\x01" * size, [1], EXAMPLE_EXTRA.digest())


# ---------------------------------------------------------------- common prefix


def test_common_prefix_blocks_examples() -> None:
    k = [bytes([i]) * 32 for i in range(5)]
    assert common_prefix_blocks([], []) == 0
    assert common_prefix_blocks(k, []) == 0
    assert common_prefix_blocks(k, k) == 5
    assert common_prefix_blocks(k[:3], k) == 3
    assert common_prefix_blocks(k, k[:3]) == 3
    assert common_prefix_blocks([k[0], k[2]], [k[0], k[1], k[2]]) == 1
    assert common_prefix_blocks([k[1], k[0]], [k[0], k[1]]) == 0
    # Equal keys after a difference do not count: the match runs from the first block.
    assert common_prefix_blocks([k[0], k[1], k[2]], [k[0], k[3], k[2]]) == 1


@PROPS
@given(
    a=st.lists(small_tokens, max_size=24),
    b=st.lists(small_tokens, max_size=24),
    block_size=st.integers(1, 4),
)
def test_common_prefix_blocks_counts_equal_leading_full_blocks(a: list[int], b: list[int], block_size: int) -> None:
    ka = block_keys(a, block_size, EXAMPLE_EXTRA)
    kb = block_keys(b, block_size, EXAMPLE_EXTRA)
    expected = 0
    while (
        expected < min(len(ka), len(kb))
        and a[expected * block_size : (expected + 1) * block_size]
        == b[expected * block_size : (expected + 1) * block_size]
    ):
        expected += 1
    assert common_prefix_blocks(ka, kb) == expected == common_prefix_blocks(kb, ka)
