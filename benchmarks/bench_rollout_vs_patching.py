"""Does attention rollout follow the interventions? Per layer, the Spearman correlation over token
positions between exact residual-stream patching (denoising: restore the clean stream at one (layer,
position) into the corrupted run) and each method's prediction for that layer
(`attnflow.causal.versus`): rollout up to the layer, rollout of the layers above it, attention flow,
grad_rollout, AttnLRP, GIM and the importance of information flow routes. Mean ± standard error
over prompt pairs.

Pairs: ``--model smollm2`` the factual prompts with counterfactual subjects
(attnflow/causal/data/factual.jsonl, metric logit(target) − logit(contrast)); ``--model
minilm-sentiment`` the word swaps (attnflow/causal/data/sentiment_swaps.jsonl, metric
logit(clean class) − logit(other class)). Writes ``--out``/comparisons.jsonl (every number of every
pair, appended as it goes: rerun to continue; pairs written before a method joined get its
predictions added, without patching again), ``table.md`` (all positions, without the first
position, and from the first position the corruption changes on: the streams before it are the
same in both runs, so restoring them does nothing) and the figure ``--figure`` (one line per
method across layers).

    OMP_NUM_THREADS=1 python benchmarks/bench_rollout_vs_patching.py --model smollm2 [--limit 20]
    OMP_NUM_THREADS=1 python benchmarks/bench_rollout_vs_patching.py --model minilm-sentiment
    OMP_NUM_THREADS=1 python benchmarks/bench_rollout_vs_patching.py --model smollm2 --routes-variants
"""

from __future__ import annotations

import argparse
import json
import time
from importlib.resources import files
from pathlib import Path

import numpy as np

import attnflow
from attnflow.causal.dataset import read_pairs
from attnflow.causal.versus import (
    VERSUS_METHODS,
    LayerComparison,
    compare_with_patching,
    format_table,
    layer_predictions,
    spearman_table,
)
from attnflow.targets import as_target

PAIRS = {"smollm2": "factual.jsonl", "minilm-sentiment": "sentiment_swaps.jsonl"}


def load_done(path: Path) -> list[LayerComparison]:
    """The comparisons already written to ``path`` (one JSON object a line)."""
    if not path.exists():
        return []
    done = []
    for line in path.read_text().splitlines():
        data = json.loads(line)
        done.append(
            LayerComparison(
                data["clean_text"],
                data["corrupt_text"],
                data["tokens"],
                data["row"],
                np.asarray(data["effects"], dtype=np.float64),
                {method: np.asarray(values, dtype=np.float64) for method, values in data["predictions"].items()},
            )
        )
    return done


def add_missing_methods(model, comparisons: list[LayerComparison], pairs: list[dict], path: Path) -> None:
    """Give pairs patched before a method joined that method's predictions (the patching, the
    costly part, is kept), and rewrite ``path``."""
    changed = False
    for comparison, pair in zip(comparisons, pairs, strict=False):
        missing = [method for method in VERSUS_METHODS if method not in comparison.predictions]
        if missing:
            found = layer_predictions(
                model, comparison.clean_text, missing, target=pair.get("target"), corrupt=comparison.corrupt_text
            )
            comparison.predictions.update(found)
            changed = True
    if changed:
        path.write_text("".join(json.dumps(comparison.to_dict()) + "\n" for comparison in comparisons))


def first_change(model, comparison: LayerComparison) -> int:
    """The first position whose token the corruption changes."""
    clean, corrupt = (model.tokenizer(text)["input_ids"] for text in (comparison.clean_text, comparison.corrupt_text))
    return next(i for i, (a, b) in enumerate(zip(clean, corrupt, strict=True)) if a != b)


def from_position(comparison: LayerComparison, start: int) -> LayerComparison:
    """The comparison over positions ``start`` … T − 1 only."""
    predictions = {method: values[:, start:] for method, values in comparison.predictions.items()}
    return LayerComparison(
        comparison.clean_text,
        comparison.corrupt_text,
        comparison.tokens[start:],
        comparison.row,
        comparison.effects[:, start:],
        predictions,
    )


def means_over_rows(table: dict) -> str:
    """Each method's mean ρ over the rows where it is defined, and over them less the last row
    (leaving the last layer: trivially +1 for a prediction that is the top itself)."""
    found = []
    for method, values in table.items():
        mean = np.asarray(values["mean"], dtype=np.float64)
        found.append(f"{method} {np.nanmean(mean):+.3f} ({np.nanmean(mean[:-1]):+.3f} without the last row)")
    return "; ".join(found)


ROUTES_VARIANTS = ((1, 0.0), (1, 0.02), (1, 0.04), (1, 0.08), (2, 0.04))  # (norm p, threshold τ)


def routes_variants(model, comparisons: list[LayerComparison]) -> str:
    """Routes' mean ρ over rows for other thresholds and norms, on the pairs already patched (the
    effects are reused; only the routes are computed again): all positions, and without the first."""
    from attnflow.flow_routes.api import prediction_importance

    lines = ["routes variants (mean ρ over rows, without the last row; all positions | without the first):"]
    for norm, threshold in ROUTES_VARIANTS:
        varied = [
            LayerComparison(
                c.clean_text,
                c.corrupt_text,
                c.tokens,
                c.row,
                c.effects,
                {"routes": prediction_importance(model, c.clean_text, c.row, threshold, norm=norm)},
            )
            for c in comparisons
        ]
        means = [np.asarray(spearman_table(varied, skip)["routes"]["mean"]) for skip in (False, True)]
        found = " | ".join(f"{np.nanmean(mean):+.3f} ({np.nanmean(mean[:-1]):+.3f})" for mean in means)
        lines.append(f"  norm {norm}, threshold {threshold:g}: {found}")
    return "\n".join(lines)


def plot(table: dict, title: str, path: Path) -> None:
    """One line per method (mean ρ across residual rows) with its ±1 s.e. band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 4.2))
    for method, values in table.items():
        x = np.arange(len(values["mean"]))
        axis.plot(x, values["mean"], marker="o", markersize=3, label=method)
        axis.fill_between(x, values["mean"] - values["se"], values["mean"] + values["se"], alpha=0.15)
    axis.axhline(0, color="grey", linewidth=0.8)
    n_rows = len(next(iter(table.values()))["mean"])
    ticks = np.arange(0, n_rows, max(1, n_rows // 8))
    axis.set_xticks(ticks, ["emb" if tick == 0 else f"L{tick - 1}" for tick in ticks])
    axis.set_xlabel("residual stream (emb = entering the first layer, Ln = leaving layer n)")
    axis.set_ylabel("Spearman ρ with exact patching")
    axis.set_ylim(-1, 1)
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=8, ncol=4, loc="upper center")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument("--limit", type=int, default=30, help="at most this many pairs (the file's first ones)")
    parser.add_argument("--out", type=Path, default=None, help="default out/bench-versus-MODEL")
    parser.add_argument("--figure", type=Path, default=None, help="default docs/figures/causal/versus-MODEL.png")
    parser.add_argument(
        "--routes-variants",
        action="store_true",
        help="also: routes at other thresholds and norms on the pairs patched (their effects reused)",
    )
    args = parser.parse_args()
    out = args.out or Path(f"out/bench-versus-{args.model}")
    figure = args.figure or Path(f"docs/figures/causal/versus-{args.model}.png")
    out.mkdir(parents=True, exist_ok=True)
    log = out / "comparisons.jsonl"
    pairs = read_pairs(Path(str(files("attnflow.causal") / "data" / PAIRS[args.model])))[: args.limit]
    comparisons = load_done(log)
    model = attnflow.load(args.model, device="cpu")
    started = time.perf_counter()
    add_missing_methods(model, comparisons, pairs, log)
    for number, pair in enumerate(pairs[len(comparisons) :], start=len(comparisons) + 1):
        target = as_target(pair.get("target"), contrast=pair.get("contrast"))  # the pairs file's two fields
        comparison = compare_with_patching(model, pair["clean"], pair["corrupt"], target=target)
        with log.open("a") as handle:
            handle.write(json.dumps(comparison.to_dict()) + "\n")
        comparisons.append(comparison)
        print(f"pair {number}/{len(pairs)} done ({time.perf_counter() - started:.0f} s)", flush=True)
    tables = {
        "all positions": spearman_table(comparisons),
        "without the first position": spearman_table(comparisons, True),
        "from the first position the corruption changes on": spearman_table(
            [from_position(comparison, first_change(model, comparison)) for comparison in comparisons]
        ),
    }
    text = [f"{args.model}: {len(comparisons)} pairs, saliency row {model.default_row!r}"]
    for name, table in tables.items():
        text += ["", f"Spearman ρ, {name} (mean ± s.e. over pairs):", "", format_table(table), ""]
        text += [f"mean over rows: {means_over_rows(table)}"]
    if args.routes_variants:
        text += ["", routes_variants(model, comparisons)]
    (out / "table.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    plot(tables["all positions"], f"{args.model}: {len(comparisons)} pairs, all positions", figure)
    print(f"figure: {figure}; seconds this run: {time.perf_counter() - started:.0f}")


if __name__ == "__main__":
    main()
