"""Fixtures that start real vLLM engines: one tiny model built here, one prefill and one decode engine.

Both are session-scoped and shared: building the model and starting an engine take tens of seconds on
a 2-core machine. The engines start concurrently (two ``vllm serve`` processes through
:func:`engines.launcher.spawn_engine`, upstream NixlConnector, float32) and are stopped at teardown,
even when a test fails. Tests that stop them (``@pytest.mark.stops_engines``) are moved to the end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engines.config import EngineConfig, vllm_distribution
from engines.launcher import EngineProcess, plan_engine, spawn_engine

ENGINE_START_TIMEOUT_S = 600.0  # ~70 s for both on an idle 2-core machine; far more when it is shared
# Upstream's 30 s lease on the prefill's blocks can run out before the decode engine's first NIXL
# handshake on a loaded 2-core machine; the decode engine then waits forever (upstream bug, see
# engines/connector.py). Give the test room.
EXTRA_CONFIG = '{"kv_lease_duration": 180}'


def split_cpus(parts: int) -> list[str]:
    """This process's CPUs cut into ``parts`` disjoint lists for VLLM_CPU_OMP_THREADS_BIND ("auto" when too few).

    Engines on one machine need disjoint cores: vLLM's CPU workers spin (OpenMP and shared-memory
    queues), and two engines bound to the same two cores starved each other's NIXL handshake thread
    here (the decode engine waited minutes for the prefill engine's reply)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < parts:
        return ["auto"] * parts
    size = len(cpus) // parts
    return [",".join(str(c) for c in cpus[i * size:(i + 1) * size]) for i in range(parts)]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: starts real vLLM engines (needs vllm or vllm-cpu installed)")
    config.addinivalue_line("markers", "stops_engines: stops the shared engines; runs after the other tests")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("stops_engines") is not None)  # stable: order kept


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (hidden 256, 4 layers, vocab 4096) in float32, briefly trained, in a tmp folder."""
    if vllm_distribution() is None:
        pytest.skip("vLLM is not installed (pip install -e '.[cpu]' or '.[gpu]')")
    from engines.model import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(out, seed=0, dtype="float32", train_steps=4, seq_len=64, batch_size=4, train_seconds=60)
    return out


@dataclass
class PDEngines:
    prefill: EngineProcess
    decode: EngineProcess
    model_name: str
    start_seconds: float


@pytest.fixture(scope="session")
def pd_engines(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDEngines]:
    """One prefill and one decode engine (upstream NixlConnector), on free loopback ports."""
    work_dir = tmp_path_factory.mktemp("engine-work")
    started: list[EngineProcess] = []
    t0 = time.monotonic()
    try:
        for role, cpus in zip(("prefill", "decode"), split_cpus(2), strict=True):
            config = EngineConfig(role=role, model=tiny_model, dtype="float32", max_model_len=4096,
                                  work_dir=work_dir, kv_connector_extra_config=EXTRA_CONFIG,
                                  kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                                  omp_threads_bind=cpus)
            started.append(spawn_engine(plan_engine(config)))
        for engine in started:
            engine.wait_ready(ENGINE_START_TIMEOUT_S)
        yield PDEngines(prefill=started[0], decode=started[1], model_name=tiny_model.name,
                        start_seconds=time.monotonic() - t0)
    finally:
        for engine in started:
            engine.stop()
