"""`attnflow compare`: one text, one method, two models with the same tokenizer.

Prints Spearman's rank correlation and the top-k overlap of the two saliency vectors (content
tokens), both summaries and the largest changes, and writes DIR/model_comparison.json and
DIR/model_comparison.html. Models whose tokenizers split the text differently are refused in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from attnflow.capture.texts import check_row_fits
from attnflow.cli.common import Progress, add_text_options, load_model, positive_int, target_of
from attnflow.errors import InputError
from attnflow.methods.registry import available_methods
from attnflow.staging import check_output

EPILOG = """\
examples:
  attnflow compare "The movie was terrible, but the acting was great." --model minilm-sentiment \
      --model minilm-topics --method attnlrp
  attnflow compare "A cat sat on the mat." --model minilm-sentiment --model minilm-topics --method raw --top-k 3 --json
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="compare one method's saliency for a text under two models (same tokenizer)",
        description="Side-by-side saliency of two models for one text: difference, Spearman rho, top-k overlap.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("text", metavar="TEXT", help="the text to compare on")
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="NAME",
        help="give it twice: model A, then model B (alias, folder or hub id)",
    )
    parser.add_argument("--method", default="rollout", choices=available_methods(), help="default: rollout")
    parser.add_argument(
        "--top-k", type=positive_int, default=5, metavar="K", help="size of the top-k overlap (default: 5)"
    )
    add_text_options(parser, row_help="saliency row (default: model A's)", out="out/compare-models")
    parser.add_argument("--json", action="store_true", help="print model_comparison.json to stdout")
    parser.add_argument("--overwrite", action="store_true", help="replace a comparison already in DIR")
    parser.set_defaults(handler=run, output_folder=lambda args: Path(args.out))


def run(args: argparse.Namespace) -> int:
    from attnflow.capture.loading import load_tokenizer
    from attnflow.comparison import check_same_tokens, compare, is_comparison_file

    if len(args.model) != 2:
        raise InputError(f"give --model exactly twice (model A and model B), got {len(args.model)}")
    if not args.text.strip():
        raise InputError("the text to compare is empty")
    check_row_fits(args.row, [args.text], args.max_length)
    out = Path(args.out)
    check_output(out, is_comparison_file, args.overwrite)
    say = Progress(args.quiet)
    say("checking the tokenizers …")  # from their files: a mismatch fails before any weights load
    check_same_tokens(tuple(args.model), tuple(load_tokenizer(name) for name in args.model), args.text, args.max_length)
    models = []
    for name in args.model:
        say(f"loading {name} …")
        models.append(load_model(name, args.device, args.quiet, args.dtype))
    comparison = compare(
        models[0],
        models[1],
        args.text,
        method=args.method,
        row=args.row,
        k=args.top_k,
        max_length=args.max_length,
        target=target_of(args),
    )
    paths = comparison.save(out, overwrite=args.overwrite)
    if args.json:
        json.dump(comparison.to_dict(), sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    elif not args.quiet:
        for line in comparison.describe():
            print(line)
        for path in paths.values():
            print(f"wrote {path}")
    return 0
