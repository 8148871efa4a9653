"""`attnflow explain --method auto` (the default with a target) and the per-input faithfulness it
reads, through the command line: the choice against the recorded numbers, bad input in one line,
and the demo's command on the real classifier."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from attnflow.cli import explain as explain_command
from attnflow.cli import main
from attnflow.methods.registry import available_methods, get_method
from attnflow.rows.adapters import adapter_for

TEXT = "the movie was terrible but the acting was great"
# auto's candidates on a BERT-like model: the one-pass (one forward + one backward) target methods
CANDIDATES = tuple(
    name
    for name in available_methods()
    if get_method(name).cost == "backward"
    and get_method(name).uses_target
    and get_method(name).supports(adapter_for("bert", "BertModel"))
)


@pytest.fixture(scope="module")
def classifier_path(tiny_classifier_path, tmp_path_factory):
    """The tiny classifier with its head scaled up (saved anew), so that the candidates' per-input
    comprehensiveness differ well above float noise."""
    import transformers

    source = tiny_classifier_path("bert")
    folder = tmp_path_factory.mktemp("scaled") / "classifier"
    shutil.copytree(source, folder)  # the tokenizer; the weights are written over below
    model = transformers.AutoModelForSequenceClassification.from_pretrained(source)
    with torch.no_grad():
        model.classifier.weight.mul_(1000.0)
    model.save_pretrained(folder)
    return folder


def _explain_json(capsys, *args: str):
    assert main(["explain", TEXT, "--json", "--quiet", "--device", "cpu", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_auto_shows_the_candidate_with_the_highest_comprehensiveness(classifier_path, capsys):
    shown = _explain_json(capsys, "--model", str(classifier_path), "--method", "auto," + ",".join(CANDIDATES))
    assert sorted(e["method"] for e in shown) == sorted(CANDIDATES)  # auto's choice is one of them, shown once
    recorded = {e["method"]: e["faithfulness"]["aopc_comprehensiveness"] for e in shown}
    chosen = [e for e in shown if "chosen_by" in e]
    assert len(chosen) == 1 and recorded[chosen[0]["method"]] == max(recorded.values())
    assert len(set(recorded.values())) > 1  # the candidates differ: the choice is a real one
    for method, value in recorded.items():
        assert f"{value:.3f}" in chosen[0]["chosen_by"], method

    alone = _explain_json(capsys, "--model", str(classifier_path))  # the default with a target: auto
    assert alone["method"] == chosen[0]["method"] and alone["chosen_by"] == chosen[0]["chosen_by"]


@pytest.mark.parametrize("method", ["auto", "gradient"])
def test_a_target_method_on_a_model_without_a_target_is_one_line(tiny_model_path, capsys, method):
    code = main(["explain", TEXT, "--model", str(tiny_model_path("bert")), "--method", method, "--device", "cpu", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0]
    assert ("choose a method such as rollout" if method == "auto" else "--target-text") in err[0]


def test_auto_on_a_sentence_encoder_names_target_text(minilm, monkeypatch, capsys):
    monkeypatch.setattr(explain_command, "load_model", lambda *_args: minilm)
    assert main(["explain", TEXT, "--method", "auto", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give --target-text (it explains the similarity" in err[0]


def test_the_console_shows_signed_evidence_for_and_against_and_the_badge(classifier_path, tmp_path, capsys):
    args = ["explain", TEXT, "--model", str(classifier_path), "--method", "leave_one_out", "--out", str(tmp_path)]
    assert main([*args, "--device", "cpu"]) == 0
    data = json.loads((tmp_path / "explanation.json").read_text())
    scores = dict(zip(data["tokens"], data["scores"], strict=True))
    lines = capsys.readouterr().out.splitlines()
    line = next(line for line in lines if line.startswith(f"leave_one_out for {data['target']['label']}: "))
    support, against = line.split(": ", 1)[1].split(" … against: ")
    assert all(float(part.rsplit(" ", 1)[1]) > 0 for part in support.split(", "))
    assert all(part.rsplit(" ", 1)[1].startswith("−") for part in against.split(", "))
    best = max((s, t) for t, s in scores.items() if t not in ("[CLS]", "[SEP]"))
    assert support.startswith(f"{best[1]} {best[0]:+.3g}")
    assert any(line.startswith("leave_one_out faithfulness on this input: comprehensiveness") for line in lines)
    assert data["signed"] is True and set(data["faithfulness"]) >= {"comprehensiveness", "sufficiency", "random"}


def test_file_defaults_to_auto_and_chooses_per_text(classifier_path, tmp_path, capsys):
    """--file without --method on a classifier: each text gets what `explain TEXT` (auto) shows alone."""
    texts = [TEXT, "a great cat sat on the mat", "the plot was bad"]
    source = tmp_path / "texts.txt"
    source.write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["explain", "--file", str(source), "--model", str(classifier_path), "--out", str(out), "-q"]) == 0
    for number, text in enumerate(texts, start=1):
        saved = json.loads((out / f"{number:03d}" / "explanation.json").read_text())
        assert main(["explain", text, "--model", str(classifier_path), "--json", "--quiet", "--device", "cpu"]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert saved["method"] in CANDIDATES and saved["method"] == alone["method"]
        assert saved["chosen_by"] == alone["chosen_by"]


def test_generate_defaults_to_the_candidate_with_the_highest_step_comprehensiveness(tiny_model_path, capsys):
    """--generate without --method: auto, checked against every candidate's own per-step faithfulness."""
    from attnflow.evaluate.per_input import auto_methods
    from attnflow.generation import generation_methods

    path = str(tiny_model_path("llama"))
    argv = ["explain", "Paris is the capital of", "--model", path, "--generate", "2", "--json", "--quiet"]
    assert main(argv) == 0
    chosen = json.loads(capsys.readouterr().out)
    candidates = [
        m for m in auto_methods(adapter_for("llama", "LlamaModel"), "next_token") if m in generation_methods()
    ]
    assert main([*argv, "--method", ",".join(candidates), "--faithfulness"]) == 0
    every = {data["method"]: data["faithfulness"]["mean_aopc"] for data in json.loads(capsys.readouterr().out)}
    assert chosen["method"] == max(every, key=every.get)
    assert chosen["faithfulness"]["mean_aopc"] == pytest.approx(every[chosen["method"]])


def test_the_python_front_door_takes_auto_as_the_command_line_does(classifier_path, capsys):
    import numpy as np

    import attnflow

    model = attnflow.load(str(classifier_path), device="cpu", progress=False)
    shown = _explain_json(capsys, "--model", str(classifier_path))  # the command line's auto
    chosen = model.explain(TEXT, method="auto")
    assert chosen.method == shown["method"] and chosen.chosen_by == shown["chosen_by"]
    np.testing.assert_allclose(chosen.scores, shown["scores"], rtol=1e-5, atol=1e-7)
    several = model.explain([TEXT, "a fine film"], method="auto")
    assert len(several) == 2 and all(e.method in CANDIDATES and e.chosen_by for e in several)
    with pytest.raises(ValueError, match=r"unknown method 'nope'; available: .*\bor auto\b"):
        model.explain(TEXT, method="nope")


def test_unknown_method_lists_name_auto_where_it_is_taken(capsys):
    with pytest.raises(SystemExit):  # argparse's own one-line error
        main(["explain", TEXT, "--method", "nope", "--json", "--quiet"])
    assert "or auto" in capsys.readouterr().err


def test_no_faithfulness_skips_the_badges_and_auto_says_it_chose_without_them(classifier_path, tmp_path, capsys):
    shown = _explain_json(capsys, "--model", str(classifier_path), "--method", "auto,rollout", "--no-faithfulness")
    assert [e.get("faithfulness") for e in shown] == [None, None]
    assert "without a per-input test (faithfulness turned off)" in shown[0]["chosen_by"]
    source = tmp_path / "texts.txt"
    source.write_text(TEXT + "\n", encoding="utf-8")
    out = tmp_path / "out"
    code = main(
        [
            "explain",
            "--file",
            str(source),
            "--model",
            str(classifier_path),
            "--out",
            str(out),
            "-q",
            "--no-faithfulness",
        ]
    )
    assert code == 0 and "faithfulness" not in json.loads((out / "001" / "explanation.json").read_text())
