"""`attnflow explore`: one interactive, self-contained HTML page for one text.

Writes DIR/explorer.html: every registered method (or --methods), per layer and per head where
the method has them, the relevance matrix, per-layer diagnostics, the heads' context similarity
and a one-line summary. With --generate N / --continuation TEXT (causal LMs) the page is the
generation view instead: every generated token and its sources, per method
(`attnflow.generation_exploration`). The page works offline (no network, no CDN).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from attnflow.capture.texts import check_row_fits
from attnflow.cli import explain_generation
from attnflow.cli.common import (
    DEFAULT_MODEL,
    Progress,
    add_text_options,
    load_model,
    method_table,
    parse_methods,
    target_of,
)
from attnflow.errors import InputError
from attnflow.methods.registry import available_methods, get_method
from attnflow.staging import check_output

EPILOG = """\
examples:
  attnflow explore "The movie was terrible, but the acting was great." --out out/explore
  attnflow explore "Paris is the capital of" --model smollm2 --methods raw,rollout
  attnflow explore "$(cat review.txt)" --model mpnet --max-tokens 512 --methods raw,rollout
  attnflow explore "The capital of France is" --model smollm2 --generate 8 --out out/genview
  attnflow explore "The capital of France is" --model smollm2 --continuation " Paris." --faithfulness

Open DIR/explorer.html in a browser: pick a method, a layer and a head (or fused heads); hover a
token to see its row of the matrix, click it to keep that row. Methods that are slow on long texts
({expensive} above {limit} tokens) are left out unless --methods names them;
target-dependent methods explain --target (classifiers, causal LMs) or --target-text (sentence
encoders), and are left out, with the reason, when there is no target. The page grows with the
square of the token count (mpnet, 512 tokens, raw and rollout: 45 MB); above 50 MB a warning
suggests --max-tokens or fewer --methods.

With --generate N (greedy) or --continuation TEXT (teacher-forced) on a causal LM, the page
shows the prompt and the continuation: hover or click a generated token to colour its sources by
the chosen method (per layer for rollout, raw, norm and norm_rollout), with its p(t_k), top
sources and, with --faithfulness, its per-step faithfulness; below, the step-by-source table.
Default methods there: every method that explains generations on the model, except the slow ones
({expensive_generating}), which --methods can name.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    from attnflow.exploration import EXPENSIVE_ABOVE
    from attnflow.generation import generation_methods

    expensive = [name for name in available_methods() if get_method(name).cost == "expensive"]
    parser = subparsers.add_parser(
        "explore",
        help="an interactive page: every method, layer and head for one text",
        description=(
            "Write one self-contained HTML explorer for a text: methods, layers, heads, the\n"
            f"relevance matrix, rollout diagnostics and context similarity.\n\nmethods (--methods):\n{method_table()}"
        ),
        epilog=EPILOG.format(
            expensive=", ".join(expensive),
            limit=EXPENSIVE_ABOVE,
            expensive_generating=", ".join(name for name in expensive if name in generation_methods()),
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("text", metavar="TEXT", help="the text to explore")
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"alias (minilm-sentiment, minilm, mpnet, smollm2, ...), local path or hub id (default: {DEFAULT_MODEL}, "
        "a classifier, so the target-dependent methods explain its prediction)",
    )
    parser.add_argument(
        "--methods",
        type=parse_methods,
        metavar="M1,M2,..",
        help="methods to show (default: all registered; with --generate / --continuation: those that explain "
        "generations, except the slow ones)",
    )
    add_text_options(parser, row_help="default saliency row (default: the model's)", out="out/explore")
    parser.add_argument("--overwrite", action="store_true", help="replace an explorer.html already in DIR")
    explain_generation.add_arguments(parser)
    parser.set_defaults(handler=run, output_folder=lambda args: Path(args.out))


def run(args: argparse.Namespace) -> int:
    from attnflow.exploration import explore

    if explain_generation.wants_generation(args):
        return _run_generation(args)
    if args.faithfulness or args.steps_per_pass is not None:
        raise InputError("--faithfulness and --steps-per-pass go with --generate N or --continuation TEXT")
    if not args.text.strip():
        raise InputError("the text to explore is empty")
    check_row_fits(args.row, [args.text], args.max_length)
    out, model, _ = _checked_output_and_model(args)
    exploration = explore(
        model,
        args.text,
        methods=args.methods,
        row=args.row,
        max_length=args.max_length,
        target=target_of(args),
        progress=not args.quiet,
    )
    path = exploration.save(out, overwrite=args.overwrite)
    if not args.quiet:
        for view in exploration.methods:
            print(f"{view.name}: {view.summaries['fused'][-1]}")
        for name, why in exploration.skipped.items():
            print(f"{name}: not shown ({why})")
        if exploration.opened_why:
            print(f"the page {exploration.opened_why}")
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


def _run_generation(args: argparse.Namespace) -> int:
    """The generation view: DIR/explorer.html over the prompt and its continuation."""
    from attnflow.generation import DEFAULT_STEPS_PER_PASS
    from attnflow.generation_exploration import explore_generation

    explain_generation.check_arguments(args)
    out, model, say = _checked_output_and_model(args)
    say("generating and explaining …" if args.generate is not None else "explaining the continuation …")
    exploration = explore_generation(
        model,
        args.text,
        max_new_tokens=args.generate,
        continuation=args.continuation,
        methods=args.methods,
        faithfulness=args.faithfulness,
        steps_per_pass=args.steps_per_pass or DEFAULT_STEPS_PER_PASS,
    )
    path = exploration.save(out, overwrite=args.overwrite)
    if not args.quiet:
        first = exploration.first
        print(f"{first.mode} continuation: {first.continuation!r}")
        print(f"methods: {', '.join(view.name for view in exploration.views)}")
        for name, why in exploration.skipped.items():
            print(f"{name}: not shown ({why})")
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0


def _checked_output_and_model(args: argparse.Namespace) -> tuple[Path, Any, Progress]:
    """``--out`` checked (an earlier page is replaced only with --overwrite), then the model loaded."""
    from attnflow.exploration import is_explorer_file

    out = Path(args.out)
    check_output(out, is_explorer_file, args.overwrite)
    say = Progress(args.quiet)
    say(f"loading {args.model} …")
    return out, load_model(args.model, args.device, args.quiet, args.dtype), say
