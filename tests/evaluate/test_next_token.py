"""`attnflow evaluate --task next-token` on a tiny causal LM: windows, targets, NAOPC, the report."""

from __future__ import annotations

import json

import numpy as np
import pytest

import attnflow
from attnflow.datasets import next_token_windows
from attnflow.evaluate.api import evaluate
from attnflow.evaluate.benchmark import BenchmarkOptions
from attnflow.evaluate.sanity import shown_stages


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_path):
    return attnflow.load(str(tiny_model_path("llama")), device="cpu")


def test_windows_tokenise_back_and_carry_the_true_next_token(tiny_llama):
    tokenizer = tiny_llama.tokenizer
    windows = next_token_windows(tokenizer, window=5)
    assert len(windows) > 1000  # one per held-out text of both corpora, most of them usable
    rng = np.random.default_rng(0)
    for i in rng.choice(len(windows), size=20, replace=False):
        ids = tokenizer(windows.texts[i], add_special_tokens=False)["input_ids"]
        assert len(ids) == 5
        assert windows.next_ids[i] not in (None, -1)


def test_sanity_stages_keep_the_head_and_the_last_stage():
    assert shown_stages(31, None) == list(range(31))
    assert shown_stages(31, 2) == [0, 1, 30]  # head, top layer, everything random
    assert shown_stages(31, 3) == [0, 1, 16, 30]  # 1, 15.5, 30 rounded
    assert shown_stages(4, 10) == [0, 1, 2, 3]


def test_next_token_benchmark_reports_naopc_and_the_top1_target(tiny_llama, tmp_path):
    options = BenchmarkOptions(sanity_samples=2, sanity_layers=1, chunk_size=2, bounds="exact")
    results = evaluate(
        tiny_llama,
        "next-token",
        ["grad_x_input", "random"],
        samples=3,
        out=tmp_path,
        options=options,
        progress=False,
        figures=False,
        window=5,
    )
    run = results["run"]
    assert run["task"] == "next-token" and run["window"] == 5 and run["samples"] == 3
    assert run["bounds_search"] == {"exact": 3}
    bounds = json.loads((tmp_path / "bounds.json").read_text())
    for name in ("grad_x_input", "random"):
        summary = results["methods"][name]
        record = json.loads((tmp_path / "methods" / f"{name}.json").read_text())["record"]
        aopc = np.mean(record["comprehensiveness"], axis=1)
        low, high = np.array([b["comprehensiveness"] for b in bounds]).T
        assert np.all(low - 1e-9 <= aopc) and np.all(aopc <= high + 1e-9)  # exact bounds contain every ranking
        defined = high - low > 1e-12
        expected = np.mean(((aopc - low) / np.where(defined, high - low, 1.0))[defined])
        assert summary["naopc_comprehensiveness"]["mean"] == pytest.approx(expected)
        assert [stage["stage"] for stage in summary["sanity"]["stages"]] == ["head", "layer 0"]
    table = (tmp_path / "results.md").read_text(encoding="utf-8")
    assert "NAOPC comp. ↑" in table and "exact (every deletion order" in table
    assert "Top-1 next token = the text's true next token" in table
