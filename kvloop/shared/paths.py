"""Where kvloop runs from: the repository checkout (development, ``deploy/local/run.sh``) or an installed wheel."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""The ``kvloop`` package folder (in a checkout: ``<repo>/kvloop``; installed: ``site-packages/kvloop``)."""

IMPORT_ROOT = PACKAGE_DIR.parent
"""The folder to put on ``PYTHONPATH`` so that child processes import this same ``kvloop``."""


def checkout_root() -> Path | None:
    """The repository root when kvloop runs from a checkout (it has ``pyproject.toml`` and ``protos/``), else None."""
    if (IMPORT_ROOT / "pyproject.toml").is_file() and (IMPORT_ROOT / "protos").is_dir():
        return IMPORT_ROOT
    return None
