"""``kvloop plan roofline`` (kvloop.app.fleet.roofline_cli): a spec of public figures becomes a profile whose prefills
reproduce the published ones it was fitted to, a figure without a source is refused by name, and bad input exits 2."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from kvloop.app.fleet.roofline_cli import build, roofline_main
from kvloop.shared.engine_model import load_profile
from kvloop.shared.engine_model.roofline import lone_prefill_s
from kvloop.shared.errors import ConfigError


def fake_spec() -> dict[str, Any]:
    return {
        "accelerator": {"name": "fake-gpu", "dense_flops": 1e15, "memory_bytes_per_s": 3e12, "memory_bytes": 80e9,
                        "source": "fake: the tests' accelerator"},
        "model": {"name": "fake-8b", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
                  "intermediate": 14336, "vocab": 128256, "source": "fake: a Llama-3.1-8B-like shape"},
        "deployment": {"tensor_parallel": 1, "memory_efficiency": 0.8, "efficiency_source": "fake: memory",
                       "network_bytes_per_s": 25e9, "network_latency_s": 0.01, "network_source": "fake: network"},
        "fit": {"points": [[2000, 0.09], [24000, 0.75]], "source": "fake: two prefills"},
    }


def test_a_spec_becomes_a_profile_that_reproduces_its_published_prefills() -> None:
    profile, report = build(fake_spec())
    for tokens, published in ((2000, 0.09), (24000, 0.75)):
        assert lone_prefill_s(profile, tokens) == pytest.approx(published, rel=1e-3)
    assert 0 < report["compute_efficiency"] <= 1 and report["api_request_s"] > 0
    assert profile.source["prefill"].startswith("derived: roofline of fake-8b")
    assert "fitted: compute efficiency fitted to prefills of 0.09 s at 2000 tokens" in profile.source["prefill"]
    assert profile.source["api"].startswith("fitted: the fixed cost")


@pytest.mark.parametrize(("section", "key"), [("accelerator", "source"), ("fit", "source"),
                                              ("deployment", "network_source")])
def test_a_figure_without_a_source_is_refused_by_name(section: str, key: str) -> None:
    spec = fake_spec()
    spec[section][key] = "from a slide I remember"
    with pytest.raises(ConfigError) as err:
        build(spec)
    assert err.value.field == f"{section}.{key}"


def test_the_command_writes_the_profile_and_bad_input_exits_2(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    spec, out = tmp_path / "spec.json", tmp_path / "gpu" / "profile.json"
    spec.write_text(json.dumps(fake_spec()))
    assert roofline_main(argparse.Namespace(spec=spec, out=out)) == 0
    assert load_profile(out).name == "roofline fake-8b tp1 fake-gpu"
    spec.write_text("{not json")
    assert roofline_main(argparse.Namespace(spec=spec, out=out)) == 2
    assert "is not JSON" in capsys.readouterr().err
    bad = fake_spec()
    bad["fit"]["points"] = [[2000, 0.09]] * 2
    spec.write_text(json.dumps(bad))
    assert roofline_main(argparse.Namespace(spec=spec, out=out)) == 2
    assert "--spec: fit: the prompt lengths must differ" in capsys.readouterr().err
