"""Edited copies of a causal LM's inputs run on their input's key/value cache: the same next-token
logits as whole forwards, on every decoder family (the tiny Gemma 3's local layers see 3 tokens,
so its cached prefix crosses their window), and leave-one-out equal to an explicit loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnflow.shared_prefix as shared_prefix
from attnflow.evaluate.scorer import ClassifierScorer
from attnflow.methods.deletion import perturb
from attnflow.shared_prefix import forward_batches, length_batches

from tiny_models import DECODER_FAMILIES


def edits(base: tuple[int, ...], mask_id: int) -> list[tuple[int, ...]]:
    """The base itself, single deletions at every position, masks, multi-token deletions, and
    the empty sequence: copies that share every length of start with it."""
    positions = range(len(base))
    return (
        [base]
        + [perturb(base, np.array([j]), "remove", mask_id) for j in positions]
        + [perturb(base, np.array([j, len(base) - 1]), "mask", mask_id) for j in positions[:-1]]
        + [perturb(base, np.arange(j, len(base), 2), "remove", mask_id) for j in positions]
        + [()]
    )


def last_logits(model, sequences, **kwargs) -> tuple[np.ndarray, int]:
    """``([sequence, vocab] next-token logits, the forwards that ran on a cache)``."""
    out = np.zeros((len(sequences), model.hf_model.config.get_text_config().vocab_size))
    cached = 0
    for batch in forward_batches(model, sequences, 64, **kwargs):
        with torch.no_grad():
            logits = model.hf_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **batch.options)
        out[batch.rows] = logits.logits[torch.arange(len(batch.rows)), batch.last].numpy()
        cached += bool(batch.options)
    return out, cached


@pytest.mark.parametrize("family", DECODER_FAMILIES)
def test_edits_on_their_inputs_cache_give_a_whole_forwards_logits(tiny_loaded, family):
    model = tiny_loaded(family)
    vocabulary = model.hf_model.config.get_text_config().vocab_size
    rng = np.random.default_rng(0)
    bases = [tuple(int(t) for t in rng.integers(5, vocabulary, n)) for n in (17, 11)]
    sequences = [s for base in bases for s in edits(base, 3)]
    owners = [k for k, base in enumerate(bases) for _ in edits(base, 3)]
    whole, uncached = last_logits(model, sequences)
    shared, cached = last_logits(model, sequences, bases=bases, owners=owners)
    assert uncached == 0 and cached >= 3  # the cache is used, for several shared lengths
    content = np.array([len(s) > 0 for s in sequences])
    np.testing.assert_allclose(shared[content], whole[content], atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_leave_one_out_of_a_causal_lm_equals_one_forward_per_removed_token(tiny_loaded, family):
    from attnflow import explain

    model = tiny_loaded(family)
    trace = model.trace("the cat sat on the mat and the dog ran to the park", needs=("target",))[0]
    scores = explain(trace, method="leave_one_out", model=model, batch_size=4).scores
    ids, token = list(trace.token_ids), trace.target.index

    def log_p(sequence: list[int]) -> float:
        with torch.no_grad():
            logits = model.hf_model(input_ids=torch.tensor([sequence])).logits[0, -1]
        return float(torch.log_softmax(logits.double(), dim=-1)[token])

    expected = [0.0 if trace.special_mask[j] else log_p(ids) - log_p(ids[:j] + ids[j + 1 :]) for j in range(len(ids))]
    np.testing.assert_allclose(scores, expected, atol=1e-5)


def test_the_benchmarks_scorer_gives_the_same_probabilities_with_and_without_inputs(tiny_loaded):
    model = tiny_loaded("qwen2")
    base = tuple(range(5, 25))
    sequences = edits(base, 3)[:-1]
    classes = [7] * len(sequences)
    alone = ClassifierScorer(model).chosen(sequences, classes)
    scorer = ClassifierScorer(model)
    with_input = scorer.chosen(sequences, classes, [base] * len(sequences))
    np.testing.assert_allclose(with_input, alone, rtol=1e-5)
    assert scorer.forwards == len(set(sequences))


def test_a_model_without_a_usable_cache_runs_every_sequence_whole(tiny_loaded, monkeypatch):
    model = tiny_loaded("llama")
    monkeypatch.setattr(shared_prefix, "_cache_argument", lambda model: None)
    base = tuple(range(5, 20))
    _, cached = last_logits(model, edits(base, 3), bases=[base])
    assert cached == 0


def test_length_batches_bound_padded_tokens_and_rows():
    lengths = [5, 1, 9, 3, 3, 7, 2]
    batches = length_batches(lengths, 12, max_rows=2)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) <= 2
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 12


def test_leave_one_out_of_smollm2_is_the_same_with_its_prefix_cache(smollm2, monkeypatch):
    text = "The Eiffel Tower stands in the city of Paris, the capital of"
    cached = smollm2.explain(text, method="leave_one_out").scores
    monkeypatch.setattr(shared_prefix, "_cache_argument", lambda model: None)
    whole = smollm2.explain(text, method="leave_one_out").scores
    np.testing.assert_allclose(cached, whole, atol=2e-4 * np.abs(whole).max())
