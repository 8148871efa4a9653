"""Information-flow routes on smollm2: the vectorised graph against the reference's way, and a long prompt.

(a) One prompt (``--short`` tokens of the embedded Wikipedia text), one recorded forward pass, two
    builds of the same contribution graph and route: attnflow's (`attnflow.routes`: one compiled
    kernel per layer over (query, source, head), never holding the decomposed attention) against
    the LLM Transparency Tool's way: per layer the decomposed attention ``[T, T, H, d]``
    materialised in torch and its proximities taken at once, then the graph assembled one edge at
    a time (one Python call and one ``.item()`` per edge, into a networkx multigraph: the residual
    and the self-attention edge join the same nodes) and the route found by a networkx depth-first
    search over the edges above τ. Both use max(·, 0) and τ = 0.04, and must find the same route.
(b) A ``--tokens``-token prompt (512): the time of `attnflow.routes` (forward pass, graph, route,
    lens) and its peak memory above the loaded model (RSS sampled every 5 ms during the call); then
    the time, sizes and peak memory of `Routes.save` (routes.json, routes.html, routes.png).
(c) One graph against the exact residual sweep on the same prompt, in the same run: for each of the
    first ``--pairs`` shipped factual pairs (attnflow/causal/data/factual.jsonl), `attnflow.routes`
    on the clean prompt (its whole call without the lens: the forward pass, every contribution, the
    route and every node's importance) against `attnflow.patch`'s exact sweep of the residual stream
    (``sites="residual", methods="exact"``: one patched forward pass per (layer, position), 32 a batch,
    plus its clean and corrupted runs), each timed once after warm-up calls. ``--context N``
    puts the first N tokens of the embedded Wikipedia text before both prompts of every pair (the
    pairs are 5 to 10 tokens long: the sweep's cost grows with the prompt faster than the graph's).

Targets: (a) ≥ 20× faster; (b) ≤ 60 s on a 2-core CPU and ≤ 1.5 GB above the model; (c) ≥ 100×
faster. The load average is printed with the numbers: other processes on the machine slow both sides.

    OMP_NUM_THREADS=1 python benchmarks/bench_routes.py [--short 64] [--tokens 512] [--pairs 10] [--context 0]
        [--parts a,b,c]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from importlib.resources import files
from pathlib import Path

import networkx as nx
import psutil
import torch

import attnflow
from attnflow.flow_routes import contributions as parts
from attnflow.flow_routes.api import linearised_blocks
from attnflow.flow_routes.forward import layer_view, read_weights, record
from attnflow.runs.readers import open_corpus

THRESHOLD = 0.04


def wiki_prompt(model, n_tokens: int) -> str:
    """A text of about ``n_tokens`` tokens cut from the embedded Wikipedia summaries."""
    ids: list[int] = []
    for document in open_corpus("wiki"):
        ids += model.tokenizer(document, add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            break
    return model.tokenizer.decode(ids[:n_tokens])


def reference_route(model, text: str) -> tuple[set[str], dict[str, float]]:
    """The reference tool's way: decomposed attention per layer, the graph one edge at a time, a
    networkx search. Returns the route's node names and the seconds of each part."""
    input_ids = model.tokenizer(text, return_tensors="pt")["input_ids"]
    recording, weights = record(model, input_ids), read_weights(model)
    n_layers, n_tokens = model.n_layers, input_ids.shape[1]
    # a multigraph: the residual edge and the self-attention edge join the same two nodes
    graph, seconds = nx.MultiDiGraph(), {"contributions": 0.0, "edges": 0.0, "search": 0.0}

    def add(u: str, v: str, weight: float) -> None:
        graph.add_edge(u, v, weight=weight)

    for index in range(n_layers):
        began = time.perf_counter()
        layer = layer_view(recording, weights, index)
        block, ffn_block = linearised_blocks(layer)
        vectors = parts.head_vectors(layer.values, layer.output_weights)
        vectors = parts.centre(vectors) if block.centres else vectors
        scale = torch.ones_like(layer.mid) if block.scale is None else block.scale
        decomposed = torch.einsum("hij,id,jhd->ijhd", layer.attention, scale, vectors)  # [T, T, H, d]
        heads = parts.proximity(layer.mid[:, None, None], decomposed, 1)  # [query, key, head]
        residual, heads = parts.normalise(parts.proximity(layer.mid, block.residual, 1), heads)
        ffn_part = ffn_block.part(layer.ffn_output)
        ffn, ffn_residual, _ = parts.ffn_contributions(layer.out, ffn_block, ffn_part, 1)
        seconds["contributions"] += time.perf_counter() - began
        began = time.perf_counter()
        below = "X0" if index == 0 else f"I{index - 1}"
        for i in range(n_tokens):
            for j in range(n_tokens):
                add(f"{below}_{j}", f"A{index}_{i}", heads[i, j].sum().item())
            add(f"{below}_{i}", f"A{index}_{i}", residual[i].item())
            add(f"A{index}_{i}", f"M{index}_{i}", ffn[i].item())
            add(f"M{index}_{i}", f"I{index}_{i}", ffn[i].item())
            add(f"A{index}_{i}", f"I{index}_{i}", ffn_residual[i].item())
        seconds["edges"] += time.perf_counter() - began
    began = time.perf_counter()
    reverse = graph.reverse()
    kept = nx.subgraph_view(reverse, filter_edge=lambda u, v, key: reverse[u][v][key]["weight"] > THRESHOLD)
    top = f"I{n_layers - 1}_{n_tokens - 1}"
    nodes = {top} | {node for edge in nx.edge_dfs(kept, source=top) for node in edge[:2]}
    seconds["search"] = time.perf_counter() - began
    return nodes, seconds


def as_reference_names(routes: attnflow.Routes) -> set[str]:
    """attnflow's route nodes in the reference's names (its FFN nodes M stand between A and I)."""
    names = set()
    for (stream, layer, i), _ in routes.nodes:
        names.add(f"A{layer}_{i}" if stream == "mid" else ("X0" if layer == 0 else f"I{layer - 1}") + f"_{i}")
    names |= {f"M{edge.layer}_{edge.target[2]}" for edge in routes.edges if edge.kind == "ffn"}
    return names


def compare(model, n_tokens: int) -> None:
    text = wiki_prompt(model, n_tokens)
    attnflow.routes(model, text, lens="none")  # compiles (or loads) the kernel, warms the caches
    began = time.perf_counter()
    routes = attnflow.routes(model, text, lens="none")
    ours = time.perf_counter() - began
    reference_nodes, seconds = reference_route(model, text)
    graph_ours = routes.seconds["graph"] + routes.seconds["route"]  # the lens is not part of the comparison
    graph_reference = sum(seconds.values())
    print(f"(a) {len(routes.tokens)} tokens, {model.n_layers} layers x {model.n_heads} heads:")
    print(f"    attnflow: graph + route {graph_ours:.2f} s (the whole call, forward pass and lens too: {ours:.2f} s)")
    print(
        f"    reference's way: {graph_reference:.2f} s (contributions {seconds['contributions']:.2f}, "
        f"edges one at a time {seconds['edges']:.2f}, search {seconds['search']:.2f})"
    )
    print(
        f"    speed-up {graph_reference / graph_ours:.0f}x; same route: {as_reference_names(routes) == reference_nodes}"
    )


def long_prompt(model, n_tokens: int) -> None:
    text = wiki_prompt(model, n_tokens)
    process = psutil.Process()
    before, peak, running = process.memory_info().rss, [0], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    began = time.perf_counter()
    routes = attnflow.routes(model, text)
    elapsed = time.perf_counter() - began
    running[0] = False
    sampler.join()
    seconds = ", ".join(f"{name} {value:.1f}" for name, value in routes.seconds.items())
    above = (peak[0] - before) / 2**30
    print(f"(b) {len(routes.tokens)} tokens: {elapsed:.1f} s ({seconds}); peak {above:.2f} GiB above the loaded model")
    print(f"    route: {len(routes.nodes)} nodes, {len(routes.edges)} edges; prediction {routes.prediction['token']!r}")
    with tempfile.TemporaryDirectory() as folder:
        running[0], peak[0] = True, 0
        sampler = threading.Thread(target=sample)
        sampler.start()
        began = time.perf_counter()
        routes.save(Path(folder) / "out")
        elapsed = time.perf_counter() - began
        running[0] = False
        sampler.join()
        written = sorted((Path(folder) / "out").iterdir())
        sizes = ", ".join(f"{path.name} {path.stat().st_size / 2**20:.1f} MiB" for path in written)
    print(f"    saved in {elapsed:.1f} s ({sizes}); peak {(peak[0] - before) / 2**30:.2f} GiB above the loaded model")


def versus_sweep(model, n_pairs: int, context: int) -> None:
    """(c): one graph against the exact residual sweep, per factual pair, in the same run."""
    from attnflow.causal.dataset import read_pairs
    from attnflow.targets import as_target

    pairs = read_pairs(Path(str(files("attnflow.causal") / "data" / "factual.jsonl")))[:n_pairs]
    first = pairs[0]
    attnflow.routes(model, first["clean"], lens="none")  # warm-ups (the pair alone): the kernel, the caches
    attnflow.patch(model, first["clean"], first["corrupt"], sites="residual", methods="exact", progress=False)
    before = wiki_prompt(model, context) + " " if context else ""
    pairs = [pair | {"clean": before + pair["clean"], "corrupt": before + pair["corrupt"]} for pair in pairs]
    attnflow.routes(model, pairs[0]["clean"], lens="none")  # and at the prompts' length (its first call: slower)
    ratios, graphs, sweeps = [], [], []
    for pair in pairs:
        began = time.perf_counter()
        routes = attnflow.routes(model, pair["clean"], lens="none")
        graph = time.perf_counter() - began
        began = time.perf_counter()
        result = attnflow.patch(
            model, pair["clean"], pair["corrupt"], target=as_target(pair["target"], contrast=pair["contrast"]),
            sites="residual", methods="exact", progress=False,
        )  # fmt: skip
        sweep = time.perf_counter() - began
        sites = result.effects["exact"]["residual"].size
        graphs.append(graph), sweeps.append(sweep), ratios.append(sweep / graph)
        print(
            f"(c) {len(routes.tokens)} tokens: one graph {graph:.2f} s, the exact residual sweep {sweep:.2f} s "
            f"({sites} sites): {sweep / graph:.1f}x"
        )
    print(
        f"(c) {len(pairs)} pairs: graph median {statistics.median(graphs):.2f} s, sweep median "
        f"{statistics.median(sweeps):.2f} s; ratio median {statistics.median(ratios):.1f}x "
        f"(min {min(ratios):.1f}x, max {max(ratios):.1f}x); the 100x target "
        f"{'met' if statistics.median(ratios) >= 100 else 'not met'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=int, default=64, help="tokens of the prompt of (a)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the long prompt of (b)")
    parser.add_argument("--pairs", type=int, default=10, help="factual pairs of (c)")
    parser.add_argument("--context", type=int, default=0, help="(c): tokens of Wikipedia text before each prompt")
    parser.add_argument("--parts", default="a,b,c", help="which parts to run, comma-separated (default: a,b,c)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; torch threads {torch.get_num_threads()}")
    model = attnflow.load("smollm2", device="cpu", progress=False)
    if "a" in parts:
        compare(model, args.short)
    if "b" in parts:
        long_prompt(model, args.tokens)
    if "c" in parts:
        versus_sweep(model, args.pairs, args.context)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
