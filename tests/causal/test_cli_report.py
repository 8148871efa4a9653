"""`attnflow patch` end to end on a tiny Llama: the report's files, escaping, one-line errors,
a file of pairs with its checkpoint and --resume."""

from __future__ import annotations

import json

import numpy as np

from attnflow.cli import main

from conftest import CLEAN, CORRUPT


def test_patch_writes_json_and_an_escaped_page(tiny_model_path, tmp_path):
    out = tmp_path / "out"
    code = main(
        ["patch", "the cat <script> sat", "--corrupt", "the dog <script> sat",
         "--model", str(tiny_model_path("llama")), "--method", "exact,atp,atp*,relp", "--sites", "residual,heads",
         "--out", str(out), "--quiet", "--device", "cpu"]
    )  # fmt: skip
    assert code == 0
    saved = json.loads((out / "patch.json").read_text())
    n_tokens = len(saved["tokens"])
    assert np.asarray(saved["effects"]["exact"]["residual"]).shape == (3, n_tokens)
    assert np.asarray(saved["effects"]["relp"]["heads"]).shape == (2, 4)
    assert set(saved["correlations"]) == {"atp", "atp*", "relp"}
    page = (out / "patch.html").read_text()
    assert "<script" not in page and "&lt;script&gt;" in page
    assert page.count('class="heatmap"') == 4 * 2


def test_patch_errors_are_one_line(tiny_model_path, tmp_path, capsys):
    code = main(
        ["patch", CLEAN, "--corrupt", "the cat sat on the big mat", "--model", str(tiny_model_path("llama")),
         "--out", str(tmp_path / "out"), "--quiet", "--device", "cpu"]
    )  # fmt: skip
    error = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in error and "--noise" in error


def test_a_file_of_pairs_is_checkpointed_and_resumed(tiny_model_path, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"clean": CLEAN, "corrupt": CORRUPT},
        {"clean": "the dog ran", "noise": "dog"},
        {"clean": CLEAN, "corrupt": "the cat sat"},  # a different length: left out, with its reason
    ]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    command = ["patch", "--file", str(pairs), "--model", str(tiny_model_path("llama")), "--sites", "heads",
               "--method", "exact,atp", "--samples", "2", "--out", str(out), "--quiet", "--device", "cpu"]  # fmt: skip
    assert main(command) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pairs"] == 2 and len(summary["failed"]) == 1 and "tokens" in summary["failed"][0]["error"]
    done = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    heads = np.array([row["effects"]["exact"]["heads"] for row in done if "error" not in row])
    np.testing.assert_allclose(summary["effects"]["exact"]["heads"]["mean"], heads.mean(axis=0))
    half_width = 1.959963984540054 * heads.std(axis=0, ddof=1) / np.sqrt(2)
    np.testing.assert_allclose(summary["effects"]["exact"]["heads"]["ci95"], half_width)
    assert main(command) == 2  # an earlier run is there: --resume or another folder
    assert "--resume" in capsys.readouterr().err
    assert main([*command, "--resume"]) == 0
    assert len((out / "pairs.jsonl").read_text().splitlines()) == 3  # nothing ran twice
    assert (out / "summary.html").read_text().count('class="heatmap"') == 2  # exact and atp, heads
