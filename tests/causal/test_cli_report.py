"""`attnflow patch` end to end on a tiny Llama: the report's files, escaping, one-line errors,
a file of pairs with its checkpoint and --resume."""

from __future__ import annotations

import json

import numpy as np
from causal_texts import CLEAN, CORRUPT

from attnflow.cli import main


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


def patch_pairs(tiny_model_path, pairs, rows: list[dict], sites: str) -> tuple:
    """Write ``rows`` to the pairs file ``pairs`` and run `attnflow patch --file` on the tiny Llama
    (exact and AtP, 2 noise samples) into ``out`` beside it: ``(out, the command)``."""
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = pairs.parent / "out"
    command = ["patch", "--file", str(pairs), "--model", str(tiny_model_path("llama")), "--sites", sites,
               "--method", "exact,atp", "--samples", "2", "--out", str(out), "--quiet", "--device", "cpu"]  # fmt: skip
    assert main(command) == 0
    return out, command


def test_a_file_of_pairs_is_checkpointed_and_resumed(tiny_model_path, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"clean": CLEAN, "corrupt": CORRUPT},
        {"clean": "the dog ran", "noise": "dog"},
        {"clean": CLEAN, "corrupt": "the cat sat"},  # a different length: left out, with its reason
    ]
    out, command = patch_pairs(tiny_model_path, pairs, rows, "heads")
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


def byte_level_result():
    """A hand-made result on byte-level BPE tokens whose largest residual effect is the final row at
    the predicting position (1 by definition) and whose most informative one is France after L0."""
    from attnflow.causal.api import PatchResult

    residual = np.full((3, 5), 0.01)  # [L + 1, token]: emb, after L0, after L1
    residual[1, 3] = 0.6
    residual[2, 4] = 1.0
    tokens = ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    return PatchResult(
        model="m", clean_text="The capital of France is", corrupt_text="The capital of Italy is", noise_words=[],
        tokens=tokens, corrupt_tokens=tokens, direction="denoising", metric="log p(' Paris')", clean_metric=-1.0,
        corrupt_metric=-5.0, samples=1, n_layers=2, n_heads=2,
        effects={"exact": {"residual": residual, "heads": np.array([[0.1, 0.3], [0.2, 0.05]])}},
    )  # fmt: skip


def test_strongest_sites_leave_out_the_final_residual_row_and_name_layers_as_versus_does():
    result = byte_level_result()
    lines = result.summary().splitlines()
    residual = next(line for line in lines if "residual" in line)
    assert "L0, token 3 'France'" in residual and "+0.600" in residual, residual
    assert any(line.startswith("(residual: the stream leaving the last layer left out") for line in lines)
    assert "heads    strongest: L0, head 1: +0.300" in "\n".join(lines)
    from attnflow.causal.report import report_html

    page = report_html(result)
    assert "Ġ" not in page
    strongest = page[page.index('<table class="strongest">') :]
    strongest = strongest[: strongest.index("</table>")]
    assert 'data-kind="residual" data-layer="2"' not in strongest  # the final row: 1 by definition
    assert "<td>L0</td><td>3: France</td>" in strongest
    assert "1 by definition" in page


def test_the_pairs_page_says_how_to_read_it_and_shows_the_pairs_and_the_intervals(tiny_model_path, tmp_path):
    rows = [{"clean": CLEAN, "corrupt": CORRUPT}, {"clean": "the <b>cat</b> ran", "noise": "cat"}]
    out, _ = patch_pairs(tiny_model_path, tmp_path / "pairs.jsonl", rows, "residual,heads")
    summary = json.loads((out / "summary.json").read_text())
    page = (out / "summary.html").read_text()
    assert "How to read this page" in page
    listed = page[page.index('<table class="pairs">') :]
    assert CLEAN in listed and CORRUPT in listed and "the &lt;b&gt;cat&lt;/b&gt; ran" in listed and "<b>cat" not in page
    assert [pair["clean_text"] for pair in summary["pair_list"]] == [CLEAN, "the <b>cat</b> ran"]
    intervals = page[page.index('<table class="intervals">') :]
    intervals = intervals[: intervals.index("</table>")]
    heads = summary["effects"]["exact"]["heads"]
    mean, half = np.asarray(heads["mean"]), np.asarray(heads["ci95"])
    layer, head = np.unravel_index(int(np.argmax(np.abs(mean))), mean.shape)
    row = f'data-method="exact" data-kind="heads" data-layer="{layer}" data-index="{head}"'
    assert row in intervals
    cells = intervals[intervals.index(row) :]
    assert f'data-value="{float(mean[layer, head] - half[layer, head])!r}"' in cells.split("</tr>")[0]
    agreement = page[page.index('<table class="agreement">') :].split("</table>")[0]
    assert "±" in agreement or "n = 1" in agreement  # the mean over pairs with its interval


def test_a_patch_result_shows_itself_in_one_short_line_and_as_html_in_notebooks():
    result = byte_level_result()
    text = repr(result)
    assert "\n" not in text and len(text) < 240 and "array" not in text and "0.01" not in text, text
    assert text.startswith("PatchResult(model='m'") and "exact" in text and "residual [3, 5]" in text
    fragment = result._repr_html_()
    assert "<html" not in fragment and "<script" not in fragment and "Ġ" not in fragment
    assert '<table class="strongest">' in fragment and "The capital of France is" in fragment
