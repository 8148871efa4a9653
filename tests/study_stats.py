"""A small corpus-study accumulator fed random batches (the report tests and the help examples)."""

from __future__ import annotations

import torch

from attnflow.corpus.stats import StudyConfig, StudyStats


def random_study_stats(special_token_ids: dict[str, int]) -> StudyStats:
    """A 2-layer, 2-head accumulator fed 3 random windows of 12 tokens (ids 3-7 inside, the two
    ``special_token_ids`` (ids 0 and 2) at the ends, "." = id 4 as punctuation, 3 sentences each)."""
    torch.manual_seed(0)
    stats = StudyStats(2, 2, 12, StudyConfig(), special_token_ids=special_token_ids, punctuation_ids={".": 4})
    token_ids = torch.randint(3, 8, (3, 12))
    token_ids[:, 0], token_ids[:, -1] = 0, 2
    sentence_ids = torch.arange(12).div(5, rounding_mode="floor").expand(3, 12).clone()
    sentence_ids[:, 0] = sentence_ids[:, -1] = -1
    attentions = torch.softmax(torch.randn(3, 2, 2, 12, 12), dim=-1)
    stats.update(
        token_ids=token_ids, sentence_ids=sentence_ids, attentions=attentions, head_outputs=torch.randn(3, 2, 12, 2, 4)
    )
    return stats
