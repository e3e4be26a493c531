"""The engine tests' model (``python -m tests.support.models`` builds it ahead of a run, and prints its path)."""

from __future__ import annotations

import json
from pathlib import Path

SESSION_MODEL = {"seed": 0, "dtype": "float32", "train_steps": 200, "seq_len": 64, "batch_size": 16,
                 "train_seconds": 900}
"""Float32 for exact comparisons, trained until its outputs depend on its context (an untrained model repeats one
token whatever its prompt, so equal outputs would prove little). About a minute to build on a 2-core machine,
then kept between runs (:func:`kvloop.engines.model.cached_model`)."""


def session_model() -> Path:
    """A tiny Llama (hidden 256, 4 layers, vocab 4096) in float32 whose record says ``uses_context``."""
    from kvloop.engines.model import cached_model

    out = cached_model(**SESSION_MODEL)
    record = json.loads((out / "kvloop_model.json").read_text())
    assert record["uses_context"] is True, f"{out}: training left the model ignoring its context: {record}"
    return out


if __name__ == "__main__":
    print(session_model())
