"""Edges and circuits on smollm2: EAP and EAP-IG edge scores on the factual pairs
(attnflow/causal/data/factual.jsonl, metric logit(target) − logit(contrast)) and the faithfulness of
the top-k circuit, (m_C − m_corrupted) / (m_clean − m_corrupted) with every edge outside it patched
to its corrupted value, for a few k; beside it, k edges drawn at random (seeded), the baseline a
score must beat. Mean ± standard error over pairs; the time each part took.

    OMP_NUM_THREADS=1 python benchmarks/bench_edges.py [--limit 10] [--steps 5] [--out out/bench-edges]
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
from attnflow.causal.edges import EdgeGraph

SIZES = (10, 50, 200, 1000, 3000)


def draw_circuit(scores, n_layers: int, n_heads: int, k: int, title: str, path: Path) -> None:
    """The top-``k`` edges of ``scores`` (`EdgeScores`) as a layered graph: x = layer, heads
    stacked above their layer's MLP; orange edges raise the metric, blue ones lower it, width ~ |score|."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def place(name: str, reading: bool) -> tuple[float, float]:
        if name == "emb":
            return -1.0, n_heads / 2
        if name == "logits":
            return float(n_layers), n_heads / 2
        layer = int(name[1:].split(".")[0])
        if ".h" in name:
            return layer, 1.0 + int(name.split(".h")[1])
        if name.startswith("m"):
            return layer + 0.45, 0.0
        return layer - 0.3, n_heads + 1.0 if reading else 0.0  # an attention block's input

    edges = scores.top_edges(k)
    largest = max(abs(scores.scores[u, v]) for u, v in edges)
    figure, axis = plt.subplots(figsize=(10, 4.5))
    for u, v in edges:
        value = scores.scores[u, v]
        (x0, y0), (x1, y1) = place(scores.upstream[u], False), place(scores.downstream[v], True)
        axis.plot([x0, x1], [y0, y1], color="#d95f02" if value > 0 else "#1f78b4", alpha=0.7,
                  linewidth=0.5 + 3 * abs(value) / largest)  # fmt: skip
    names = {scores.upstream[u] for u, _ in edges} | {scores.downstream[v] for _, v in edges}
    for name in names:
        x, y = place(name, name.startswith("a") and ".h" not in name)
        axis.annotate(name, (x, y), fontsize=6, ha="center", va="bottom")
        axis.plot([x], [y], "o", color="black", markersize=2)
    axis.set_xlabel("layer")
    axis.set_yticks([])
    axis.set_title(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--limit", type=int, default=10, help="at most this many pairs (the file's first ones)")
    parser.add_argument("--steps", type=int, default=5, help="EAP-IG interpolation steps")
    parser.add_argument("--out", type=Path, default=Path("out/bench-edges"))
    parser.add_argument("--figure", type=Path, default=Path("docs/figures/causal/circuit-smollm2.png"))
    parser.add_argument("--figure-edges", type=int, default=40, help="edges drawn (the first pair's EAP-IG top)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pairs = read_pairs(Path(str(files("attnflow.causal") / "data" / "factual.jsonl")))[: args.limit]
    model = attnflow.load(args.model, device="cpu")
    rng = np.random.default_rng(0)
    rows: dict[str, list[list[float]]] = {"eap": [], "eap-ig": [], "random": []}
    seconds: dict[str, float] = {"graph": 0.0, "eap": 0.0, "eap-ig": 0.0, "circuits": 0.0}
    for number, pair in enumerate(pairs, start=1):
        started = time.perf_counter()
        graph = EdgeGraph(model, pair["clean"], pair["corrupt"], pair.get("target"), pair.get("contrast"))
        seconds["graph"] += time.perf_counter() - started
        edges = [tuple(edge) for edge in np.argwhere(graph.valid)]
        for method in ("eap", "eap-ig"):
            started = time.perf_counter()
            scores = graph.scores(method, args.steps)
            seconds[method] += time.perf_counter() - started
            started = time.perf_counter()
            rows[method].append([graph.faithfulness(scores.top_edges(k)) for k in SIZES])
            seconds["circuits"] += time.perf_counter() - started
            if number == 1 and method == "eap-ig":
                share = graph.faithfulness(scores.top_edges(args.figure_edges))
                title = f"{pair['clean']!r}: top {args.figure_edges} EAP-IG edges (faithfulness {share:.2f})"
                draw_circuit(scores, model.n_layers, model.n_heads, args.figure_edges, title, args.figure)
        picks = [[edges[i] for i in rng.choice(len(edges), size=min(k, len(edges)), replace=False)] for k in SIZES]
        rows["random"].append([graph.faithfulness(pick) for pick in picks])
        print(
            f"pair {number}/{len(pairs)}: {len(edges)} edges; "
            + ", ".join(f"{name} {np.round(values[-1], 2).tolist()}" for name, values in rows.items()),
            flush=True,
        )
    lines = [
        f"{args.model}: {len(pairs)} pairs, {len(edges)} edges per pair, EAP-IG {args.steps} steps",
        "",
        "| circuit | " + " | ".join(f"top {k}" for k in SIZES) + " |",
        "|---|" + "---:|" * len(SIZES),
    ]
    for name, values in rows.items():
        array = np.asarray(values)  # [pair, size]
        mean, se = array.mean(axis=0), array.std(axis=0, ddof=1) / np.sqrt(len(array))
        lines.append(f"| {name} | " + " | ".join(f"{m:+.2f} ± {s:.2f}" for m, s in zip(mean, se, strict=True)) + " |")
    lines += ["", "seconds (all pairs): " + ", ".join(f"{name} {value:.1f}" for name, value in seconds.items())]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    (args.out / "faithfulness.json").write_text(json.dumps({"sizes": SIZES, **rows, "seconds": seconds}))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
