"""`attnflow patch`: which layers, positions and heads carry a prediction, by activation patching."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnflow.cli.common import RUNS_NOTE, add_run_arguments, engine_options, load_model, positive_int, quiet_loading


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "patch",
        help="activation patching: which sites carry a prediction (exact, AtP, AtP*, RelP)",
        description=(
            "Run a corrupted input with one site at a time restored to its value on the clean input "
            "(denoising; --direction noising does the reverse) and report the normalised effect "
            "(m_patched - m_corrupted) / (m_clean - m_corrupted) of every site: the residual stream, "
            "attention and MLP outputs per (layer, position), and each head's output per layer; or, with "
            "--sites knockout, block one attention edge at a time (key -> --knockout-target) on the clean "
            "input in a window of layers (Geva et al. 2023), effect (m_clean - m_blocked) / (m_clean - "
            "m_corrupted). The "
            "corruption is a counterfactual text of the same token length (--corrupt) or Gaussian noise "
            "(3x the std of the embeddings) on the embeddings of chosen words (--noise, seeded, --samples "
            "draws averaged). The metric: a classifier's class logit, a causal LM's log p(next token), or "
            "with --contrast the logit difference target - contrast. The approximations (atp, atp*, "
            "relp) come with their Pearson and Spearman correlation with exact patching. Writes "
            "patch.json (every number) and patch.html (heatmaps) into --out."
        ),
        epilog=(
            "examples:\n"
            '  attnflow patch "The capital of France is" --corrupt "The capital of Italy is" \\\n'
            '      --model smollm2 --target " Paris" --contrast " Rome" --out out/patch\n'
            '  attnflow patch "The Eiffel Tower is in" --noise "Eiffel Tower" --model smollm2 --out out/noise\n'
            '  attnflow patch "The Eiffel Tower is in" --noise "Eiffel Tower" --model smollm2 --sites knockout \\\n'
            "      --knockout-window 9 --method exact --out out/knockout\n"
            "  attnflow patch --file pairs.jsonl --model smollm2 --sites heads --method exact,atp,relp "
            "--out out/pairs\n"
            "  attnflow patch --file pairs.jsonl --model smollm2 --sites heads --method exact,atp,relp "
            "--out out/pairs --resume\n"
            "  attnflow patch --file pairs.jsonl --model smollm2 --engine ray --workers 4 --out out/pairs-ray\n\n"
            'pairs.jsonl: one {"clean": ..., "corrupt": ... | "noise": ..., "target": ..., "contrast": ...} a line;\n'
            "--out receives pairs.jsonl (every pair's numbers), summary.json, summary.html and checkpoint.json.\n\n"
            + RUNS_NOTE.replace("runs (", "--file runs (")
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_input_arguments(parser)
    _add_sweep_arguments(parser)
    _add_run_arguments(parser)
    _add_other_analyses(parser)
    parser.set_defaults(handler=run, output_folder=lambda args: args.out)


def _add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """The clean text, its corruption, the model and what the metric reads."""
    parser.add_argument("text", nargs="?", help="the clean text (omit with --file)")
    corruption = parser.add_mutually_exclusive_group()
    corruption.add_argument("--corrupt", metavar="TEXT", help="a counterfactual text of the same token length")
    corruption.add_argument("--noise", metavar="WORDS", help="comma-separated words of the text to add noise to")
    parser.add_argument("--model", default="smollm2", help="a causal LM or a classifier (default: smollm2)")
    parser.add_argument(
        "--target", metavar="CLASS|TOKEN", help="the class or next token the metric reads (default: the prediction)"
    )
    parser.add_argument("--contrast", metavar="CLASS|TOKEN", help="measure the logit difference target - contrast")


def _add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """Which sites, by which methods, in which direction; the noise draws and the batch."""
    from attnflow.capture.site_kinds import SITE_TABLE

    default = ",".join(row.name for row in SITE_TABLE if row.is_activation)
    kinds = "; ".join(f"{row.name}: {row.help}" for row in SITE_TABLE)
    parser.add_argument(
        "--sites", default=default, metavar="KINDS", help=f"comma-separated site kinds (default: {default}). {kinds}"
    )
    parser.add_argument(
        "--method",
        default="exact,atp",
        help="exact, atp, atp* (AtP with GradDrop), relp (AtP with the AttnLRP backward) (default: exact,atp)",
    )
    parser.add_argument(
        "--direction",
        choices=("denoising", "noising"),
        default="denoising",
        help="denoising: restore clean values into the corrupted run (default); noising: corrupt the clean run",
    )
    parser.add_argument("--samples", type=positive_int, default=10, help="noise draws averaged (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the noise (default 0)")
    parser.add_argument(
        "--batch-size", type=positive_int, default=32, help="rows per forward pass of the exact sweep (default 32)"
    )
    parser.add_argument(
        "--head-position",
        type=int,
        metavar="N",
        help="patch each head at token N only (-1: the last) instead of at every position",
    )
    _add_knockout_arguments(parser)


# (flag, type, metavar, default, help) of the options of --sites knockout
KNOCKOUT_OPTIONS = (
    (
        "--knockout-target",
        int,
        "N",
        None,
        "the query token whose attention edges are blocked (-1: the last; default: the predicting token, the "
        "last or a classifier's first)",
    ),
    (
        "--knockout-window",
        positive_int,
        "K",
        1,
        "block the edge in K layers centred on each layer (default 1; Geva et al. use 9 in GPT-2 XL)",
    ),
    ("--knockout-sources", str, "N,N", None, "the key tokens swept, comma-separated (-1: the last; default: all)"),
)


def _add_knockout_arguments(parser: argparse.ArgumentParser) -> None:
    """Where ``--sites knockout`` blocks attention edges."""
    for flag, kind, metavar, default, text in KNOCKOUT_OPTIONS:
        parser.add_argument(flag, type=kind, metavar=metavar, default=default, help=f"with --sites knockout: {text}")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """A file of pairs, the run engine's options for it, the output folder, the device and the progress bar."""
    parser.add_argument("--file", type=Path, metavar="PAIRS.jsonl", help="patch every prompt pair of a file")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="output folder")
    add_run_arguments(parser.add_argument_group("runs of a --file (docs/runs.md)"), scope="--file: ")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: a GPU when present (default: auto)"
    )
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar or summary")


def _add_other_analyses(parser: argparse.ArgumentParser) -> None:
    """Instead of the site sweep: methods against exact patching (--versus), or edge scores (--edges)."""
    parser.add_argument(
        "--versus",
        metavar="METHODS",
        help="instead: per layer, the Spearman correlation between exact residual patching and each of "
        "rollout,rollout_above,flow,grad_rollout,attnlrp,gim (comma-separated; 'all'); writes versus.json",
    )
    parser.add_argument(
        "--edges",
        choices=("eap", "eap-ig"),
        help="instead: score every edge between embeddings, heads, MLPs and logits (pre-norm models) and "
        "print the top edges and the faithfulness of the top-k circuits; writes edges.json",
    )
    parser.add_argument("--steps", type=positive_int, default=5, help="with --edges eap-ig: interpolation steps")


def run(args: argparse.Namespace) -> int:
    from attnflow.causal.api import parse_methods
    from attnflow.causal.sites import parse_site_kinds

    options = {
        "sites": parse_site_kinds(args.sites),
        "methods": parse_methods(args.method),
        "direction": args.direction,
        "samples": args.samples,
        "seed": args.seed,
        "batch_size": args.batch_size,
        "head_position": args.head_position,
        "knockout_target": args.knockout_target,
        "knockout_window": args.knockout_window,
        "knockout_sources": _positions(args.knockout_sources),
        "progress": not args.quiet,
    }
    if args.file is not None:
        if args.text or args.corrupt or args.noise or args.target or args.contrast:
            raise ValueError("--file holds the texts, targets and contrasts: give no TEXT, --corrupt, --noise, ...")
        from attnflow.causal.dataset import patch_file

        quiet_loading(args.quiet)
        summary = patch_file(
            args.model, args.file, args.out, resume=args.resume, overwrite=args.overwrite, engine=engine_options(args),
            **options,
        )  # fmt: skip
        for method, kinds in summary["correlations"].items():
            agreement = ", ".join(f"{kind} r={values['pooled_pearson']:.2f}" for kind, values in kinds.items())
            print(f"{method} vs exact (pooled): {agreement}")
        print(f"{summary['pairs']} pairs ({len(summary['failed'])} left out): {args.out / 'summary.html'}")
        return 0
    if not args.text:
        raise ValueError("give the clean TEXT (or --file PAIRS.jsonl)")
    if args.corrupt is None and args.noise is None:
        raise ValueError("give --corrupt TEXT (same token length) or --noise WORDS")
    if args.resume or args.overwrite or args.engine != "local":
        raise ValueError("--resume, --overwrite and --engine are for a --file run of many pairs")
    if args.versus:
        return run_versus(args)
    if args.edges:
        return run_edges(args)
    from attnflow.causal import patch

    model = load_model(args.model, args.device, args.quiet)
    result = patch(
        model, args.text, args.corrupt, noise=args.noise, target=args.target, contrast=args.contrast, **options
    )
    page = result.save(args.out)
    if not args.quiet:
        print(result.summary())
    print(f"{page} {args.out / 'patch.json'}")
    return 0


def _positions(text: str | None) -> list[int] | None:
    """``"1,-1"`` -> [1, -1] (None stays None)."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--knockout-sources takes comma-separated token positions, got {text!r}") from None


def run_versus(args: argparse.Namespace) -> int:
    """``--versus``: one pair's per-layer Spearman table (`attnflow.causal.versus`), printed and
    written to ``--out``/versus.json."""
    import json

    import numpy as np

    from attnflow.causal.versus import VERSUS_METHODS, compare_with_patching, format_table, parse_versus_methods
    from attnflow.staging import atomic_file

    if args.corrupt is None:
        raise ValueError("--versus compares with residual patching of a counterfactual: give --corrupt TEXT")
    methods = VERSUS_METHODS if args.versus == "all" else parse_versus_methods(args.versus)
    model = load_model(args.model, args.device, args.quiet)
    comparison = compare_with_patching(
        model,
        args.text,
        args.corrupt,
        target=args.target,
        contrast=args.contrast,
        methods=methods,
        batch_size=args.batch_size,
        progress=not args.quiet,
    )
    rhos = comparison.spearman()  # one pair: no standard error
    print(
        format_table({method: {"mean": values, "se": np.full_like(values, np.nan)} for method, values in rhos.items()})
    )
    path = args.out / "versus.json"
    data = {**comparison.to_dict(), "spearman": {method: values.tolist() for method, values in rhos.items()}}
    with atomic_file(path) as handle:
        handle.write(json.dumps(data).encode())
    print(path)
    return 0


def run_edges(args: argparse.Namespace) -> int:
    """``--edges``: one pair's edge scores (`attnflow.causal.edges`), the ten strongest edges and the
    faithfulness of the top-k circuits, printed and written to ``--out``/edges.json."""
    import json

    from attnflow.causal.edges import edge_scores
    from attnflow.staging import atomic_file

    if args.corrupt is None:
        raise ValueError("--edges needs a counterfactual: give --corrupt TEXT")
    model = load_model(args.model, args.device, args.quiet)
    result = edge_scores(
        model, args.text, args.corrupt, target=args.target, contrast=args.contrast, method=args.edges, steps=args.steps
    )
    for up, down in result.top_edges(10):
        print(f"{result.upstream[up]:>8} -> {result.downstream[down]:<8} {result.scores[up, down]:+.3f}")
    print("faithfulness: " + ", ".join(f"top {k} {value:.2f}" for k, value in result.faithfulness.items()))
    path = args.out / "edges.json"
    with atomic_file(path) as handle:
        handle.write(json.dumps(result.to_dict()).encode())
    print(path)
    return 0
