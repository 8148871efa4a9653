"""routes.html and routes.png: `Routes.save` writes them beside routes.json; the page carries the
very numbers of routes.json (nothing recomputed), reaches nothing outside itself and never lets a
token string become markup."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import attnflow
from attnflow.viz.explorer import asset
from attnflow.viz.routes import PAGE_FIELDS, routes_html, routes_payload

HOSTILE = "the <img src=x onerror=alert(1)> cat sat"


@pytest.fixture(scope="module")
def hostile_routes(tiny_loaded):
    return attnflow.routes(tiny_loaded("llama"), HOSTILE, threshold=0.005)  # random weights: small shares


def test_the_page_carries_the_numbers_of_routes_json(hostile_routes):
    saved = json.loads(hostile_routes.to_json())
    payload = json.loads(json.dumps(routes_payload(hostile_routes)))
    for name in PAGE_FIELDS:
        assert payload[name] == saved[name], name
    assert payload["n_layers"] == len(saved["graph"]["layers"]) and payload["n_heads"] == 4
    edges = saved["route"]["edges"]
    assert edges and all(edge["reach"] > saved["threshold"] for edge in edges)
    assert any("promotes" in edge for edge in edges) and all("reach" in node for node in saved["route"]["nodes"])


def test_the_page_is_offline_and_tokens_are_never_markup(hostile_routes):
    html = routes_html(hostile_routes)
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html).group(1)
    assert "default-src &#x27;none&#x27;" in policy and "connect-src" not in policy
    assert "<img" not in html  # the hostile text is escaped everywhere, in the JSON block too
    assert "innerHTML" not in asset("routes.js") and "insertAdjacentHTML" not in asset("routes.js")
    assert html.count("<script") == 2  # the data block and the one script the policy allows


def test_save_writes_json_page_and_png_together(hostile_routes, tmp_path):
    out = tmp_path / "out"
    path = hostile_routes.save(out)
    assert path == out / "routes.json" and sorted(p.name for p in out.iterdir()) == [
        "routes.html",
        "routes.json",
        "routes.png",
    ]
    assert (out / "routes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(path.read_text()) == json.loads(hostile_routes.to_json())
    with pytest.raises(FileExistsError):
        hostile_routes.save(out)
    hostile_routes.save(out, overwrite=True)


def test_routes_json_is_compact_and_rounded(hostile_routes):
    text = hostile_routes.to_json()
    assert ", " not in text.replace(HOSTILE, "") and ": " not in text.replace(HOSTILE, "")
    data = json.loads(text)
    heads = np.asarray(data["graph"]["layers"][0]["heads"])
    np.testing.assert_allclose(heads, hostile_routes.graph.heads[0], atol=5e-7)
    numbers = [entry["target"]["probability"] for entry in data["lens"]] + [e["weight"] for e in data["route"]["edges"]]
    assert all(float(f"{value:.6g}") == value for value in numbers)  # 6 significant digits
