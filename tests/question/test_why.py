"""`attnflow why` on tiny random models, in-process: its agreement equals what the separate commands'
JSON files give (recomputed independently, `why_oracle`); every number of its reading is in why.json
as displayed; the budget drops the most expensive evidence first, named; a classifier gets its
evidence words and value-aware rollout; bad input is refused as the other commands refuse it."""

from __future__ import annotations

import json

import pytest
from why_oracle import check_reading, numbers_of, read_separate, recomputed, separate_commands

from attnflow.cli import explain as explain_command
from attnflow.cli import main
from attnflow.cli import patch as patch_command
from attnflow.cli import routes as routes_command
from attnflow.cli import why as why_command
from attnflow.question.plan import Step, estimate_work, fit

TEXTS = ("the cat sat on the mat", "a dog ran to the park and sat")


@pytest.fixture
def tiny_models_by_name(monkeypatch, tiny_loaded):
    """``--model FAMILY`` loads the session's tiny model of that family, in every command."""
    for command in (why_command, explain_command, routes_command, patch_command):
        monkeypatch.setattr(command, "load_model", lambda name, *_: tiny_loaded(name))


def check_against_separate_commands(text, model, folder, extra=(), why_only=()):
    """Run why (with ``extra`` and ``why_only``) and the three commands (with ``extra``); the page's
    agreement must equal the one recomputed from their files."""
    arguments = ["why", text, "--model", model, "--out", str(folder / "why"), "--quiet", *extra, *why_only]
    assert main(arguments) == 0
    why = json.loads((folder / "why" / "why.json").read_text())
    for command in separate_commands(text, model, why, folder, list(extra)):
        assert main([*command, "--quiet"]) == 0, command
    expected = recomputed(read_separate(folder))
    assert len(why["agreement"]["tokens"]) == len(expected["pairs"])
    for pair in why["agreement"]["tokens"]:
        rho, overlap, k = expected["pairs"][(pair["first"], pair["second"])]
        assert pair["k"] == k and pair["top_k_overlap"] == pytest.approx(overlap, abs=1e-12), pair
        assert (pair["spearman"] is None) == (rho is None), pair
        if rho is not None:
            assert pair["spearman"] == pytest.approx(rho, abs=1e-9), pair
    assert why["agreement"]["layers"]["layers"] == expected["layers"]
    return why


@pytest.mark.usefixtures("tiny_models_by_name")
@pytest.mark.parametrize("text", TEXTS)
def test_the_agreement_is_what_the_separate_commands_files_give(tmp_path, text):
    why = check_against_separate_commands(text, "llama", tmp_path)
    assert {step["evidence"] for step in why["plan"]["steps"]} == {"attribution", "routes", "patching", "knockout"}
    check_reading(why)


@pytest.mark.usefixtures("tiny_models_by_name")
def test_a_contrast_and_a_counterfactual_text_reach_every_command(tmp_path):
    extra = ("--target", "cat", "--contrast", "mat", "--corrupt", "the mat sat on the cat")
    why = check_against_separate_commands(TEXTS[0], "llama", tmp_path, extra)
    patching = why["evidence"]["patching"]
    assert patching["noise_words"] == [] and patching["corrupt_text"] == "the mat sat on the cat"
    assert patching["metric"] == "logit('cat') - logit('mat')"
    assert "rather than 'mat'" in why["paragraphs"][0]["text"]
    check_reading(why)


def test_the_reading_test_can_fail():
    stated = {"shown": {"p": {"text": "0.77", "value": 0.7712}}, "paragraphs": [{"text": "p = 0.78"}]}
    with pytest.raises(AssertionError):
        check_reading(stated)
    wrong = {"shown": {"p": {"text": "0.78", "value": 0.7712}}, "paragraphs": [{"text": "p = 0.78"}]}
    with pytest.raises(AssertionError):
        check_reading(wrong)


def steps():
    exact = Step("patching", 20.0, fallback=Step("patching estimate", 2.0))
    return [Step("attribution", 4.0, required=True), Step("routes", 1.0), exact, Step("knockout", 3.0)]


def test_the_budget_drops_the_most_expensive_first_and_replaces_exact_patching():
    plan = fit(steps(), 10.0)  # 28 s planned: exact patching (20 s) goes, AtP's estimate (2 s) comes;
    # the knockout runs in exact patching's sweep: it goes with it
    assert plan.dropped == ["patching", "knockout"] and plan.seconds == pytest.approx(7.0)
    assert [(step.name, step.status) for step in plan.steps][2:4] == [
        ("patching", "replaced"),
        ("patching estimate", "planned"),
    ]
    plan = fit(steps(), 9.0)  # the same: the attribution (4 s) is required, whatever the budget
    assert plan.dropped == ["patching", "knockout"] and plan.seconds == pytest.approx(7.0)
    assert "budget 9 s" in plan.steps[2].reason and "DROPPED" in "\n".join(plan.lines())
    plan = fit(steps(), 0.5)  # everything goes but the attribution, the estimate included
    assert plan.dropped == ["patching", "knockout", "patching estimate", "routes"]
    assert plan.runs("attribution") and "over the budget" in plan.lines()[-1]
    assert {step.status for step in fit(steps(), None).steps} == {"planned"}


@pytest.mark.usefixtures("tiny_models_by_name")
def test_a_tight_budget_names_each_drop(tmp_path, capsys, monkeypatch):
    from attnflow import costs

    monkeypatch.setattr(costs, "calibrate", lambda _model: costs.Rates(pass_s=0.01, token_s=0.001))
    out = tmp_path / "why"
    assert main(["why", TEXTS[0], "--model", "llama", "--out", str(out), "--budget", "0.05"]) == 0
    captured = capsys.readouterr()
    why = json.loads((out / "why.json").read_text())
    assert why["plan"]["dropped"] and why["plan"]["budget"] == 0.05
    assert "dropped for the budget: " + ", ".join(why["plan"]["dropped"]) in captured.out
    assert captured.err.count("DROPPED") + captured.err.count("REPLACED") == len(why["plan"]["dropped"])
    statuses = {step["evidence"]: step["status"] for step in why["plan"]["steps"]}
    assert statuses.pop("attribution") == "planned"  # always kept: it names the answer and the noised word
    assert set(statuses.values()) <= {"dropped", "replaced"} and why["evidence"]["routes"] is None
    assert why["evidence"]["patching"] is None and "over the budget" in captured.err


def test_a_classifier_gets_its_evidence_words_and_value_aware_rollout(tmp_path, monkeypatch, tiny_classifier_path):
    import attnflow

    model = attnflow.load(str(tiny_classifier_path("bert")), device="cpu")
    monkeypatch.setattr(why_command, "load_model", lambda *_: model)
    out = tmp_path / "why"
    assert main(["why", "the movie was great fun", "--model", "bert", "--out", str(out), "--quiet"]) == 0
    why = json.loads((out / "why.json").read_text())
    assert {step["evidence"] for step in why["plan"]["steps"]} == {"attribution", "value-aware rollout"}
    assert why["evidence"]["patching"] is None and why["evidence"]["routes"] is None
    assert why["paragraphs"][-1]["question"].startswith("Which words push")
    assert "value-aware rollout" in why["token_scores"]
    check_reading(why)


def test_no_template_states_a_number_of_its_own():
    from attnflow.question import wording

    for name, template in wording.T.items():
        assert numbers_of(template) == [], name
    assert numbers_of(wording.quoted("Ġ1990")) == ["1990"]  # a token's digits come from shown texts only


def test_every_faithfulness_level_has_its_sentence():
    from attnflow.explanation import LEVEL_NOTES
    from attnflow.question import wording

    assert set(LEVEL_NOTES) <= set(wording.T)  # a level the badge can show is worded, not a KeyError


def test_over_the_budget_exact_patching_becomes_atps_estimate_and_the_reading_says_so(tiny_loaded, monkeypatch):
    import attnflow
    from attnflow import costs

    rates = costs.Rates(pass_s=0.01, token_s=0.001)
    monkeypatch.setattr(costs, "calibrate", lambda _model: rates)
    model = tiny_loaded("llama")
    first = attnflow.why(model, TEXTS[0])
    planned = {step.name: step.seconds for step in first.plan.steps}
    estimate = rates.seconds(estimate_work(len(first.tokens), 3))
    assert estimate < planned["patching"]
    budget = sum(planned.values()) - planned["patching"] - planned["knockout"] + estimate + 1e-6
    found = attnflow.why(model, TEXTS[0], budget=budget)
    assert found.plan.dropped == ["patching", "knockout"] and found.plan.runs("patching estimate")
    assert list(found.patching.effects) == ["atp"] and found.knockout_effect() is None
    reading = found.summary()
    assert "an estimate by AtP" in reading and ("AtP estimates (an estimate, not exact patching)" in reading)
    check_reading(found.to_dict())


def test_the_built_counterfactual_noises_the_whole_word_of_the_top_token_before_the_predicting_one():
    from types import SimpleNamespace

    from attnflow.explanation import Explanation
    from attnflow.question.plan import Plan
    from attnflow.question.result import Why
    from attnflow.question.run import noise_word

    text = "The Eiffel Tower is in"
    tokens = ["The", " E", "iffel", " Tower", " is", " in"]
    offsets = [[0, 3], [3, 5], [5, 10], [10, 16], [16, 19], [19, 22]]
    scores = [0.1, 0.2, 0.5, 0.3, 0.0, 0.9]  # the predicting token (" in") first: left out
    found = Why(model="m", text=text, tokens=tokens, plan=Plan([]))
    found.attribution = [Explanation(tokens, None, scores, "gim", {}, None, offsets=offsets)]
    assert noise_word(found, SimpleNamespace(target_kind="next_token")) == "Eiffel"
    assert noise_word(found, SimpleNamespace(target_kind="class")) == "in"  # a classifier reads every token


def test_the_reading_quotes_whole_words_not_word_pieces(tiny_loaded):
    import re

    import attnflow

    text = "the Eiffel tower is tall"  # the tiny WordPiece tokenizer splits every word but 'the' and 'is'
    model = tiny_loaded("llama")
    found = attnflow.why(model, text)
    assert "##i" in found.tokens and len(found.tokens) > len(text.split()) + 2
    why = found.to_dict()
    check_reading(why)  # the numbers are as before: each one shown
    special = {token for token, mask in zip(found.tokens, found.attribution[0].special_mask, strict=True) if mask}
    named = {
        name: re.findall(r"'([^']*)'", why["shown"][name]["text"])
        for name in ("top_words", "at", "route_source")
        if name in why["shown"]
    }
    assert named["top_words"] and set(named["top_words"]) <= set(text.split())  # 'Eiffel', never 'e' or '##f'
    for quoted_words in named.values():
        assert set(quoted_words) <= set(text.split()) | special, named
    for paragraph in why["paragraphs"]:
        assert "##" not in paragraph["text"], paragraph["text"]


def test_two_compared_numbers_that_round_alike_get_a_third_decimal(tiny_loaded):
    import attnflow
    from attnflow.question.wording import reading

    found = attnflow.why(tiny_loaded("llama"), TEXTS[0])
    faithful = found.attribution[0].faithfulness
    cases = {(0.5712, 0.5749): ("0.571", "0.575"), (0.5712, 0.6): ("0.57", "0.60"), (0.57, 0.57): ("0.57", "0.57")}
    for (ours, random), (ours_text, random_text) in cases.items():
        faithful["aopc_comprehensiveness"], faithful["random"]["aopc_comprehensiveness"] = ours, random
        shown, paragraphs = reading(found)
        assert f"({ours_text} against {random_text}" in paragraphs[1]["text"], paragraphs[1]["text"]
        assert shown["comprehensiveness"] == {"text": ours_text, "value": ours}
        assert shown["comprehensiveness_random"] == {"text": random_text, "value": random}
