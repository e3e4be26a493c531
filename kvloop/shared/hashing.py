"""Block keys: chained content hashes of KV blocks, identical in every kvloop process.

The specification is in ``docs/block-keys.md``; this module is its reference implementation. The
router, the engines' connector and the tests compute keys only through these functions, so a
change here is a protocol change (bump ``KEY_VERSION``).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

KEY_VERSION = b"kvloop-block-v1"
KEY_BYTES = 32
ROOT_PARENT = bytes(KEY_BYTES)
_MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Everything besides token ids that makes two blocks' KV differ."""

    layout_fingerprint: str
    """Model and KV-layout fingerprint (see ``layout_fingerprint``)."""
    lora_id: str = ""
    """LoRA adapter name or id; empty for the base model."""
    cache_dtype: str = "auto"
    """KV cache dtype as the engine runs it (``auto``, ``fp8``, ...)."""

    def digest(self) -> bytes:
        parts = (self.layout_fingerprint, self.lora_id, self.cache_dtype)
        h = hashlib.sha256(KEY_VERSION + b"/extra")
        for part in parts:
            raw = part.encode("utf-8")
            h.update(struct.pack("<I", len(raw)))
            h.update(raw)
        return h.digest()


def layout_fingerprint(**fields: str | int | float | bool) -> str:
    """A short stable id of a model's KV layout, e.g. model name, layers, KV heads, head dim, dtype,
    block size. Engines whose fingerprints differ never share blocks."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:24]


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}]: {exc}") from None


def block_key(parent: bytes, tokens: Sequence[int], extra_digest: bytes) -> bytes:
    """sha256(version | parent | n | tokens as little-endian u32 | extra digest)."""
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    packed = _pack_tokens(tokens)
    h = hashlib.sha256(KEY_VERSION)
    h.update(parent)
    h.update(struct.pack("<I", len(tokens)))
    h.update(packed)
    h.update(extra_digest)
    return h.digest()


def block_keys(tokens: Sequence[int], block_size: int, extra: ExtraKeys) -> list[bytes]:
    """Keys of the full blocks of ``tokens``; a trailing partial block has no key."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    extra_digest = extra.digest()
    keys: list[bytes] = []
    parent = ROOT_PARENT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size], extra_digest)
        keys.append(parent)
    # The trailing partial block gets no key, but its token ids must be valid all the same: whether
    # an input is accepted must not depend on where its last full block ends.
    _pack_tokens(tokens[len(keys) * block_size :])
    return keys


def common_prefix_blocks(a: Sequence[bytes] | Sequence[str] | Sequence[int],
                         b: Sequence[bytes] | Sequence[str] | Sequence[int]) -> int:
    """Length of the longest run of equal keys from the first block (whole keys, digests of them, or a trace's
    hash ids)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
