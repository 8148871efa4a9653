"""`attnflow routes`: the information flow routes of one prediction (Ferrando & Voita 2024)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnflow.cli.common import Progress, load_model, target_of
from attnflow.errors import InputError

EPILOG = """\
examples:
  attnflow routes "The capital of France is" --model smollm2 --out out/routes
  attnflow routes "The capital of France is" --model smollm2 --target " Paris" --contrast " Rome" \\
      --out out/routes-contrast
  attnflow routes "The capital of France is" --model smollm2 --threshold 0.02 --out out/routes --overwrite
  attnflow routes "The movie was terrible." --model minilm --position 0 --json --quiet > routes.json

Every residual update splits into parts: the stream before the block, each (head, source token)
term A_h[i, j] v_h(j) W_O^h of an attention block, a feed-forward block's output, and the biases.
A part's contribution is its proximity to the whole, max(|whole|_1 - |whole - part|_1, 0),
normalised over the parts of that whole. From the top node (the stream leaving the last layer at
--position) the route keeps every edge above --threshold, going down; each node's importance is
the product of the weights along its paths to the top, summed. Language models also get the logit
lens at the route's nodes and each head's and feed-forward block's direct effect on the target's
logit (what it promotes and suppresses). With --contrast the edges into the predicting position's
stream are chosen by their direct effect on logit(target) - logit(contrast).
Writes DIR/routes.json (the whole graph before the threshold, the route, the lens), routes.html (the
route through positions and layers, a threshold slider, each node's lens and each edge's heads, offline)
and routes.png; definitions in docs/routes.md.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    from attnflow.flow_routes.graph import DEFAULT_THRESHOLD
    from attnflow.flow_routes.result import LENS_MODES

    parser = subparsers.add_parser(
        "routes",
        help="information flow routes: which tokens, heads and FFNs a prediction goes through",
        description="The information flow routes of one prediction, from one forward pass (Ferrando & Voita 2024).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("text", metavar="TEXT", help="the text (a causal LM explains its next token)")
    parser.add_argument("--model", default="smollm2", help="alias, folder or hub id (default: smollm2)")
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write DIR/routes.json, routes.html and routes.png (required without --json)",
    )
    parser.add_argument(
        "--position", type=int, metavar="N", help="the top node's token (default: the last; -1 counts from the end)"
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        metavar="TAU",
        help=f"keep the edges with weight > TAU, in [0, 1) (default: {DEFAULT_THRESHOLD})",
    )
    parser.add_argument("--target", metavar="TOKEN", help="the token the lens reads (default: the prediction)")
    parser.add_argument("--contrast", metavar="TOKEN", help="contrastive route: logit(target) - logit(contrast)")
    parser.add_argument("--norm", type=int, choices=(1, 2), default=1, help="p of the proximity's norm (default: 1)")
    parser.add_argument(
        "--lens", choices=LENS_MODES, default="route", help="nodes the logit lens reads (default: route)"
    )
    parser.add_argument("--json", action="store_true", help="print routes.json on stdout (the summary on stderr)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress or summary lines")
    parser.add_argument("--overwrite", action="store_true", help="replace a routes.json already in DIR")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: a GPU when present (default: auto)"
    )
    parser.set_defaults(handler=run, output_folder=lambda args: args.out)


def run(args: argparse.Namespace) -> int:
    from attnflow.flow_routes.graph import check_threshold
    from attnflow.flow_routes.result import is_routes_file
    from attnflow.staging import check_output

    if not args.text.strip():
        raise InputError("the text is empty")
    if args.out is None and not args.json:
        raise InputError("give --out DIR (routes.json is written there) or --json (printed on stdout)")
    check_threshold(args.threshold)
    if args.out is not None:
        check_output(args.out, is_routes_file, args.overwrite)
    say = Progress(args.quiet)
    say(f"loading {args.model} …")
    model = load_model(args.model, args.device, args.quiet)
    say("building the routes …")
    from attnflow.flow_routes.api import routes  # torch: after the checks

    options = {name: getattr(args, name) for name in ("position", "threshold", "norm", "lens")}
    result = routes(model, args.text, target=target_of(args), **options)  # errors name their flags (cli.main)
    path = result.save(args.out, overwrite=args.overwrite) if args.out is not None else None
    if args.json:
        result.write_json(sys.stdout)
        print()
    if not args.quiet:
        report = sys.stderr if args.json else sys.stdout
        print(result.summary(), file=report)
        seconds = ", ".join(f"{name} {value:.2f}" for name, value in result.seconds.items())
        print(f"seconds: {seconds}" + (f"\n{path}" if path is not None else ""), file=report)
    return 0
