"""The explanation HTML: escaped, self-contained, offline; and the reusable page helpers."""

from __future__ import annotations

import base64
from html.parser import HTMLParser

import numpy as np
import pytest

from attnflow.explanation import Explanation, explain
from attnflow.viz import page as viz_page
from attnflow.viz.html import explanation_html

SCRIPT = "<script>alert(1)</script>"  # one of the tokens of the hostile_trace fixture


class Elements(HTMLParser):
    """Every start tag with its attributes, and the page's text."""

    def __init__(self, markup: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def named(self, tag: str) -> list[dict[str, str | None]]:
        return [attrs for name, attrs in self.tags if name == tag]


def test_tokens_are_escaped_and_no_markup_is_injected(hostile_explanation):
    markup = hostile_explanation.to_html()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in markup
    assert "<script" not in markup.lower()
    elements = Elements(markup)
    assert not elements.named("script")
    assert not elements.named("b")  # "<b>bold</b>" from the text stays text
    assert all(not name.startswith("on") for _, attrs in elements.tags for name in attrs)
    # The images are ours (data: URIs), the model name's <img onerror> is text.
    assert all(attrs["src"].startswith("data:image/png;base64,") for attrs in elements.named("img"))
    text = "".join(elements.text)
    assert SCRIPT in text and '<img src=x onerror="alert(2)">' in text and '"great" &' in text


def test_page_is_self_contained_and_offline(hostile_explanation):
    markup = explanation_html(hostile_explanation)
    assert markup.startswith("<!DOCTYPE html>")
    assert "http://" not in markup and "https://" not in markup
    elements = Elements(markup)
    assert not elements.named("link") and not elements.named("iframe")
    csp = [attrs for attrs in elements.named("meta") if attrs.get("http-equiv") == "Content-Security-Policy"]
    assert csp and "default-src 'none'" in csp[0]["content"] and "script-src" not in csp[0]["content"]
    images = elements.named("img")
    assert images, "the matrix heatmap is embedded"
    for attrs in images:
        png = base64.b64decode(attrs["src"].split(",", 1)[1])
        assert png.startswith(b"\x89PNG")


def test_tokens_coloured_by_score_with_the_original_text(hostile_explanation):
    markup = hostile_explanation.to_html()
    spans = [attrs for attrs in Elements(markup).named("span") if attrs.get("class") == "tok"]
    assert len(spans) == hostile_explanation.n_tokens - 2  # special tokens are shown apart
    alphas = [float(attrs["style"].split("rgba(217,72,15,")[1].split(")")[0]) for attrs in spans]
    scores = hostile_explanation.scores[1:-1]
    assert np.argmax(alphas) == np.argmax(scores) and max(alphas) == pytest.approx(1.0)
    assert all(f"#{i} " in attrs["title"] for i, attrs in enumerate(spans, start=1))
    assert "&quot;great&quot; &amp; " in markup  # the text between tokens keeps its characters


def test_truncated_text_is_shown_as_unseen(hostile_trace):
    hostile_trace.text += " and a tail the model never saw"
    markup = explain(hostile_trace).to_html()
    assert 'class="unseen"' in markup and "a tail the model never saw" in markup


def test_tokens_without_offsets_are_shown_as_chips(hostile_trace):
    hostile_trace.text = ""
    explanation = explain(hostile_trace)
    markup = explanation.to_html()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in markup and "<script" not in markup


def test_page_helpers_escape_everything():
    markup = viz_page.page(
        "<t>",
        viz_page.section("<s>", viz_page.table(("<h>",), [("<c>",), (1.5,), (3,)])),
        subtitle="<sub>",
        meta={"<k>": "<v>", "skipped": None},
        footer="<f>",
    )
    for raw in ("<t>", "<s>", "<h>", "<c>", "<sub>", "<k>", "<v>", "<f>"):
        assert raw not in markup and viz_page.esc(raw) in markup
    assert "skipped" not in markup
    assert '<td class="num">1.5</td>' in markup and '<td class="num">3</td>' in markup
    assert viz_page.esc("a\"b'c") == "a&quot;b&#x27;c"


def test_figure_embedding():
    from matplotlib.figure import Figure

    figure = Figure(figsize=(2, 2))
    figure.subplots().plot([0, 1], [1, 0])
    tag = viz_page.figure_img(figure, alt="a <line>")
    assert tag.startswith('<img class="figure" alt="a &lt;line&gt;" src="data:image/png;base64,')


def test_the_file_index_shows_each_texts_prediction():
    from attnflow.viz.index import index_html

    def explanation(text, prediction):
        return Explanation(
            tokens=["[CLS]", "a", "[SEP]"],
            matrix=None,
            scores=[0.2, 0.5, 0.3],
            method="gradient",
            options={},
            row=None,
            text=text,
            prediction=prediction,
        )

    def predicted(label, probability):
        return {"kind": "class", "index": 0, "label": label, "value": 1.0, "probability": probability}

    page = index_html([("001", explanation("good", predicted("positive", 0.91))), ("002", explanation("bad", None))])
    assert "<thead><tr><th>#</th><th>text</th><th>prediction</th><th>method</th><th>top tokens" in page
    assert '<td class="text">good</td><td>positive (p = 0.91)</td>' in page
    assert '<td class="text">bad</td><td></td>' in page  # no prediction for this one
    assert "<th>prediction</th>" not in index_html([("001", explanation("good", None))])


def test_the_file_index_names_each_rows_method_and_gives_signed_scores_their_sign():
    from attnflow.viz.index import index_html

    def explanation(method, scores, signed):
        return Explanation(
            tokens=["good", "bad", "film"], matrix=None, scores=scores, method=method, options={}, row=None,
            text="good bad film", signed=signed, chosen_by=f"--method auto chose {method}: ...",
        )  # fmt: skip

    page = index_html([("001", explanation("gradient", [0.1, 0.5, 0.2], False)),
                       ("002", explanation("attnlrp", [-0.6, 0.8, 0.1], True))])  # fmt: skip
    assert "<th>method</th>" in page
    first, second = (page[page.index(f'href="{n}/explanation.html"') :].split("</tr>")[0] for n in ("001", "002"))
    assert "auto → gradient" in first and "auto → attnlrp" in second
    assert "bad 0.500" in first and "+" not in first.split("<td>")[-2]  # unsigned: no sign
    assert "bad +0.800" in second and "good −0.600" in second  # signed: for and against, with their signs
    meta = page[: page.index("<thead>")]
    assert "auto (gradient, attnlrp)" in meta and "attnlrp</td>" not in meta.replace("auto (gradient, attnlrp)", "")
