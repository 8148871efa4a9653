"""The study report draws what the statistics say, offline, with every token escaped."""

from __future__ import annotations

import numpy as np

from attnflow.corpus.stats import StudyConfig, StudyStats
from attnflow.viz.report import build_report, study_figures


def hostile_stats() -> StudyStats:
    """A 2-layer, 2-head accumulator fed random batches whose tokens include markup."""
    import torch

    torch.manual_seed(0)
    stats = StudyStats(2, 2, 12, StudyConfig(), special_token_ids={"<s>": 0, "</s>": 2}, punctuation_ids={".": 4})
    token_ids = torch.randint(3, 8, (3, 12))
    token_ids[:, 0], token_ids[:, -1] = 0, 2
    sentence_ids = torch.arange(12).div(5, rounding_mode="floor").expand(3, 12).clone()
    sentence_ids[:, 0] = sentence_ids[:, -1] = -1
    attentions = torch.softmax(torch.randn(3, 2, 2, 12, 12), dim=-1)
    stats.update(token_ids=token_ids, sentence_ids=sentence_ids, attentions=attentions, head_outputs=torch.randn(3, 2, 12, 2, 4))
    return stats


VOCAB = {0: "<s>", 2: "</s>", 3: "<script>alert(1)</script>", 4: ".", 5: "&amp;", 6: '"quoted"', 7: "Ġword"}


def test_report_is_self_contained_and_escapes_tokens():
    stats = hostile_stats()
    summary = stats.summary(VOCAB.__getitem__)
    summary.update(model={"name": "<b>model</b>"}, config={**summary["config"], "stride": 10})
    html = build_report(summary, stats.arrays())
    assert "<script" not in html and "alert(1)</script>" not in html
    assert "&lt;script&gt;" in html and "&lt;b&gt;model&lt;/b&gt;" in html
    assert "http://" not in html.split("</head>")[1] and "https://" not in html
    assert html.count('src="data:image/png;base64,') == 6


def test_figures_draw_from_the_arrays():
    stats = hostile_stats()
    summary = stats.summary(VOCAB.__getitem__)
    figures = study_figures(summary, stats.arrays())
    assert set(figures) == {"distance_by_layer", "layer_trends", "same_sentence", "similarity_grid", "head_maps", "attention_targets"}
    grid = figures["similarity_grid"]
    assert len(grid.axes) == 4  # layer × head panels
    image = grid.axes[0].images[0].get_array()
    np.testing.assert_allclose(image, stats.arrays()["mean_similarity"][0, 0])
