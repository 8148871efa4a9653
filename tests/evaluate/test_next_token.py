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


def test_key_rank_counts_among_the_content_tokens_only():
    from attnflow.evaluate.metrics import key_rank

    special = np.array([True, False, False, False, True])
    scores = np.array([9.0, 0.1, 0.7, 0.3, 8.0])  # the specials' scores never count
    assert key_rank(scores, special, np.array([0, 0, 1, 0, 0])) == 1
    assert key_rank(scores, special, np.array([0, 1, 0, 0, 0])) == 3
    assert key_rank(scores, special, np.array([0, 1, 0, 1, 0])) == 2  # the first key token in the ranking
    with pytest.raises(ValueError, match="no content token"):
        key_rank(scores, special, np.array([1, 0, 0, 0, 0]))


def test_probes_depend_on_a_key_the_text_holds_and_answer_with_one_token(smollm2):
    from attnflow.datasets import next_token_probes

    tokenizer = smollm2.tokenizer
    probes = next_token_probes(tokenizer, context=32)
    assert set(probes.kinds) == {"copy", "factual", "agreement"} and len(probes) == 20 + 58 + 20
    for text, answer, kind, (start, end) in zip(probes.texts, probes.next_ids, probes.kinds, probes.keys, strict=True):
        key = text[start:end]
        assert 26 <= len(tokenizer(text)["input_ids"]) <= 36 and key.strip() == key and key
        if kind == "copy":  # the answer is the key word, said once at the start
            assert tokenizer.decode([int(answer)]) == " " + key and text.count(key) == 1
        if kind == "agreement":  # the subject's number decides the verb; the clause's noun has the other
            plural = key.endswith("s")
            assert tokenizer.decode([int(answer)]) == (" are" if plural else " is")
            assert text[end:].startswith(" that the old man" if plural else " that the children")


@pytest.mark.slow  # about a minute on one CPU thread; key_ranks itself is checked below on a tiny model
def test_the_probe_benchmark_says_where_each_map_ranks_the_key(smollm2, tmp_path):
    """smollm2 on 4 probes it answers: each method's share of probes whose map ranks the key first,
    recomputed here from the saved scores and the tokenizer's offsets."""
    options = BenchmarkOptions(sanity_samples=0)
    results = evaluate(
        smollm2, "next-token-probes", ["grad_x_input", "random"], samples=4, out=tmp_path, options=options,
        progress=False, figures=False,
    )  # fmt: skip
    assert results["run"]["samples"] == 4 and "the model answers" in results["run"]["split"]
    from attnflow.evaluate.api import next_token_task

    texts, _, _, keys = next_token_task(smollm2, "next-token-probes", 32, 4, 0)  # the same draw
    by_text = dict(zip(texts, keys, strict=True))
    for method in ("grad_x_input", "random"):
        record = json.loads((tmp_path / "methods" / f"{method}.json").read_text())["record"]
        hits = []
        for text, scores in zip(texts, record["scores"], strict=True):
            encoded = smollm2.tokenizer(text, return_offsets_mapping=True)
            start, end = by_text[text]
            content = [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if b > a]
            best = max(content, key=lambda i: (scores[i], -i))
            hits.append(encoded["offset_mapping"][best][0] < end and encoded["offset_mapping"][best][1] > start)
        assert results["methods"][method]["key"]["first"] == pytest.approx(np.mean(hits))
    assert "key ranked first ↑" in (tmp_path / "results.md").read_text(encoding="utf-8")


def test_key_ranks_map_the_key_span_to_its_tokens(tiny_llama):
    """Character spans to tokens through the tokenizer's offsets: the key "cat" of "the cat sat" is
    the token a map scoring it highest ranks first, and third when two others score higher."""
    from attnflow.evaluate.api import key_ranks

    text = "the cat sat on the mat"
    encoded = tiny_llama.tokenizer(text, return_offsets_mapping=True)
    key = text.index("cat"), text.index("cat") + 3
    position = next(i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a == key[0])
    scores = np.zeros(len(encoded["input_ids"]))
    scores[position] = 1.0
    assert key_ranks(tiny_llama, [text], [key], [scores]) == [1]
    others = [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if b > a and i != position][:2]
    scores[others] = 2.0
    assert key_ranks(tiny_llama, [text], [key], [scores]) == [3]
