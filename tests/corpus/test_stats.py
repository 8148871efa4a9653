"""`StudyStats` on hand-built windows with known answers, against a per-matrix numpy oracle,
and merge / checkpoint exactness (definitions: the docstring of attnflow/corpus/stats.py)."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from attnflow.corpus.stats import HEAD_SCALARS, StudyConfig, StudyStats, kth_largest, parse_high, top_count

CLS, SEP, DOT, COMMA = 101, 102, 7, 8
SPECIAL = {"[CLS]": CLS, "[SEP]": SEP}
PUNCTUATION = {".": DOT, ",": COMMA}


# ---------------------------------------------------------------------------- helpers


def make_stats(n_layers=1, n_heads=1, n=8, **config) -> StudyStats:
    return StudyStats(n_layers, n_heads, n, StudyConfig(**config), SPECIAL, PUNCTUATION)


def uniform_attention(batch, n_layers, n_heads, n, dtype=torch.float64):
    return torch.full((batch, n_layers, n_heads, n, n), 1.0 / n, dtype=dtype)


def feed(stats, token_ids, head_outputs, attentions=None, sentence_ids=None):
    """One update; head_outputs ``[batch, token, d]`` are broadcast to every layer and head."""
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1, stats.seq_len)
    batch = token_ids.shape[0]
    z = torch.as_tensor(head_outputs, dtype=torch.float64)
    if z.ndim == 2:
        z = z.expand(batch, *z.shape)
    if z.ndim == 3:  # [batch, token, d] -> [batch, layer, token, head, d]
        z = z[:, None, :, None, :].expand(batch, stats.n_layers, stats.seq_len, stats.n_heads, z.shape[-1])
    if attentions is None:
        attentions = uniform_attention(batch, stats.n_layers, stats.n_heads, stats.seq_len)
    if sentence_ids is not None:
        sentence_ids = torch.as_tensor(sentence_ids, dtype=torch.int64).reshape(batch, -1)
    stats.update(token_ids=token_ids, sentence_ids=sentence_ids, attentions=attentions, head_outputs=z)
    return stats


def neighbours(n):
    """Token vectors e_i + e_{i+1}: S_ij = 1 exactly when |i - j| = 1, else 0."""
    z = np.zeros((n, n + 1))
    z[np.arange(n), np.arange(n)] = 1
    z[np.arange(n), np.arange(n) + 1] = 1
    return z


def pair_vectors(n, pairs, d=None):
    """Token vectors whose only non-zero off-diagonal similarities are 1 at ``pairs``."""
    d = d or len(pairs) + n
    z = np.zeros((n, d))
    for k, (i, j) in enumerate(pairs):
        z[i, k] = z[j, k] = 1
    return z


def value(stats, name, layer=0, head=0):
    return stats.arrays()[name][layer, head]


# ---------------------------------------------------------------------------- hand-built windows

N = 8
P = N * (N - 1) // 2  # 28 pairs
ADJACENT_PERCENT = 100 * (N - 1) / P  # k = 7: exactly the adjacent pairs
TOKENS = [CLS, 11, 12, 13, 14, 15, 16, SEP]


def test_neighbouring_tokens_give_distance_one():
    stats = feed(make_stats(high=f"top-percent:{ADJACENT_PERCENT}", short_range=2), [TOKENS, TOKENS], neighbours(N))
    hist = value(stats, "high_distance_hist")
    assert hist.tolist() == [0, 2 * (N - 1)] + [0] * (N - 2)
    assert value(stats, "mean_distance_high") == 1
    assert value(stats, "mean_distance_all") == pytest.approx((N + 1) / 3)
    assert value(stats, "short_range_share") == 1 and value(stats, "long_range_share") == 0
    assert value(stats, "short_range_chance") == pytest.approx((7 + 6) / P)
    assert value(stats, "high_pairs_per_sample") == N - 1
    assert stats.arrays()["all_distance_hist"].tolist() == [0] + [2 * (N - d) for d in range(1, N)]


def test_repeated_token_gives_repeat_share_one():
    tokens = [CLS, 20, 21, 22, 20, 23, 24, SEP]  # token 20 at positions 1 and 4
    stats = feed(make_stats(high="top-percent:1"), tokens, pair_vectors(N, [(1, 4)]))  # k = 1
    assert value(stats, "high_pairs_per_sample") == 1
    assert value(stats, "repeat_share") == 1
    assert value(stats, "repeat_chance") == pytest.approx(1 / P)
    assert value(stats, "mean_distance_high") == 3


def test_same_sentence_share_and_chance_by_hand():
    sentences = [-1, 0, 0, 0, 1, 1, 1, -1]
    stats = feed(make_stats(high=f"top-percent:{ADJACENT_PERCENT}"), TOKENS, neighbours(N), sentence_ids=sentences)
    # Eligible adjacent pairs: (1,2) (2,3) (3,4) (4,5) (5,6); same sentence: all but (3,4).
    assert value(stats, "same_sentence_share") == pytest.approx(4 / 5)
    # Chance: Σ nₛ(nₛ−1) / (m(m−1)) over the m = 6 non-special tokens = (6 + 6) / 30.
    assert value(stats, "same_sentence_chance") == pytest.approx(12 / 30)
    # A second window with one sentence: pooled over both windows.
    feed(stats, TOKENS, neighbours(N), sentence_ids=[-1, 0, 0, 0, 0, 0, 0, -1])
    assert value(stats, "same_sentence_share") == pytest.approx((4 + 5) / (5 + 5))
    assert value(stats, "same_sentence_chance") == pytest.approx((6 + 15) / (15 + 15))


def test_attention_equal_to_similarity_pattern_is_all_signal():
    adjacency = neighbours(N) @ neighbours(N).T
    np.fill_diagonal(adjacency, 0)  # 1 at |i - j| = 1
    attention = torch.as_tensor(adjacency / adjacency.sum(1, keepdims=True))[None, None, None]
    stats = make_stats(high=f"top-percent:{ADJACENT_PERCENT}", attention_top_percent=ADJACENT_PERCENT)
    feed(stats, TOKENS, neighbours(N), attentions=attention)
    assert value(stats, "signal_share") == 1 and value(stats, "noise_share") == 0
    assert value(stats, "signal_chance") == pytest.approx((N - 1) / P)
    # Attention on distance-2 pairs instead: no high-similarity pair is a high-attention pair.
    skip = np.eye(N, k=2) + np.eye(N, k=-2)
    attention = torch.as_tensor(skip / skip.sum(1, keepdims=True))[None, None, None]
    stats = make_stats(high=f"top-percent:{ADJACENT_PERCENT}", attention_top_percent=ADJACENT_PERCENT)
    feed(stats, TOKENS, neighbours(N), attentions=attention)
    assert value(stats, "signal_share") == 0 and value(stats, "noise_share") == 1


def test_all_attention_on_cls():
    attention = torch.zeros(1, 1, 1, N, N, dtype=torch.float64)
    attention[..., 0] = 1
    stats = feed(make_stats(), [CLS, 11, DOT, 12, COMMA, DOT, 13, SEP], neighbours(N), attentions=attention)
    arrays = stats.arrays()
    names = list(arrays["attention_token_names"])
    assert names == ["[CLS]", "[SEP]", ".", ","]
    assert arrays["attention_to"][0, 0].tolist() == [1, 0, 0, 0]
    assert arrays["attention_to_chance"].tolist() == pytest.approx([1 / N, 1 / N, 2 / N, 1 / N])
    assert value(stats, "attention_self") == pytest.approx(1 / N)  # only row 0 attends to itself
    assert value(stats, "attention_prev") == pytest.approx(1 / (N - 1))  # only row 1 attends to 0
    assert value(stats, "attention_next") == 0
    assert value(stats, "attention_entropy") == 0


def test_uniform_attention():
    stats = feed(make_stats(), [CLS, 11, DOT, 12, COMMA, DOT, 13, SEP], neighbours(N))
    arrays = stats.arrays()
    assert value(stats, "attention_entropy") == pytest.approx(math.log(N))
    for name in ("self", "prev", "next"):
        assert value(stats, f"attention_{name}") == pytest.approx(1 / N)
    assert arrays["attention_to"][0, 0].tolist() == pytest.approx([1 / N, 1 / N, 2 / N, 1 / N])


def test_anchor_token_counts_a_repeat_pair_once():
    tokens = [CLS, 30, 31, 32, 31, 33, 34, SEP]  # token 31 at positions 2 and 4
    # H = {(0,2), (2,4), (4,6)}: all three touch token 31; the 31–31 pair counts once.
    stats = feed(make_stats(high=f"top-percent:{100 * 3 / P}"), tokens, pair_vectors(N, [(0, 2), (2, 4), (4, 6)]))
    assert value(stats, "high_pairs_per_sample") == 3
    assert value(stats, "anchor_share") == 1
    # Chance: token 31 (c = 2) covers c(n−c) + c(c−1)/2 = 12 + 1 of the 28 pairs.
    assert value(stats, "anchor_share_chance") == pytest.approx(13 / P)
    summary = stats.summary(lambda token: f"tok{token}")
    assert summary["layers"][0]["heads"][0]["top_anchor_tokens"] == [{"token": "tok31", "id": 31, "count": 1}]


def test_star_anchor_and_corpus_anchor_counts():
    star = np.zeros((N, N))
    star[np.arange(N), np.arange(N)] = 1
    star[3] = 1  # token 3 is similar to every other token
    windows = [
        [CLS, 40, 41, 42, 43, 44, 45, SEP],
        [CLS, 50, 51, 42, 53, 54, 55, SEP],
        [CLS, 60, 61, 62, 63, 64, 65, SEP],
    ]
    stats = make_stats(n_heads=2, high=f"top-percent:{ADJACENT_PERCENT}", n_anchor_tokens=2)
    feed(stats, windows, star)
    assert value(stats, "anchor_share", head=1) == 1  # all 7 pairs touch position 3
    anchors = stats.summary(str)["layers"][0]["heads"][1]["top_anchor_tokens"]
    assert anchors == [{"token": "42", "id": 42, "count": 2}, {"token": "62", "id": 62, "count": 1}]
    assert stats.arrays()["top_anchor_ids"][0, 0].tolist() == [42, 62]


# ---------------------------------------------------------------------------- numpy oracle


def oracle(config, token_ids, sentence_ids, attentions, head_outputs):
    """Every statistic by explicit loops over samples, layers and heads (float64 numpy)."""
    batch, n_layers, n_heads, n, _ = attentions.shape
    rule = parse_high(config.high)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    shape = (n_layers, n_heads)
    acc = {
        key: np.zeros(shape)
        for key in ("high", "dist", "short", "same", "eligible", "repeat", "signal", "anchor", "nonempty")
    }
    acc["hist"] = np.zeros((*shape, n))
    acc["entries"] = [[[] for _ in range(n_heads)] for _ in range(n_layers)]
    anchors = [[Counter() for _ in range(n_heads)] for _ in range(n_layers)]
    mean_similarity = np.zeros((*shape, n, n))
    for b in range(batch):
        tokens, sentences = token_ids[b], sentence_ids[b]
        for layer in range(n_layers):
            for head in range(n_heads):
                z = head_outputs[b, layer, :, head, :]
                s = z @ z.T
                np.fill_diagonal(s, 0)
                mean_similarity[layer, head] += s / batch
                values = np.array([s[i, j] for i, j in pairs])
                acc["entries"][layer][head].extend(values)
                if rule.kind == "top-percent":
                    cutoff = np.sort(values)[::-1][top_count(rule.value, len(pairs)) - 1]
                    high = [p for p, v in zip(pairs, values) if v >= cutoff]
                elif rule.kind == "zscore":
                    mu, sigma = values.mean(), values.std()
                    high = [p for p, v in zip(pairs, values) if sigma > 0 and v - mu > rule.value * sigma]
                else:
                    chosen = set()
                    for i in range(n):
                        row = [(s[i, j], j) for j in range(n) if j != i]
                        cutoff = sorted(row, reverse=True)[int(rule.value) - 1][0]
                        chosen |= {(min(i, j), max(i, j)) for v, j in row if v >= cutoff}
                    high = sorted(chosen)
                a = attentions[b, layer, head]
                symmetric = np.array([max(a[i, j], a[j, i]) for i, j in pairs])
                a_cutoff = np.sort(symmetric)[::-1][top_count(config.attention_top_percent, len(pairs)) - 1]
                in_attention = {p for p, v in zip(pairs, symmetric) if v >= a_cutoff and v > 0}
                acc["high"][layer, head] += len(high)
                for i, j in high:
                    acc["hist"][layer, head, j - i] += 1
                    acc["short"][layer, head] += j - i <= config.short_range
                    eligible = sentences[i] >= 0 and sentences[j] >= 0
                    acc["eligible"][layer, head] += eligible
                    acc["same"][layer, head] += eligible and sentences[i] == sentences[j]
                    acc["repeat"][layer, head] += tokens[i] == tokens[j]
                    acc["signal"][layer, head] += (i, j) in in_attention
                if high:
                    cover = {
                        t: sum(1 for i, j in high if tokens[i] == t or tokens[j] == t) for t in set(tokens.tolist())
                    }
                    best = max(cover.values())
                    anchor = next(int(t) for t in tokens if cover[t] == best)  # first occurring
                    acc["anchor"][layer, head] += best / len(high)
                    acc["nonempty"][layer, head] += 1
                    anchors[layer][head][anchor] += 1
    same_pairs = sum(
        1
        for b in range(batch)
        for i, j in pairs
        if sentence_ids[b, i] >= 0 and sentence_ids[b, i] == sentence_ids[b, j]
    )
    eligible_pairs = sum(
        1 for b in range(batch) for i, j in pairs if sentence_ids[b, i] >= 0 and sentence_ids[b, j] >= 0
    )
    repeat_pairs = sum(1 for b in range(batch) for i, j in pairs if token_ids[b, i] == token_ids[b, j])
    anchor_chance = np.mean(
        [
            max(sum(1 for i, j in pairs if token_ids[b, i] == t or token_ids[b, j] == t) for t in token_ids[b])
            / len(pairs)
            for b in range(batch)
        ]
    )
    entries = np.array(acc["entries"])  # [layer, head, entries]
    a = attentions
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(a > 0, a * np.log(a), 0).sum(-1).mean(-1).mean(0)
    return {
        "mean_similarity": mean_similarity,
        "similarity_mean": entries.mean(-1),
        "similarity_std": entries.std(-1),
        "high_pairs_per_sample": acc["high"] / batch,
        "high_distance_hist": acc["hist"],
        "mean_distance_high": (acc["hist"] * np.arange(n)).sum(-1) / acc["high"],
        "short_range_share": acc["short"] / acc["high"],
        "same_sentence_share": acc["same"] / acc["eligible"],
        "same_sentence_chance": np.full(shape, same_pairs / eligible_pairs),
        "repeat_share": acc["repeat"] / acc["high"],
        "repeat_chance": np.full(shape, repeat_pairs / (batch * len(pairs))),
        "signal_share": acc["signal"] / acc["high"],
        "anchor_share": acc["anchor"] / acc["nonempty"],
        "anchor_share_chance": np.full(shape, anchor_chance),
        "attention_self": np.einsum("blhii->lh", a) / (n * batch),
        "attention_prev": np.array(
            [
                [np.mean([a[b, l, h, i, i - 1] for b in range(batch) for i in range(1, n)]) for h in range(n_heads)]
                for l in range(n_layers)
            ]
        ),
        "attention_next": np.array(
            [
                [np.mean([a[b, l, h, i, i + 1] for b in range(batch) for i in range(n - 1)]) for h in range(n_heads)]
                for l in range(n_layers)
            ]
        ),
        "attention_entropy": entropy,
        "attention_to": np.stack(
            [(a * (token_ids[:, None, None, None, :] == t)).sum(-1).mean(-1).mean(0) for t in (CLS, SEP, DOT, COMMA)],
            -1,
        ),
        "anchors": anchors,
    }


def random_batch(seed, batch=4, n_layers=2, n_heads=3, n=10, d_head=4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, 12, (batch, n), generator=g)  # small vocab: repeats happen
    token_ids[:, 0], token_ids[:, -1] = CLS, SEP
    token_ids[:, 3] = DOT
    sentence_ids = torch.randint(0, 3, (batch, n), generator=g).sort(-1).values
    sentence_ids[:, 0] = sentence_ids[:, -1] = -1
    attentions = torch.softmax(2 * torch.randn(batch, n_layers, n_heads, n, n, generator=g, dtype=torch.float64), -1)
    head_outputs = torch.randn(batch, n_layers, n, n_heads, d_head, generator=g, dtype=torch.float64)
    return {
        "token_ids": token_ids,
        "sentence_ids": sentence_ids,
        "attentions": attentions.to(dtype),
        "head_outputs": head_outputs.to(dtype),
    }


@pytest.mark.parametrize("high", ["top-percent:5", "top-percent:30", "zscore:1.5", "top-k-per-row:2"])
def test_every_statistic_matches_the_oracle(high):
    config = StudyConfig(high=high, attention_top_percent=10, short_range=3, n_anchor_tokens=3)
    data = random_batch(1)
    stats = StudyStats(2, 3, 10, config, SPECIAL, PUNCTUATION)
    stats.update(**data)
    expected = oracle(config, *(data[k].numpy() for k in ("token_ids", "sentence_ids", "attentions", "head_outputs")))
    arrays = stats.arrays()
    for name, wanted in expected.items():
        if name == "anchors":
            continue
        np.testing.assert_allclose(arrays[name], wanted, rtol=1e-10, atol=1e-12, err_msg=name)
    for layer in range(2):
        for head in range(3):
            wanted = sorted(expected["anchors"][layer][head].items(), key=lambda item: (-item[1], item[0]))[:3]
            got = [
                (int(t), int(c))
                for t, c in zip(arrays["top_anchor_ids"][layer, head], arrays["top_anchor_counts"][layer, head])
                if c
            ]
            assert got == wanted


# ---------------------------------------------------------------------------- merge and checkpoints


def split(data, rows):
    return {key: value[rows] for key, value in data.items()}


def assert_same_results(left: StudyStats, right: StudyStats, tolerance=1e-10):
    assert left.n_samples == right.n_samples
    a, b = left.arrays(), right.arrays()
    assert a.keys() == b.keys()
    for name in a:
        if a[name].dtype.kind in "fc":
            np.testing.assert_allclose(a[name], b[name], rtol=tolerance, atol=tolerance, err_msg=name)
        else:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    if tolerance == 0:
        assert left.summary(str) == right.summary(str)


@pytest.mark.parametrize("high", ["top-percent:5", "zscore:1", "top-k-per-row:2"])
def test_merging_two_halves_equals_the_whole(high):
    config = StudyConfig(high=high)
    data = random_batch(2, batch=6)
    whole = StudyStats(2, 3, 10, config, SPECIAL, PUNCTUATION)
    whole.update(**data)
    first, second = (StudyStats(2, 3, 10, config, SPECIAL, PUNCTUATION) for _ in range(2))
    first.update(**split(data, slice(0, 2)))
    second.update(**split(data, slice(2, 6)))
    assert first.merge(second) is first
    assert_same_results(first, whole)


def test_merge_of_float32_batches_is_exact():
    """Same batches on two workers vs one: float64 accumulators make the merge exact."""
    batches = [random_batch(seed, dtype=torch.float32) for seed in (3, 4, 5)]
    whole = StudyStats(2, 3, 10, StudyConfig(), SPECIAL, PUNCTUATION)
    for batch in batches:
        whole.update(**batch)
    left, right = (StudyStats(2, 3, 10, StudyConfig(), SPECIAL, PUNCTUATION) for _ in range(2))
    left.update(**batches[0])
    right.update(**batches[1])
    right.update(**batches[2])
    assert_same_results(left.merge(right), whole, tolerance=1e-12)


@pytest.mark.parametrize("layer_chunk", [1, 2])
def test_per_layer_attention_maps_equal_the_stacked_tensor(layer_chunk):
    """Capture hands over one map per layer (no stacked copy); the results must not change."""
    data = random_batch(6, dtype=torch.float32)
    stacked = StudyStats(2, 3, 10, StudyConfig(), SPECIAL, PUNCTUATION, layer_chunk=layer_chunk)
    stacked.update(**data)
    per_layer = StudyStats(2, 3, 10, StudyConfig(), SPECIAL, PUNCTUATION, layer_chunk=layer_chunk)
    per_layer.update(**{**data, "attentions": list(data["attentions"].unbind(1))})
    assert_same_results(per_layer, stacked, tolerance=0)
    with pytest.raises(ValueError, match="2 tensors"):
        per_layer.update(**{**data, "attentions": list(data["attentions"].unbind(1))[:1]})


def test_merge_rejects_other_studies():
    stats = make_stats()
    with pytest.raises(ValueError, match="cannot merge"):
        stats.merge(make_stats(high="top-percent:5"))
    with pytest.raises(ValueError, match="cannot merge"):
        stats.merge(make_stats(n_heads=2))


def test_state_dict_round_trip_through_npz(tmp_path):
    first, second = random_batch(6), random_batch(7)
    stats = StudyStats(2, 3, 10, StudyConfig(high="zscore:1", n_anchor_tokens=4), SPECIAL, PUNCTUATION)
    stats.update(**first)
    path = tmp_path / "state.npz"
    np.savez(path, **stats.state_dict())
    with np.load(path, allow_pickle=False) as saved:
        restored = StudyStats.from_state_dict(dict(saved))
    assert restored.config == stats.config and restored.special_token_ids == SPECIAL
    assert_same_results(restored, stats, tolerance=0)
    stats.update(**second)
    restored.update(**second)  # resuming continues exactly where the checkpoint left off
    assert_same_results(restored, stats, tolerance=0)


# ---------------------------------------------------------------------------- summary and validation


def test_summary_is_json_with_layer_means_over_heads():
    stats = StudyStats(2, 3, 10, StudyConfig(high="zscore:3"), SPECIAL, PUNCTUATION)
    stats.update(**random_batch(8))
    summary = json.loads(json.dumps(stats.summary(lambda t: f"<{t}>"), allow_nan=False))
    assert summary["samples"] == 4 and len(summary["layers"]) == 2
    layer = summary["layers"][1]
    assert len(layer["heads"]) == 3
    for name in HEAD_SCALARS:
        heads = [head[name] for head in layer["heads"] if head[name] is not None]
        assert layer[name] == pytest.approx(np.mean(heads) if heads else None), name
    for head in layer["heads"]:
        assert set(HEAD_SCALARS) <= set(head) and "anchor_share" in head and "top_anchor_tokens" in head
        assert all(anchor["token"].startswith("<") for anchor in head["top_anchor_tokens"])
    table = stats.head_table(str)
    assert len(table) == 6 and {"layer", "head", "attention_to_[CLS]", "top_anchor_tokens"} <= set(table[0])
    assert StudyStats(1, 1, 8).summary(str)["layers"][0]["mean_distance_high"] is None  # no samples yet


@pytest.mark.parametrize(
    "spec",
    [
        "top-percent",
        "top-percent:0",
        "top-percent:150",
        "top-percent:x",
        "top-k-per-row:1.5",
        "top-k-per-row:0",
        "zscore:nan",
        "top:2",
        "zscore:1:2",
        5,
    ],
)
def test_bad_high_rules_raise(spec):
    with pytest.raises(ValueError, match="bad high-similarity rule .* expected .*top-percent:P"):
        StudyConfig(high=spec)


def test_bad_options_raise():
    with pytest.raises(ValueError, match="attention_top_percent"):
        StudyConfig(attention_top_percent=0)
    with pytest.raises(ValueError, match="short_range"):
        StudyConfig(short_range=0)
    with pytest.raises(ValueError, match="n_anchor_tokens"):
        StudyConfig(n_anchor_tokens=0)
    with pytest.raises(ValueError, match="seq_len - 1"):
        StudyStats(1, 1, 8, StudyConfig(high="top-k-per-row:8"))
    stats = make_stats()
    data = random_batch(0, n_layers=1, n_heads=1, n=8)
    with pytest.raises(ValueError, match="attentions must be"):
        stats.update(**{**data, "attentions": data["attentions"][:, :, :, :7, :7]})
    with pytest.raises(ValueError, match="head_outputs must be"):
        stats.update(**{**data, "head_outputs": data["head_outputs"].transpose(2, 3)})
    with pytest.raises(ValueError, match="token_ids must be"):
        stats.update(**{**data, "token_ids": data["token_ids"][:, :5]})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    data = random_batch(9, dtype=torch.float32)
    on_cpu = StudyStats(2, 3, 10, StudyConfig(high="top-percent:10"), SPECIAL, PUNCTUATION)
    on_cpu.update(**data)
    on_gpu = StudyStats(2, 3, 10, StudyConfig(high="top-percent:10"), SPECIAL, PUNCTUATION)
    on_gpu.update(**{key: value.cuda() for key, value in data.items()})
    assert on_gpu.device.type == "cuda"
    assert_same_results(on_gpu, on_cpu, tolerance=1e-5)


def test_blocks_of_one_window_and_one_layer_equal_one_block():
    data = random_batch(10, batch=5)
    whole = StudyStats(2, 3, 10, StudyConfig(), SPECIAL, PUNCTUATION, layer_chunk=2, sample_block=5)
    whole.update(**data)
    blocked = StudyStats(2, 3, 10, StudyConfig(), SPECIAL, PUNCTUATION, layer_chunk=1, sample_block=2)
    blocked.update(**data)
    assert_same_results(blocked, whole, tolerance=1e-12)


def test_pairs_tied_at_the_cutoff_are_all_kept():
    # k = 3 of 28 pairs, but the 7 adjacent pairs all have S = 1: all 7 are in H.
    stats = feed(make_stats(high=f"top-percent:{100 * 3 / P}"), TOKENS, neighbours(N))
    assert value(stats, "high_pairs_per_sample") == N - 1
    assert value(stats, "mean_distance_high") == 1


def test_kth_largest_numpy_and_torch_paths_agree():
    values = torch.randn(5, 3, 40, generator=torch.Generator().manual_seed(11))
    for k in (1, 7, 40):
        expected = values.sort(-1, descending=True).values[..., k - 1]
        assert torch.equal(kth_largest(values, k), expected)  # numpy introselect on the CPU
        assert torch.equal(kth_largest(values.half(), k), expected.half())  # torch.kthvalue path
        copy = values.clone()
        assert torch.equal(kth_largest(copy, k, overwrite=True), expected)
    with pytest.raises(ValueError, match="k must lie"):
        kth_largest(values, 41)


def test_threads_option_is_restored_and_changes_nothing():
    data = random_batch(12)
    before = torch.get_num_threads()
    single = StudyStats(2, 3, 10, StudyConfig(), SPECIAL, PUNCTUATION, threads=1)
    single.update(**data)
    assert torch.get_num_threads() == before
    default = StudyStats(2, 3, 10, StudyConfig(), SPECIAL, PUNCTUATION)
    default.update(**data)
    assert_same_results(single, default, tolerance=1e-12)
