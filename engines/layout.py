"""The layout fingerprint of an engine: what must be equal for two engines to share KV blocks.

It goes into every block key (:mod:`kvloop.shared.hashing`), so engines, the router and the tests must compute
it the same way: from the model directory's ``config.json`` (the whole file: layers, heads, head size,
rope settings), the sizes of its weight files (two fine-tunes of one shape differ there), the KV dtype
and the block size. The model's directory path and served name are left out on purpose: the same
model mounted at different paths shares blocks.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvloop.shared.hashing import layout_fingerprint


def model_digest(model_dir: Path) -> str:
    """sha256 of config.json's canonical JSON and the names and sizes of the weight files."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    weights = sorted((p.name, p.stat().st_size) for p in model_dir.iterdir()
                     if p.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
    canonical = json.dumps({"config": config, "weights": weights}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def resolved_dtype(model_dir: Path, dtype: str) -> str:
    """``auto`` as vLLM resolves it for KV: the model's ``torch_dtype`` (or ``dtype``), else bfloat16."""
    if dtype != "auto":
        return dtype
    config = json.loads((Path(model_dir) / "config.json").read_text())
    value = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return {"float": "float32", "half": "float16"}.get(value, value)


def engine_fingerprint(model_dir: Path, *, dtype: str, block_size: int, kv_cache_dtype: str = "auto") -> str:
    return layout_fingerprint(model=model_digest(model_dir), dtype=resolved_dtype(model_dir, dtype),
                              block_size=block_size, kv_cache_dtype=kv_cache_dtype)
