"""`attnflow evaluate`: the faithfulness benchmark of every method on a classifier or a causal LM."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnflow.cli.common import RUNS_NOTE, add_loading_arguments, add_run_arguments, engine_options
from attnflow.datasets import DEFAULT_WINDOW
from attnflow.evaluate.bounds import BEAM_WIDTH, BOUND_SEARCHES, EXACT_LIMIT
from attnflow.evaluate.metrics import BINS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="rank the methods by how faithfully they explain a classifier or a language model's next token",
        description=(
            "Faithfulness benchmark on held-out examples: AOPC comprehensiveness and sufficiency over "
            f"{', '.join(f'{k * 100:g}' for k in BINS)} % of the content tokens (with --bounds, their normalised "
            "form NAOPC: between the worst and best AOPC any ranking of that input reaches), deletion-curve AUC, "
            "Spearman rho "
            "against leave_one_out, and a cascading-randomisation sanity check, each with its standard error, "
            "for every method next to `random`. Tokens are removed from the token-id sequence (special tokens "
            "never), or masked with --replace mask. Writes results.json, results.md, figures and results.html. "
            "The plan and its time estimate (and what each --bounds search would add) print before any work."
        ),
        epilog=(
            "examples:\n  attnflow evaluate --out out/eval --samples 50 --methods rollout,alti,gradient,random\n"
            "  attnflow evaluate --model minilm-topics --task wiki-topics --out out/topics\n"
            "  attnflow evaluate --model smollm2 --task next-token --window 8 --samples 200 --bounds exact "
            "--out out/smollm2\n"
            "  attnflow evaluate --model minilm-topics --samples 100 --bounds levels --out out/naopc\n"
            "  attnflow evaluate --model minilm-sentiment --task reviews.csv "
            "--text-column review --label-column stars --out out/mine\n"
            "  attnflow evaluate --samples 50 --methods rollout,alti --engine ray --workers 4 --out out/eval\n\n"
            + RUNS_NOTE
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
        help="a classifier: minilm-sentiment (default), minilm-topics, mpnet-sentiment, or a path; or a causal "
        "LM (smollm2, gemma3-270m, qwen2.5-0.5b, ...) with --task next-token or next-token-probes",
    )
    parser.add_argument(
        "--task",
        default=None,
        help=(
            "rotten-tomatoes, wiki-topics (their held-out 20 %%) or "
            "a CSV/JSONL file; default: the classifier's own task. Causal LMs (such as smollm2): next-token, "
            "one window of --window tokens per held-out text of both; next-token-probes, prompts of about "
            "--window tokens whose answer depends on one earlier token (a word to copy, a factual subject; "
            "those the model answers are kept, and the table adds how often each map ranks that token "
            "first). The target is the model's top-1 next token, deletion removes context tokens"
        ),
    )
    parser.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        help=f"--task next-token(-probes): context tokens per window (default {DEFAULT_WINDOW}: enough that "
        f"random rankings fall well below the best ones; up to {EXACT_LIMIT} the NAOPC bounds of --bounds are exact)",
    )
    parser.add_argument("--text-column", default="text", help="text column of a task file (default: text)")
    parser.add_argument(
        "--label-column",
        default="label",
        help="label column of a task file: the model's class names or indices (default: label)",
    )
    parser.add_argument(
        "--methods",
        default="default",
        help="comma-separated method names; default: the candidates of explain's --method auto for this model "
        "(the one-pass target methods; for causal LMs those the measured table keeps), rollout and random "
        "(leave_one_out is explained as the agreement reference; name it for its own row); all: every method "
        "the model supports",
    )
    parser.add_argument(
        "--samples", type=int, help="held-out examples to evaluate (default 500, or all of a smaller set)"
    )


def _add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """The sanity check, the NAOPC bounds, how tokens are removed, and the seed."""
    parser.add_argument(
        "--sanity-samples",
        type=int,
        default=8,
        help="examples re-explained at each randomisation stage (default 8; 0 skips the sanity check)",
    )
    parser.add_argument(
        "--sanity-layers",
        type=int,
        default=2,
        help="layer stages of the sanity check re-explained, evenly spaced, the last (every layer random) "
        "always (default 2; 0: all of them; every layer is randomised either way)",
    )
    parser.add_argument(
        "--sanity-all-methods",
        action="store_true",
        help="the sanity check re-explains the expensive methods too (leave_one_out, shap, integrated_gradients, "
        "value_zeroing, flow); by default they are left out of it: re-explaining them at every stage costs most "
        "of a run",
    )
    parser.add_argument(
        "--bounds",
        choices=BOUND_SEARCHES,
        default="none",
        help="the NAOPC columns: the lowest and highest AOPC any ranking of each input reaches. none (default: "
        f"no NAOPC); exact (every deletion order of inputs up to {EXACT_LIMIT} content tokens, none beyond); "
        f"or exact up to {EXACT_LIMIT} and beyond: singles (each token's own drop, ~m passes per input: cheap, "
        "loose, leave-one-out meets its upper bound by construction), levels (a bin at a time: ~10 m passes, "
        "tighter), beam (--beam-width orders: ~m^2 passes, tightest). All are inner bounds beyond the exact "
        "limit. The plan printed at the start prices each",
    )
    parser.add_argument(
        "--beam-width",
        type=int,
        default=BEAM_WIDTH,
        help=f"--bounds beam: orders the beam search keeps (default {BEAM_WIDTH}; its cost grows with the width "
        "and the tokens squared)",
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
    """The output folder, the run engine's options (resume, engines), the device and the progress bar."""
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    add_run_arguments(parser)
    add_loading_arguments(parser, devices=None, device_help="cpu, cuda, mps or auto (default)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from attnflow.evaluate.api import check_task_name, evaluate, resolve_methods
    from attnflow.evaluate.benchmark import BenchmarkOptions

    resolve_methods(args.methods)  # unknown names fail before the model loads
    check_task_name(args.task)
    if args.sanity_samples < 0:
        raise ValueError("--sanity-samples must be 0 or more")
    options = BenchmarkOptions(
        replace=args.replace,
        sanity_samples=args.sanity_samples,
        seed=args.seed,
        bounds=args.bounds,
        beam_width=args.beam_width,
        sanity_layers=args.sanity_layers or None,
        sanity_all=args.sanity_all_methods,
    )
    results = evaluate(
        args.model,
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
        engine=engine_options(args),
        dtype=args.dtype,
    )
    print(
        f"{len(results['methods'])} methods on {results['run']['samples']} samples: {args.out / 'results.md'}, "
        f"{args.out / 'results.html'}"
    )
    return 0
