"""The whole study on the real all-MiniLM-L6-v2 and the embedded Wikipedia text (16 windows)."""

from __future__ import annotations

import json

import pytest

from attnflow.corpus.engine import StudyOptions, run_study


def test_minilm_study_on_wiki(minilm, tmp_path):
    options = StudyOptions(model="minilm", data="wiki", samples=16, batch_size=8, device="cpu", quiet=True)
    summary = run_study(options, tmp_path / "study", model=minilm)
    saved = json.loads((tmp_path / "study" / "summary.json").read_text())
    assert saved["samples"] == 16 and saved["seq_len"] == 128
    assert saved["model"] == {"name": "minilm", "n_layers": 6, "n_heads": 12, "d_head": 32, "max_length": 512}
    assert len(saved["layers"]) == 6 and all(len(layer["heads"]) == 12 for layer in saved["layers"])
    first = saved["layers"][0]
    assert first["mean_distance_all"] == pytest.approx(129 / 3)
    assert 0 < first["same_sentence_chance"] < 1 and 0 < first["repeat_chance"] < 0.2
    for layer in saved["layers"]:
        assert 0 <= layer["signal_share"] <= 1
        assert set(layer["attention_to"]) == {"[CLS]", "[SEP]", ".", ","}
        assert all(head["top_anchor_tokens"] for head in layer["heads"])
    assert summary["corpus"]["documents_read"] >= 16
    header = (tmp_path / "study" / "heads.csv").read_text().splitlines()[0].split(",")
    assert {"layer", "head", "attention_to_[CLS]", "attention_to_[SEP]", "top_anchor_tokens"} <= set(header)


@pytest.mark.slow
def test_minilm_ray_engine_matches_local_with_overlapping_windows(minilm, tmp_path):
    import numpy as np

    pytest.importorskip("ray")
    options = dict(model="minilm", data="wiki", samples=48, stride=50, batch_size=8, device="cpu", quiet=True)
    run_study(StudyOptions(**options), tmp_path / "local", model=minilm)
    run_study(StudyOptions(**options, engine="ray", workers=2), tmp_path / "ray")
    with np.load(tmp_path / "local" / "stats.npz") as local, np.load(tmp_path / "ray" / "stats.npz") as ray:
        for name in local.files:
            if local[name].dtype.kind == "f":
                np.testing.assert_allclose(local[name], ray[name], rtol=1e-5, atol=1e-7, equal_nan=True, err_msg=name)
            else:
                np.testing.assert_array_equal(local[name], ray[name], err_msg=name)
