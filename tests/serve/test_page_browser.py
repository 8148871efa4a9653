"""The page of `attnflow serve` in real headless Chromium (Debian `chromium`, driven by Playwright),
against a real uvicorn server on a tiny classifier: what the DOM shows is what /api/explain answered."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from .conftest import make_app

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
    app = make_app(tiny_loader)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert running.started, "uvicorn did not start"
    port = running.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(10)


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
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(server + "/")
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    return browser, page, errors


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
