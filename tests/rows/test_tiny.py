"""Tiny models of any architecture (`attnflow.rows.tiny`) and the coverage sweep that runs them
(scripts/architectures.py): seeded builds, no constant parameter left, the generic shrink, and the
sweep's per-architecture function on a representative dozen (the whole sweep: slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnflow.rows.tiny import EXPERTS, HIDDEN, LAYERS, TOP_K, build_tiny, tiny_config, tiny_vocab

ROOT = Path(__file__).resolve().parents[2]

# What the dozen cannot run, by design, each with the part of the reason that says why (none now:
# OPT's feed-forward block, which runs on a flattened [batch * token, d] tensor, is read as
# [batch, token, d], `attnflow.rows.adapters.as_tokens`).
REFUSED: dict[tuple[str, str], str] = {}
DOZEN = [
    ("llama", "causal-lm"),
    ("gpt2", "causal-lm"),
    ("gpt_neox", "causal-lm"),
    ("gptj", "causal-lm"),
    ("phi", "causal-lm"),
    ("phi3", "causal-lm"),
    ("gemma2", "causal-lm"),
    ("olmo2", "causal-lm"),
    ("mixtral", "causal-lm"),
    ("qwen2_moe", "causal-lm"),
    ("falcon", "causal-lm"),
    ("bloom", "causal-lm"),
    ("opt", "causal-lm"),
    ("bert", "sequence-classification"),
    ("llama", "sequence-classification"),
]


@pytest.fixture
def coverage(monkeypatch):
    """scripts/architectures.py, imported as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import architectures

    return architectures


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_builds_are_seeded(tmp_path):
    first, again = (_weights(build_tiny("llama", tmp_path / name)) for name in ("a", "b"))
    other = _weights(build_tiny("llama", tmp_path / "c", seed=1))
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not all(torch.equal(first[name], other[name]) for name in first)


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen2", "olmo2", "bert"])
def test_no_parameter_is_left_constant(tmp_path, model_type):
    """Norm weights of ones (or of zeros, Gemma's 1 + w) and zero biases are perturbed: a check that
    read x·w as x·(1 + w), or dropped a bias, would fail on these models."""
    for name, tensor in _weights(build_tiny(model_type, tmp_path)).items():
        flat = tensor.flatten()
        assert flat.numel() == 1 or not bool((flat == flat[0]).all()), f"{name} is constant"


def test_the_shrink_is_generic():
    llama = tiny_config("llama")
    assert (llama.num_hidden_layers, llama.hidden_size, llama.num_attention_heads) == (LAYERS, HIDDEN, 4)
    assert llama.num_key_value_heads == 2 and llama.head_dim == 16 and llama.vocab_size >= len(tiny_vocab())
    gemma = tiny_config("gemma3_text")
    assert gemma.layer_types == ["sliding_attention", "full_attention"]  # one local, one global layer
    mixtral = tiny_config("mixtral")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (EXPERTS, TOP_K)
    gpt2 = tiny_config("gpt2")  # names of its own, through the attribute map
    assert (gpt2.n_layer, gpt2.n_embd, gpt2.n_head) == (LAYERS, HIDDEN, 4)
    deepseek = tiny_config("deepseek_v3")  # multi-head latent attention: widths derived stay consistent
    assert deepseek.qk_head_dim == deepseek.qk_nope_head_dim + deepseek.qk_rope_head_dim
    classifier = tiny_config("llama", "sequence-classification")
    assert classifier.id2label == {0: "neg", 1: "pos"} and classifier.pad_token_id == 0


@pytest.mark.parametrize(("model_type", "task"), DOZEN)
def test_a_dozen_architectures_load_through_inference_and_run_every_capability(coverage, tmp_path, model_type, task):
    """Every step of the sweep passes, or is refused by design with its reason (`REFUSED`)."""
    steps = coverage.probe(model_type, task, tmp_path).steps
    for step, outcome in steps.items():
        why = REFUSED.get((model_type, step))
        if why is None:
            assert outcome.ok, f"{step}: {outcome.reason}"
        else:
            assert outcome.ok is False and why in outcome.reason, f"{step}: {outcome.reason}"


def test_an_architecture_without_attention_is_refused(coverage, tmp_path):
    result = coverage.probe("mamba", "causal-lm", tmp_path)
    assert result.attention is False
    assert result.steps["forward"].ok is None and "no attention weights" in result.steps["forward"].reason
    assert "load" not in result.steps


def test_the_page_is_filled_from_the_results(coverage):
    """Every count on the page comes from the results: 2 decoders (1 loads), 1 refused."""
    outcome = coverage.Outcome
    passing = {step: outcome(True) for step in coverage.STEPS}
    failing = {"build": outcome(True), "forward": outcome(True), "load": outcome(False, "CaptureError: no row")}
    refused = {
        "build": outcome(True),
        "forward": outcome(None, "refused: no attention weights over the input tokens returned"),
    }
    results = [
        coverage.asdict(coverage.Result("llama", "causal-lm", "decoder", True, 1.0, passing)),
        coverage.asdict(coverage.Result("gpt_neox", "causal-lm", "decoder", True, 1.0, failing)),
        coverage.asdict(coverage.Result("mamba", "causal-lm", "decoder", False, 1.0, refused)),
    ]
    counts = coverage.summary(results)["decoder"]
    assert counts["architectures"] == 2 and counts["refused"] == 1
    assert counts["passed"]["build"] == 2 and counts["passed"]["load"] == 1 and counts["passed"]["patching"] == 1
    meta = {"command": "python scripts/architectures.py", "date": "2026-01-01", "transformers": "5", "seconds": 3.0}
    page = coverage.markdown(results, meta)
    assert "| decoder-only causal LMs with attention | 2 | 2 (100 %) | 2 (100 %) | 1 (50 %) |" in page
    assert "| gpt_neox | ✓ | ✓ | ✗ | – | – | – | – | – | – | load: CaptureError: no row |" in page
    assert "Refused, no attention weights over the input tokens returned (1): mamba." in page


@pytest.mark.slow
def test_the_whole_sweep(coverage, tmp_path):
    """Every causal-LM and sequence-classification architecture of the installed transformers
    (about a minute on one thread): at least 90 % of the decoder-only ones with attention build
    and run forward."""
    out = tmp_path / "architectures.md"
    assert coverage.main(["--out", str(out)]) == 0
    document = json.loads(out.with_suffix(".json").read_text())
    decoders = document["summary"]["decoder"]
    assert decoders["passed"]["forward"] >= 0.9 * decoders["architectures"]
    assert f"| {decoders['architectures']} |" in out.read_text()
