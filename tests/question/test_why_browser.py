"""why.html in real headless Chromium (Playwright): the reading is on top; a click on a token opens
its panel with its attribution, route importance and patching row — the numbers of why.json — and
marks its row in the tables; no console error, no request beyond the file, no token run as markup.
Screenshots go to ``out/test-artifacts/why/`` (or ``$ATTNFLOW_ARTIFACTS``)."""

from __future__ import annotations

import json

import pytest

import attnflow
from browser_pages import ARTIFACTS, needs_chromium, offline_page

pytestmark = pytest.mark.browser
playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright is not installed (pip install -e .[test])"
)
HOSTILE = 'a "<script>alert(1)</script>" & the <img src=x onerror=alert(2)> cat'


@pytest.fixture(scope="module")
def saved(tiny_loaded, tmp_path_factory):
    """The folder a tiny Llama's why was saved to, and its why.json."""
    found = attnflow.why(tiny_loaded("llama"), HOSTILE)
    out = tmp_path_factory.mktemp("why") / "out"
    found.save(out)
    return out, json.loads((out / "why.json").read_text())


@pytest.fixture(scope="module")
def page(saved):
    """The page, offline, recording console errors, page errors, dialogs and every request."""
    with offline_page(saved[0] / "why.html", playwright_api, width=1300, height=900) as opened:
        yield opened


def shot(tab, name: str) -> None:
    (ARTIFACTS / "why").mkdir(parents=True, exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / "why" / f"{name}.png"), full_page=True)


@needs_chromium
def test_the_reading_comes_first_and_says_what_why_json_says(page, saved):
    tab, _ = page
    data = saved[1]
    first = tab.eval_on_selector("body", "b => b.querySelector('h2').textContent")
    assert first == "The reading"
    shown = tab.eval_on_selector_all("#reading p", "ps => ps.map(p => p.textContent)")
    assert shown == [entry["text"] for entry in data["paragraphs"]]
    assert tab.eval_on_selector_all("img[src^='x'], script", "found => found.length") == 0  # tokens stay text
    assert "<img" in tab.inner_text("#tokens") and "onerror" in tab.inner_text("#reading") + tab.inner_text("#tokens")


@needs_chromium
def test_a_token_click_shows_its_evidence_with_the_numbers_of_why_json(page, saved):
    tab, _ = page
    data = saved[1]
    index = int(max(range(len(data["tokens"])), key=lambda i: data["token_scores"]["attribution"][i]))
    panel = f"#token-{index}"
    assert not tab.is_visible(panel)
    before = tab.eval_on_selector(f'#scores tr[data-token="{index}"]', "r => getComputedStyle(r).backgroundColor")
    shot(tab, "before")
    tab.click(f'#tokens a[data-token="{index}"]')
    assert tab.is_visible(panel)
    shot(tab, "token")
    values = tab.eval_on_selector_all(
        f"{panel} table.token-scores tr",
        "rows => rows.map(r => [r.dataset.evidence, Number(r.querySelector('td.num').dataset.value)])",
    )
    assert {name: value for name, value in values} == pytest.approx(
        {name: scores[index] for name, scores in data["token_scores"].items()}
    )
    row = tab.eval_on_selector_all(f"{panel} table.patch-row td", "cells => cells.map(c => Number(c.dataset.value))")
    assert row == pytest.approx([values[index] for values in data["evidence"]["patching"]["residual"]])
    after = tab.eval_on_selector(f'#scores tr[data-token="{index}"]', "r => getComputedStyle(r).backgroundColor")
    assert after != before  # its row in the table below is marked
    other = (index + 1) % len(data["tokens"])
    tab.click(f'#scores tr[data-token="{other}"] a')
    assert tab.is_visible(f"#token-{other}") and not tab.is_visible(panel)


@needs_chromium
def test_the_agreement_table_holds_why_json_numbers(page, saved):
    tab, _ = page
    data = saved[1]
    cells = tab.eval_on_selector_all(
        "table.token-agreement tbody tr",
        "rows => rows.map(r => [r.dataset.first, r.dataset.second, r.querySelector('td.num').dataset.value])",
    )
    expected = [
        [pair["first"], pair["second"], "" if pair["spearman"] is None else repr(pair["spearman"])]
        for pair in data["agreement"]["tokens"]
    ]
    assert cells == expected
