"""Windowing: exact length, packing order, stride, resume skipping, sentence ids, streaming."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnflow.corpus.windows import SentenceSplitter, WindowStream, batched, marker_token_ids, special_tokens
from attnflow.errors import InputError

from corpus_helpers import story

DOCS = [story(i, sentences=1 + i % 4) for i in range(40)]


def packed(tokenizer, docs) -> np.ndarray:
    """The reference stream: every document's wordpieces, end to end."""
    return np.concatenate([tokenizer(doc, add_special_tokens=False)["input_ids"] for doc in docs])


def test_special_tokens_are_the_models_own(tiny_tokenizer, minilm):
    cls, sep = tiny_tokenizer.cls_token_id, tiny_tokenizer.sep_token_id
    assert special_tokens(tiny_tokenizer) == ([cls], [sep])
    assert marker_token_ids(minilm.tokenizer) == ({"[CLS]": 101, "[SEP]": 102}, {".": 1012, ",": 1010})


@pytest.mark.parametrize("seq_len, stride", [(16, None), (16, 5), (24, 30), (8, 1)])
def test_windows_are_exact_slices_of_the_packed_stream(tiny_tokenizer, seq_len, stride):
    stream = WindowStream(DOCS, tiny_tokenizer, seq_len=seq_len, stride=stride)
    windows = list(stream)
    reference = packed(tiny_tokenizer, DOCS)
    content = seq_len - 2
    step = stride or content
    assert len(windows) == (len(reference) - content) // step + 1 == stream.windows
    for k, window in enumerate(windows):
        assert window.index == k
        assert window.token_ids.shape == window.sentence_ids.shape == (seq_len,)
        assert window.token_ids.dtype == np.int64
        assert (
            window.token_ids[0] == tiny_tokenizer.cls_token_id and window.token_ids[-1] == tiny_tokenizer.sep_token_id
        )
        np.testing.assert_array_equal(window.token_ids[1:-1], reference[k * step : k * step + content])
        assert window.sentence_ids[0] == window.sentence_ids[-1] == -1
        assert (window.sentence_ids[1:-1] >= 0).all()
    assert stream.exhausted and stream.tokens_read == len(reference)


def test_disjoint_windows_concatenate_to_the_stream_prefix(tiny_tokenizer):
    windows = list(WindowStream(DOCS, tiny_tokenizer, seq_len=32))
    content = np.concatenate([w.token_ids[1:-1] for w in windows])
    reference = packed(tiny_tokenizer, DOCS)
    np.testing.assert_array_equal(content, reference[: len(content)])
    assert len(reference) - len(content) < 30  # only the trailing partial window is dropped


@settings(max_examples=25, deadline=None)
@given(
    seq_len=st.integers(4, 40),
    stride=st.one_of(st.none(), st.integers(1, 45)),
    samples=st.one_of(st.none(), st.integers(1, 30)),
    start=st.integers(0, 12),
)
def test_resume_start_yields_the_tail_of_the_full_stream(tiny_tokenizer, seq_len, stride, samples, start):
    options = dict(seq_len=seq_len, stride=stride, samples=samples)
    full = list(WindowStream(DOCS[:15], tiny_tokenizer, **options))
    tail = list(WindowStream(DOCS[:15], tiny_tokenizer, start=start, **options))
    assert [w.index for w in tail] == [w.index for w in full[start:]]
    for a, b in zip(full[start:], tail):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.sentence_ids, b.sentence_ids)
    if samples is not None:
        assert len(full) <= samples


def test_samples_caps_and_stops_reading(tiny_tokenizer):
    consumed = []

    def endless():
        for i in itertools.count():
            consumed.append(i)
            yield story(i)

    stream = WindowStream(endless(), tiny_tokenizer, seq_len=16, samples=5, doc_chunk=2)
    assert len(list(stream)) == 5
    assert not stream.exhausted and stream.shortfall() is None
    assert len(consumed) <= 6  # a streaming generator: it stopped reading once 5 windows were out


def test_shortfall_suggests_a_stride(tiny_tokenizer):
    stream = WindowStream(DOCS, tiny_tokenizer, seq_len=32, samples=200)
    got = len(list(stream))
    message = stream.shortfall()
    assert f"gave {got} windows of 32 tokens" in message and "fewer than --samples 200" in message
    stride = int(message.rsplit("--stride ", 1)[1].split()[0])
    assert len(list(WindowStream(DOCS, tiny_tokenizer, seq_len=32, stride=stride, samples=200))) == 200


def test_too_little_text_and_bad_options(tiny_tokenizer):
    with pytest.raises(InputError, match="fewer than one window needs"):
        list(WindowStream(["the cat."], tiny_tokenizer, seq_len=32))
    with pytest.raises(InputError, match="^stride must be at least 1"):
        WindowStream(DOCS, tiny_tokenizer, stride=0)
    with pytest.raises(InputError, match="no room for text"):
        WindowStream(DOCS, tiny_tokenizer, seq_len=2)


def test_sentence_ids_follow_the_splitter_not_only_periods(tiny_tokenizer):
    # "!" and "?" end sentences; the "." of "mr." does not (pysbd knows abbreviations).
    doc = "The cat sat! Did the dog run? Mr. Smith ran to the mat."  # pysbd reads the raw (cased) text
    tokens = tiny_tokenizer.convert_ids_to_tokens(tiny_tokenizer(doc, add_special_tokens=False)["input_ids"])
    window = next(iter(WindowStream([doc], tiny_tokenizer, seq_len=len(tokens) + 2)))
    ids = window.sentence_ids[1:-1]
    boundaries = [tokens[k] for k in range(1, len(tokens)) if ids[k] != ids[k - 1]]
    assert ids[0] == 0 and ids.max() == 2
    assert boundaries == ["d", "m"]  # "did" and "mr" are spelled "d ##i ##d", "m ##r" by the tiny vocabulary
    assert SentenceSplitter().starts(doc).tolist() == [0, 13, 30]


def test_sentence_ids_restart_in_each_window_and_differ_across_documents(tiny_tokenizer):
    docs = ["the cat sat on the mat and the dog ran", "the cat sat on the mat and the dog ran"]
    n = len(tiny_tokenizer(docs[0], add_special_tokens=False)["input_ids"])
    # One window holding both documents: no punctuation, but two documents = two sentences.
    window = next(iter(WindowStream(docs, tiny_tokenizer, seq_len=2 * n + 2)))
    assert window.sentence_ids[1:-1].tolist() == [0] * n + [1] * n
    # Windows that cut one sentence: each window numbers its piece 0.
    first, second = list(WindowStream(docs[:1], tiny_tokenizer, seq_len=2 + n // 2, stride=n // 2))[:2]
    assert (first.sentence_ids[1:-1] == 0).all() and (second.sentence_ids[1:-1] == 0).all()


def test_batched_stacks_consecutive_windows(tiny_tokenizer):
    windows = list(WindowStream(DOCS, tiny_tokenizer, seq_len=16, samples=7))
    batches = list(batched(iter(windows), 3))
    assert [len(b) for b in batches] == [3, 3, 1]
    assert [b.first for b in batches] == [0, 3, 6]
    np.testing.assert_array_equal(batches[1].token_ids[2], windows[5].token_ids)
    assert batches[0].token_ids.shape == (3, 16) and batches[0].sentence_ids.dtype == np.int64
    with pytest.raises(InputError, match="^batch_size must be at least 1"):
        next(batched(iter(windows), 0))


def test_wiki_minilm_windows(minilm):
    from attnflow.runs.readers import open_corpus

    windows = list(WindowStream(open_corpus("wiki"), minilm.tokenizer, seq_len=128, samples=3))
    assert [len(w.token_ids) for w in windows] == [128, 128, 128]
    text = minilm.tokenizer.decode(windows[0].token_ids)
    assert text.startswith("[CLS] 20th - century classical music is western art music") and text.endswith("[SEP]")
    ids = windows[0].sentence_ids
    assert ids[0] == ids[-1] == -1 and ids.max() >= 3  # several real sentences in 126 wordpieces
