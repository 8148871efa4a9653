"""Tables for docs/findings.md from a finished corpus study folder (summary.json + stats.npz).

    python docs/analyze_study.py docs/study-minilm [--figures docs/figures/minilm]

Besides the study's own numbers it computes one control the study does not: a *distance-matched*
chance for the same-sentence and repeated-token shares. High-similarity pairs are closer than
random pairs, and close pairs share a sentence more often, so the plain chance (all pairs) is too
easy a baseline. The control re-reads the same windows (the window stream is deterministic; only
token and sentence ids, no model) and measures, for every distance d, the probability p(d) that
two positions d apart are in one sentence (resp. hold the same token); a head's matched chance is
Σ_d hist_H(d) p(d) / Σ_d hist_H(d), with hist_H its high-similarity distance histogram. (hist_H
counts pairs with a special token too, which the same-sentence share leaves out: an approximation
on at most the pairs touching positions 0 and n − 1.)
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np


def distance_profiles(summary: dict) -> tuple[np.ndarray, np.ndarray]:
    """p_same[d], p_repeat[d] over the study's own windows (d = 0 … n−1; entry 0 unused)."""
    from transformers import AutoTokenizer

    from attnflow.capture import resolve
    from attnflow.corpus.windows import WindowStream, batched
    from attnflow.runs.readers import open_corpus

    config, corpus = summary["config"], summary["corpus"]
    tokenizer = AutoTokenizer.from_pretrained(resolve(summary["model"]["name"]).path)
    documents = open_corpus(corpus["source"])
    stream = WindowStream(
        documents, tokenizer, seq_len=summary["seq_len"], stride=config["stride"], samples=summary["samples"]
    )
    n = summary["seq_len"]
    same, eligible, repeat = np.zeros(n), np.zeros(n), np.zeros(n)
    for batch in batched(stream, 256):
        sentences, tokens = batch.sentence_ids, batch.token_ids  # [batch, n]
        ok = sentences >= 0
        for d in range(1, n):
            both = ok[:, :-d] & ok[:, d:]
            eligible[d] += both.sum()
            same[d] += (both & (sentences[:, :-d] == sentences[:, d:])).sum()
            repeat[d] += (tokens[:, :-d] == tokens[:, d:]).sum()
    pairs = (n - np.arange(n)).astype(float) * summary["samples"]  # position pairs at distance d
    with np.errstate(invalid="ignore", divide="ignore"):
        return same / eligible, repeat / pairs


def fmt(value, digits=3):
    return "–" if value is None or (isinstance(value, float) and np.isnan(value)) else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", type=Path)
    parser.add_argument("--figures", type=Path, default=None, help="also save the report's figures here as PNG")
    parser.add_argument("--no-control", action="store_true", help="skip the distance-matched control (no corpus pass)")
    args = parser.parse_args()
    summary = json.loads((args.study / "summary.json").read_text())
    with np.load(args.study / "stats.npz") as saved:
        arrays = {name: saved[name] for name in saved.files}
    layers = summary["layers"]
    heads = [head for layer in layers for head in layer["heads"]]
    names = list(layers[0]["attention_to"])
    print(
        f"## {summary['model']['name']}: {summary['samples']} windows of {summary['seq_len']} tokens, "
        f"stride {summary['config']['stride']}, {summary['elapsed_s']:.0f} s\n"
    )

    hist = arrays["high_distance_hist"].astype(float)  # [layer, head, distance]
    if not args.no_control:
        p_same, p_repeat = distance_profiles(summary)
        weights = hist / hist.sum(-1, keepdims=True)
        matched_same = np.nansum(weights * p_same, -1)  # [layer, head]
        matched_repeat = np.nansum(weights * p_repeat, -1)
    else:
        matched_same = matched_repeat = np.full(hist.shape[:2], np.nan)

    print(
        "| layer | mean distance H (all pairs) | short-range share H (chance) | same-sentence share H (chance / distance-matched) "
        "| repeat share H (chance / distance-matched) | anchor share (chance) | signal share (chance) | "
        + " | ".join(f"attention to {name}" for name in names)
        + " |"
    )
    print("|" + "---|" * (7 + len(names)))
    for k, layer in enumerate(layers):
        print(
            f"| {k} | {fmt(layer['mean_distance_high'], 1)} ({fmt(layer['mean_distance_all'], 1)}) "
            f"| {fmt(layer['short_range_share'])} ({fmt(layer['short_range_chance'])}) "
            f"| **{fmt(layer['same_sentence_share'])}** ({fmt(layer['same_sentence_chance'])} / {fmt(np.nanmean(matched_same[k]))}) "
            f"| **{fmt(layer['repeat_share'])}** ({fmt(layer['repeat_chance'])} / {fmt(np.nanmean(matched_repeat[k]))}) "
            f"| {fmt(layer['anchor_share'])} ({fmt(layer['anchor_share_chance'])}) "
            f"| {fmt(layer['signal_share'])} ({fmt(layer['signal_chance'])}) | "
            + " | ".join(fmt(layer["attention_to"][name]) for name in names)
            + " |"
        )
    chance = summary["chance"]["attention_to"]
    print("| share of positions | | | | | | | " + " | ".join(fmt(chance[name]) for name in names) + " |\n")

    same = arrays["same_sentence_share"]
    print(
        f"- heads with same-sentence share above chance: {(same > arrays['same_sentence_chance']).sum()}/{same.size}; "
        f"above 0.33: {(same > 0.33).sum()}; above the distance-matched chance: {(same > matched_same).sum()}; "
        f"range {np.nanmin(same):.3f}–{np.nanmax(same):.3f}"
    )
    excess = same - matched_same
    best = np.dstack(np.unravel_index(np.argsort(-np.nan_to_num(excess, nan=-9).ravel())[:5], same.shape))[0]
    print(
        "- largest same-sentence excess over the distance-matched chance: "
        + ", ".join(f"L{l}H{h} {same[l, h]:.3f} vs {matched_same[l, h]:.3f}" for l, h in best)
    )
    rep = arrays["repeat_share"]
    top = np.dstack(np.unravel_index(np.argsort(-rep.ravel())[:6], rep.shape))[0]
    print(
        "- repetition heads (repeat share vs distance-matched chance; mean distance of H): "
        + "; ".join(
            f"L{l}H{h} {rep[l, h]:.3f} vs {matched_repeat[l, h]:.3f}, {arrays['mean_distance_high'][l, h]:.1f} tokens, "
            f"anchors {', '.join(repr(a['token']) for a in layers[l]['heads'][h]['top_anchor_tokens'][:3])}"
            for l, h in top
        )
    )
    top1 = collections.Counter(h["top_anchor_tokens"][0]["token"] for h in heads if h["top_anchor_tokens"])
    anchor = arrays["anchor_share"]
    dominance = np.array(
        [h["top_anchor_tokens"][0]["count"] / summary["samples"] for h in heads if h["top_anchor_tokens"]]
    )
    print(
        f"- anchor share: median {np.nanmedian(anchor):.3f} (chance {np.nanmedian(arrays['anchor_share_chance']):.3f}), "
        f"heads above 0.5: {(anchor > 0.5).sum()}/{anchor.size}; the head's most frequent anchor is the anchor in a "
        f"median {np.median(dominance):.0%} of windows (max {dominance.max():.0%})"
    )
    print(
        f"- distinct most-frequent anchor tokens over {len(heads)} heads: {len(top1)}: "
        + ", ".join(f"{token!r} ×{count}" for token, count in top1.most_common(12))
    )
    signal = arrays["signal_share"]
    print(
        f"- signal share: median {np.nanmedian(signal):.3f}, range {np.nanmin(signal):.3f}–{np.nanmax(signal):.3f} "
        f"(chance {float(np.nanmean(arrays['signal_chance'])):.3f}); heads below chance: {(signal < arrays['signal_chance']).sum()}"
    )
    if args.figures:
        from attnflow.corpus.report import save_figures

        for path in save_figures(summary, arrays, args.figures):
            print(f"- figure: {path}")


if __name__ == "__main__":
    main()
