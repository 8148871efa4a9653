"""The page of a two-side audit in real headless Chromium, offline: it leads with the three largest
changes, every number of those sentences is in results.json as shown, hostile words stay text and
no request leaves the file."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from attnflow.dataset_audit.engine import write_outputs
from attnflow.dataset_audit.stats import ExampleResult
from attnflow.dataset_audit.versus import VersusStats, analyse_versus, lead
from browser_pages import needs_chromium, offline_page

pytestmark = pytest.mark.browser
playwright_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install .[test])")

SCRIPT = "<script>alert(1)</script>"
IMAGE = '<img src=x onerror="alert(2)">'
NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?(?:e[+-]?\d+)?")


def hostile_results() -> dict:
    """A two-domain audit of 16 texts a side whose words and names are markup: the first domain
    leans on ``<script>``, the second on ``film``; heads and rollout maps move too."""
    rng = np.random.default_rng(0)
    stats = VersusStats(2, 2, shape=[2, 2], paired=False)
    tokens, offsets, mask = ["[CLS]", "the", "[SEP]"], [[0, 0], [0, 3], [0, 0]], [True, False, True]
    for side in (0, 1):
        for index in range(16):
            lean = (0.5 if side == 0 else 0.1) + 0.1 * rng.random()
            words = {SCRIPT: (1, lean), "film": (1, 0.6 - lean), IMAGE: (1, 0.05 * rng.random())}
            result = ExampleResult(index, "the", index % 2, 0.8, (index + side) % 2, words, tokens, offsets, mask,
                                   [0.0, 1.0, 0.0])  # fmt: skip
            heads = rng.random((3, 2, 2)) + side
            maps = {"rollout": {"film": (1, lean)}, "norm_rollout": {SCRIPT: (1, 1 - lean)}}
            sided = (result, None) if side == 0 else (None, result)
            on_side = {name: (found, None) if side == 0 else (None, found) for name, found in maps.items()}
            stats.update(*sided, terms=[SCRIPT], heads=(heads, None) if side == 0 else (None, heads), maps=on_side)
    labels = ['neg"<x>', "pos&"]
    run = {"model": IMAGE, "method": "attnlrp", "data": "first<b>", "split": "all", "labels": labels,
           "samples": 32, "min_count": 1, "engine": "local", "elapsed_s": 1.0, "swap": [],
           "versus_data": "second<i>", "versus_split": "all", "sides": ["first<b>", "second<i>"]}  # fmt: skip
    results = {"run": run, **analyse_versus(stats, labels, 1, [SCRIPT], swaps=False, labelled=True)}
    results["changes"]["lead"] = lead(results)
    return results


def at(results: dict, path: str) -> float:
    value = results
    for key in path.split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return float(value)


@needs_chromium
def test_the_page_leads_with_the_largest_changes_from_the_numbers(tmp_path):
    write_outputs(tmp_path, hostile_results())
    saved = json.loads((tmp_path / "results.json").read_text())
    entries = saved["changes"]["lead"]
    assert len(entries) == 3 and [entry["kind"] for entry in entries[:2]] == ["word", "word"]
    with offline_page(tmp_path / "report.html", playwright_api) as (tab, _):
        shown = tab.eval_on_selector_all("ol.lead li", "items => items.map(item => item.textContent)")
        first_section = tab.eval_on_selector("section h2", "h => h.textContent")
        scripts = tab.eval_on_selector_all("script", "found => found.length")
        images = tab.eval_on_selector_all("img[onerror]", "found => found.length")
        text = tab.inner_text("body")
    # the lead comes first, sentence for sentence as in results.json
    assert shown == [entry["sentence"] for entry in entries]
    assert first_section == "Words whose relevance moved"
    assert f'relies more on "{SCRIPT}" than on second<i>' in shown[0]
    assert 'relies less on "film"' in shown[1]
    for sentence, entry in zip(shown, entries, strict=True):
        # every number of the sentence (the model's name, quoted words and the "95 %" of an interval aside)
        # is one it lists ...
        numbers = NUMBER.findall(re.sub(r'"[^"]*"|95 % CI', "", sentence.replace(IMAGE, "")))
        listed = [number["shown"] for number in entry["numbers"]]
        assert numbers and sorted(numbers) == sorted(listed), (sentence, listed)
        # ... and each listed number is the value at its place in results.json, as formatted there
        for number in entry["numbers"]:
            value = number["scale"] * at(saved, number["path"])
            spec = number["format"]
            assert number["shown"] == (format(round(value), spec) if spec.endswith("d") else format(value, spec))
    # hostile names and words are text, never markup
    assert scripts == 0 and images == 0
    assert SCRIPT in text and IMAGE in text and "second<i>" in text
