"""``kvloop model tiny`` (engines.model): a small causal LM built here, without downloads.

Builds with a small shape and a short training on a fixed slice of the Python standard library (the
same on every machine with this Python), so the whole file takes well under a minute: one model
trained long enough to use its context (~10 s), three 30-step builds for determinism, untrained ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from kvloop.engines import model as tiny

pytestmark = pytest.mark.slow

SHAPE: dict[str, Any] = {"hidden": 96, "layers": 2, "heads": 2, "kv_heads": 1, "vocab": 512,
                         "max_positions": 4096, "batch_size": 8, "seq_len": 64, "lr": 5e-3, "threads": 1}
STEPS = 250  # the shared trained model: eval loss ~3.6 against a unigram entropy ~5
WEIGHTS = "model.safetensors"


def corpus() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("[a-c]*.py") if p.is_file())


def build(out: Path, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {**SHAPE, "seed": 0, "train_steps": STEPS, "train_seconds": 120.0,
                              "text_files": corpus(), **overrides}
    return tiny.build_tiny_model(out, **kwargs)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("tiny") / "seed0"
    return out, build(out)


def test_writes_a_model_directory(built: tuple[Path, dict[str, Any]]) -> None:
    out, summary = built
    for name in ("config.json", WEIGHTS, "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "kvloop_model.json"):
        assert (out / name).is_file(), name
    record = json.loads((out / "kvloop_model.json").read_text())
    assert record["seed"] == 0 and record["hidden"] == 96 and record["dtype"] == "bfloat16"
    assert record["train_steps"] == STEPS and record["cut_short"] is False
    assert record["weights_sha256"][WEIGHTS] == sha(out / WEIGHTS)
    files = {r["path"]: r["sha256"] for r in record["corpus"]["list"]}
    assert files and all(sha(Path(p)) == digest for p, digest in files.items())
    assert record["params"] == summary["params"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] == 1 and config["vocab_size"] == 512


def test_training_lowers_the_loss_below_any_context_free_predictor(built: tuple[Path, dict[str, Any]]) -> None:
    _, summary = built
    assert summary["final_loss"] < summary["initial_loss"] - 1.0
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 1.0
    assert summary["eval_loss_after"] < summary["eval_unigram_entropy"] - 0.5
    assert summary["uses_context"] is True


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    first = build(tmp_path / "first", train_steps=30)
    again = build(tmp_path / "again", train_steps=30)
    other = build(tmp_path / "other", train_steps=30, seed=1)
    assert first["train_steps"] == again["train_steps"] == other["train_steps"] == 30
    assert sha(tmp_path / "again" / WEIGHTS) == sha(tmp_path / "first" / WEIGHTS)
    assert again["final_loss"] == first["final_loss"]
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        assert sha(tmp_path / "again" / name) == sha(tmp_path / "first" / name), name
    assert sha(tmp_path / "other" / WEIGHTS) != sha(tmp_path / "first" / WEIGHTS)
    assert sha(tmp_path / "other" / "tokenizer.json") == sha(tmp_path / "first" / "tokenizer.json")  # corpus only


def test_loads_with_transformers_and_depends_on_context(built: tuple[Path, dict[str, Any]]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = built
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    lm = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert lm.dtype == torch.bfloat16

    def greedy(prompt: str) -> list[int]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = lm.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
        return [int(t) for t in gen[0, ids.shape[1]:]]

    a = greedy("import os\nimport sys\n\n\ndef main(")
    b = greedy("Copyright (C) the authors. All rights")
    assert len(a) == len(b) == 12
    assert a != b, (tok.decode(a), tok.decode(b))
    assert len(set(a)) > 1 and len(set(b)) > 1, (tok.decode(a), tok.decode(b))  # not one token repeated


def test_chat_template(built: tuple[Path, dict[str, Any]]) -> None:
    from transformers import AutoTokenizer

    out, _ = built
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, tokenize=False).endswith("Hello there<|im_end|>\n")
    ids = tok(text, add_special_tokens=False).input_ids
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>"
    gen = json.loads((out / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen["eos_token_id"]
    assert "max_new_tokens" not in gen and "do_sample" not in gen  # vLLM would take them as defaults
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # also known to transformers 4.x
    assert config["chat_template"] == tiny.CHAT_TEMPLATE


def test_untrained_float32_qwen3(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    summary = build(tmp_path / "u", train_steps=0, dtype="float32", arch="qwen3")
    assert summary["train_steps"] == 0 and summary["trained"] is False and summary["final_loss"] is None
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "u", local_files_only=True)
    assert type(lm).__name__ == "Qwen3ForCausalLM"
    assert str(lm.dtype) == "torch.float32"
    capped = build(tmp_path / "c", train_seconds=0)
    assert capped["train_steps"] == 0 and capped["cut_short"] is False


def test_cli_flags(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    tiny.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "m")])
    assert (args.seed, args.hidden, args.layers, args.heads, args.kv_heads) == (0, 256, 4, 4, 2)
    assert (args.vocab, args.max_positions, args.dtype, args.arch) == (4096, 32768, "bfloat16", "llama")
    assert args.train_steps > 0 and args.train_seconds > 0 and args.text_dir is None
    text = tmp_path / "text"
    text.mkdir()
    for p in corpus()[:6]:
        (text / p.name).write_text(p.read_text())
    args = parser.parse_args(["--out", str(tmp_path / "m"), "--text-dir", str(text), "--hidden", "64",
                              "--layers", "1", "--vocab", "512", "--train-steps", "2", "--seq-len", "64",
                              "--batch-size", "2", "--dtype", "float32", "--threads", "1"])
    assert tiny.main(args) == 0
    record = json.loads((tmp_path / "m" / "kvloop_model.json").read_text())
    assert record["train_steps"] == 2 and record["corpus"]["files"] == 6 and record["dtype"] == "float32"
