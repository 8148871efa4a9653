"""The explorer's generation view in real headless Chromium (see test_explorer_browser.py: the same
`Page` wrapper fails on any console error, dialog or request beyond the page's own file).

Clicking a generated token must colour exactly its sources by the Python numbers (each within the
7-bit codes' error and the browser's 8-bit alpha), leave the later tokens blank, and show its
p(t_k), top sources and per-step faithfulness as `explain_generation` computed them.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_explorer_browser import Page, browser, needs_chromium  # noqa: F401  (browser: the shared fixture)

import attnflow
from test_generation_exploration import hostile_exploration

pytestmark = pytest.mark.browser
PROMPT = "the movie was"
CONTINUATION = "good but the cat sat"
METHODS = ["rollout", "gradient", "leave_one_out"]
HOSTILE = "<img src=x onerror=alert(1)>"
# a decoded value is off by at most 1/254 of its row's scale, the browser keeps alpha in 8 bits
COLOUR_TOLERANCE = 1 / 254 + 1 / 255 + 1e-3


@pytest.fixture(scope="module")
def generation_page(tiny_model_path, tmp_path_factory):
    model = attnflow.load(str(tiny_model_path("llama")), device="cpu")
    exploration = attnflow.explore_generation(
        model, PROMPT, continuation=CONTINUATION, methods=METHODS, faithfulness=True
    )
    return exploration.save(tmp_path_factory.mktemp("generation")), exploration


def alpha(colour: str) -> float:
    """A CSS colour's alpha as the browser writes it: ``rgba(r, g, b, a)``, ``rgb(...)`` for 1, "" for none."""
    return float(re.findall(r"[\d.]+", colour)[-1]) if colour.startswith("rgba") else (1.0 if colour else 0.0)


def alphas_and_blues(page: Page) -> tuple[np.ndarray, list[bool]]:
    """Each token's background alpha (0 without a background) and whether it is blue (negative)."""
    colours = page.token_colours()
    blues = [c.startswith(("rgba(33, 102, 172", "rgb(33, 102, 172")) for c in colours]
    return np.asarray([alpha(c) for c in colours]), blues


def expected_alphas(scores: np.ndarray, special: np.ndarray) -> np.ndarray:
    """|score| over the step's largest |score| of a non-special source, at most 1."""
    return np.minimum(np.abs(scores) / np.abs(scores[~special]).max(), 1.0)


@needs_chromium
def test_clicking_a_generated_token_colours_its_sources(browser, generation_page):  # noqa: F811  (the imported fixture)
    path, exploration = generation_page
    page = Page(browser, path)
    first = exploration.first
    p, step = first.n_prompt, 2
    assert page.page.eval_on_selector_all(".tok.gen", "spans => spans.length") == first.n_steps
    page.page.select_option("#method", str(METHODS.index("gradient")))
    page.wait_drawn()
    page.page.click(f".tok[data-i='{p + step}']")
    scores = exploration.method("gradient").explanation.step_scores(step)  # [P + step] sources
    alphas, _ = alphas_and_blues(page)
    special = first.special_mask[: p + step]
    np.testing.assert_allclose(alphas[: p + step], expected_alphas(scores, special), atol=COLOUR_TOLERANCE)
    classes = page.page.eval_on_selector_all(".tok", "spans => spans.map(s => s.className)")
    assert "current" in classes[p + step] and "pinned" in classes[p + step]
    assert all("absent" in c for c in classes[p + step + 1 :]) and not any("absent" in c for c in classes[: p + step])
    assert np.all(alphas[p + step :] == 0)  # the token itself and what follows it: blank
    # p(t_k), its top sources and its faithfulness, as the Python numbers (3 significant digits)
    token = first.generated[step]
    probability = page.text("#step-probability")
    assert probability.startswith(f"p('{token}' | everything before) = ")
    assert float(probability.split("= ")[1].split(" ")[0]) == pytest.approx(first.probabilities[step], rel=5e-3)
    shown = re.findall(r"#(\d+) '([^']*)' ([-\d.e]+)", page.text("#step-top").removeprefix("top sources: "))
    top = exploration.method("gradient").explanation.top_sources(step, 3)
    assert [(int(index), name) for index, name, _ in shown] == [(index, source) for index, source, _ in top]
    np.testing.assert_allclose([float(v) for _, _, v in shown], [score for _, _, score in top], rtol=5e-3)
    aopc = float(re.search(r"AOPC ([-\d.e]+)", page.text("#step-faithfulness")).group(1))
    faithfulness = exploration.method("gradient").explanation.faithfulness
    assert aopc == pytest.approx(faithfulness["aopc"][step], rel=5e-3, abs=1e-9)
    # the table's row of this step is coloured the same way, its later cells hatched
    cells = page.page.eval_on_selector_all(
        f"#heatmap tr[data-step='{step}'] td.cell", "tds => tds.map(td => [td.className, td.style.backgroundColor])"
    )
    table_alphas = [alpha(colour) for _, colour in cells[: p + step]]
    np.testing.assert_allclose(table_alphas, expected_alphas(scores, special), atol=COLOUR_TOLERANCE)
    assert all(css == "cell absent" for css, _ in cells[p + step :])
    page.screenshot("generation-gradient-step3")
    page.close()


@needs_chromium
def test_hover_signed_method_and_layers(browser, generation_page):  # noqa: F811  (the imported fixture)
    path, exploration = generation_page
    page = Page(browser, path)
    first = exploration.first
    p = first.n_prompt
    # leave-one-out is signed: two colours, blue where a source made the token less likely
    page.page.select_option("#method", str(METHODS.index("leave_one_out")))
    page.wait_drawn()
    assert "signed" in (page.page.get_attribute("#scale-bar", "class") or "")
    assert page.page.is_disabled("#layer")  # no per-layer scores
    last = first.n_steps - 1
    page.page.hover(f".tok[data-i='{p + last}']")
    scores = exploration.method("leave_one_out").explanation.step_scores(last)
    alphas, blues = alphas_and_blues(page)
    np.testing.assert_allclose(
        alphas[: p + last], expected_alphas(scores, first.special_mask[: p + last]), atol=COLOUR_TOLERANCE
    )
    visible = np.abs(scores) / np.abs(scores[1:]).max() > 0.02  # a colour at all
    assert [blue for blue, shown in zip(blues, visible, strict=False) if shown] == list(scores[visible] < 0)
    assert f"(step {last + 1})" in page.text("#tokens-caption")
    page.page.mouse.move(0, 0)  # leaving it goes back to the pinned step (the first)
    assert "(step 1)" in page.text("#tokens-caption")
    # rollout after layer 0: the row predicting each token in layer 0's rollout
    page.page.select_option("#method", str(METHODS.index("rollout")))
    page.wait_drawn()
    page.page.select_option("#layer", "0")
    page.wait_drawn()
    page.page.click(f".tok[data-i='{p + 1}']")
    layer0 = exploration.method("rollout").layers[0, 1, : p + 1]
    alphas, _ = alphas_and_blues(page)
    np.testing.assert_allclose(
        alphas[: p + 1], expected_alphas(layer0, first.special_mask[: p + 1]), atol=COLOUR_TOLERANCE
    )
    assert "after layer 0" in page.text("#step-caption")
    decoded = page.page.evaluate(
        "attnflowGeneration.values(attnflowGeneration.meta.methods[0].layers, 1).then(Array.from)"
    )
    layer1 = exploration.method("rollout").layers[1]  # [step, source]
    step_max = np.abs(layer1[:, 1:]).max(axis=1, keepdims=True)  # the scale of each row (column 0: exact)
    assert np.all(np.abs(np.reshape(decoded, layer1.shape) - layer1) <= step_max / 254 * (1 + 1e-4) + 1e-7)
    page.screenshot("generation-rollout-layer0")
    page.close()


@needs_chromium
def test_hostile_tokens_are_text(browser, tmp_path):  # noqa: F811  (the imported fixture)
    tokens = ["[CLS]", "a", HOSTILE, "</script><script>alert(2)</script>", "b"]
    exploration = hostile_exploration(tokens, model=HOSTILE, prompt=HOSTILE)
    page = Page(browser, exploration.save(tmp_path))
    assert page.page.evaluate("document.querySelectorAll('img').length") == 0
    shown = page.page.eval_on_selector_all(".tok", "spans => spans.map(s => s.textContent)")
    assert HOSTILE in shown and "</script><script>alert(2)</script>" in shown
    page.page.click(".tok[data-i='3']")
    assert page.text("#step-token") == "'</script><script>alert(2)</script>'"
    page.close()  # no dialog opened, no console error
