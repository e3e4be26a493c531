"""Regenerate the Python stubs in ``kvloop/v1`` from ``protos/``: ``python -m kvloop.shared.protogen``.

The output is committed; ``tests/unit/test_protos_fresh.py`` fails when it is stale. grpcio-tools is
pinned in the ``dev`` extra so that the same command gives the same bytes everywhere.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvloop.shared.paths import IMPORT_ROOT

REPO = IMPORT_ROOT  # protos/ and kvloop/v1 live in the repository root
PROTO_ROOT = REPO / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("kvloop/**/*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` for every proto under ``out_dir``."""
    from grpc_tools import protoc  # dev-only dependency

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    protos = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    stems = [out_dir / p.removesuffix(".proto") for p in protos]
    return [s.with_name(s.name + suffix) for s in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO, help="output root (default: the repository)")
    ns = parser.parse_args(argv)
    for path in generate(ns.out):
        print(path.relative_to(ns.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
