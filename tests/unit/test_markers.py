"""``-m "not slow"`` starts no engine: the ``slow`` and ``vllm`` markers follow the engine fixtures
(tests/engines/conftest.py), and a test left unmarked that starts an engine fails (``no_engine_unless_slow``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)


def test_tests_that_use_an_engine_fixture_are_slow_whatever_their_own_markers() -> None:
    fast = run_pytest("--collect-only", "-m", "not slow", "tests/engines/test_launcher.py").stdout
    assert "test_bad_config_fails_naming_the_field_before_any_process" in fast  # plain code stays in
    # Used pd_engines with no marker of its own (the markers sat on a helper above it).
    assert "test_each_engine_computes_on_its_own_cores" not in fast
    assert "test_both_engines_answer_health_and_models" not in fast


def test_an_unmarked_test_that_starts_an_engine_fails(tmp_path: Path) -> None:
    probe = ROOT / "tests" / "engines" / "test_zz_marker_probe.py"
    probe.write_text("from kvloop.app.engine_set import start_engines\n"
                     "from kvloop.engines.config import EngineConfig\n\n\n"
                     "def test_unmarked(tmp_path):\n"
                     "    (tmp_path / 'config.json').write_text('{}')\n"
                     "    start_engines([EngineConfig(model=tmp_path, engine_id='x', work_dir=tmp_path)])\n")
    try:
        done = run_pytest("-m", "not slow", str(probe))
    finally:
        probe.unlink()
    assert done.returncode == 1 and "starts an engine but is not marked slow" in done.stdout, done.stdout[-2000:]


def test_no_test_module_imports_another() -> None:
    """Shared fakes and helpers live in ``tests/support`` (or a folder's ``helpers.py``), not in test modules."""
    import ast

    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
                last = node.module.rsplit(".", 1)[-1]
                if last.startswith("test_"):
                    offenders.append(f"{path.relative_to(ROOT)}: from {node.module}")
    assert offenders == []
