"""The page of `attnflow serve` in real headless Chromium (Debian `chromium`, driven by Playwright),
against a real uvicorn server on a tiny classifier: what the DOM shows is what /api/explain answered."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest

from .conftest import make_app, served
from .test_api import TOKEN

pytestmark = pytest.mark.browser
playwright_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install .[test])")
uvicorn = pytest.importorskip("uvicorn", reason="attnflow serve needs the serve extra")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (run `make browser`)")
HOSTILE = "<img src=x onerror=alert(1)> the movie was great"
ARTIFACTS = Path(os.environ.get("ATTNFLOW_ARTIFACTS", Path(__file__).resolve().parents[2] / "out" / "test-artifacts"))


@pytest.fixture(scope="module")
def server(tiny_loader):
    """A uvicorn server on a free port of 127.0.0.1, in a thread; yields its base URL."""
    yield from served(make_app(tiny_loader))


@pytest.fixture(scope="module")
def token_server(tiny_loader):
    """The same, behind a token."""
    yield from served(make_app(tiny_loader, token=TOKEN))


@needs_chromium
def test_typed_text_and_chosen_methods_show_the_api_scores_and_switch_without_refetching(server):
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        errors: list[str] = []
        dialogs: list[str] = []
        explains: list[str] = []
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
        page.on("request", lambda request: explains.append(request.url) if "/api/explain" in request.url else None)
        page.goto(server + "/")
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        assert page.input_value("#model") == "tiny-a"
        page.fill("#text", HOSTILE)
        page.uncheck("#methods input[value='rollout']")  # checked by default, with auto
        page.check("#methods input[value='grad_x_input']")
        page.check("#methods input[value='rollout']")
        with page.expect_response("**/api/explain") as answered:
            page.click("#run")
        answer = answered.value.json()
        page.wait_for_selector("body[data-busy='0'] .tok", timeout=60_000)
        assert [e["method"] for e in answer["explanations"]][1:] == ["grad_x_input", "rollout"]
        assert answer["explanations"][0]["chosen_by"]

        for view, explanation in enumerate(answer["explanations"]):
            page.select_option("#view-method", str(view))
            assert page.get_attribute("body", "data-method") == explanation["method"]
            read = "spans => spans.map(s => [s.textContent, Number(s.dataset.score), s.style.backgroundColor])"
            spans = page.eval_on_selector_all("#tokens .tok", read)
            assert [text for text, _, _ in spans] == explanation["display_tokens"]  # text: the <img> is no element
            assert [score for _, score, _ in spans] == explanation["scores"]  # exactly the JSON's numbers
            top = max(range(len(spans)), key=lambda i: abs(spans[i][1]) * (not explanation["special_mask"][i]))
            assert spans[top][2].endswith(", 0.85)")  # the strongest content token gets the full colour
            if explanation.get("faithfulness"):
                badge = page.text_content("#badge") or ""
                assert f"comprehensiveness {explanation['faithfulness']['aopc_comprehensiveness']:.2f}" in badge
            link = page.get_attribute("#dl-json", "href")
            assert link == f"/api/results/{answer['id']}/{explanation['method']}.json"
        assert len(explains) == 1, explains  # switching methods asked the server nothing
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "serve-page.png"), full_page=True)
        assert page.query_selector("#tokens img") is None and dialogs == []

        rollout = answer["explanations"][2]
        page.click("#tokens .tok[data-index='2']")  # a token's own row of the rollout matrix
        row = page.eval_on_selector_all("#tokens .tok", "spans => spans.map(s => Number(s.dataset.score))")
        assert row == rollout["matrix"][2]
        downloaded = page.request.get(server + page.get_attribute("#dl-json", "href")).json()
        assert downloaded["scores"] == rollout["scores"]

        page.click("#explore")  # every layer and head: the explorer's own page, from the server
        page.wait_for_selector("#explorer-link:not([hidden])", timeout=60_000)
        explorer = browser.new_page()
        explorer.on("pageerror", lambda error: errors.append(str(error)))
        explorer.goto(server + (page.get_attribute("#explorer-link", "href") or ""))
        explorer.wait_for_selector("body[data-ready='1']", timeout=60_000)
        assert explorer.locator("#layer option").count() >= 2  # the per-layer views
        explorer.close()

        page.select_option("#model", "tiny-b")
        page.click("#run")
        page.wait_for_selector("#history li:nth-child(2)", timeout=60_000)  # (the page's CSP forbids eval)
        page.click("#history li:first-child button")  # the session's first answer again, from memory
        assert page.eval_on_selector_all("#tokens .tok", "s => s.length") == len(answer["explanations"][0]["tokens"])
        assert len(explains) == 2 and errors == [], (explains, errors)
        browser.close()


def _open(playwright, server):
    """A page of the app, ready; the errors it reports go to the returned list."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
    errors: list[str] = []
    return browser, watched(browser, server + "/", errors), errors


@needs_chromium
def test_generating_keeps_auto_and_shows_tokens_as_a_reader_sees_them(server):
    with playwright_api.sync_playwright() as playwright:
        browser, page, errors = _open(playwright, server)
        page.select_option("#model", "tiny-gpt2")
        page.fill("#text", "the cat sat")
        page.fill("#generate", "2")
        assert page.is_checked("#methods input[value='auto']")
        with page.expect_request("**/api/generate") as asked, page.expect_response("**/api/generate") as answered:
            page.click("#run")
        assert "auto" in asked.value.post_data_json["methods"]
        answer = answered.value.json()
        page.wait_for_selector("body[data-busy='0'] #steps table", timeout=60_000)
        chosen = answer["explanations"][0]
        assert chosen["chosen_by"] and page.text_content("#view-method option") == "auto → " + chosen["method"]
        read = "rows => rows.map(r => [r.cells[1].textContent, Array.from(r.cells[3].children, s => s.textContent)])"
        rows = page.eval_on_selector_all("#steps tr:not(:first-child)", read)
        assert [token for token, _ in rows] == chosen["display_generated"]
        for step, (_, sources) in enumerate(rows):
            assert sources == chosen["display_sources"][: len(chosen["matrix"][step])]
        assert errors == []
        browser.close()


@needs_chromium
def test_a_history_entry_and_the_explorer_link_belong_to_the_result_shown(server):
    first, second = "the movie was great", "the acting was terrible"
    with playwright_api.sync_playwright() as playwright:
        browser, page, errors = _open(playwright, server)
        page.fill("#text", first)
        page.click("#run")
        page.wait_for_selector("#history li:nth-child(1)", timeout=60_000)
        held: list = []
        page.route("**/api/explore", lambda route: held.append(route))  # the explorer answers late
        page.click("#explore")
        page.wait_for_function("() => true")  # let the request reach the route
        while not held:
            page.wait_for_timeout(50)
        page.select_option("#model", "tiny-b")
        page.fill("#text", second)
        page.click("#run")
        page.wait_for_selector("#history li:nth-child(2)", timeout=60_000)
        page.wait_for_selector("body[data-busy='0']")
        with page.expect_response("**/api/explore"):
            held[0].continue_()
        page.wait_for_timeout(200)
        assert page.is_hidden("#explorer-link")  # built for the first text: not beside the second result
        assert second in page.text_content("#result-source") and "tiny-b" in page.text_content("#result-source")

        page.click("#history li:first-child button")  # the first result again, under its own text and model
        assert page.input_value("#text") == first and page.input_value("#model") == "tiny-a"
        assert first in page.text_content("#result-source") and "tiny-a" in page.text_content("#result-source")
        assert page.is_visible("#explorer-link")  # its explorer, built meanwhile
        page.click("#history li:nth-child(2) button")
        assert page.input_value("#text") == second and page.is_hidden("#explorer-link")
        assert errors == []
        browser.close()


@needs_chromium
def test_the_token_leaves_the_address_bar_and_the_cookie_carries_it(token_server):
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.goto(f"{token_server}/?token={TOKEN}")
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        assert page.url == token_server + "/" and TOKEN not in page.evaluate("history.state + location.href")
        assert page.input_value("#model") == "tiny-a"  # the API answered: the cookie carries the token
        page.reload()
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        assert page.input_value("#model") == "tiny-a" and page.url == token_server + "/"
        browser.close()


@needs_chromium
def test_a_late_progress_poll_leaves_the_final_error_shown(server):
    """The answer (504) arrives while a progress poll is on its way; the poll's "working: …" comes
    after it and must not replace the error."""
    with playwright_api.sync_playwright() as playwright:
        browser, page, errors = _open(playwright, server)
        polls: list = []
        answers: list = []
        page.route("**/api/progress/**", lambda route: polls.append(route))
        page.route("**/api/explain", lambda route: answers.append(route))
        page.fill("#text", "the movie was great")
        page.click("#run")
        while not (polls and answers):
            page.wait_for_timeout(50)
        failed = "the request ran longer than the server's time limit (60 s) and was stopped during faithfulness"
        answers[0].fulfill(status=504, content_type="application/json", body='{"error": "' + failed + '"}')
        page.wait_for_selector("#status.error", timeout=10_000)
        working = {"id": "x", "running": True, "step": "faithfulness", "forward_passes": 9, "elapsed_s": 59.5}
        polls[0].fulfill(status=200, content_type="application/json", body=json.dumps({**working, "cancelled": False}))
        page.wait_for_timeout(500)
        assert page.text_content("#status") == failed and page.get_attribute("#status", "class") == "status error"
        assert [e for e in errors if "Failed to load resource" not in e] == []  # the browser logs the 504 itself
        browser.close()


@needs_chromium
def test_a_failed_request_leaves_no_earlier_result_under_its_text(server):
    with playwright_api.sync_playwright() as playwright:
        browser, page, errors = _open(playwright, server)
        page.fill("#text", "the movie was great")
        page.click("#run")
        page.wait_for_selector("body[data-busy='0'] #result:not([hidden]) .tok", timeout=60_000)
        page.fill("#text", "   ")  # the server refuses a blank text (400)
        with page.expect_response("**/api/explain") as answered:
            page.click("#run")
        assert answered.value.status == 400
        page.wait_for_selector("body[data-busy='0'] #status.error", timeout=60_000)
        assert page.is_hidden("#result") and "empty" in (page.text_content("#status") or "")
        page.click("#history li:first-child button")  # the earlier answer is still in the history
        assert page.is_visible("#result") and page.input_value("#text") == "the movie was great"
        assert [e for e in errors if "Failed to load resource" not in e] == []  # the browser logs the 400 itself
        browser.close()


def watched(browser, url: str, errors: list[str]):
    """A new tab on ``url``, ready, whose console errors and uncaught exceptions go to ``errors``."""
    tab = browser.new_page()
    tab.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    tab.on("pageerror", lambda error: errors.append(str(error)))
    tab.goto(url)
    tab.wait_for_selector("body[data-ready='1']", timeout=60_000)
    return tab


@needs_chromium
def test_a_causal_lm_answer_offers_its_routes_and_the_page_draws_them(server):
    errors: list[str] = []
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = watched(browser, server + "/", errors)
        page.fill("#text", "the cat sat on the mat")
        page.click("#run")  # the default model, a classifier: no routes offered
        page.wait_for_selector("body[data-busy='0'] .tok", timeout=60_000)
        assert page.is_hidden("#routes")
        page.select_option("#model", "tiny-gpt2")
        page.click("#run")
        page.wait_for_selector("#history li:nth-child(2)", timeout=60_000)
        page.wait_for_selector("#routes:not([hidden])", timeout=60_000)
        with page.expect_response("**/api/routes") as answered:
            page.click("#routes")
        answer = answered.value.json()
        page.wait_for_selector("#routes-link:not([hidden])", timeout=60_000)
        assert f"{len(answer['routes']['route']['edges'])} edges" in (page.text_content("#status") or "")
        routes = watched(browser, server + (page.get_attribute("#routes-link", "href") or ""), errors)
        edges, nodes = answer["routes"]["route"]["edges"], answer["routes"]["route"]["nodes"]
        assert routes.eval_on_selector_all("#graph .edge", "e => e.length") == len(edges)
        assert int(routes.get_attribute("#graph", "data-drawn-edges")) == len(edges)
        routes.dispatch_event("#graph .node[data-index='0']", "click")
        top = next(entry for entry in answer["routes"]["lens"] if entry["node"] == nodes[0]["node"])
        assert float(routes.get_attribute("#lens-target-probability", "data-value")) == top["target"]["probability"]
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        routes.screenshot(path=str(ARTIFACTS / "serve-routes.png"), full_page=True)
        browser.close()
    assert errors == [], errors


def _family_page(page, model: str, prompt: str) -> dict:
    """Choose ``model`` on ``page``: its unsupported methods greyed with the reason, the causal LM's
    defaults (a prompt, auto alone); then a box ticked before the page knew (forced) is skipped by
    the server and named on the page. The answer's JSON."""
    page.select_option("#model", model)
    page.wait_for_selector("#methods input[value='alti']:disabled", timeout=60_000)
    title = page.get_attribute("#methods label:has(input[value='alti'])", "title") or ""
    assert f"not for {model}" in title and "post_norm" in title, title
    ticked = page.eval_on_selector_all("#methods input:checked", "boxes => boxes.map(b => b.value)")
    assert ticked == ["auto"], ticked  # not rollout, which puts nearly everything on the first token
    assert page.get_attribute("#text", "placeholder") == "The capital of France is"
    page.eval_on_selector("#methods input[value='alti']", "box => { box.disabled = false; box.checked = true; }")
    page.uncheck("#methods input[value='auto']")
    page.check("#methods input[value='raw']")
    page.fill("#text", prompt)
    with page.expect_response("**/api/explain") as answered:
        page.click("#run")
    assert answered.value.status == 200
    page.wait_for_selector("body[data-busy='0'] .tok", timeout=60_000)
    answer = answered.value.json()
    assert [e["method"] for e in answer["explanations"]] == ["raw"]
    assert "skipped alti: method 'alti' does not support" in (page.text_content("#skipped") or "")
    return answer


@needs_chromium
def test_a_causal_lm_offers_only_its_familys_methods_and_llm_defaults(server):
    with playwright_api.sync_playwright() as playwright:
        browser, page, errors = _open(playwright, server)
        assert page.is_enabled("#methods input[value='alti']")  # the BERT classifier runs every method
        ticked = page.eval_on_selector_all("#methods input:checked", "boxes => boxes.map(b => b.value)")
        assert ticked == ["auto", "rollout"]
        _family_page(page, "tiny-gpt2", "the cat sat on the")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "serve-family-methods.png"), full_page=True)
        page.select_option("#model", "tiny-a")  # back: every method offered again
        page.wait_for_selector("#methods input[value='alti']:enabled", timeout=60_000)
        assert errors == [], errors
        browser.close()


@needs_chromium
def test_smollm2_is_not_offered_alti(smollm2, minilm_sentiment):
    """The real models of the issue: `attnflow serve --model minilm-sentiment --model smollm2`."""
    from attnflow.serve import ModelPool, ServeConfig, create_app

    loaded = {"smollm2": smollm2, "minilm-sentiment": minilm_sentiment}
    pool = ModelPool(list(loaded), loader=loaded.__getitem__, known=list(loaded))
    for url in served(create_app(pool, ServeConfig())):
        with playwright_api.sync_playwright() as playwright:
            browser, page, errors = _open(playwright, url)
            answer = _family_page(page, "smollm2", "The capital of France is")
            assert answer["explanations"][0]["tokens"][-1] == "Ġis"
            assert errors == [], errors
            browser.close()


@contextlib.contextmanager
def explained_in_chromium(url: str, model: str, text: str, errors: list[str]):
    """A Chromium tab on the app at ``url`` with ``text`` explained by ``model``, its answer drawn."""
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        tab = watched(browser, url + "/", errors)
        tab.select_option("#model", model)
        tab.fill("#text", text)
        tab.click("#run")
        tab.wait_for_selector("body[data-busy='0'] .tok", timeout=60_000)
        yield tab
        browser.close()


@needs_chromium
def test_why_shows_the_reading_as_text_and_the_evidence_below_it(server):
    errors: list[str] = []
    with explained_in_chromium(server, "tiny-gpt2", "the cat <b>sat</b> on the mat", errors) as page:
        page.wait_for_selector("#why:not([hidden])", timeout=60_000)
        assert page.is_hidden("#why-view")
        with page.expect_response("**/api/why") as answered:
            page.click("#why")
        answer = answered.value.json()
        page.wait_for_selector("#why-view:not([hidden]) #why-agreement", timeout=60_000)
        shown = page.eval_on_selector_all("#why-paragraphs p", "ps => ps.map(p => p.textContent)")
        assert shown == [entry["text"] for entry in answer["why"]["paragraphs"]] and shown
        questions = page.eval_on_selector_all("#why-paragraphs h3", "hs => hs.map(h => h.textContent)")
        assert questions == [entry["question"] for entry in answer["why"]["paragraphs"]]
        assert page.query_selector("#why-view b") is None  # the text's markup is text, in the reading and below
        assert "<b>" in (page.text_content("#why-evidence") or "")
        assert page.is_hidden("#token-1")
        page.click("#why-evidence .tokens a[data-token='1']")  # a token: its attribution, route and patching row
        assert page.is_visible("#token-1")
        assert page.get_attribute("#why-link", "href") == answer["url"]
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "serve-why.png"), full_page=True)
    assert errors == [], errors
