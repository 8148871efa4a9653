"""The benchmark's report: ``results.md`` (the table), figures and ``results.html``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnflow.viz.page import esc, img, page, section, table

RESULTS_MD = "results.md"
RESULTS_HTML = "results.html"
CURVES_PNG = "deletion_curves.png"
BARS_PNG = "metrics.png"
# The bar figure's panels: (metric key in results.json, title; the arrow says which way is better).
BAR_METRICS = (
    ("comprehensiveness", "comprehensiveness ↑"),
    ("sufficiency", "sufficiency ↓"),
    ("deletion_auc", "deletion AUC ↓"),
)
CONTROL_METHOD = "random"  # scores that ignore the model: the floor every method should beat


def _pm(figure: dict[str, float] | None, digits: int = 3) -> str:
    if figure is None:
        return "–"
    return f"{figure['mean']:.{digits}f} ± {figure['se']:.{digits}f}"


def ordered_methods(results: dict[str, Any]) -> list[str]:
    """Methods by comprehensiveness, best first."""
    methods = results["methods"]
    return sorted(methods, key=lambda name: -methods[name]["comprehensiveness"]["mean"])


def table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the results table (mean ± standard error over samples); the NAOPC columns
    only when the run computed the bounds."""
    header = [
        "method",
        "comprehensiveness ↑",
        "NAOPC comp. ↑",
        "sufficiency ↓",
        "NAOPC suff. ↓",
        "deletion AUC ↓",
        "ρ vs leave-one-out",
        "sanity ρ (all random)",
        "s / sample",
    ]
    rows = []
    for name in ordered_methods(results):
        summary = results["methods"][name]
        sanity = summary.get("sanity")
        sanity_cell = "–" if sanity is None else f"{sanity['final_rho']:.2f}" + _flag(name, sanity["flagged"])
        agreement = (
            "reference" if name == results["run"].get("agreement_reference") else _pm(summary["agreement_loo"], 2)
        )
        rows.append(
            [
                name,
                _pm(summary["comprehensiveness"]),
                _pm(summary.get("naopc_comprehensiveness")),
                _pm(summary["sufficiency"]),
                _pm(summary.get("naopc_sufficiency")),
                _pm(summary["deletion_auc"]),
                agreement,
                sanity_cell,
                _pm(summary["seconds_per_sample"], 2),
            ]
        )
    if any("key" in summary for summary in results["methods"].values()):  # probes: how often the key ranks first
        header.insert(-3, "key ranked first ↑")
        for name, row in zip(ordered_methods(results), rows, strict=True):
            key = results["methods"][name].get("key")
            row.insert(-3, "–" if key is None else f"{key['first']:.2f} ± {key['first_se']:.2f}")
    if not results["run"].get("bounds_search"):  # no bounds searched: no NAOPC to show
        keep = [i for i, column in enumerate(header) if not column.startswith("NAOPC")]
        header, rows = [header[i] for i in keep], [[row[i] for i in keep] for row in rows]
    return header, rows


def _flag(method: str, flagged: bool) -> str:
    if not flagged:
        return ""
    return " **flagged** (expected: the control)" if method == CONTROL_METHOD else " **flagged**"


def bin_rows(results: dict[str, Any], metric: str) -> tuple[list[str], list[list[str]]]:
    """Per-bin values of ``metric`` (comprehensiveness or sufficiency)."""
    names = ordered_methods(results)
    bins = list(results["methods"][names[0]][metric]["bins"])
    header = ["method"] + [f"{float(k) * 100:g} %" for k in bins]
    rows = [[name] + [_pm(results["methods"][name][metric]["bins"][k]) for k in bins] for name in names]
    return header, rows


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def describe(results: dict[str, Any]) -> str:
    """One paragraph: what was evaluated and how."""
    run = results["run"]
    options = run["options"]
    accuracy = run.get("classifier_heldout_accuracy")
    sanity_samples = _sanity_samples(results)
    replace = (
        "removed from the token-id sequence (the sequence gets shorter)"
        if options["replace"] == "remove"
        else "replaced by the mask token"
    )
    next_token = run.get("target") == "next_token"
    parts = [
        f"Model `{run['model']}` on task `{run['task']}` ({run.get('split', '')}), "
        f"{run['samples']} samples, seed {options['seed']}.",
        f"Classifier held-out accuracy: {accuracy:.3f} (majority class {run['majority_accuracy']:.3f})."
        if accuracy is not None
        else "",
        (
            f"Top-1 next token = the text's true next token on {run['accuracy_on_samples']:.3f} of the windows; "
            if next_token
            else f"Accuracy on the evaluated samples: {run['accuracy_on_samples']:.3f}; "
        )
        + f"mean content tokens per sample: {run['mean_content_tokens']:.1f}.",
        f"Tokens are {replace}; special tokens are never removed. "
        f"Bins: {', '.join(f'{k * 100:g} %' for k in options['bins'])} "
        f"of the content tokens (top ⌈k·m⌉); the deletion curve has {options['curve_points']} points.",
        bounds_sentence(run),
        (
            f"Sanity check: {sanity_samples} samples "
            "re-explained after randomising the head, then each layer "
            "top-down"
            + (
                f" (re-explained after the head and {options['sanity_layers']} evenly spaced layer stages, "
                "the last with every layer random)"
                if options.get("sanity_layers")
                else ""
            )
            + "; flagged when the mean Spearman ρ after the last stage is ≥ 0.5."
            + (
                " – in the sanity column: an expensive method (leave-one-out, SHAP, integrated gradients, value "
                "zeroing, flow), not re-explained unless asked (--sanity-all-methods)."
                if any(summary["sanity"] is None for summary in results["methods"].values())
                else ""
            )
            if sanity_samples
            else "No sanity check (--sanity-samples 0)."
        ),
        "Every figure is the mean ± standard error over samples; the target is "
        + (
            "the model's top-1 next token after the untouched window."
            if next_token
            else "the class predicted for the untouched input."
        ),
    ]
    return " ".join(part for part in parts if part)


def bounds_sentence(run: dict[str, Any]) -> str:
    """How the NAOPC columns' per-sample AOPC bounds were found (which search, how often); without
    bounds, that NAOPC was not computed and how to add it."""
    searches = run.get("bounds_search")
    if not searches:
        return "NAOPC (normalised AOPC) was not computed: `attnflow evaluate --bounds singles|levels|beam` adds it."
    options = run["options"]
    how = {
        "exact": f"exact (every deletion order, by enumerating the bins' token sets; ≤ {options['exact_limit']} "
        "content tokens)",
        "beam": f"beam search (width {options['beam_width']}; its bounds are inner bounds)",
        "levels": "a greedy search a bin at a time (every remaining token tried alone, the best fill the next "
        "bin; its bounds are inner bounds)",
        "singles": "the two orders of the tokens by their own drop (each removed alone; loose inner bounds, "
        "met by leave-one-out's ranking by construction)",
        "none": f"none (over {options['exact_limit']} content tokens with --bounds exact: NAOPC left out)",
    }
    found = "; ".join(f"{how[search]} for {count} samples" for search, count in searches.items())
    return (
        "NAOPC (normalised AOPC, Edin et al. 2025) = (AOPC − lower) / (upper − lower) per sample, between the "
        f"lowest and highest AOPC any ranking of that sample reaches: bounds {found}. Comprehensiveness NAOPC "
        "is 1 for the best ranking, sufficiency NAOPC 0 for the best."
    )


def _sanity_samples(results: dict[str, Any]) -> int:
    """How many samples the sanity check re-explained (``--sanity-samples`` capped by ``--samples``)."""
    sanity = [summary["sanity"] for summary in results["methods"].values() if summary["sanity"]]
    return max((stage["n"] for checked in sanity for stage in checked["stages"]), default=0)


def legend(results: dict[str, Any]) -> str:
    """What the table's marks mean: the agreement reference, the sanity flag, the control."""
    parts = []
    reference = results["run"].get("agreement_reference")
    if reference in results["methods"]:
        parts.append(f"`reference`: `{reference}` is the method the ρ column compares the others with.")
    if _sanity_samples(results):
        parts.append(
            "**flagged**: with the head and every layer re-initialised, the method's maps still rank the tokens "
            "as before (mean ρ ≥ 0.5), so they do not follow the weights they claim to explain."
        )
    if CONTROL_METHOD in results["methods"]:
        parts.append(
            f"`{CONTROL_METHOD}` is the control: its scores ignore the model, so it is expected to be flagged and "
            "to agree with no method; a method tells something about the model as far as it beats "
            f"`{CONTROL_METHOD}` on comprehensiveness, sufficiency and deletion AUC."
        )
    return " ".join(parts)


def markdown(results: dict[str, Any]) -> str:
    """The benchmark's results as Markdown: the setting, the table, then each bin of the two curves."""
    sections = [
        "# Faithfulness benchmark",
        describe(results),
        _markdown_table(*table_rows(results)),
        legend(results),
        "## Comprehensiveness per bin",
        _markdown_table(*bin_rows(results, "comprehensiveness")),
        "## Sufficiency per bin",
        _markdown_table(*bin_rows(results, "sufficiency")),
    ]
    return "\n\n".join(sections) + "\n"


def html_page(results: dict[str, Any], figures: dict[str, bytes] | None = None) -> str:
    """``results.html``: the description, the table, the figures (``{file name: PNG bytes}``,
    embedded, so the page is one self-contained file) and the per-bin tables, through
    attnflow.viz's escaped offline page."""
    images = "".join(img(png, alt=Path(name).stem.replace("_", " ")) for name, png in (figures or {}).items())
    body = (
        table(*table_rows(results))
        + f"<p>{esc(legend(results))}</p>\n"
        + images
        + section("Comprehensiveness per bin", table(*bin_rows(results, "comprehensiveness")))
        + section("Sufficiency per bin", table(*bin_rows(results, "sufficiency")))
    )
    # Markdown marks (**flagged**, `name`) are for results.md; the page shows plain text.
    return page("attnflow faithfulness benchmark", _plain(body), subtitle=_plain(describe(results)))


def _plain(text: str) -> str:
    return text.replace("**", "").replace("`", "")


def write_report(results: dict[str, Any], out: str | Path, figures: bool = True) -> dict[str, Path]:
    """Write ``results.md``, ``results.html`` and (with ``figures``) the two PNG figures."""
    out = Path(out)
    paths = {"markdown": out / RESULTS_MD, "html": out / RESULTS_HTML}
    paths["markdown"].write_text(markdown(results), encoding="utf-8")
    pngs: dict[str, bytes] = {}
    if figures:
        from attnflow.viz.page import figure_png
        from attnflow.viz.plot import deletion_curves_figure, metrics_figure

        names = ordered_methods(results)
        methods = [results["methods"][name] for name in names]
        pngs[CURVES_PNG] = figure_png(deletion_curves_figure(names, [m["deletion_curve"] for m in methods]))
        pngs[BARS_PNG] = figure_png(metrics_figure(names, methods, BAR_METRICS))
        for key, name in (("curves", CURVES_PNG), ("bars", BARS_PNG)):
            paths[key] = out / name
            paths[key].write_bytes(pngs[name])
    paths["html"].write_text(html_page(results, pngs), encoding="utf-8")
    return paths
