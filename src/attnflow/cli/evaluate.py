"""`attnflow evaluate`: the faithfulness benchmark of every method on a classifier or a causal LM."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnflow.datasets import DEFAULT_WINDOW
from attnflow.evaluate.bounds import BEAM_WIDTH, EXACT_LIMIT, LONG_INPUT_SEARCHES
from attnflow.evaluate.metrics import BINS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="rank the methods by how faithfully they explain a classifier or a language model's next token",
        description=(
            "Faithfulness benchmark on held-out examples: AOPC comprehensiveness and sufficiency over "
            f"{', '.join(f'{k * 100:g}' for k in BINS)} % of the content tokens and their normalised form (NAOPC: "
            "between the worst and best AOPC any ranking of that input reaches; exact bounds on short inputs, "
            "beam search on longer ones), deletion-curve AUC, Spearman rho "
            "against leave_one_out, and a cascading-randomisation sanity check, each with its standard error, "
            "for every method next to `random`. Tokens are removed from the token-id sequence (special tokens "
            "never), or masked with --replace mask. Writes results.json, results.md, figures and results.html."
        ),
        epilog=(
            "examples:\n  attnflow evaluate --out out/eval --samples 50 --methods rollout,alti,gradient,random\n"
            "  attnflow evaluate --model minilm-topics --task wiki-topics --out out/topics\n"
            "  attnflow evaluate --model smollm2 --task next-token --window 8 --samples 200 --out out/smollm2\n"
            "  attnflow evaluate --model minilm-sentiment --task reviews.csv "
            "--text-column review --label-column stars --out out/mine"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_task_arguments(parser)
    _add_measure_arguments(parser)
    _add_run_arguments(parser)
    parser.set_defaults(handler=run, output_folder=lambda args: args.out)


def _add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, the task (its file's columns), the methods and the examples."""
    parser.add_argument(
        "--model",
        default="minilm-sentiment",
        help="a classifier: minilm-sentiment (default), minilm-topics, mpnet-sentiment, or a path",
    )
    parser.add_argument(
        "--task",
        default=None,
        help=(
            "rotten-tomatoes, wiki-topics (their held-out 20 %%) or "
            "a CSV/JSONL file; default: the classifier's own task. next-token (causal LMs such as smollm2): "
            "one window of --window tokens per held-out text of both, the target the model's top-1 next token, "
            "deletion removing context tokens"
        ),
    )
    parser.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        help=f"--task next-token: context tokens per window (default {DEFAULT_WINDOW}; up to "
        f"{EXACT_LIMIT} the NAOPC bounds are exact, beyond a beam search)",
    )
    parser.add_argument("--text-column", default="text", help="text column of a task file (default: text)")
    parser.add_argument(
        "--label-column",
        default="label",
        help="label column of a task file: the model's class names or indices (default: label)",
    )
    parser.add_argument("--methods", default="all", help="comma-separated method names, or all (default)")
    parser.add_argument(
        "--samples", type=int, help="held-out examples to evaluate (default 500, or all of a smaller set)"
    )


def _add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """The sanity check, the NAOPC bounds, how tokens are removed, and the seed."""
    parser.add_argument(
        "--sanity-samples",
        type=int,
        default=32,
        help="examples re-explained at each randomisation stage (default 32; 0 skips the sanity check)",
    )
    parser.add_argument(
        "--sanity-layers",
        type=int,
        default=None,
        help="layer stages of the sanity check re-explained, evenly spaced, the last (every layer random) "
        "always (default: all; every layer is randomised either way)",
    )
    parser.add_argument(
        "--beam-width",
        type=int,
        default=BEAM_WIDTH,
        help=f"NAOPC bounds of inputs over {EXACT_LIMIT} content tokens: orders the beam search keeps "
        f"(default {BEAM_WIDTH}; its cost grows with the tokens squared; 0: no bounds, NAOPC only for short inputs)",
    )
    parser.add_argument(
        "--bounds-search",
        choices=LONG_INPUT_SEARCHES,
        default="beam",
        help="how the NAOPC bounds of inputs over the exact limit are searched: beam (default; --beam-width "
        "orders kept) or levels (a bin at a time: every remaining token tried alone, the best fill the next bin; "
        "about half the forward passes of --beam-width 1, looser inner bounds)",
    )
    parser.add_argument(
        "--replace",
        choices=("remove", "mask"),
        default="remove",
        help="remove tokens from the sequence (default) or put the mask token in their place",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the sample choice and the randomised weights (default 0)"
    )


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The output folder, resuming or replacing it, the device and the progress bar."""
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out (same run only): keep the AOPC bounds searched so far and the finished methods",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results already in --out (they stay until the new run has finished)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, mps or auto (default)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from attnflow.evaluate.api import check_out, check_task_name, evaluate, resolve_methods
    from attnflow.evaluate.benchmark import BenchmarkOptions

    resolve_methods(args.methods)  # unknown names fail before the model loads
    check_task_name(args.task)
    if args.sanity_samples < 0:
        raise ValueError("--sanity-samples must be 0 or more")
    check_out(args.out, args.overwrite, args.resume)
    options = BenchmarkOptions(
        replace=args.replace,
        sanity_samples=args.sanity_samples,
        seed=args.seed,
        beam_width=args.beam_width,
        bounds_search=args.bounds_search,
        sanity_layers=args.sanity_layers,
    )
    from attnflow.model import load

    model = load(args.model, device=args.device)
    results = evaluate(
        model,
        args.task,
        args.methods,
        args.samples,
        args.out,
        options,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=not args.quiet,
        text_column=args.text_column,
        label_column=args.label_column,
        window=args.window,
    )
    print(
        f"{len(results['methods'])} methods on {results['run']['samples']} samples: {args.out / 'results.md'}, "
        f"{args.out / 'results.html'}"
    )
    return 0
