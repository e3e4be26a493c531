"""``kvloop plan roofline``: an engine profile for hardware this machine lacks, derived from a spec file of public
figures (:mod:`kvloop.shared.engine_model.roofline`), its compute efficiency fitted to a published TTFT.

The spec (JSON) names a source for every figure group::

    {"accelerator": {"name", "dense_flops", "memory_bytes_per_s", "memory_bytes", "source"},
     "model": {"name", "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
               "weight_bytes", "kv_bytes", "source"},
     "deployment": {"tensor_parallel", "memory_efficiency", "efficiency_source", "network_bytes_per_s",
                    "network_latency_s", "network_source", ...},
     "fit": {"points": [[prompt_tokens, seconds], ...], "source"},
     "decode_fit": {"model": {...}, "tensor_parallel", "streams", "context_tokens", "step_s", "source"}}

``fit`` is the published lone prefills the compute efficiency is solved from (two or more: and the per-request
fixed cost, by least squares), ``decode_fit`` the published decode step
(of this model or another on the same accelerator) the memory efficiency is solved from; without them the
deployment gives ``compute_efficiency`` and ``memory_efficiency`` itself. A source must begin ``public:`` (or
``fitted:``/``derived:`` for figures made from public ones): a figure without one is refused, not used.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from kvloop.shared.engine_model import dump_profile
from kvloop.shared.engine_model.roofline import (
    Accelerator,
    Deployment,
    ModelShape,
    efficiency_for_ttft,
    fit_prefill,
    lone_prefill_s,
    memory_efficiency_for_step,
    roofline_profile,
)
from kvloop.shared.errors import ConfigError

PUBLIC = ("public:", "fitted:", "derived:", "fake:")
"""What a spec's source may begin with (``fake:``: a test's figures, as in a profile)."""


def add_roofline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", type=Path, required=True, help="the accelerator, model, deployment and fit (JSON)")
    parser.add_argument("--out", type=Path, required=True, help="write the profile here (kvloop plan simulate's input)")


def _typed(kind: type, raw: Any, section: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"spec.{section}: must be an object", field=section)
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"spec.{section}: unknown {unknown}", field=section)
    try:
        return kind(**raw)
    except TypeError as exc:
        raise ConfigError(f"spec.{section}: {exc}", field=section) from None


def _sourced(text: Any, where: str) -> str:
    if not isinstance(text, str) or not text.startswith(PUBLIC):
        raise ConfigError(f"spec.{where}: must say where its figures came from, beginning with one of {list(PUBLIC)}",
                          field=where)
    return text


def build(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The profile from a spec, and what the fits found (the efficiencies, the figures they reproduce)."""
    gpu = _typed(Accelerator, spec.get("accelerator"), "accelerator")
    model = _typed(ModelShape, spec.get("model"), "model")
    _sourced(gpu.source, "accelerator.source")
    _sourced(model.source, "model.source")
    raw = dict(spec.get("deployment") or {})
    _sourced(raw.get("network_source"), "deployment.network_source")
    fit, decode_fit = spec.get("fit"), spec.get("decode_fit")
    _check_fit(fit, "fit", ("points", "source"))
    points = _points(fit) if fit is not None else []
    _check_fit(decode_fit, "decode_fit", ("model", "tensor_parallel", "streams", "context_tokens", "step_s", "source"))
    compute = float(raw.get("compute_efficiency", 1.0))
    memory = float(raw.get("memory_efficiency", 1.0))
    # Each fit's figure has a small part the other efficiency prices (a prefill step reads the weights, a decode
    # step computes its tokens): solved in turn until both settle.
    for _ in range(4):
        trial = _typed(Deployment, {**raw, "compute_efficiency": compute, "memory_efficiency": memory}, "deployment")
        if decode_fit is not None:
            other = _typed(ModelShape, decode_fit["model"], "decode_fit.model")
            memory = memory_efficiency_for_step(gpu, other, replace(trial, tensor_parallel=int(
                decode_fit["tensor_parallel"])), int(decode_fit["streams"]), int(decode_fit["context_tokens"]),
                float(decode_fit["step_s"]))
            trial = replace(trial, memory_efficiency=memory)
        if len(points) == 1:
            compute = efficiency_for_ttft(gpu, model, trial, *points[0])
        elif points:
            compute, fixed = fit_prefill(gpu, model, trial, points)
            raw["api_request_s"] = round(fixed, 5)
    report: dict[str, Any] = {}
    notes = []
    if fit is not None:
        raw["compute_efficiency"] = round(compute, 4)
        shown = ", ".join(f"{s:g} s at {n} tokens" for n, s in points)
        notes.append(f"compute efficiency fitted to prefills of {shown} ({fit['source']})")
        report["compute_efficiency"] = raw["compute_efficiency"]
        if len(points) > 1:
            raw["overheads_source"] = (f"fitted: the fixed cost of a request through prefills of {shown} "
                                       f"({fit['source']}); the router's own not modelled (0)")
            report["api_request_s"] = raw["api_request_s"]
    if decode_fit is not None:
        raw["memory_efficiency"] = round(memory, 4)
        notes.append(f"memory efficiency fitted to a {decode_fit['step_s']} s decode step of "
                     f"{decode_fit['streams']} streams of {decode_fit['model'].get('name')} on "
                     f"{decode_fit['tensor_parallel']} accelerators ({decode_fit['source']})")
        report["memory_efficiency"] = raw["memory_efficiency"]
    if notes:
        raw["efficiency_source"] = "fitted: " + "; ".join(notes) + (
            f"; otherwise {raw['efficiency_source']}" if raw.get("efficiency_source") else "")
    deployment = _typed(Deployment, raw, "deployment")
    _sourced(deployment.efficiency_source, "deployment.efficiency_source")
    profile = roofline_profile(gpu, model, deployment)
    report["modelled"] = [(n, s, round(lone_prefill_s(profile, n), 4)) for n, s in points]
    return profile, report


def _points(fit: dict[str, Any]) -> list[tuple[int, float]]:
    raw = fit["points"]
    if not isinstance(raw, list) or not raw or not all(isinstance(p, list) and len(p) == 2 for p in raw):
        raise ConfigError("spec.fit.points: a list of [prompt_tokens, seconds] pairs", field="fit.points")
    return [(int(n), float(s)) for n, s in raw]


def _check_fit(fit: Any, name: str, keys: tuple[str, ...]) -> None:
    if fit is None:
        return
    if not isinstance(fit, dict) or not set(keys) <= set(fit):
        raise ConfigError(f"spec.{name}: needs {', '.join(keys)}", field=name)
    _sourced(fit["source"], f"{name}.source")


def roofline_main(args: argparse.Namespace) -> int:
    try:
        spec = json.loads(args.spec.read_text())
        profile, report = build(spec)
    except OSError as exc:
        print(f"kvloop plan roofline: --spec: cannot read {args.spec} ({exc.strerror})", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvloop plan roofline: --spec: {args.spec} is not JSON ({exc})", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"kvloop plan roofline: --spec: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    dump_profile(profile, args.out)
    print(f"kvloop plan roofline: {profile.name}: prefill {profile.prefill_token_s * 1e6:.2f} us a token, a decode "
          f"step {profile.step_base_s * 1e3:.2f} ms + {profile.decode_context_s * 1e9:.2f} ns a token of context, "
          f"{profile.kv_pool_blocks} blocks of {profile.block_size} tokens")
    if "compute_efficiency" in report:
        print(f"  fitted compute efficiency {report['compute_efficiency']}"
              + (f", fixed cost {report['api_request_s'] * 1e3:.1f} ms a request" if "api_request_s" in report else ""))
    for tokens, published, modelled in report["modelled"]:
        print(f"  prefill of {tokens} tokens: published {published:g} s, modelled {modelled:g} s")
    if "memory_efficiency" in report:
        print(f"  fitted memory efficiency {report['memory_efficiency']}")
    print(f"wrote {args.out}")
    return 0
