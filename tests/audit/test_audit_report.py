"""report.html: hostile words and texts escaped, the gallery's commands, rendering in headless Chromium."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from attnflow.dataset_audit.analysis import analyse
from attnflow.dataset_audit.report import build_report, explain_command
from attnflow.dataset_audit.stats import AuditStats, ExampleResult

sys.path.insert(0, str(Path(__file__).parents[1] / "viz"))
from test_browser import assert_not_blank, needs_chromium, render, script_elements

SCRIPT = "<script>alert(1)</script>"
TEXT = f"the {SCRIPT} & <b>bold</b> film"


def hostile_results() -> dict:
    """Results of 12 texts holding script tags and markup, 4 of them misclassified, 3 swapped, one
    left unswapped (an ambiguous swap word)."""
    spans = [(0, 3), (4, 12), (12, 18), (18, 23), (24, 25), (26, 29), (29, 33), (33, 37), (38, 42)]
    stats = AuditStats(2)
    rng = np.random.default_rng(0)
    for index in range(12):
        scores = rng.random(len(spans) + 2)
        words = {"<script>": (1, 0.4), "film": (1, 0.2), "bold": (1, 0.1)}
        swapped = {"text": TEXT.replace("film", "<i>movie</i>"), "predicted_before": 1, "predicted_after": index % 2}
        swapped.update(p_before=0.9, p_after=0.4, delta_p=-0.5)
        stats.update(
            ExampleResult(
                index, TEXT, 1, 0.5 + index / 30, int(index % 3 != 0), words,
                ["[CLS]", *(TEXT[a:b] for a, b in spans), "[SEP]"], [[0, 0], *map(list, spans), [0, 0]],
                [True] + [False] * len(spans) + [True], scores.tolist(), swapped if index < 3 else None,
                ("<her>",) if index == 5 else (),
            )
        )  # fmt: skip
    labels = ['neg"<x>', "pos&"]
    results = analyse(stats, labels, min_count=1, terms=["<script>", "film"], swaps=True)
    run = {"model": '<img src=x onerror="alert(2)">', "method": "grad_rollout", "data": "d.csv", "split": "all"}
    run.update(labels=labels, samples=12, min_count=1, engine="local", elapsed_s=1.0, swap=[["film", "<i>"]])
    return {"run": run, **results}


def test_every_token_and_text_is_escaped():
    page = build_report(hostile_results())
    assert SCRIPT not in page and "<b>bold" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "1 texts were not swapped" in page and "&lt;her&gt; (1 texts)" in page and "<her>" not in page
    assert page.count('class="example"') == 4 + 2  # 4 errors, 2 flipping swaps
    assert "Content-Security-Policy" in page


def test_the_gallery_command_reproduces_the_map():
    results = hostile_results()
    record = results["errors"]["most_confident"][0]
    command = shlex.split(explain_command(record, results["run"]))
    assert command[:3] == ["attnflow", "explain", TEXT]
    assert command[3:] == ["--model", results["run"]["model"], "--method", "grad_rollout", "--target", "pos&"]


@pytest.mark.browser
@needs_chromium
def test_the_report_renders_in_chromium(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(build_report(hostile_results()), encoding="utf-8")
    image, dom = render(page, tmp_path)
    assert_not_blank(image)
    assert "Words per predicted class" in dom and "Counterfactual swaps" in dom
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom
    assert script_elements(dom) == 0
