"""Every result object shows itself compactly in a notebook: a repr of one line that names the
shapes (never the arrays) and a small escaped HTML summary; a warning said in a cell is not said
again by the HTML of the result that cell shows; explore warns only about the methods asked for."""

from __future__ import annotations

import json
import sys
import types
import warnings
from html.parser import HTMLParser

import numpy as np
import pytest

import attnflow
from attnflow.errors import ExplanationWarning
from attnflow.notebook import Results, current_cell

HOSTILE = "the <img src=x onerror=alert(1)> cat sat"


class _Markup(HTMLParser):
    """The tags of a fragment and its text."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, _attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def parsed(markup: str) -> _Markup:
    parser = _Markup()
    parser.feed(markup)
    return parser


@pytest.fixture(scope="module")
def llama(tiny_loaded):
    return tiny_loaded("llama")


@pytest.fixture(scope="module")
def hostile_routes(llama):
    return attnflow.routes(llama, HOSTILE, threshold=0.005)


def test_a_trace_repr_is_one_line_of_shapes(llama):
    trace = llama.trace(HOSTILE, needs=("head_outputs", "values"))[0]
    text = repr(trace)
    n = trace.n_tokens
    assert "\n" not in text and len(text) < 400
    assert f"attentions=[{trace.n_layers} x {trace.n_heads} x {n} x {n}]" in text
    assert f"n_tokens={n}" in text and "values=[" in text and "head_outputs=[" in text
    assert "array(" not in text and "0." not in text.split("attentions")[1]  # no numbers of the arrays


def test_a_trace_shows_its_tokens_escaped(llama):
    trace = llama.trace(HOSTILE)[0]
    markup = parsed(trace._repr_html_())
    assert "img" not in markup.tags and "script" not in markup.tags
    shown = "".join(markup.text)
    assert "onerror" in shown and "attentions" in shown  # the hostile token is text, and the shapes are listed
    assert len(trace._repr_html_()) < 5_000


def test_routes_repr_is_compact_and_names_the_top_inputs(hostile_routes):
    text = repr(hostile_routes)
    assert "\n" not in text and len(text) < 600
    best = int(np.argmax(hostile_routes.importance.inputs[0]))
    assert hostile_routes.token(best) in text  # the most important input token, by the route's own numbers
    assert f"nodes={len(hostile_routes.nodes)}" in text and f"edges={len(hostile_routes.edges)}" in text


def test_routes_html_is_small_escaped_and_carries_the_strongest_edge(hostile_routes):
    fragment = hostile_routes._repr_html_()
    markup = parsed(fragment)
    assert "img" not in markup.tags and "script" not in markup.tags and len(fragment) < 20_000
    edge = next(edge for edge in hostile_routes.edges if not edge.kind.endswith("residual"))
    assert f"{edge.importance:.4g}" in fragment


def test_results_stay_a_dict_and_show_their_headline():
    results = Results(
        "evaluate",
        {
            "run": {"model": "<em>m</em>", "samples": 4, "methods": ["rollout"]},
            "methods": {"rollout": {"comprehensiveness": {"mean": 0.25, "se": 0.1}, "sufficiency": {"mean": 0.5}}},
        },
    )
    assert isinstance(results, dict) and json.loads(json.dumps(results))["run"]["samples"] == 4
    assert repr(results).startswith(
        "Results(kind='evaluate', model='<em>m</em>', methods=[rollout], samples=4"
    ) and "\n" not in repr(results)
    markup = parsed(results._repr_html_())
    assert "em" not in markup.tags
    assert "0.25" in "".join(markup.text) and "rollout" in "".join(markup.text)


def test_the_current_cell_is_ipythons_execution_count(monkeypatch):
    assert current_cell() is None or "IPython" in sys.modules  # outside a notebook: None
    fake = types.ModuleType("IPython")
    fake.version_info = (9, 0, 0)  # type: ignore[attr-defined]
    fake.get_ipython = lambda: types.SimpleNamespace(execution_count=12)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert current_cell() == 12
    fake.get_ipython = lambda: None  # type: ignore[attr-defined]  # IPython imported, but no shell
    assert current_cell() is None


@pytest.fixture
def in_cell(monkeypatch):
    """The notebook cell running now is ``count[0]`` (as IPython's execution count)."""
    import attnflow.explanation
    import attnflow.notebook

    count = [7]
    for module in (attnflow.notebook, attnflow.explanation):
        monkeypatch.setattr(module, "current_cell", lambda: count[0])
    return count


def test_a_warning_said_in_a_cell_is_not_repeated_by_the_result_it_shows(llama, in_cell):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explanation = llama.explain(HOSTILE, method="rollout", max_length=4)  # truncated: a capture note
    said = [str(warning.message) for warning in caught] + [note for note in explanation.notes]
    assert explanation.notes, "the truncation note is the case under test"
    fragment = explanation._repr_html_()
    for note in explanation.notes:
        assert note[:40] not in fragment  # said on stderr above: counted, not repeated
    assert "above" in fragment and said
    in_cell[0] += 1  # shown again in a later cell: the notes are there in full
    later = explanation._repr_html_()
    assert all(note[:30].replace("<", "&lt;") in later for note in explanation.notes)
    assert all(note[:30] in explanation.to_html() or "&" in note[:30] for note in explanation.notes)


@pytest.fixture
def noisy_method():
    """A registered method that always warns (as integrated gradients does about its completeness)."""
    from attnflow.methods.registry import register, unregister

    def noisy(attentions):
        warnings.warn("noisy: completeness is off", ExplanationWarning, stacklevel=2)
        return attentions.mean(axis=(0, 1))  # [query, key]

    register("noisy_test_method", "warns every time", takes="attentions")(noisy)
    yield "noisy_test_method"
    unregister("noisy_test_method")


def test_explore_warns_only_about_methods_asked_for(llama, noisy_method):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explored = attnflow.explore(llama, "the cat sat on the mat", faithfulness=False)
    assert not [w for w in caught if "noisy" in str(w.message)]  # not asked for: no console warning
    assert "noisy: completeness is off" in explored.method(noisy_method).note  # but on the page
    with pytest.warns(ExplanationWarning, match="noisy"):
        attnflow.explore(llama, "the cat sat on the mat", methods=["rollout", noisy_method], faithfulness=False)
