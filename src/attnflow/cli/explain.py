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
from typing import Any

from attnflow.capture.texts import check_texts
from attnflow.cli.outputs import TRACE_FILE, prepare_output, write_explanations
from attnflow.errors import InputError
from attnflow.methods.registry import available_methods, get_method
from attnflow.viz.tokens import display_token

DEFAULT_MODEL = "minilm-sentiment"
AUTO = "auto"  # --method auto: the most comprehensive one-pass target method on this input

# How the CLI spells each method option (for help and error messages).
FLAGS = {
    "head_fusion": "--head-fusion",
    "weights": "--head-weights",
    "residual": "--residual",
    "start_layer": "--start-layer",
    "top_k": "--top-k",
    "threshold": "--threshold",
    "discard_ratio": "--discard-ratio",
    "prune_on": "--prune-on",
    "layer": "--layer",
    "seed": "--seed",
    "n_steps": "--steps",
}

EPILOG = """\
examples:
  attnflow explain "The movie was terrible, but the acting was great." --out out/movie
  attnflow explain "The movie was terrible, but the acting was great." --method rollout,alti --out out/both
  attnflow explain "The movie was terrible, but the acting was great." --method grad_rollout --target positive
  attnflow explain "Paris is the capital of" --model smollm2 --method norm_rollout --row last
  attnflow explain "Paris is the capital of" --model smollm2 --method gradient --target-token " France"
  attnflow explain "A cat sat on the mat." --model minilm --method leave_one_out --target-text "a dog"
  attnflow explain "A cat sat on the mat." --method raw --layer 0 --json --quiet > raw.json
  attnflow explain --image photo.jpg --model dinov2-s --out out/photo
  attnflow explain --image photo.jpg --model dinov2-s --method flow --save-trace
  attnflow explain --file reviews.jsonl --text-field review --out out/reviews   # one folder per text + index.html
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

The output folder receives explanation.json (model, method, options, target, tokens, row, scores,
matrix), explanation.html (open it in any browser, works offline), explanation.png and, for an
image, explanation_overlay.png (the saliency over the image). With several methods (--method a,b)
each goes to DIR/METHOD/ and DIR/comparison.html shows them side by side.
A folder that already holds an explanation is only replaced with --overwrite.
"""


def method_table() -> str:
    """One line per registered method: its name and summary (for --help texts)."""
    return "\n".join(f"  {name:<21} {get_method(name).summary}" for name in available_methods())


def register(subparsers: argparse._SubParsersAction) -> None:
    methods = method_table()
    parser = subparsers.add_parser(
        "explain",
        help="explain one text or image with attention rollout (or another method)",
        description=(
            "Show which input tokens an output position draws on, through the model's attention.\n\n"
            f"methods (--method):\n{methods}"
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("text", nargs="?", metavar="TEXT", help="the text to explain (omit with --image)")
    source = parser.add_argument_group("input and model")
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
        "--batch-size", type=_positive_int, default=16, metavar="N", help="--file: texts per forward pass (default: 16)"
    )
    source.add_argument(
        "--max-length",
        type=_positive_int,
        metavar="N",
        help="truncate the text to N tokens (default: the model's maximum)",
    )
    source.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: a GPU when present (default: auto)"
    )

    method = parser.add_argument_group("method and options (definitions: docs/methods.md)")
    method.add_argument(
        "--method",
        type=_methods,
        metavar="NAME[,NAME..]",
        help="one or more methods listed above, or auto: the one-pass target methods, the one with the highest "
        "comprehensiveness on this input shown (default: auto when the model has a target: classifiers, causal "
        "LMs, sentence encoders with --target-text; rollout otherwise)",
    )
    method.add_argument(
        "--head-fusion",
        choices=("mean", "max", "min", "none"),
        help="fuse heads (default: mean; none: one rollout or flow per head, averaged)",
    )
    method.add_argument(
        "--head-weights",
        type=_weights,
        metavar="W1,W2,..",
        help="weighted head fusion, one weight per head (normalised)",
    )
    method.add_argument(
        "--residual",
        type=_residual,
        metavar="half|renorm|none|ALPHA|norm",
        help="residual correction (default: half; norm: norm_rollout only)",
    )
    method.add_argument("--start-layer", type=_non_negative_int, metavar="N", help="first layer composed (default: 0)")
    method.add_argument("--top-k", type=_positive_int, metavar="K", help="keep the K largest entries of each row")
    method.add_argument("--threshold", type=_ratio, metavar="T", help="drop entries below T in each row (T in [0, 1))")
    method.add_argument(
        "--discard-ratio", type=_ratio, metavar="Q", help="drop the smallest fraction Q of each row (Q in [0, 1))"
    )
    method.add_argument(
        "--prune-on",
        choices=("attention", "residual"),
        help="what --top-k/--threshold/--discard-ratio prune: the head-fused attention before the residual "
        "is added (default), or the residual-corrected matrix (its diagonal is >= 1/2, so strong pruning "
        "keeps only the diagonal)",
    )
    method.add_argument("--layer", type=int, metavar="N", help="layer of --method raw or norm (default: last)")
    method.add_argument("--seed", type=_non_negative_int, metavar="S", help="seed of --method random (default: 0)")
    method.add_argument(
        "--steps", type=_positive_int, metavar="N", help="steps of --method integrated_gradients (default: 32)"
    )
    target = parser.add_argument_group(
        "target (methods that explain one output: grad_rollout, gradients, leave_one_out, ...)"
    )
    target.add_argument(
        "--target", metavar="CLASS", help="classifiers: class index or label name (default: the predicted class)"
    )
    target.add_argument(
        "--target-token", metavar="TOKEN", help="causal LMs: the next token explained (default: the most likely one)"
    )
    target.add_argument(
        "--target-text", metavar="TEXT", help="sentence encoders without a head: explain the similarity to this text"
    )
    method.add_argument(
        "--row",
        type=_row,
        metavar="cls|mean|last|N",
        help="saliency row (default: the model's: mean for sentence encoders, last for decoders, cls otherwise)",
    )

    output = parser.add_argument_group("output")
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
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from attnflow.capture.images import read_image
    from attnflow.evaluate.per_input import add_faithfulness, auto_methods, badge, choose_most_comprehensive
    from attnflow.explanation import explain

    if args.file is not None:
        from attnflow.cli.explain_file import run_file

        if args.method is not None and AUTO in args.method:
            raise InputError("--method auto explains one text; with --file name the methods (e.g. --method gradient)")
        methods = args.method or ["rollout"]
        return run_file(args, _options_per_method(methods, _options(args)), _load, _Progress(args.quiet))
    # Check everything that needs no model first, so mistakes fail in milliseconds.
    if args.image is not None:
        if args.text is not None:
            raise InputError("give either TEXT or --image, not both")
        if args.target is not None or args.target_token is not None or args.target_text is not None:
            raise InputError("targets (--target, --target-token, --target-text) are not defined for images")
        read_image(args.image)  # a missing or unreadable file fails before the model loads
    elif args.text is None:
        raise InputError("nothing to explain: give a TEXT (or --image PATH, or --file PATH)")
    else:
        check_texts(args.text)  # empty, or bytes that are not UTF-8 (argv is surrogateescape'd)
    if args.target is not None and args.target_token is not None:
        raise InputError("give either --target (a class) or --target-token (a next token), not both")
    if args.method is not None:
        _options_per_method(_with_candidates(args.method, None), _options(args))  # fails before the model loads
    out = prepare_output(args)

    say = _Progress(args.quiet)
    say(f"loading {args.model} …")
    model = _load(args.model, args.device, args.quiet)
    has_target = args.image is None and _has_target(model, args.target_text)
    requested = args.method or ([AUTO] if has_target else ["rollout"])
    if AUTO in requested and not has_target:
        raise InputError(_no_target_message(model, args.image is not None))
    family = model.adapter.family if AUTO in requested else None
    candidates = auto_methods(family) if AUTO in requested else []
    per_method = _options_per_method(_with_candidates(requested, family), _options(args))
    if args.image is not None:
        say(f"tracing {args.image} …")
        trace = model.trace_image_for(list(per_method), args.image)
    else:
        say("tracing …")
        target = args.target if args.target is not None else args.target_token
        trace = model.trace_for(
            list(per_method), [args.text], target=target, target_text=args.target_text, max_length=args.max_length
        )[0]
    row = args.row if args.row is not None else getattr(model, "default_row", None)
    computed = {}
    for method, options in per_method.items():
        say(f"{method} …")
        computed[method] = explain(trace, method=method, row=row, model=model, **options)
    if trace.target is not None:
        say("faithfulness on this input …")
        add_faithfulness(model, trace, list(computed.values()))
    chosen = choose_most_comprehensive([computed[name] for name in candidates]) if candidates else None
    explanations = list(
        {
            id(explanation): explanation
            for explanation in (chosen if name == AUTO else computed[name] for name in requested)
        }.values()
    )  # auto's choice where auto was asked for, each explanation once

    paths = write_explanations(out, explanations, trace if args.save_trace else None) if out is not None else {}

    if args.json:
        data = [explanation.to_dict() for explanation in explanations]
        json.dump(data[0] if len(data) == 1 else data, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    elif not args.quiet:
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
                label = explanation.target["label"] if explanation.target else "the target"
                evidence = ", ".join(f"{display_token(t)} {s:+.3g}" for _, t, s in explanation.top(5) if s > 0)
                against = ", ".join(f"{display_token(t)} −{-s:.3g}" for _, t, s in explanation.against(3))
                print(f"{explanation.method} for {label}: {evidence or '-'} … against: {against or '-'}")
            else:
                top = ", ".join(f"{display_token(token)} {score:.3f}" for _, token, score in explanation.top(5))
                where = f"row {explanation.row}" if explanation.row is not None else "scores"
                print(f"{explanation.method} top tokens ({where}): {top}")
            print(f"{explanation.method} summary: {explanation.summary()}")
            if explanation.faithfulness is not None:
                print(f"{explanation.method} faithfulness on this input: {badge(explanation.faithfulness)}")
        for path in paths.values():
            print(f"wrote {path}")
    return 0


def _has_target(model: Any, target_text: str | None) -> bool:
    """Whether the model's output gives target methods something to explain on a text."""
    if model.kind == "decoder" or model.is_classifier:
        return True
    return model.kind == "encoder" and target_text is not None and model.default_row == "mean"


def _no_target_message(model: Any, image: bool) -> str:
    if image:
        return "--method auto compares target methods, and images have no target: choose a method such as rollout"
    if model.kind == "encoder" and model.default_row == "mean":
        return (
            f"--method auto compares target methods, and {model.name} is a sentence encoder without a classifier: "
            "give --target-text TEXT (it explains the similarity to that text), or choose a method such as rollout"
        )
    return f"--method auto compares target methods, and {model.name} has no target: choose a method such as rollout"


def _with_candidates(methods: list[str], family: str | None) -> list[str]:
    """``methods`` with ``auto`` replaced by its candidates for ``family`` (None: for any family)."""
    from attnflow.evaluate.per_input import auto_methods

    expanded: list[str] = []
    for name in methods:
        expanded += auto_methods(family) if name == AUTO else [name]
    return list(dict.fromkeys(expanded))


def _options_per_method(methods: list[str], options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each method's share of the options the user set; an option no chosen method takes is an error."""
    from attnflow.explanation import method_options

    given = {name: value for name, value in options.items() if value is not None}
    if len(methods) == 1:
        method_options(get_method(methods[0]), given, spell=FLAGS)
        return {methods[0]: given}
    specs = [get_method(name) for name in methods]
    accepted = {name for spec in specs for name in spec.options} | (
        {"weights"} if any("head_fusion" in s.options for s in specs) else set()
    )
    unused = [FLAGS.get(name, name) for name in given if name not in accepted]
    if unused:
        raise ValueError(f"none of the methods {', '.join(methods)} takes {', '.join(unused)}")
    chosen = {}
    for spec in specs:
        mine = {
            name: value
            for name, value in given.items()
            if name in spec.options or (name == "weights" and "head_fusion" in spec.options)
        }
        chosen[spec.name] = method_options(spec, mine, spell=FLAGS)
    return chosen


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The method options the user set (None: not given, the method's default applies)."""
    return {
        "head_fusion": args.head_fusion,
        "weights": args.head_weights,
        "residual": args.residual,
        "start_layer": args.start_layer,
        "top_k": args.top_k,
        "threshold": args.threshold,
        "discard_ratio": args.discard_ratio,
        "prune_on": args.prune_on,
        "layer": args.layer,
        "seed": args.seed,
        "n_steps": args.steps,
    }


def _load(name: str, device: str, quiet: bool) -> Any:
    if quiet:
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        except ImportError:  # pragma: no cover - transformers is a dependency
            pass
    from attnflow.capture import load

    return load(name, device=device, progress=not quiet)


class _Progress:
    """Progress lines on stderr (stdout stays clean for --json)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"attnflow: {message}", file=sys.stderr, flush=True)


# ----- argument types (argparse shows their messages as "argument --x: ...") -----------------


def _positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _ratio(text: str) -> float:
    value = _number(text, float)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {text}")
    return value


def _methods(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in available_methods() and name != AUTO]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown method {', '.join(unknown) or repr(text)}; available: {AUTO}, {', '.join(available_methods())}"
        )
    return list(dict.fromkeys(names))


def _residual(text: str) -> str | float:
    if text in ("half", "renorm", "none", "norm"):
        return text
    value = _number(text, float, "half, renorm, none, norm or a number in [0, 1]")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a residual weight must lie in [0, 1], got {text}")
    return value


def _weights(text: str) -> list[float]:
    weights = [_number(part.strip(), float, "comma-separated numbers") for part in text.split(",") if part.strip()]
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise argparse.ArgumentTypeError(f"need non-negative head weights, not all zero, got {text!r}")
    return weights


def _row(text: str) -> str | int:
    from attnflow.methods.saliency import parse_row

    try:
        return parse_row(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _number(text: str, kind: type, expected: str | None = None) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected or kind.__name__}, got {text!r}") from None
    if kind is float and value != value:  # NaN
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value
