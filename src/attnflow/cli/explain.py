"""`attnflow explain`: explain one text (or one image) with a registered attention method.

Writes DIR/explanation.json, DIR/explanation.html and DIR/explanation.png (and, for an image,
DIR/explanation_overlay.png; with --save-trace, DIR/trace.npz); with --json and no --out it
only prints the JSON. The folder rules (other files kept, --overwrite, safe writes) are in
`attnflow.cli.outputs`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from attnflow.capture.texts import check_row_fits, check_texts
from attnflow.cli import explain_generation
from attnflow.cli.common import (
    DEFAULT_MODEL,
    RUNS_NOTE,
    Progress,
    add_loading_arguments,
    add_method_options,
    add_run_arguments,
    given_method_options,
    load_model,
    method_table,
    options_per_method,
    parse_methods,
    parse_row,
    positive_int,
    target_of,
)
from attnflow.cli.outputs import TRACE_FILE, output_folder, prepare_output, write_explanations
from attnflow.errors import InputError
from attnflow.methods.registry import AUTO
from attnflow.model_like import ModelLike
from attnflow.tokens import display_token
from attnflow.trace import Trace

if TYPE_CHECKING:
    from attnflow.explanation import Explanation

EPILOG = (
    """\
examples:
  attnflow explain "The movie was terrible, but the acting was great." --out out/movie
  attnflow explain "The movie was terrible, but the acting was great." --method rollout,alti --out out/both
  attnflow explain "The movie was terrible, but the acting was great." --method auto,rollout,leave_one_out
  attnflow explain "The movie was terrible, but the acting was great." --method shap --max-evals 256
  attnflow explain "The movie was terrible, but the acting was great." --method grad_x_input --signed
  attnflow explain "The movie was terrible, but the acting was great." --method grad_rollout --target positive
  attnflow explain "Paris is the capital of" --model smollm2 --method norm_rollout --row last
  attnflow explain "Paris is the capital of" --model smollm2 --method gradient --target-token " France"
  attnflow explain "The capital of France is" --model smollm2 --method grad_x_input --target " Paris" --contrast " Rome"
  attnflow explain "A cat sat on the mat." --model minilm --method leave_one_out --target-text "a dog"
  attnflow explain "A cat sat on the mat." --method raw --layer 0 --json --quiet > raw.json
  attnflow explain --image photo.jpg --model dinov2-s --out out/photo
  attnflow explain --image photo.jpg --model dinov2-s --method flow --save-trace
  attnflow explain --file reviews.jsonl --text-field review --out out/reviews   # one folder per text + index.html
  attnflow explain --file reviews.jsonl --text-field review --out out/reviews --resume   # after Ctrl-C or a crash
  cat sentences.txt | attnflow explain --file - --json --quiet > explanations.jsonl

Images (--image): any file Pillow reads; grayscale, RGBA and palette images are converted to
RGB with a note. dinov2-s (DINOv2 ViT-S/14) uses the standard DINOv2 preprocessing: the shorter
side is resized to 256 px (bicubic), the centre 224x224 is cropped and the pixels are scaled to
[0, 1] and normalised with the ImageNet mean (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.225)
- the input the ONNX graph it is converted from expects. That gives CLS + a 16x16 grid of 14-px
patches; the overlay covers the cropped square. Other vision models follow their folder's
preprocessor_config.json. On an image, flow computes only the saliency row (CLS by default);
rollout, raw, flow, norm and norm_rollout apply (gradient and target methods do not).

The default model, minilm-sentiment, is a real classifier (all-MiniLM-L6-v2, mean pooling and a
logistic-regression head trained on Rotten Tomatoes snippets; `attnflow models list` shows its
held-out accuracy): target-dependent methods explain its predicted class unless --target names one.
With a class or next-token target every map gets its faithfulness on this input (comprehensiveness
and sufficiency at 10/20/50 % of the tokens, next to random rankings', docs/methods.md), and the
default method is auto: the one-pass target methods, the most comprehensive one shown.

The output folder receives explanation.json (model, method, options, target, tokens, row, scores,
matrix), explanation.html (open it in any browser, works offline), explanation.png and, for an
image, explanation_overlay.png (the saliency over the image). With several methods (--method a,b)
each goes to DIR/METHOD/ and DIR/comparison.html shows them side by side.
A folder that already holds an explanation is only replaced with --overwrite.

With --file, """
    + RUNS_NOTE
)


def register(subparsers: argparse._SubParsersAction) -> None:
    methods = method_table()
    parser = subparsers.add_parser(
        "explain",
        help="explain one text or image (auto: the most faithful one-pass target method; rollout; ...)",
        description=(
            "Show which input tokens an output position draws on, through the model's attention.\n\n"
            f"methods (--method):\n{methods}"
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("text", nargs="?", metavar="TEXT", help="the text to explain (omit with --image)")
    _add_source_arguments(parser.add_argument_group("input and model"))
    method = parser.add_argument_group("method and options (definitions: docs/methods.md)")
    target = parser.add_argument_group(
        "target (methods that explain one output: grad_rollout, gradients, leave_one_out, ...)"
    )
    _add_method_arguments(method)
    _add_target_arguments(target)
    explain_generation.add_arguments(parser)
    _add_output_arguments(parser.add_argument_group("output"))
    # a target: --target for classifiers, --target-token for causal LMs
    parser.set_defaults(handler=run, output_folder=output_folder, parameter_flags={"target": "--target/--target-token"})


def _add_source_arguments(source: argparse._ArgumentGroup) -> None:
    """The model and what it reads: a text, an image or a file of texts; batches, length, device."""
    source.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"alias (minilm-sentiment, minilm, mpnet, smollm2, dinov2-s, ...), local path or hub id "
        f"(default: {DEFAULT_MODEL})",
    )
    source.add_argument(
        "--image",
        metavar="PATH",
        help="explain an image instead of a text (needs a vision model, e.g. dinov2-s; preprocessing below)",
    )
    source.add_argument(
        "--file",
        metavar="PATH",
        help=(
            "explain every text of a .txt (one per line), .jsonl or .csv "
            "file, or of stdin (-): DIR/001/, DIR/002/, ... and DIR/index.html"
        ),
    )
    source.add_argument(
        "--text-field",
        metavar="NAME",
        help="--file: the JSON field that holds the text (default: text; with -: read JSON lines)",
    )
    source.add_argument(
        "--text-column",
        metavar="NAME",
        help="--file: the CSV column that holds the text (default: text; with -: read CSV)",
    )
    source.add_argument(
        "--skip-bad",
        action="store_true",
        help="--file: count and skip malformed JSON lines instead of stopping at the first one",
    )
    source.add_argument(
        "--batch-size", type=positive_int, default=16, metavar="N", help="--file: texts per forward pass (default: 16)"
    )
    source.add_argument(
        "--max-length",
        type=positive_int,
        metavar="N",
        help="truncate the text to N tokens (default: the model's maximum)",
    )
    add_loading_arguments(source)


def _add_method_arguments(method: argparse._ArgumentGroup) -> None:
    """--method, every registered method's options (from the registry), and the saliency row."""
    method.add_argument(
        "--method",
        type=_methods,
        metavar="NAME[,NAME..]",
        help="one or more methods listed above, or auto: the one-pass target methods, the one with the highest "
        "comprehensiveness on this input shown (default: auto when the model has a target: classifiers, causal "
        "LMs, sentence encoders with --target-text; rollout otherwise)",
    )
    add_method_options(method)
    method.add_argument(
        "--row",
        type=parse_row,
        metavar="cls|mean|last|N",
        help="saliency row (default: the model's: mean for sentence encoders, last for decoders, cls otherwise)",
    )


def _add_target_arguments(target: argparse._ArgumentGroup) -> None:
    """What a target-dependent method explains: a class, a next token, a similarity, a contrast."""
    target.add_argument(
        "--target", metavar="CLASS", help="classifiers: class index or label name (default: the predicted class)"
    )
    target.add_argument(
        "--target-token", metavar="TOKEN", help="causal LMs: the next token explained (default: the most likely one)"
    )
    target.add_argument(
        "--target-text", metavar="TEXT", help="sentence encoders without a head: explain the similarity to this text"
    )
    target.add_argument(
        "--contrast",
        metavar="CLASS|TOKEN",
        help="explain the target rather than this class or single token: logit(target) − logit(contrast), "
        "e.g. --target ' Paris' --contrast ' Rome' (classifiers, causal LMs; with --generate every step)",
    )


def _add_output_arguments(output: argparse._ArgumentGroup) -> None:
    """The output folder, replacing it, the saved trace, JSON on stdout, quiet."""
    output.add_argument(
        "--out", metavar="DIR", help="output folder (default: out/explain; with --json: none, only stdout)"
    )
    output.add_argument("--overwrite", action="store_true", help="replace an explanation already in DIR")
    output.add_argument(
        "--save-trace", action="store_true", help=f"also write DIR/{TRACE_FILE} (attentions [L,H,n,n] float32, tokens)"
    )
    output.add_argument(
        "--json", action="store_true", help="print explanation.json to stdout (writes no folder unless --out is given)"
    )
    output.add_argument(
        "--quiet", "-q", action="store_true", help="no progress or summary (warnings and errors still show)"
    )
    output.add_argument(
        "--no-faithfulness",
        dest="faithfulness",
        action="store_const",
        const=False,
        help="skip each map's faithfulness on this input (its badge; auto then shows its first candidate). "
        "Its cost is bounded anyway: NAOPC bounds from the tightest search that fits a budget (none beyond 93 "
        "content tokens), no faithfulness over 256 content tokens",
    )
    add_run_arguments(output, overwrite=False, scope="--file: ")


def run(args: argparse.Namespace) -> int:
    from attnflow.evaluate.per_input import explain_planned, plan_methods, with_candidates

    if args.file is not None or explain_generation.wants_generation(args):
        # bad options fail before the model loads (checked against auto's candidates for any family)
        options_per_method(with_candidates(args.method or [AUTO], None), given_method_options(args))
    if args.file is not None:
        from attnflow.cli.explain_file import run_file

        return run_file(args, load_model, Progress(args.quiet))
    if args.resume or args.engine != "local" or args.checkpoint_every is not None:
        raise InputError("--resume, --engine and --checkpoint-every are for a --file run of many texts")
    if explain_generation.wants_generation(args):
        return explain_generation.run_generation(args, load_model, Progress(args.quiet))
    _check_input(args)
    out = prepare_output(args)

    say = Progress(args.quiet)
    say(f"loading {args.model} …")
    model = load_model(args.model, args.device, args.quiet, args.dtype)
    plan = plan_methods(model, args.method, given_method_options(args), target_of(args), args.image is not None)
    trace = _trace(model, plan.per_method, args, say)
    faithfulness = args.faithfulness is not False
    explanations = explain_planned(model, trace, plan, args.row, lambda step: say(f"{step} …"), faithfulness)

    paths = (
        write_explanations(out, explanations, trace if args.save_trace else None, args.overwrite)
        if out is not None
        else {}
    )

    if args.json:
        data = [explanation.to_dict() for explanation in explanations]
        json.dump(data[0] if len(data) == 1 else data, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    elif not args.quiet:
        _print_summary(trace, explanations)
        for path in paths.values():
            print(f"wrote {path}")
    return 0


def _check_input(args: argparse.Namespace) -> None:
    """Everything that needs no model, checked first, so mistakes fail in milliseconds."""
    from attnflow.capture.images import read_image
    from attnflow.evaluate.per_input import with_candidates

    if args.image is not None:
        if args.text is not None:
            raise InputError("give either TEXT or --image, not both")
        if any(x is not None for x in (args.target, args.target_token, args.target_text, args.contrast)):
            raise InputError("targets (--target, --target-token, --target-text, --contrast) are not defined for images")
        read_image(args.image)  # a missing or unreadable file fails before the model loads
    elif args.text is None:
        raise InputError("nothing to explain: give a TEXT (or --image PATH, or --file PATH)")
    else:
        check_texts(args.text)  # empty, or bytes that are not UTF-8 (argv is surrogateescape'd)
        check_row_fits(args.row, [args.text], args.max_length)
    if args.target is not None and args.target_token is not None:
        raise InputError("give either --target (a class) or --target-token (a next token), not both")
    if args.method is not None:  # bad options fail before the model loads
        options_per_method(with_candidates(args.method, None), given_method_options(args))


def _trace(model: ModelLike, per_method: dict[str, dict[str, Any]], args: argparse.Namespace, say: Progress) -> Trace:
    """The trace of the image or the text, holding what the methods need (with the target the options
    name); only each layer's head mean when every method reads nothing else and no --save-trace keeps
    the trace (the memory-lean capture: `attnflow.model.reads_head_mean`)."""
    from attnflow.methods.registry import get_method
    from attnflow.model import reads_head_mean

    methods = list(per_method)
    if args.image is not None:
        say(f"tracing {args.image} …")
        return model.trace_image_for(methods, args.image)
    say("tracing …")
    lean = model.fuses_heads and not args.save_trace
    lean = lean and all(reads_head_mean(get_method(name), options) for name, options in per_method.items())
    fuse_heads = "mean" if lean else None
    return model.trace_for(
        methods, [args.text], target=target_of(args), max_length=args.max_length, fuse_heads=fuse_heads
    )[0]


def _print_summary(trace: Trace, explanations: list[Explanation]) -> None:
    """The prediction, then per method its top tokens (evidence and counter-evidence when signed),
    its summary and its faithfulness on this input."""
    from attnflow.viz.page import faithfulness_badge

    if trace.target is not None:
        print(
            f"prediction: {trace.target.describe()}"
            if any(e.target is None for e in explanations)
            else f"explains: {trace.target.describe()}"
        )
    for explanation in explanations:
        if explanation.chosen_by:
            print(explanation.chosen_by)
        if explanation.signed:
            label = _target_label(explanation.target)
            evidence = ", ".join(f"{display_token(t)} {s:+.3g}" for _, t, s in explanation.top(5) if s > 0)
            against = ", ".join(f"{display_token(t)} −{-s:.3g}" for _, t, s in explanation.against(3))
            print(f"{explanation.method} for {label}: {evidence or '-'} … against: {against or '-'}")
        else:
            top = ", ".join(f"{display_token(token)} {score:.3f}" for _, token, score in explanation.top(5))
            where = f"row {explanation.row}" if explanation.row is not None else "scores"
            print(f"{explanation.method} top tokens ({where}): {top}")
        print(f"{explanation.method} summary: {explanation.summary()}")
        if explanation.faithfulness is not None:
            badge = faithfulness_badge(explanation.faithfulness)
            print(f"{explanation.method} faithfulness on this input: {badge}")


def _target_label(target: dict[str, Any] | None) -> str:
    """A class as it is named (negative), a next token as a reader sees it, quoted ('Paris', not
    the label's own leading space)."""
    if target is None:
        return "the target"
    if target["kind"] == "next_token":
        return f"'{display_token(target['label'])}'"
    return str(target["label"])


def _methods(text: str) -> list[str]:
    """`parse_methods`, with ``auto`` allowed among the names (argparse type)."""
    return parse_methods(text, also=(AUTO,))
