"""report.html of an audit: tables, bar charts and the error gallery, offline (`attnflow.viz.page`).

Every word, text and label comes from data and is escaped; figures are embedded PNGs.
"""

from __future__ import annotations

import math
import shlex
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from attnflow.dataset_audit.analysis import FLAG_PERCENTILE
from attnflow.viz.page import esc, figure_img, page, section, table

GALLERY = 12  # errors and counterfactuals shown with their maps
CSS = """
.attnflow .text { white-space: pre-wrap; line-height: 1.9; padding: .4rem .6rem; border: 1px solid #e3e3e3;
                  border-radius: 6px; background: #fcfcfc; }
.attnflow .tok { border-radius: 3px; padding: .1rem .05rem; }
.attnflow .special { font-family: ui-monospace, monospace; font-size: .7rem; color: #666;
                     border: 1px dashed #aaa; border-radius: 3px; padding: 0 .2rem; margin: 0 .15rem; }
.attnflow .legend { display: flex; align-items: center; gap: .6rem; font-size: .8rem; color: #555; margin: .3rem 0; }
.attnflow .scale { width: 140px; height: 10px; border: 1px solid #ccc;
                   background: linear-gradient(to right, rgba(217,72,15,0), rgba(217,72,15,1)); }
.example { margin: 1rem 0 1.6rem; }
.flag { color: #a61b1b; font-weight: 600; }
pre { background: #f5f5f7; padding: .4rem .6rem; white-space: pre-wrap; word-break: break-all; font-size: .8rem; }
"""


def words_figure(rows: Sequence[Mapping[str, Any]], value: str, title: str, interval: str | None = None) -> Figure:
    """Horizontal bars of ``row[value]`` per word (best at the top), with ``row[interval]`` as error bars
    (none for a word without an interval: one text)."""
    figure = Figure(figsize=(5.2, 0.26 * len(rows) + 0.9), layout="constrained")
    axes = figure.add_subplot()
    words = [str(row["word"]) for row in rows][::-1]
    values = [float(row[value]) for row in rows][::-1]
    errors = None
    if interval is not None:
        bounds = [(v, v) if None in row[interval] else row[interval] for v, row in zip(values, rows[::-1], strict=True)]
        errors = [
            [v - float(low) for v, (low, _) in zip(values, bounds, strict=True)],
            [float(high) - v for v, (_, high) in zip(values, bounds, strict=True)],
        ]
    axes.barh(range(len(words)), values, xerr=errors, color="#d9480f", ecolor="#555", capsize=2)
    axes.set_yticks(range(len(words)), words, fontsize=8)
    axes.set_title(title, fontsize=9)
    axes.tick_params(axis="x", labelsize=8)
    return figure


def build_report(results: Mapping[str, Any]) -> str:
    """The audit's report page (self-contained HTML) from its results."""
    if "changes" in results:
        return build_versus_report(results)
    run = results["run"]
    parts = [
        f"<p>What {esc(run['model'])} relies on across {run['samples']} texts, by {esc(run['method'])} "
        "(definitions: docs/audit.md). Relevance of a word in one text: the share of the text's total relevance "
        "its tokens receive; means are over the texts that hold the word, with 95 % intervals. The word tables "
        "rank relevance <i>for</i> the class each map explains (the predicted one): with a signed method the "
        "positive part of each text's word relevance (a word that speaks against the prediction counts 0 "
        "there); the signed mean is shown beside it.</p>"
    ]
    if results.get("noted_texts"):
        parts.append(
            f"<p>{results['noted_texts']} of the {run['samples']} maps carry a note of the method (for example most "
            "of the relevance on one token); `attnflow explain` on a text shows it.</p>"
        )
    parts.append(section("Words per predicted class", _classes(results, run), "words"))
    if "errors" in results:
        parts.append(section("Errors", _errors(results["errors"], run), "errors"))
    if "terms" in results:
        parts.append(section("Term audit", _terms(results["terms"]), "terms"))
    if "swaps" in results:
        parts.append(section("Counterfactual swaps", _swaps(results["swaps"], run), "swaps"))
    meta = {
        "model": run["model"],
        "method": run["method"],
        "data": f"{run['data']} ({run['split']})",
        "texts": run["samples"],
        "minimum count": run["min_count"],
        "engine": run["engine"],
        "time (s)": run["elapsed_s"],
    }
    return page(f"attnflow audit: {run['model']}", "\n".join(parts), meta=meta, css=CSS)


def _classes(results: Mapping[str, Any], run: Mapping[str, Any]) -> str:
    parts = []
    for group in results["classes"]:
        name = group["class"]
        parts.append(f"<h3>{esc(name)} ({group['examples']} texts predicted)</h3>")
        rows = group["top_words"]
        if not rows:
            parts.append(f"<p>No word occurs in {run['min_count']} or more of these texts.</p>")
            continue
        parts.append(
            figure_img(
                words_figure(rows, "mean", f"{name}: mean relevance for {name} per text (95 % CI)", "ci"),
                f"{name} words",
            )
        )
        parts.append(
            table(
                ["word", "texts", "occurrences", "mean for class", "95 % CI", "signed mean", "total", "share"],
                (
                    [
                        r["word"],
                        r["examples"],
                        r["occurrences"],
                        r["mean"],
                        _interval(r["ci"]),
                        r["signed_mean"],
                        r["total"],
                        r["share"],
                    ]
                    for r in rows
                ),
            )
        )
        if group["contrast"]:
            parts.append(f"<p>Words that separate <b>{esc(name)}</b> from the other classes (relevance per text):</p>")
            parts.append(
                table(
                    ["word", "contrast", f"per {name} text", "per other text", f"{name} texts", "other texts"],
                    _contrast_cells(group["contrast"]),
                )
            )
    return "\n".join(parts)


def _contrast_cells(rows: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    """The table cells of contrast rows (`attnflow.dataset_audit.analysis.contrast`): word,
    contrast, relevance per text inside and outside, and the two groups' text counts."""
    keys = ("word", "contrast", "inside_per_example", "outside_per_example", "inside_examples", "outside_examples")
    return [[row[key] for key in keys] for row in rows]


def _errors(errors: Mapping[str, Any], run: Mapping[str, Any]) -> str:
    labels = run["labels"]
    parts = [
        f"<p>Accuracy {errors['accuracy']:.3f} ({errors['correct']} correct, {errors['errors']} errors).</p>",
        "<p>Confusion (rows: label, columns: prediction):</p>",
        table(["", *labels], ([labels[i], *row] for i, row in enumerate(errors["confusion"]))),
    ]
    if errors["error_words"]:
        parts.append("<p>Words more relevant in errors than in correct predictions (relevance per text):</p>")
        parts.append(
            table(
                ["word", "difference", "per error", "per correct", "errors holding it", "correct holding it"],
                _contrast_cells(errors["error_words"]),
            )
        )
    shown = errors["most_confident"][:GALLERY]
    if shown:
        parts.append(f"<h3>The {len(shown)} most confident errors</h3>")
    for record in shown:
        title = (
            f"#{record['index']}: predicted {labels[record['predicted']]} (p = {record['probability']:.3f}), "
            f"label {labels[record['label']]}"
        )
        parts.append(_example(record, run, title))
    return "\n".join(parts)


def _terms(terms: Mapping[str, Any]) -> str:
    parts = [
        f"<p>The terms receive {100 * terms['share']:.2f} % of all relevance; words of matched frequency would "
        f"receive {100 * terms['baseline_share']:.2f} % (ratio {terms['ratio']:.2f}). "
        f"Flagged (above the {FLAG_PERCENTILE:g}th percentile of their matched words): "
        f'<span class="flag">{esc(", ".join(terms["flagged"]) or "none")}</span>.</p>'
    ]
    if terms["missing"]:
        parts.append(f"<p>In no text: {esc(', '.join(terms['missing']))}.</p>")
    rows = terms["terms"]
    if rows:
        bars = [{"word": r["term"], "mean": r["mean"], "ci": r["ci"]} for r in rows]
        parts.append(figure_img(words_figure(bars, "mean", "terms: mean relevance per text (95 % CI)", "ci"), "terms"))
        parts.append(
            table(
                ["term", "texts", "mean", "95 % CI", "matched median", "matched 95th pct", "percentile", "flagged"],
                (
                    [
                        r["term"],
                        r["examples"],
                        r["mean"],
                        _interval(r["ci"]),
                        r["baseline_median"],
                        r["baseline_p95"],
                        r["percentile"],
                        "yes" if r["flagged"] else "no",
                    ]
                    for r in rows
                ),
            )
        )
    return "\n".join(parts)


def _swaps(swaps: Mapping[str, Any], run: Mapping[str, Any]) -> str:
    pairs = ", ".join(f"{a}↔{b}" for a, b in run["swap"])
    parts = []
    if swaps["unswapped"]:
        words = ", ".join(f"{word} ({texts} texts)" for word, texts in swaps["ambiguous"].items())
        parts.append(
            f"<p>{swaps['unswapped']} texts were not swapped: they hold a word with several partners "
            f"({esc(words)}), so no single swap is consistent. For example:</p><ul>"
            + "".join(f"<li>#{r['index']}: {esc(r['text'])}</li>" for r in swaps["unswapped_examples"])
            + "</ul>"
        )
    if not swaps["texts"]:
        return "".join(parts) + f"<p>No text holds a swapped word ({esc(pairs)}).</p>"
    parts += [
        f"<p>{swaps['texts']} texts were swapped ({esc(pairs)}). Flipped predictions: {swaps['flips']} "
        f"({100 * swaps['flip_rate']:.1f} %, 95 % CI {_interval(swaps['flip_rate_ci'], percent=True)}); "
        f"mean Δp of the predicted class {swaps['mean_delta_p']:+.4f} "
        f"(95 % CI {_interval(swaps['mean_delta_p_ci'])}).</p>"
    ]
    labels = run["labels"]
    for record in swaps["flipping_examples"][:GALLERY]:
        change = record["swapped"]
        title = (
            f"#{record['index']}: {labels[change['predicted_before']]} (p = {change['p_before']:.3f}) becomes "
            f"{labels[change['predicted_after']]} after the swap (Δp = {change['delta_p']:+.3f})"
        )
        parts.append(_example(record, run, title, after=change["text"]))
    return "\n".join(parts)


def _example(record: Mapping[str, Any], run: Mapping[str, Any], title: str, after: str | None = None) -> str:
    from attnflow.explanation import Explanation
    from attnflow.viz.html import token_view

    explanation = Explanation(
        tokens=record["tokens"],
        matrix=None,
        scores=record["scores"],
        method=run["method"],
        options={},
        row=None,
        text=record["text"],
        offsets=record["offsets"],
        special_mask=record["special_mask"],
    )
    parts = [f'<div class="example"><p><b>{esc(title)}</b></p><div class="attnflow">{token_view(explanation)}</div>']
    if after is not None:
        parts.append(f"<p>After the swap: {esc(after)}</p>")
    parts.append(f"<pre>{esc(explain_command(record, run))}</pre></div>")
    return "".join(parts)


def explain_command(record: Mapping[str, Any], run: Mapping[str, Any]) -> str:
    """The `attnflow explain` command that shows this example's map again."""
    label = run["labels"][record["predicted"]]
    return (
        f"attnflow explain {shlex.quote(record['text'])} --model {shlex.quote(run['model'])} "
        f"--method {shlex.quote(run['method'])} --target {shlex.quote(label)}"
    )


def _interval(bounds: Sequence[float | None], percent: bool = False) -> str:
    if bounds[0] is None or bounds[1] is None:
        return "n = 1: no interval"
    scale, unit = (100.0, " %") if percent else (1.0, "")
    return f"[{scale * bounds[0]:.3g}, {scale * bounds[1]:.3g}]{unit}"


# -- a two-model audit (--versus) ---------------------------------------------------------------


def build_versus_report(results: Mapping[str, Any]) -> str:
    """The report page of ``attnflow audit --versus`` / ``--versus-data``: the three largest changes
    in plain words (``changes.lead``, written with the numbers), then the word changes, the term
    share, the predictions (changed ones with both maps, or each domain's), the heads and the
    rollout maps, as tables and plots."""
    run, changes = results["run"], results["changes"]
    first, second = run["sides"]
    if changes["paired"]:
        intro = (
            f"What changed from <b>{esc(second)}</b> to <b>{esc(first)}</b> over the same {run['samples']} texts, "
            f"each model explaining its own prediction with {esc(run['method'])} (definitions: docs/audit.md). "
            "A word's relevance in a text: its share of the text's absolute relevance; a change is "
            f"{esc(first)} minus {esc(second)} per text (texts without the word count 0), with a paired 95 % "
            "interval."
        )
    else:
        intro = (
            f"What <b>{esc(run['model'])}</b> relies on in <b>{esc(first)}</b> ({changes['texts'][0]} texts) and in "
            f"<b>{esc(second)}</b> ({changes['texts'][1]} texts), explained with {esc(run['method'])} (definitions: "
            "docs/audit.md). A word's relevance in a text: its share of the text's absolute relevance; a change is "
            f"the mean per text on {esc(first)} minus that on {esc(second)} (texts without the word count 0), with "
            "a 95 % interval from both domains' spreads."
        )
    parts = [
        f"<p>{intro}</p>",
        '<ol class="lead">' + "".join(f"<li>{esc(entry['sentence'])}</li>" for entry in changes["lead"]) + "</ol>",
        section("Words whose relevance moved", _word_changes(changes, first, second), "words"),
    ]
    if "terms" in changes:
        parts.append(section("The terms' share of relevance", _term_share(changes["terms"], first, second), "terms"))
    if changes["paired"]:
        parts.append(section("Predictions that changed", _changed_predictions(changes["predictions"], run), "flips"))
    else:
        parts.append(section("Predictions in each domain", _side_predictions(changes["predictions"], first, second),
                             "predictions"))  # fmt: skip
    if "heads" in changes:
        parts.append(section("Attention heads that moved", _head_changes(changes["heads"], first, second), "heads"))
    if "maps" in changes:
        parts.append(section("Rollout maps per word", _map_changes(changes["maps"], first, second), "maps"))
    if changes.get("ffn"):
        rows = [[r["layer"], r["versus"], r["model"], r["change"], _interval(r["ci"])] for r in changes["ffn"]]
        body = table(["layer", second, first, "change", "95 % CI"], rows)
        parts.append(section("Feed-forward blocks: importance for the prediction per layer", body, "ffn"))
    meta = {"sides": f"{first} against {second}", "model": run["model"], "method": run["method"],
            "data": f"{run['data']} ({run['split']})", "texts": run["samples"], "minimum count": run["min_count"],
            "engine": run["engine"], "time (s)": run["elapsed_s"]}  # fmt: skip
    if "versus_data" in run:
        meta["second domain"] = f"{run['versus_data']} ({run['versus_split']})"
    return page(f"attnflow audit: {first} against {second}", "\n".join(parts), meta=meta, css=CSS)


def _change_table(rows: Sequence[Mapping[str, Any]], first: str, second: str) -> str:
    header = ["word", "texts", "change per text", "95 % CI", f"{first} per text", f"{second} per text",
              f"{first} where present", f"{second} where present"]  # fmt: skip
    keys = ("word", "texts", "change", "ci", "model_per_text", "versus_per_text", "model_where_present",
            "versus_where_present")  # fmt: skip
    cells = ([_interval(row[key]) if key == "ci" else row.get(key) for key in keys] for row in rows)
    return table(header, ([("–" if cell is None else cell) for cell in row] for row in cells))


def _change_figure(rows: Sequence[Mapping[str, Any]], title: str, alt: str) -> str:
    bars = [{"word": r["word"], "change": r["change"], "ci": r["ci"]} for r in rows]
    return figure_img(words_figure(bars, "change", title, "ci"), alt) if bars else ""


def _word_changes(changes: Mapping[str, Any], first: str, second: str) -> str:
    parts = [
        _change_figure(changes["words"], f"{first} minus {second}: relevance per text (95 % CI)", "changes"),
        "<h3>All texts</h3>",
        _change_table(changes["words"], first, second),
    ]
    for group in changes["words_per_group"] if len(changes["words_per_group"]) > 1 else []:
        texts = group["texts"] if changes["paired"] else " and ".join(str(n) for n in group["texts"])
        parts += [
            f"<h3>Texts labelled {esc(group['group'])} ({esc(texts[0] if changes['paired'] else texts)})</h3>",
            _change_table(group["words"], first, second),
        ]
    return "\n".join(parts)


def _term_share(terms: Mapping[str, Any], first: str, second: str) -> str:
    rows = [[name, 100 * terms[key]["mean"], _interval(terms[key]["ci"], True)]
            for name, key in ((first, "model_share"), (second, "versus_share"), ("change", "change"))]  # fmt: skip
    return f"<p>Terms: {esc(', '.join(terms['terms']))}.</p>" + table(["", "share (%)", "95 % CI"], rows)


def _side_predictions(predictions: Mapping[str, Any], first: str, second: str) -> str:
    parts = []
    if "model_accuracy" in predictions:
        change = predictions["accuracy_change"]
        parts.append(
            table(
                ["", first, second, "change", "95 % CI"],
                [["accuracy", predictions["model_accuracy"], predictions["versus_accuracy"], change["mean"],
                  _interval(change["ci"])]],
            )
        )  # fmt: skip
    parts.append("<p>Predicted classes (share of the texts):</p>")
    parts.append(
        table(["class", first, second], ([r["class"], r["model"], r["versus"]] for r in predictions["predicted"]))
    )
    return "\n".join(parts)


def _changed_predictions(predictions: Mapping[str, Any], run: Mapping[str, Any]) -> str:
    labels = run["labels"]
    what = "next tokens" if "next_tokens" in predictions else "classes"
    parts = [f"<p>{predictions['changed']} of {predictions['texts']} predicted {what} changed.</p>"]
    if predictions.get("next_tokens"):
        parts.append(
            table(
                ["#", "prompt", run["sides"][1], run["sides"][0]],
                ([r["index"], r["text"], r["versus"], r["model"]] for r in predictions["next_tokens"]),
            )
        )
    if "fixed" in predictions:
        parts.append(
            table(
                ["both right", "fixed errors", "new errors", "both wrong"],
                [[predictions[key] for key in ("both_right", "fixed", "new_errors", "both_wrong")]],
            )
        )
    for record in predictions["examples"][:GALLERY]:
        first, second = record["model"], record["versus"]
        label = "" if first["label"] is None else f", label {labels[first['label']]}"
        parts.append(f"<h3>#{record['index']} ({esc(record['outcome'].replace('_', ' '))}{esc(label)})</h3>")
        for name, side in ((run["model"], first), (run["versus"], second)):
            title = f"{name}: {labels[side['predicted']]} (p = {side['probability']:.3f})"
            parts.append(_example({**side, "index": record["index"]}, {**run, "model": name}, title))
    return "\n".join(parts)


def _head_changes(heads: Mapping[str, Any], first: str, second: str) -> str:
    from attnflow.dataset_audit.versus import HEAD_TITLES

    names = {key: HEAD_TITLES.get(key, key) for key, block in heads.items() if isinstance(block, Mapping)}
    parts = [figure_img(_layers_figure(heads, names, first, second), "per-layer head statistics")]
    for key, title in names.items():
        rows = heads[key]["moved"][:10]
        parts.append(f"<h3>{esc(title)}</h3>")
        parts.append(
            table(
                ["layer", "head", second, first, "change", "95 % CI"],
                [[r["layer"], r["head"], r["versus"], r["model"], r["change"], _interval(r["ci"])] for r in rows],
            )
        )
    return "\n".join(parts)


def _layers_figure(heads: Mapping[str, Any], names: Mapping[str, str], first: str, second: str) -> Figure:
    """Per statistic, its mean over each layer's heads on both sides (a line each)."""
    figure = Figure(figsize=(3.2 * min(len(names), 4), 2.6 * math.ceil(len(names) / 4)), layout="constrained")
    grid = np.atleast_1d(figure.subplots(math.ceil(len(names) / 4), min(len(names), 4))).ravel()
    for axes, (key, title) in zip(grid, names.items(), strict=False):
        rows = heads[key]["per_layer"]
        for side, name, style in (("versus", second, "--"), ("model", first, "-")):
            axes.plot([r["layer"] for r in rows], [r[side] for r in rows], style, marker="o", ms=3, label=name)
        axes.set_title(title, fontsize=8)
        axes.set_xlabel("layer", fontsize=8)
        axes.tick_params(labelsize=7)
    grid[0].legend(fontsize=7)
    return figure


def _map_changes(maps: Mapping[str, Sequence[Mapping[str, Any]]], first: str, second: str) -> str:
    titles = {"rollout": "attention rollout", "norm_rollout": "value-aware (norm-based) rollout"}
    parts = []
    for method, rows in maps.items():
        title = titles.get(method, method)
        parts += [
            f"<h3>{esc(title)}: words whose share of the map moved</h3>",
            _change_figure(rows, f"{title}: {first} minus {second} per text (95 % CI)", method),
            _change_table(rows, first, second),
        ]
    return "\n".join(parts)
