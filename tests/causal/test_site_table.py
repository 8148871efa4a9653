"""A site kind is one row of `SITE_TABLE`, and every row is then found everywhere: the sweep's
kinds and shapes, `attnflow patch --sites` and its help, `patch.json`, the report and the summary
of a file of pairs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from causal_texts import CLEAN, CORRUPT

from attnflow.causal.sites import ALL_KINDS, SITE_KINDS, parse_site_kinds, sweep_shape
from attnflow.cli import build_parser, main
from attnflow.rows import register_adapter, unregister_adapter
from attnflow.rows.site_kinds import SITE_TABLE

from tiny_models import moe_row


def test_the_kinds_and_shapes_are_the_table():
    assert ALL_KINDS == tuple(row.name for row in SITE_TABLE) and "knockout" in ALL_KINDS
    assert SITE_KINDS == ("residual", "attn", "mlp", "heads")  # the activations: the default sweep
    assert parse_site_kinds(",".join(ALL_KINDS)) == ALL_KINDS
    assert {kind: sweep_shape(kind, 2, 7, 4, n_experts=3) for kind in ALL_KINDS} == {
        "residual": (3, 7),
        "attn": (2, 7),
        "mlp": (2, 7),
        "heads": (2, 4),
        "experts": (2, 3),
        "knockout": (2, 7),
    }


def test_the_command_line_lists_every_row():
    patch_parser = build_parser()._subparsers._group_actions[0].choices["patch"]  # type: ignore[union-attr]
    text = "".join(patch_parser.format_help().split())  # argparse wraps lines, even inside a flag
    for row in SITE_TABLE:
        assert "".join(f"{row.name}: {row.help}".split()) in text


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_every_kind_reaches_the_json_the_report_and_the_summary(tiny_model_path, tmp_path, family):
    """Every kind the family's row has (experts: a mixture of experts, the tiny Mixtral's 4)."""
    kinds = ALL_KINDS if family == "mixtral" else tuple(kind for kind in ALL_KINDS if kind != "experts")
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"clean": CLEAN, "corrupt": CORRUPT}, {"clean": "the dog ran", "corrupt": "the cat ran"}]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    command = ["patch", "--file", str(pairs), "--model", str(tiny_model_path(family)), "--sites", ",".join(kinds),
               "--method", "exact", "--out", str(out), "--quiet", "--device", "cpu"]  # fmt: skip
    row = moe_row(family) if family == "mixtral" else None
    if row is not None:
        register_adapter(row)
    try:
        assert main(command) == 0
    finally:
        if row is not None:
            unregister_adapter(row.family)
    done = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert all(set(row["effects"]["exact"]) == set(kinds) for row in done)
    summary = json.loads((out / "summary.json").read_text())
    longest = max(len(row["tokens"]) for row in done)
    for kind in kinds:
        mean = np.asarray(summary["effects"]["exact"][kind]["mean"], dtype=float)
        assert mean.shape == sweep_shape(kind, 2, longest, 4, n_experts=4)
    # position kinds are aligned on the predicting (last) position: the short pair fills the right end
    knockout = [np.asarray(row["effects"]["exact"]["knockout"], dtype=float) for row in done]
    short, long = sorted(knockout, key=lambda array: array.shape[1])
    expected = (short + long[:, -short.shape[1] :]) / 2
    np.testing.assert_allclose(
        np.asarray(summary["effects"]["exact"]["knockout"]["mean"])[:, -short.shape[1] :], expected
    )
    page = (out / "summary.html").read_text()
    assert all(f'data-kind="{kind}"' in page for kind in kinds)
