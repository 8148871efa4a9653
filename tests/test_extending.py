"""docs/extending.md runs as written, and each extension point works from its one declaration and is
found everywhere: a toy method with an option (the CLI's flag and --help, the table of methods, the
server's /api/methods, a saved page), a toy family (one adapter row: every method whose requirements it
meets runs, the others refuse naming what is missing), a toy rule set and a rule of its own (working
methods, in --help, the table, /api/methods and as RelP's backward)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from attnflow.methods.registry import available_methods, get_method, markdown_table, unregister
from attnflow.rows import unregister_adapter

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
TEXT = "the movie was great but the acting"
ADDED_METHODS = ("last_layer", "plain_rules")
ADDED_RULES = ("attnlrp_tempered", "cp_lrp_mine")


@pytest.fixture(scope="module")
def extended():
    """The namespace after running every Python block of docs/extending.md in order."""
    from attnflow.methods.model import unregister_rules

    namespace: dict = {}
    try:
        for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
            exec(compile(block, str(DOC), "exec"), namespace)
        yield namespace
    finally:
        for name in ADDED_METHODS:
            unregister(name)
        for name in (*ADDED_RULES, "plain_rules"):
            unregister_rules(name)
        unregister_adapter("gemma")


def test_the_toy_method_and_its_option_run_through_the_front_door(extended):
    model = extended["model"]
    explanation = model.explain(TEXT, method="last_layer", row="last")
    attentions = model.trace(TEXT)[0].attentions  # [layer, head, query, key]
    np.testing.assert_allclose(explanation.scores, attentions[-1].mean(axis=0)[-1], rtol=1e-6)
    both = model.explain(TEXT, method="last_layer", row="last", last_layers=2)
    np.testing.assert_allclose(both.scores, attentions[-2:].mean(axis=(0, 1))[-1], rtol=1e-6)
    # reading the weights alone, it requires only that attention be every layer's token mixer
    assert "last_layer" in available_methods() and get_method("last_layer").requires == {"attention_mixing"}


def explain_help() -> str:
    from attnflow.cli import build_parser

    parser = build_parser()
    subparsers = next(action for action in parser._actions if action.dest == "command")
    return " ".join(subparsers.choices["explain"].format_help().split())


def test_every_addition_is_found_everywhere(extended, tmp_path):
    """The CLI's --help and flags, the table of methods, the server's /api/methods and a saved page."""
    from fastapi.testclient import TestClient

    from attnflow.cli import main
    from attnflow.serve import ModelPool, create_app

    model = extended["model"]
    shown = explain_help()
    table = markdown_table()
    pool = ModelPool(["toy"], loader=lambda _name: model, known=("toy",))
    with TestClient(create_app(pool)) as client:
        listed = {record["name"]: record for record in client.get("/api/methods").json()["methods"]}
    for name in ("last_layer", *ADDED_RULES):
        assert f"{name} " in shown and f"| `{name}` |" in table and name in listed, name
    assert "--last-layers N" in shown and "[last_layer]" in shown
    assert listed["last_layer"]["options"][0]["flag"] == "--last-layers"
    assert listed["attnlrp_tempered"]["signed"] and listed["cp_lrp_mine"]["cost"] == "backward"
    out = tmp_path / "page"
    code = main(["explain", TEXT, "--model", str(extended["folder"]), "--method", "last_layer", "--last-layers",
                 "2", "--out", str(out), "--quiet", "--device", "cpu", "--no-faithfulness"])  # fmt: skip
    (page,) = out.rglob("explanation.html")  # the page one method writes
    assert code == 0 and "last_layer" in page.read_text(encoding="utf-8")


def test_the_toy_family_runs_every_method_it_provides_for_and_refuses_the_others(extended):
    model = extended["model"]
    assert model.adapter.family == "gemma" and type(model.model).__name__ == "GemmaForCausalLM"
    supported, refused = [], []
    for name in available_methods():
        spec = get_method(name)
        if spec.supports(model.adapter):
            scores = model.explain(TEXT, method=name).scores
            assert scores.shape[-1] == len(model.trace(TEXT)[0].tokens) and np.all(np.isfinite(scores)), name
            supported.append(name)
        else:
            missing = sorted(spec.requires - model.adapter.provides)
            with pytest.raises(
                ValueError, match=rf"{name}' does not support the gemma family: it requires {missing[0]}"
            ):
                model.explain(TEXT, method=name)
            refused.append(name)
    assert {"attnlrp", "gim", "cp_lrp", "rollout", "flow", "norm", "grad_x_input", "leave_one_out"} <= set(supported)
    assert {"alti", "value_zeroing"} <= set(refused)  # post-LN only: Gemma normalises before each block


def test_a_rule_set_and_a_rule_of_ones_own_are_working_methods(extended):
    from attnflow.methods.model import BackwardRules, lrp_relevance, register_rules

    model = extended["model"]
    tempered = extended["tempered"]
    assert tempered.signed and "conservation" in tempered.extras
    assert not np.allclose(tempered.scores, model.explain(TEXT, method="attnlrp").scores)
    trace = model.trace(TEXT, needs=("attentions", "target"))[0]
    (by_name,) = lrp_relevance(model, [trace], "attnlrp_tempered")
    np.testing.assert_allclose(by_name.scores, tempered.scores, rtol=1e-5, atol=1e-8)
    # the rule written in the page is CP-LRP's stop at the query and key projections
    np.testing.assert_allclose(extended["mine"].scores, model.explain(TEXT, method="cp_lrp").scores, rtol=1e-6)
    estimated = extended["estimated"].effects
    relp = estimated["relp:attnlrp_tempered"]["residual"]
    assert relp.shape == estimated["exact"]["residual"].shape and np.all(np.isfinite(relp))
    # A rule set that changes nothing is plain gradient x input at the word embeddings: grad_x_input's numbers.
    register_rules(BackwardRules("plain_rules", "no rule at all"))
    plain = model.explain(TEXT, method="plain_rules").scores
    expected = model.explain(TEXT, method="grad_x_input", signed=True).scores
    np.testing.assert_allclose(plain, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())
