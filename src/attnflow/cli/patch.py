"""`attnflow patch`: which layers, positions and heads carry a prediction, by activation patching."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnflow.cli.common import load_model, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "patch",
        help="activation patching: which sites carry a prediction (exact, AtP, AtP*, RelP)",
        description=(
            "Run a corrupted input with one site at a time restored to its value on the clean input "
            "(denoising; --direction noising does the reverse) and report the normalised effect "
            "(m_patched - m_corrupted) / (m_clean - m_corrupted) of every site: the residual stream, "
            "attention and MLP outputs per (layer, position), and each head's output per layer. The "
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
            "  attnflow patch --file pairs.jsonl --model smollm2 --sites heads --method exact,atp,relp "
            "--out out/pairs --resume\n"
            'pairs.jsonl: one {"clean": ..., "corrupt": ... | "noise": ..., "target": ..., "contrast": ...} a line'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("text", nargs="?", help="the clean text (omit with --file)")
    corruption = parser.add_mutually_exclusive_group()
    corruption.add_argument("--corrupt", metavar="TEXT", help="a counterfactual text of the same token length")
    corruption.add_argument("--noise", metavar="WORDS", help="comma-separated words of the text to add noise to")
    parser.add_argument("--model", default="smollm2", help="a causal LM or a classifier (default: smollm2)")
    parser.add_argument(
        "--target", metavar="CLASS|TOKEN", help="the class or next token the metric reads (default: the prediction)"
    )
    parser.add_argument("--contrast", metavar="CLASS|TOKEN", help="measure the logit difference target - contrast")
    parser.add_argument(
        "--sites", default="residual,attn,mlp,heads", help="site kinds (default: residual,attn,mlp,heads)"
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
    parser.add_argument("--file", type=Path, metavar="PAIRS.jsonl", help="patch every prompt pair of a file")
    parser.add_argument("--resume", action="store_true", help="with --file: continue the run checkpointed in --out")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="output folder")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: a GPU when present (default: auto)"
    )
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar or summary")
    parser.set_defaults(handler=run)


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
        "progress": not args.quiet,
    }
    if args.file is not None:
        if args.text or args.corrupt or args.noise or args.target or args.contrast:
            raise ValueError("--file holds the texts, targets and contrasts: give no TEXT, --corrupt, --noise, ...")
        from attnflow.causal.dataset import patch_file, read_pairs

        read_pairs(args.file)  # a bad file fails before the model loads
        model = load_model(args.model, args.device, args.quiet)
        say = None if args.quiet else (lambda line: print(f"attnflow: {line}", flush=True))
        summary = patch_file(model, args.file, args.out, resume=args.resume, on_pair=say, **options)
        for method, kinds in summary["correlations"].items():
            agreement = ", ".join(f"{kind} r={values['pooled_pearson']:.2f}" for kind, values in kinds.items())
            print(f"{method} vs exact (pooled): {agreement}")
        print(f"{summary['pairs']} pairs ({len(summary['failed'])} left out): {args.out / 'summary.html'}")
        return 0
    if not args.text:
        raise ValueError("give the clean TEXT (or --file PAIRS.jsonl)")
    if args.corrupt is None and args.noise is None:
        raise ValueError("give --corrupt TEXT (same token length) or --noise WORDS")
    if args.resume:
        raise ValueError("--resume continues a --file run")
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
