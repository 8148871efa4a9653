"""`attnflow why`: why did the model give this answer? Every kind of evidence attnflow has that fits
the model and the question, within a budget, cross-checked, read out in plain language
(`attnflow.why`; docs/why.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnflow.cli.common import Progress, add_loading_arguments, load_model, positive_int, target_of
from attnflow.errors import InputError

EPILOG = """\
examples:
  attnflow why "The capital of France is" --model smollm2 --contrast " Rome" --out out/why
  attnflow why "The capital of France is" --model smollm2 --corrupt "The capital of Italy is" --out out/why-italy
  attnflow why "The capital of France is" --model smollm2 --budget 10 --out out/why-quick
  attnflow why "The movie was terrible, but the acting was great." --model minilm-sentiment --out out/why-demo
  attnflow why "The Eiffel Tower is in" --model smollm2 --json --quiet > why.json

What runs (the plan is printed first, with each piece's estimated seconds):
  attribution   auto's method (the most comprehensive one-pass target method on this input) and
                leave-one-out, each with its faithfulness on this input against random rankings
  routes        causal LMs: the information flow route, with the logit lens down the predicting position
  patching      exact residual patching against a counterfactual: --corrupt TEXT (same token length),
                else (causal LMs) noise on the most attributed word before the predicting position
                (--samples draws); a classifier is patched only with --corrupt or --contrast.
                Over the budget it is replaced by AtP's estimate (one backward pass), said to be one
  knockout      causal LMs: blocking the route's strongest attention edge into the predicting position
  value-aware rollout  classifiers: norm_rollout
--budget SECONDS drops the most expensive evidence first (by the plan's estimates), each drop named.
The agreement between the kinds of evidence (which tokens: Spearman and top-3 overlap; which layer:
the lens, patching's handover, the route's strongest move) is measured and shown, disagreement as
such. The reading is filled in from the numbers; every number it states is in why.json ("shown").
Writes DIR/why.json, DIR/why.html (offline; click a token for its evidence) and DIR/why.png.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "why",
        help="why did the model say this? attribution, routes and patching, cross-checked, in plain language",
        description="Why a causal LM gives its next token, or a classifier its class: every kind of evidence "
        "attnflow has, within a budget, their agreement measured, and a reading in plain language.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("text", metavar="TEXT", help="the text (a causal LM explains its next token)")
    parser.add_argument("--model", default="smollm2", help="a causal LM or a classifier (default: smollm2)")
    parser.add_argument(
        "--target", metavar="CLASS|TOKEN", help="the class or next token explained (default: the prediction)"
    )
    parser.add_argument("--contrast", metavar="CLASS|TOKEN", help="why the target rather than this class or token")
    parser.add_argument("--corrupt", metavar="TEXT", help="the counterfactual of patching (same token length)")
    parser.add_argument("--budget", type=float, metavar="SECONDS", help="drop the most expensive evidence over it")
    parser.add_argument("--samples", type=positive_int, help="noise draws of a built counterfactual (default: 3)")
    parser.add_argument("--out", type=Path, metavar="DIR", help="output folder (default: out/why; none with --json)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier why.json and why.html in DIR")
    parser.add_argument("--json", action="store_true", help="print why.json on stdout (the reading on stderr)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no plan, progress or reading")
    add_loading_arguments(parser)
    parser.set_defaults(handler=run, output_folder=_out)


def _out(args: argparse.Namespace) -> Path | None:
    """The folder written: --out, or out/why without --json."""
    return args.out if args.out is not None or args.json else Path("out/why")


def run(args: argparse.Namespace) -> int:
    """Check what needs no model, load it, run `attnflow.why`, write or print why.json."""
    from attnflow.capture.texts import check_texts
    from attnflow.question.plan import check_budget
    from attnflow.question.result import is_why_file
    from attnflow.staging import check_output

    check_texts(args.text)
    if args.corrupt is not None:
        check_texts(args.corrupt)
    budget = check_budget(args.budget)
    if args.samples is not None and args.corrupt is not None:
        raise InputError("--samples would be ignored with --corrupt (it draws the noise of a built counterfactual)")
    out = _out(args)
    if out is not None:
        check_output(out, is_why_file, args.overwrite)
    say = Progress(args.quiet)
    say(f"loading {args.model} …")
    model = load_model(args.model, args.device, args.quiet, args.dtype)
    from attnflow.question.run import SAMPLES, why

    found = why(
        model, args.text, target_of(args), corrupt=args.corrupt, budget=budget, samples=args.samples or SAMPLES,
        progress=None if args.quiet else lambda line: print(f"attnflow: {line}", file=sys.stderr, flush=True),
    )  # fmt: skip
    path = found.save(out, overwrite=args.overwrite) if out is not None else None
    if args.json:
        print(found.to_json())
    if not args.quiet:
        report = sys.stderr if args.json else sys.stdout
        print(found.summary(), file=report)
        if found.plan.dropped:
            print("dropped for the budget: " + ", ".join(found.plan.dropped), file=report)
        print("seconds: " + ", ".join(f"{name} {value:.1f}" for name, value in found.seconds.items()), file=report)
        if path is not None:
            print(f"{path} {path.with_name('why.json')}", file=report)
    return 0
