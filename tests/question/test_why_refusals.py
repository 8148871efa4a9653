"""Bad input to `attnflow why` is refused as `attnflow explain`, `routes` and `patch` refuse it: the
same one line (exit status 2), before any work, and nothing written."""

from __future__ import annotations

import pytest

from attnflow.cli import explain as explain_command
from attnflow.cli import main
from attnflow.cli import patch as patch_command
from attnflow.cli import routes as routes_command
from attnflow.cli import why as why_command

TEXT = "the cat sat on the mat"


@pytest.fixture
def tiny_models_by_name(monkeypatch, tiny_loaded, tiny_classifier_path):
    """``--model FAMILY`` loads the session's tiny model of that family (``classifier``: a tiny BERT
    classifier), in every command."""
    import attnflow
    from attnflow.cli.common import load_model

    classifier = attnflow.load(str(tiny_classifier_path("bert")), device="cpu")

    def load(name, *rest):
        if name == "no-such-model":
            return load_model(name, *rest)
        return classifier if name == "classifier" else tiny_loaded(name)

    for command in (why_command, explain_command, routes_command, patch_command):
        monkeypatch.setattr(command, "load_model", load)


def refused(arguments, tmp_path, capsys) -> str:
    """The one error line of a refused command; nothing written into tmp_path."""
    out = tmp_path / "out"
    assert main([*arguments, "--out", str(out), "--quiet"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("attnflow: error:"), error
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    return error[0]


# (why's arguments after TEXT, the text, the other command that refuses the same, its arguments)
CASES = [
    ("empty text", [], "", "explain", ["--method", "rollout"]),
    ("blank text", [], "   ", "explain", ["--method", "rollout"]),
    ("too long", [], "cat " * 70, "routes", []),
    ("target of two tokens", ["--target", "park"], TEXT, "routes", ["--target", "park"]),
    ("contrast of two tokens", ["--contrast", "park"], TEXT, "patch", ["--noise", "cat", "--contrast", "park"]),
    (
        "contrast = target",
        ["--target", "cat", "--contrast", "cat"],
        TEXT,
        "patch",
        ["--noise", "cat", "--target", "cat", "--contrast", "cat"],
    ),
    ("counterfactual length", ["--corrupt", "the cat"], TEXT, "patch", ["--corrupt", "the cat"]),
    (
        "unknown class",
        ["--model", "classifier", "--target", "happy"],
        TEXT,
        "patch",
        ["--model", "classifier", "--noise", "cat", "--target", "happy"],
    ),
    ("unknown model", ["--model", "no-such-model"], TEXT, "routes", ["--model", "no-such-model"]),
]


@pytest.mark.usefixtures("tiny_models_by_name")
@pytest.mark.parametrize(("why", "text", "command", "other"), [case[1:] for case in CASES], ids=[c[0] for c in CASES])
def test_refused_as_the_other_command_refuses_it(why, text, command, other, tmp_path, capsys):
    model = [] if "--model" in why else ["--model", "llama"]
    mine = refused(["why", text, *model, *why], tmp_path, capsys)
    model = [] if "--model" in other else ["--model", "llama"]
    theirs = refused([command, text, *model, *other], tmp_path, capsys)
    assert mine == theirs


@pytest.mark.usefixtures("tiny_models_by_name")
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--budget", "0"], "--budget must be a positive number of seconds"),
        (["--budget", "nan"], "--budget must be a positive number of seconds"),
        (["--corrupt", "the mat sat on the cat", "--samples", "2"], "--samples would be ignored with --corrupt"),
        (["--model", "t5"], "attnflow why explains a causal LM's next token or a classifier's class"),
    ],
)
def test_its_own_options_are_refused_in_one_line(arguments, message, tmp_path, capsys):
    model = [] if "--model" in arguments else ["--model", "llama"]
    assert message in refused(["why", TEXT, *model, *arguments], tmp_path, capsys)


@pytest.mark.usefixtures("tiny_models_by_name")
def test_an_earlier_run_needs_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["why", TEXT, "--model", "llama", "--out", str(out), "--quiet"]) == 0
    before = (out / "why.json").read_bytes()
    assert main(["why", TEXT, "--model", "llama", "--out", str(out), "--quiet"]) == 2
    assert "--overwrite" in capsys.readouterr().err and (out / "why.json").read_bytes() == before
