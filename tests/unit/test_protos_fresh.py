"""The committed stubs in kvloop/v1 are exactly what the pinned grpcio-tools makes of protos/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvloop.shared import protogen


def test_generated_stubs_are_up_to_date(tmp_path: Path) -> None:
    # protoc runs in a process of its own: in-process, after the whole suite had loaded vLLM, torch, NIXL and
    # cryptography into pytest, grpc_tools' protoc crashed the run with a segfault (a fresh-clone CI run).
    result = subprocess.run([sys.executable, "-m", "kvloop.shared.protogen", "--out", str(tmp_path)], cwd=protogen.REPO,
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    generated = [tmp_path / line for line in result.stdout.split()]
    assert generated, "no .proto files found under protos/"
    assert {p.relative_to(tmp_path).as_posix() for p in generated} >= {
        "kvloop/v1/broker_pb2.py", "kvloop/v1/broker_pb2.pyi", "kvloop/v1/broker_pb2_grpc.py"}
    stale = []
    for path in generated:
        rel = path.relative_to(tmp_path)
        committed = protogen.REPO / rel
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(rel.as_posix())
    assert not stale, (f"stale generated stubs: {stale}; regenerate them with `python -m kvloop.shared.protogen` "
                       "and commit the result")


def test_every_proto_has_committed_stubs() -> None:
    for proto in protogen.proto_files():
        stem = protogen.REPO / proto.relative_to(protogen.PROTO_ROOT).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = stem.with_name(stem.name + suffix)
            assert path.exists(), f"{path} is missing; run `python -m kvloop.shared.protogen`"
