"""routes.html in real headless Chromium (Debian `chromium`, driven by Playwright): the route's
edges are drawn, the threshold slider redraws the route at a higher threshold, a click on a node
shows its logit lens and a click on an edge its heads and tokens, with the numbers of routes.json;
no console error, no request beyond the file, no token ever run as markup. Screenshots go to
``out/test-artifacts/routes/`` (or ``$ATTNFLOW_ARTIFACTS``)."""

from __future__ import annotations

import json

import pytest

import attnflow
from browser_pages import ARTIFACTS, needs_chromium, offline_page

pytestmark = pytest.mark.browser
playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright is not installed (pip install -e .[test])"
)
HOSTILE = "the <img src=x onerror=alert(1)> cat sat"


@pytest.fixture(scope="module")
def saved(tiny_loaded, tmp_path_factory):
    """The folder a tiny Llama's routes were saved to, and its routes.json."""
    routes = attnflow.routes(tiny_loaded("llama"), HOSTILE, threshold=0.005)  # random weights: small shares
    out = tmp_path_factory.mktemp("routes") / "out"
    routes.save(out)
    return out, json.loads((out / "routes.json").read_text())


@pytest.fixture(scope="module")
def page(saved):
    """The page, offline, recording console errors, page errors, dialogs and every request."""
    with offline_page(saved[0] / "routes.html", playwright_api) as (tab, seen):
        tab.wait_for_selector("body[data-ready='1']", timeout=60_000)
        yield tab, seen


def drawn(tab) -> int:
    count = int(tab.get_attribute("#graph", "data-drawn-edges"))
    assert count == tab.eval_on_selector_all("#graph .edge:not(.off)", "edges => edges.length")
    return count


def slide(tab, threshold: float) -> None:
    """Move the threshold slider as a hand would (its input event)."""
    tab.eval_on_selector("#threshold", f"r => {{ r.value = '{threshold}'; r.dispatchEvent(new Event('input')); }}")


def shot(tab, name: str) -> None:
    (ARTIFACTS / "routes").mkdir(parents=True, exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / "routes" / f"{name}.png"), full_page=True)


@needs_chromium
def test_edges_are_drawn_and_the_slider_redraws_the_route(page, saved):
    tab, _ = page
    data = saved[1]
    edges = data["route"]["edges"]
    assert tab.eval_on_selector_all("#graph .edge", "edges => edges.length") == len(edges) == drawn(tab)
    labels = tab.eval_on_selector_all("#graph text.token", "labels => labels.map(l => l.textContent)")
    assert labels == [attnflow.tokens.display_token(token) for token in data["tokens"]]
    assert tab.eval_on_selector_all("img", "found => found.length") == 0  # "<img" stayed text
    shot(tab, "tiny-at-its-threshold")
    for threshold in (0.008, 0.012):
        tab.eval_on_selector(
            "#threshold", f"range => {{ range.value = '{threshold}'; range.dispatchEvent(new Event('input')); }}"
        )
        expected = sum(edge["reach"] > threshold for edge in edges)
        assert drawn(tab) == expected < len(edges)
        nodes = int(tab.get_attribute("#graph", "data-drawn-nodes"))
        assert nodes == sum(node["reach"] > threshold for node in data["route"]["nodes"])
    shot(tab, "tiny-higher-threshold")
    tab.eval_on_selector(
        "#threshold", f"range => {{ range.value = '{data['threshold']}'; range.dispatchEvent(new Event('input')); }}"
    )
    assert drawn(tab) == len(edges)


@needs_chromium
def test_a_node_click_shows_its_lens_with_the_numbers_of_routes_json(page, saved):
    tab, _ = page
    data = saved[1]
    top = data["route"]["nodes"][0]
    lens = next(entry for entry in data["lens"] if entry["node"] == top["node"])
    tab.dispatch_event("#graph .node[data-index='0']", "click")
    assert tab.get_attribute("#node-info", "data-node") == ":".join(map(str, top["node"]))
    assert float(tab.get_attribute("#node-importance", "data-value")) == top["importance"]
    shown = tab.eval_on_selector_all("#lens-top .tok", "tokens => tokens.map(t => [t.textContent, t.dataset.value])")
    assert [(text, float(value)) for text, value in shown] == [(e["token"], e["probability"]) for e in lens["top"]]
    for name in ("rank", "probability", "logit"):
        assert float(tab.get_attribute(f"#lens-target-{name}", "data-value")) == lens["target"][name]
    shot(tab, "tiny-node-lens")


@needs_chromium
def test_an_edge_click_shows_its_heads_weight_and_tokens(page, saved):
    tab, _ = page
    edges = saved[1]["route"]["edges"]
    index, edge = next((i, edge) for i, edge in enumerate(edges) if edge["kind"] == "attention" and "promotes" in edge)
    tab.dispatch_event(f"#graph .edge[data-index='{index}']", "click")
    assert tab.get_attribute("#edge-info", "data-edge") == str(index)
    for name in ("weight", "importance", "reach", "effect"):
        assert float(tab.get_attribute(f"#edge-{name}", "data-value")) == edge[name]
    rows = tab.eval_on_selector_all("#edge-heads tr", "rows => rows.slice(1).map(r => r.cells[0].textContent)")
    shares = edge["heads"]
    assert rows == [
        f"L{edge['layer']}.H{h}" for h in sorted(range(len(shares)), key=lambda h: -shares[h]) if shares[h] > 0
    ]
    promoted = tab.eval_on_selector_all("#edge-promotes .tok", "tokens => tokens.map(t => t.textContent)")
    assert promoted == [entry["token"] for entry in edge["promotes"]]
    shot(tab, "tiny-edge")
