"""`attnflow evaluate` end to end on the real minilm-sentiment classifier, and its one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnflow.cli import main
from attnflow.datasets import load_labelled_file


def run_cli(capsys, *argv):
    code = main(["evaluate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """Three held-out Rotten Tomatoes examples, three methods, one sanity sample."""
    out = tmp_path_factory.mktemp("evaluate")
    code = main(
        [
            "evaluate",
            "--samples",
            "3",
            "--methods",
            "rollout,gradient,random",
            "--sanity-samples",
            "1",
            "--bounds",
            "singles",  # ~26-token snippets: the cheap bounds (the searches' thousands of forwards are for real runs)
            "--out",
            str(out),
            "--quiet",
        ]
    )
    return code, out


def test_small_real_run_writes_every_output(small_run):
    code, out = small_run
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["run"]["model"] == "minilm-sentiment" and results["run"]["task"] == "rotten-tomatoes"
    assert 0.7 < results["run"]["classifier_heldout_accuracy"] < 0.85
    assert results["run"]["samples"] == 3 and results["run"]["options"]["replace"] == "remove"
    assert set(results["methods"]) == {"rollout", "gradient", "random"}
    for summary in results["methods"].values():
        bins = [b["mean"] for b in summary["comprehensiveness"]["bins"].values()]
        assert summary["comprehensiveness"]["mean"] == pytest.approx(np.mean(bins))  # AOPC = mean over the bins
        assert (
            len(summary["sanity"]["stages"]) == 3
        )  # head + 2 of minilm's 6 layer stages (the default), the last one all
        assert summary["agreement_loo"] is not None and summary["seconds_per_sample"]["mean"] > 0
    # every method starts its deletion curve from the same untouched inputs
    starts = {round(s["deletion_curve"]["mean"][0], 9) for s in results["methods"].values()}
    assert len(starts) == 1
    table = (out / "results.md").read_text()
    assert all(f"| {name} |" in table for name in ("rollout", "gradient", "random")) and "held-out accuracy" in table
    page = (out / "results.html").read_text()
    assert "<table>" in page and page.count('src="data:image/png;base64,') == 2  # both figures embedded
    assert "Content-Security-Policy" in page and "<script" not in page
    assert "Model minilm-sentiment on task" in page and "`" not in page and "**" not in page  # no Markdown marks
    assert (out / "deletion_curves.png").stat().st_size > 0 and (out / "metrics.png").stat().st_size > 0


def test_unknown_method_and_task_are_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "--methods", "rollout,nope", "--out", str(tmp_path))
    assert code == 2 and err.strip().splitlines() == [err.strip()] and "unknown method 'nope'" in err
    code, _, err = run_cli(capsys, "--task", "imdb", "--out", str(tmp_path))
    assert code == 2 and "unknown task 'imdb'" in err and len(err.strip().splitlines()) == 1


def test_a_missing_task_file_fails_before_the_model_loads(capsys, tmp_path, monkeypatch):
    import attnflow.model

    monkeypatch.setattr(attnflow.model, "load", lambda *_a, **_k: pytest.fail("a model was loaded"))
    code, _, err = run_cli(capsys, "--task", str(tmp_path / "reviews.csv"), "--out", str(tmp_path / "out"))
    assert code == 2 and err.strip() == f"attnflow: error: --task {tmp_path / 'reviews.csv'}: no such file"
    code, _, err = run_cli(capsys, "--task", str(tmp_path), "--out", str(tmp_path / "out"))
    assert code == 2 and "a folder, not a CSV/JSONL file" in err


def test_model_without_classifier_head_is_refused(capsys, tmp_path):
    code, _, err = run_cli(capsys, "--model", "minilm", "--task", "rotten-tomatoes", "--out", str(tmp_path), "--quiet")
    assert code == 2 and "no classifier head" in err and len(err.strip().splitlines()) == 1


def test_task_file_without_the_columns_is_one_line(capsys, tmp_path):
    path = tmp_path / "reviews.csv"
    path.write_text("review,stars\ngreat film,positive\n")
    code, _, err = run_cli(capsys, "--task", str(path), "--out", str(tmp_path / "out"), "--quiet")
    assert code == 2 and "no column 'text', 'label'" in err and "review, stars" in err


def test_samples_above_the_file_size_are_capped_with_a_warning(capsys, tmp_path, caplog):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"review": "A wonderful, moving film.", "y": "positive"}\n{"review": "Dull and far too long.", "y": 0}\n'
    )
    code, _, err = run_cli(
        capsys,
        "--task",
        str(path),
        "--text-column",
        "review",
        "--label-column",
        "y",
        "--samples",
        "50",
        "--methods",
        "random",
        "--sanity-samples",
        "0",
        "--out",
        str(tmp_path / "out"),
        "--quiet",
    )
    assert code == 0
    assert any("--samples 50 is more than the 2" in record.getMessage() for record in caplog.records)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["run"]["samples"] == 2 and results["run"]["split"] == "all rows of the file"
    table = (tmp_path / "out" / "results.md").read_text(encoding="utf-8")
    assert "comprehensiveness ↑" in table and "NAOPC comp." not in table  # no --bounds: no NAOPC columns
    assert "NAOPC (normalised AOPC) was not computed" in table


def test_file_labels_map_to_the_model_classes(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("text,label\na,Positive\nb,0\nc,negative\n")
    data = load_labelled_file(path, ("negative", "positive"))
    assert data.labels.tolist() == [1, 0, 0] and data.texts == ("a", "b", "c")
    path.write_text("text,label\na,neutral\n")
    with pytest.raises(Exception, match="label 'neutral' is not one of the model's classes"):
        load_labelled_file(path, ("negative", "positive"))
