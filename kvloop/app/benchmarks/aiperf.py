"""NVIDIA AIPerf as ``kvloop bench load``'s load generator: its environment, its command line, its records.

AIPerf (the load generator Dynamo publishes its figures with) drives an OpenAI endpoint with multi-turn chat
sessions or a Mooncake-format trace, streams, and exports one record per request. kvloop pins one version and
installs it in an environment of its own (``.kvloop/aiperf-<version>``, made by the bench on first use): in
vLLM's environment it would replace huggingface_hub, pyzmq, prometheus_client, psutil and pillow with versions
vLLM was not built against (``pip install --dry-run aiperf==0.13.0`` there says so).

:func:`command` and :func:`read_records` are pure (unit-tested in ``tests/unit/test_load_bench.py``);
:func:`ensure` does the installing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvloop.app import tool_env
from kvloop.shared import headers as hdr
from kvloop.shared import procs

VERSION = "0.13.0"
RECORDS = "profile_export.jsonl"
"""AIPerf's per-request export, one JSON object a line (``metadata`` and ``metrics``)."""


def env_dir(root: Path) -> Path:
    return tool_env.env_dir(root, "aiperf", VERSION)


def ensure(root: Path) -> Path:
    """The ``aiperf`` executable of the pinned version, installing it under ``root`` first if it is missing
    (:func:`kvloop.app.tool_env.ensure_tool`)."""
    return tool_env.ensure_tool(root, "aiperf", VERSION, "aiperf")


@dataclass(frozen=True)
class Slo:
    """DistServe's goodput: a request counts when it meets every target (milliseconds)."""
    ttft_ms: float = 1000.0
    itl_ms: float = 50.0
    """The request's mean gap between output tokens (AIPerf's ``inter_token_latency``, DistServe's TPOT)."""

    def aiperf(self) -> str:
        return f"time_to_first_token:{self.ttft_ms:g} inter_token_latency:{self.itl_ms:g}"


@dataclass(frozen=True)
class AgentLoad:
    """Synthetic multi-turn sessions that share one system prompt: every turn carries the whole history."""
    sessions: int = 32
    turns: int = 8
    system_tokens: int = 1500
    user_tokens: int = 200
    answer_tokens: int = 64
    think_ms: float = 500.0
    seed: int = 0
    turns_stddev: int = 0
    """In whole turns (AIPerf refuses a fraction)."""
    user_stddev: float = 0.0
    answer_stddev: float = 0.0
    think_stddev_ms: float = 0.0
    private_tokens: int = 0
    """Each session's own context ahead of its turns (AIPerf's user context prompt), after the shared system prompt."""

    def history_tokens(self) -> int:
        """The longest prompt a session reaches (its last turn's), a spread taken at three deviations."""
        turns = self.turns + math.ceil(3 * self.turns_stddev)
        user = self.user_tokens + 3 * self.user_stddev
        answer = self.answer_tokens + 3 * self.answer_stddev
        return self.system_tokens + self.private_tokens + math.ceil(turns * (user + answer)) + 64


@dataclass(frozen=True)
class TraceLoad:
    """A Mooncake-format trace (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``), replayed at
    its timestamps."""
    path: Path
    block_size: int = 512


def _spread(argv: list[str], load: AgentLoad) -> list[str]:
    """The load's spreads in place of the fixed zeros, and its private context (a workload shape)."""
    spreads = {"--conversation-turn-stddev": load.turns_stddev, "--prompt-input-tokens-stddev": load.user_stddev,
               "--output-tokens-stddev": load.answer_stddev}
    out = [f"{spreads[argv[i - 1]]:g}" if i and argv[i - 1] in spreads else a for i, a in enumerate(argv)]
    if load.think_stddev_ms:
        out += ["--conversation-turn-delay-stddev", f"{load.think_stddev_ms:g}"]
    if load.private_tokens:
        # AIPerf draws one context per dataset entry, and needs their count.
        out += ["--user-context-prompt-length", str(load.private_tokens), "--num-dataset-entries", str(load.sessions)]
    return out


def command(exe: Path, *, model: str, tokenizer: Path | str, url: str, concurrency: int, load: AgentLoad | TraceLoad,
            slo: Slo, artifacts: Path, timeout_s: float) -> list[str]:
    """The AIPerf command line for one load point."""
    argv = [str(exe), "profile", "--model", model, "--tokenizer", str(tokenizer), "--url", url,
            "--endpoint-type", "chat" if isinstance(load, AgentLoad) else "completions", "--streaming",
            "--goodput", slo.aiperf(), "--session-header", hdr.SESSION_ID, "--artifact-dir", str(artifacts),
            "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry", "--use-server-token-count",
            "--request-timeout-seconds", f"{timeout_s:g}", "--extra-inputs", "ignore_eos:true",
            "--concurrency", str(concurrency)]
    if isinstance(load, AgentLoad):
        argv += ["--conversation-num", str(load.sessions), "--conversation-turn-mean", str(load.turns),
                 "--conversation-turn-stddev", "0", "--conversation-turn-delay-mean", f"{load.think_ms:g}",
                 "--shared-system-prompt-length", str(load.system_tokens),
                 "--prompt-input-tokens-mean", str(load.user_tokens), "--prompt-input-tokens-stddev", "0",
                 "--output-tokens-mean", str(load.answer_tokens), "--output-tokens-stddev", "0",
                 "--random-seed", str(load.seed)]
        argv = _spread(argv, load)
    else:
        argv += ["--input-file", str(load.path), "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
                 "--isl-block-size", str(load.block_size)]
    return argv


@dataclass
class Request:
    """One request as AIPerf recorded it (milliseconds; None where AIPerf recorded none)."""
    session: str
    turn: int
    start_ns: int
    end_ns: int
    ttft_ms: float | None
    itl_ms: float | None
    """The request's mean inter-token latency."""
    e2e_ms: float | None
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    gaps_ms: list[float] = field(default_factory=list)
    """Every gap between streamed chunks after the first."""
    error: str = ""
    correlation_id: str = ""
    """The session id AIPerf sent (``X-Session-ID``): the router's records name the turn's session by it."""


def _value(metrics: dict[str, object], name: str) -> object:
    entry = metrics.get(name)
    return entry.get("value") if isinstance(entry, dict) else None


def _number(metrics: dict[str, object], name: str) -> float | None:
    value = _value(metrics, name)
    return float(value) if isinstance(value, (int, float)) else None


def parse_record(line: str) -> Request:
    """One line of :data:`RECORDS`. Raises ``ValueError`` naming what is missing."""
    data = json.loads(line)
    meta, metrics = data.get("metadata"), data.get("metrics")
    if not isinstance(meta, dict) or not isinstance(metrics, dict):
        raise ValueError("an AIPerf record needs 'metadata' and 'metrics' objects")
    gaps = _value(metrics, "inter_chunk_latency")
    error = data.get("error")
    return Request(
        session=str(meta.get("conversation_id", "")), turn=int(meta.get("turn_index", 0)),
        start_ns=int(meta.get("request_start_ns", 0)), end_ns=int(meta.get("request_end_ns", 0)),
        ttft_ms=_number(metrics, "time_to_first_token"), itl_ms=_number(metrics, "inter_token_latency"),
        e2e_ms=_number(metrics, "request_latency"),
        output_tokens=int(_number(metrics, "output_token_count") or 0),
        prompt_tokens=int(_number(metrics, "usage_prompt_tokens") or 0),
        cached_tokens=int(_number(metrics, "usage_prompt_cache_read_tokens") or 0),
        gaps_ms=[float(g) for g in gaps] if isinstance(gaps, list) else [],
        error=json.dumps(error)[:300] if error else "", correlation_id=str(meta.get("x_correlation_id") or ""))


def read_records(lines: Iterable[str]) -> list[Request]:
    return [parse_record(line) for line in lines if line.strip()]


def hub_tokenizer(model: Path, hf_home: Path) -> str:
    """A Hugging Face repo id for ``model``'s tokenizer, cached under ``hf_home`` (pass it as ``HF_HOME``).

    AIPerf 0.13 loads the tokenizer of a trace replay in worker processes in offline mode, where a local
    directory is looked up as a cached repo and refused (``HFValidationError: Repo id must be in the form
    ...``); the model is therefore linked into a hub cache layout (``models--kvloop--<name>/snapshots/local``,
    ``refs/main`` naming it) and named by that id."""
    repo = hf_home / "hub" / f"models--kvloop--{model.name}"
    (repo / "snapshots").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / "local"
    if snapshot.is_symlink() or snapshot.exists():
        snapshot.unlink()
    snapshot.symlink_to(model.absolute(), target_is_directory=True)
    (repo / "refs" / "main").write_text("local")
    return f"kvloop/{model.name}"


def run(argv: Sequence[str], artifacts: Path, timeout_s: float, hf_home: Path | None = None) -> list[Request]:
    """Runs one load point; its records. Raises ``RuntimeError`` with AIPerf's last lines when it fails."""
    artifacts.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "AIPERF_METRICS_OSL_MISMATCH_PCT_THRESHOLD": "100"}
    if hf_home is not None:
        env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    # A session of its own (procs.OWN_SESSION): the load generator must not share the in-process router's share.
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, env=env,
                          stdin=subprocess.DEVNULL, start_new_session=procs.OWN_SESSION)
    (artifacts / "aiperf.log").write_text(done.stdout[-200_000:] + done.stderr[-200_000:])
    records = artifacts / RECORDS
    if done.returncode != 0 or not records.exists():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"AIPerf exited {done.returncode}:\n{tail}")
    with records.open() as f:
        return read_records(f)


if __name__ == "__main__":  # python -m kvloop.app.benchmarks.aiperf: install it now (the test command's set-up)
    from kvloop.engines.config import default_work_dir

    print(ensure(default_work_dir()))
