"""Does attention rollout follow the interventions? Per layer, the Spearman correlation over token
positions between exact residual-stream patching (denoising: restore the clean stream at one (layer,
position) into the corrupted run) and each method's prediction for that layer
(`attnflow.causal.versus`): rollout up to the layer, rollout of the layers above it, attention flow,
grad_rollout, AttnLRP and GIM. Mean ± standard error over prompt pairs.

Pairs: ``--model smollm2`` the factual prompts with counterfactual subjects
(attnflow/causal/data/factual.jsonl, metric logit(target) − logit(contrast)); ``--model
minilm-sentiment`` the word swaps (attnflow/causal/data/sentiment_swaps.jsonl, metric
logit(clean class) − logit(other class)). Writes ``--out``/comparisons.jsonl (every number of every
pair, appended as it goes: rerun to continue), ``table.md`` (all positions, and without the first
position) and the figure ``--figure`` (one line per method across layers).

    OMP_NUM_THREADS=1 python benchmarks/bench_rollout_vs_patching.py --model smollm2 [--limit 20]
    OMP_NUM_THREADS=1 python benchmarks/bench_rollout_vs_patching.py --model minilm-sentiment
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
from attnflow.causal.versus import LayerComparison, compare_with_patching, format_table, spearman_table

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
    axis.legend(fontsize=8, ncol=3, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(PAIRS), default="smollm2")
    parser.add_argument("--limit", type=int, default=30, help="at most this many pairs (the file's first ones)")
    parser.add_argument("--out", type=Path, default=None, help="default out/bench-versus-MODEL")
    parser.add_argument("--figure", type=Path, default=None, help="default docs/figures/causal/versus-MODEL.png")
    args = parser.parse_args()
    out = args.out or Path(f"out/bench-versus-{args.model}")
    figure = args.figure or Path(f"docs/figures/causal/versus-{args.model}.png")
    out.mkdir(parents=True, exist_ok=True)
    log = out / "comparisons.jsonl"
    pairs = read_pairs(Path(str(files("attnflow.causal") / "data" / PAIRS[args.model])))[: args.limit]
    comparisons = load_done(log)
    model = attnflow.load(args.model, device="cpu")
    started = time.perf_counter()
    for number, pair in enumerate(pairs[len(comparisons) :], start=len(comparisons) + 1):
        comparison = compare_with_patching(
            model, pair["clean"], pair["corrupt"], target=pair.get("target"), contrast=pair.get("contrast")
        )
        with log.open("a") as handle:
            handle.write(json.dumps(comparison.to_dict()) + "\n")
        comparisons.append(comparison)
        print(f"pair {number}/{len(pairs)} done ({time.perf_counter() - started:.0f} s)", flush=True)
    tables = {
        "all positions": spearman_table(comparisons),
        "without the first position": spearman_table(comparisons, True),
    }
    text = [f"{args.model}: {len(comparisons)} pairs, saliency row {model.default_row!r}"]
    for name, table in tables.items():
        text += ["", f"Spearman ρ, {name} (mean ± s.e. over pairs):", "", format_table(table)]
    (out / "table.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    plot(tables["all positions"], f"{args.model}: {len(comparisons)} pairs, all positions", figure)
    print(f"figure: {figure}; seconds this run: {time.perf_counter() - started:.0f}")


if __name__ == "__main__":
    main()
