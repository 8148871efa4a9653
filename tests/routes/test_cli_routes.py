"""`attnflow routes` in-process: a run writes routes.json and prints the route; --json prints it;
an earlier routes.json needs --overwrite; every bad input ends in one error line, exit status 2,
and nothing written."""

from __future__ import annotations

import json

import pytest

from attnflow.cli import main
from attnflow.cli import routes as routes_command

TEXT = "the cat sat on the mat"


@pytest.fixture
def tiny_models_by_name(monkeypatch, tiny_loaded):
    """``--model FAMILY`` loads the session's tiny model of that family."""
    monkeypatch.setattr(routes_command, "load_model", lambda name, *_: tiny_loaded(name))


@pytest.mark.usefixtures("tiny_models_by_name")
def test_a_run_writes_routes_json_and_prints_the_route(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["routes", TEXT, "--model", "llama", "--out", str(out), "--threshold", "0.02"]) == 0
    printed = capsys.readouterr().out
    assert "prediction at position" in printed and "top heads by importance" in printed and "lens at the top" in printed
    data = json.loads((out / "routes.json").read_text())
    n_tokens = len(data["tokens"])
    assert data["threshold"] == 0.02 and data["position"] == n_tokens - 1
    layer = data["graph"]["layers"][0]
    assert len(layer["heads"]) == 4 and len(layer["heads"][0]) == n_tokens and len(layer["attention"]) == n_tokens
    assert data["route"]["nodes"][0] == {"node": ["in", 2, n_tokens - 1], "importance": 1.0, "reach": 1.0}
    assert main(["routes", TEXT, "--model", "llama", "--out", str(out)]) == 2  # an earlier routes.json
    assert "--overwrite" in capsys.readouterr().err
    assert main(["routes", TEXT, "--model", "llama", "--out", str(out), "--overwrite", "--quiet"]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.usefixtures("tiny_models_by_name")
def test_json_goes_to_stdout_and_the_summary_to_stderr(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["routes", TEXT, "--model", "gpt2", "--json", "--target", "cat", "--contrast", "mat"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["contrastive"]["total"] == pytest.approx(data["target"]["logit"] - data["contrast"]["logit"], abs=1e-4)
    assert "contrastive route" in captured.err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--model", "t5"], "do not support the t5 family"),
        (["--model", "llama", "--position", "99"], "--position must be an integer in"),
        (["--model", "llama", "--position", "-99"], "--position must be an integer in"),
        (["--model", "llama", "--threshold", "1"], r"--threshold must be a number in [0, 1)"),
        (["--model", "llama", "--threshold", "-0.1"], r"--threshold must be a number in [0, 1)"),
        (["--model", "llama", "--text", ""], "the text is empty"),
        (["--model", "llama", "--text", "  "], "the text is empty"),
        (["--model", "llama", "--text", "cat " * 70], "more than"),
        (["--model", "bert", "--target", "cat"], "no language-model head"),
        (["--model", "llama", "--target", "cat", "--contrast", "cat"], "is the target itself"),
    ],
)
@pytest.mark.usefixtures("tiny_models_by_name")
def test_bad_input_is_one_line_and_writes_nothing(arguments, message, tmp_path, capsys):
    text = TEXT
    if "--text" in arguments:
        at = arguments.index("--text")
        text, arguments = arguments[at + 1], arguments[:at] + arguments[at + 2 :]
    out = tmp_path / "out"
    assert main(["routes", text, *arguments, "--out", str(out), "--quiet"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("attnflow: error:") and message in error[0], error
    assert list(tmp_path.iterdir()) == []  # no folder, no lock, no scratch


def test_the_help_has_examples():
    with pytest.raises(SystemExit):
        main(["routes", "--help"])


def test_no_output_chosen_is_refused(capsys):
    assert main(["routes", TEXT]) == 2
    assert "give --out DIR" in capsys.readouterr().err
