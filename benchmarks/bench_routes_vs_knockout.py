"""Do the route's attention edges predict attention knockout? On the factual pairs
(attnflow/causal/data/factual.jsonl), smollm2: for every layer window and source token j, the
attention edge j → the predicting position i blocked in the window's layers (`attnflow.patch(...,
sites="knockout", knockout_window=W)`: the window of W layers centred on layer l), its effect
(m_clean − m_blocked) / (m_clean − m_corrupted) with m = logit(target) − logit(contrast) and the
pair's corrupt prompt as the normaliser; against the edge's route contribution over the same
layers (`attnflow.routes` on the clean prompt):

- ``carried``: Σ over the window's layers of importance_full(("mid", layer, i)) × the edge's weight
  attention[layer, i, j] — the share of the prediction the edge carries, every edge kept (τ = 0);
- ``route``: the same with the route's importance (τ = 0.04): 0 for edges off the route;
- ``weight``: Σ over the window's layers of the edge's weight alone (its share of the stream after
  the attention block at i).

Spearman ρ over the (layer, source) cells of each pair, mean ± s.e. over pairs; also pooled over
every cell of every pair, and without the first position (the attention sink). Writes
``--out``/pairs.jsonl (every number of every pair, appended as it goes: rerun to continue) and
``summary.md``.

    OMP_NUM_THREADS=1 python benchmarks/bench_routes_vs_knockout.py [--limit 30] [--windows 1,9]
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
from attnflow.methods.agreement import spearman
from attnflow.targets import Target

PREDICTORS = ("carried", "route", "weight")


def window_layers(layer: int, window: int, n_layers: int) -> range:
    """Layers l − ⌊(W − 1)/2⌋ … l + ⌊W/2⌋, clipped: the knockout's window centred on ``layer``."""
    return range(max(0, layer - (window - 1) // 2), min(n_layers, layer + window // 2 + 1))


def route_contributions(routes, window: int) -> dict[str, np.ndarray]:
    """``{predictor: [layer, source]}`` the edge source → the top position over each window."""
    position, n_layers = routes.position, routes.n_layers
    weight = routes.graph.attention[:, position, :].astype(np.float64)  # [layer, source]
    per_layer = {
        "carried": routes.importance_full.mids[:, position, None] * weight,
        "route": routes.importance.mids[:, position, None] * np.where(weight > routes.threshold, weight, 0.0),
        "weight": weight,
    }
    return {
        name: np.stack([values[list(window_layers(layer, window, n_layers))].sum(axis=0) for layer in range(n_layers)])
        for name, values in per_layer.items()
    }


def one_pair(model, pair: dict, windows: list[int]) -> dict:
    """Every number of one pair: the knockout effects and the route contributions per window."""
    routes = attnflow.routes(model, pair["clean"], lens="none")
    record: dict = {"pair": pair, "tokens": routes.tokens, "position": routes.position, "windows": {}}
    for window in windows:
        started = time.perf_counter()
        result = attnflow.patch(
            model,
            pair["clean"],
            pair["corrupt"],
            target=Target(pair["target"], contrast=pair["contrast"]),
            sites="knockout",
            methods="exact",
            knockout_window=window,
            progress=False,
        )
        effects = np.asarray(result.effects["exact"]["knockout"], dtype=np.float64)  # [layer, source]
        predicted = route_contributions(routes, window)
        record["windows"][str(window)] = {
            "effects": effects.tolist(),
            "seconds": time.perf_counter() - started,
            **{name: values.tolist() for name, values in predicted.items()},
        }
    return record


def correlations(records: list[dict], window: str, start: int) -> dict[str, dict[str, float]]:
    """Per predictor: mean ± s.e. over pairs of Spearman ρ over the (layer, source ≥ start) cells,
    and the pooled Spearman ρ and Pearson r over every such cell of every pair."""
    found = {}
    for name in PREDICTORS:
        per_pair, pooled_x, pooled_y = [], [], []
        for record in records:
            data = record["windows"][window]
            effects = np.asarray(data["effects"])[:, start:].ravel()
            predicted = np.asarray(data[name])[:, start:].ravel()
            if np.ptp(effects) > 0 and np.ptp(predicted) > 0:
                per_pair.append(spearman(predicted, effects))
            pooled_x.append(predicted)
            pooled_y.append(effects)
        x, y = np.concatenate(pooled_x), np.concatenate(pooled_y)
        rhos = np.asarray(per_pair)
        found[name] = {
            "mean": float(rhos.mean()),
            "se": float(rhos.std(ddof=1) / np.sqrt(len(rhos))) if len(rhos) > 1 else float("nan"),
            "pairs": len(rhos),
            "pooled_spearman": spearman(x, y),
            "pooled_pearson": float(np.corrcoef(x, y)[0, 1]),
        }
    return found


def summary(records: list[dict], windows: list[str]) -> str:
    lines = [f"smollm2: {len(records)} factual pairs, the edge source → the predicting position", ""]
    lines += [
        "| window | positions | predictor | Spearman ρ per pair | pooled ρ | pooled r |",
        "|---|---|---|---:|---:|---:|",
    ]
    for window in windows:
        for start, positions in ((0, "all"), (1, "without the first")):
            for name, values in correlations(records, window, start).items():
                lines.append(
                    f"| {window} | {positions} | {name} | {values['mean']:+.2f} ± {values['se']:.2f} "
                    f"(n = {values['pairs']}) | {values['pooled_spearman']:+.2f} | {values['pooled_pearson']:+.2f} |"
                )
    largest = {window: largest_effects(records, window) for window in windows}
    lines += ["", "mean effect of the strongest knockout per pair, and where it is:"]
    lines += [f"  window {window}: {text}" for window, text in largest.items()]
    seconds = {window: sum(record["windows"][window]["seconds"] for record in records) for window in windows}
    lines += ["", "knockout sweep seconds: " + ", ".join(f"window {w} {s:.0f}" for w, s in seconds.items())]
    return "\n".join(lines)


def largest_effects(records: list[dict], window: str) -> str:
    """The mean over pairs of the largest knockout effect, and how often it is the top route edge's cell."""
    peaks, agree = [], 0
    for record in records:
        data = record["windows"][window]
        effects, carried = np.asarray(data["effects"]), np.asarray(data["carried"])
        peaks.append(effects.max())
        agree += int(
            np.unravel_index(effects.argmax(), effects.shape) == np.unravel_index(carried.argmax(), carried.shape)
        )
    return f"{np.mean(peaks):.2f}; the cell of the largest carried share in {agree} of {len(records)} pairs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=30, help="at most this many pairs (the file's first ones)")
    parser.add_argument("--windows", default="1,9", help="knockout windows, comma-separated (default 1,9)")
    parser.add_argument("--out", type=Path, default=Path("out/bench-routes-knockout"))
    args = parser.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "pairs.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    pairs = read_pairs(Path(str(files("attnflow.causal") / "data" / "factual.jsonl")))[: args.limit]
    model = attnflow.load("smollm2", device="cpu")
    started = time.perf_counter()
    for number, pair in enumerate(pairs[len(records) :], start=len(records) + 1):
        record = one_pair(model, pair, windows)
        with log.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        records.append(record)
        print(f"pair {number}/{len(pairs)} done ({time.perf_counter() - started:.0f} s)", flush=True)
    text = summary(records, [str(window) for window in windows])
    (args.out / "summary.md").write_text(text + "\n")
    print(text)
    print(f"seconds this run: {time.perf_counter() - started:.0f}")


if __name__ == "__main__":
    main()
