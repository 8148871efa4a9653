"""`attnflow routes`: the information flow routes of one prediction (Ferrando & Voita 2024), or
over a dataset (``--file``, ``--data``: `attnflow.flow_routes.dataset`, on the run engine)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from attnflow.cli.common import (
    RUNS_NOTE,
    Progress,
    add_loading_arguments,
    add_run_arguments,
    engine_options,
    load_model,
    positive_int,
    target_of,
)
from attnflow.errors import InputError

EPILOG = """\
examples:
  attnflow routes "The capital of France is" --model smollm2 --out out/routes
  attnflow routes "The capital of France is" --model smollm2 --target " Paris" --contrast " Rome" \\
      --out out/routes-contrast
  attnflow routes "The capital of France is" --model smollm2 --threshold 0.02 --out out/routes --overwrite
  attnflow routes "The movie was terrible." --model minilm --position 0 --json --quiet > routes.json
  attnflow routes --file sentences.txt --model smollm2 --out out/routes-file
  attnflow routes --data wiki --samples 500 --max-tokens 24 --model smollm2 --out out/routes-wiki
  attnflow routes --data wiki --samples 500 --max-tokens 24 --model smollm2 --out out/routes-wiki --resume
  attnflow routes --data python-stdlib,wiki --samples 500 --max-tokens 24 --model smollm2 --out out/routes-domains
  attnflow routes --data wiki --samples 200 --max-tokens 24 --model smollm2 --versus qwen2.5-0.5b \
      --out out/routes-versus

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

Over a dataset (--file PATH, or --data with wiki, python-stdlib or files, comma-separated: one
domain each): every text's next-token prediction, each head's and feed-forward block's importance
averaged over the prompts (mean and standard error, per domain), and what the top heads do, measured
from their attention (first-token, previous-token, self and subword-merging shares). Writes
DIR/summary.json, DIR/report.html and DIR/prompts.jsonl.

--versus MODEL (with --file/--data): a second language model over the same prompts, in the report
form of `attnflow audit --versus`: each model explains its own next token (--method, default
attnlrp) and the words whose share of relevance moved are paired per prompt with 95 % intervals
(tokenizers may differ); with the same tokens, layers and heads (a fine-tune and its base) also
each head's importance and attention shares and each feed-forward block's importance that moved.
Changes read as --model minus --versus. Writes DIR/results.json and DIR/report.html.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    from attnflow.flow_routes.graph import DEFAULT_THRESHOLD
    from attnflow.flow_routes.result import LENS_MODES

    parser = subparsers.add_parser(
        "routes",
        help="information flow routes: which tokens, heads and FFNs a prediction goes through",
        description="The information flow routes of one prediction, from one forward pass (Ferrando & Voita 2024).",
        epilog=EPILOG + "\n" + RUNS_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "text",
        metavar="TEXT",
        nargs="?",
        help="the text (a causal LM explains its next token); omit with --file/--data",
    )
    parser.add_argument("--model", default="smollm2", help="alias, folder or hub id (default: smollm2)")
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write DIR/routes.json, routes.html and routes.png (required without --json); over a dataset: "
        "summary.json, report.html, prompts.jsonl",
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
    parser.add_argument("--lens", choices=LENS_MODES, help="nodes the logit lens reads (default: route)")
    parser.add_argument("--json", action="store_true", help="print routes.json on stdout (the summary on stderr)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress or summary lines")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run's files in DIR")
    add_loading_arguments(parser)
    _add_data_arguments(parser.add_argument_group("over a dataset (docs/routes.md, docs/runs.md)"))
    parser.set_defaults(handler=run, output_folder=lambda args: args.out)


def _add_data_arguments(group: argparse._ArgumentGroup) -> None:
    """--file / --data, how many texts and how long, how they are read, and the run engine's options."""
    group.add_argument(
        "--file", metavar="PATH", help="every text of a .txt (one per line), .jsonl, .csv or .parquet file"
    )
    group.add_argument(
        "--data",
        metavar="SOURCES",
        help="comma-separated sources, one domain each: wiki (the embedded Wikipedia summaries), python-stdlib "
        "(function definitions of the installed Python's standard library) or files",
    )
    group.add_argument(
        "--samples", type=positive_int, metavar="N", help="the first N texts of each source (default: all)"
    )
    group.add_argument(
        "--max-tokens",
        type=positive_int,
        metavar="N",
        help="cut each text after the last whole word among its first N tokens (default: --file keeps each "
        "prompt whole; --data cuts each text before its last word, so that the prediction is that word)",
    )
    group.add_argument("--batch-size", type=positive_int, metavar="B", help="prompts per batch of the run (default: 8)")
    group.add_argument("--versus", metavar="MODEL", help="a second language model over the same prompts: what moved")
    group.add_argument("--method", help="with --versus: the relevance method of the words (default: attnlrp)")
    group.add_argument("--text-field", metavar="FIELD", help="JSONL field holding the text (default: text)")
    group.add_argument("--text-column", metavar="COLUMN", help="CSV/Parquet column holding the text (default: text)")
    group.add_argument("--skip-bad", action="store_true", help="count and skip bad JSONL lines instead of stopping")
    add_run_arguments(group, overwrite=False, scope="--file/--data: ")


def run(args: argparse.Namespace) -> int:
    if args.file is not None or args.data is not None:
        return run_data(args)
    _refuse(args, _DATA_ONLY, "over a dataset (--file or --data)", engine=True)
    from attnflow.flow_routes.graph import check_threshold
    from attnflow.flow_routes.result import is_routes_file
    from attnflow.staging import check_output

    if args.text is None:
        raise InputError("give the TEXT, or a dataset with --file PATH or --data SOURCES")
    if not args.text.strip():
        raise InputError("the text is empty")
    if args.out is None and not args.json:
        raise InputError("give --out DIR (routes.json is written there) or --json (printed on stdout)")
    check_threshold(args.threshold)
    if args.out is not None:
        check_output(args.out, is_routes_file, args.overwrite)
    say = Progress(args.quiet)
    say(f"loading {args.model} …")
    model = load_model(args.model, args.device, args.quiet, args.dtype)
    say("building the routes …")
    from attnflow.flow_routes.api import routes  # torch: after the checks

    options = {name: getattr(args, name) for name in ("position", "threshold", "norm")}
    lens = args.lens or "route"  # None when not given: refused with a dataset (_ONE_PROMPT)
    result = routes(model, args.text, target=target_of(args), lens=lens, **options)  # errors name their flags
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


# What only one of the two modes reads (flag -> argparse destination): refused in the other, one line.
_ONE_PROMPT = {"--position": "position", "--target": "target", "--contrast": "contrast", "--lens": "lens"}
_ONE_PROMPT |= {"--json": "json"}
_DATA_ONLY = {"--samples": "samples", "--max-tokens": "max_tokens", "--batch-size": "batch_size"}
_DATA_ONLY |= {"--text-field": "text_field", "--text-column": "text_column", "--skip-bad": "skip_bad"}
_DATA_ONLY |= {"--resume": "resume", "--checkpoint-every": "checkpoint_every", "--workers": "workers"}
_DATA_ONLY |= {"--ray-address": "ray_address", "--versus": "versus", "--method": "method"}


def _refuse(args: argparse.Namespace, flags: dict[str, str], mode: str, engine: bool = False) -> None:
    """One line naming the ``flags`` given that ``mode`` would ignore (``engine``: --engine too)."""
    given = [
        flag for flag, dest in flags.items() if getattr(args, dest) is not None and getattr(args, dest) is not False
    ]
    if engine and args.engine != "local":
        given.append("--engine")
    if given:
        them = "them" if len(given) > 1 else "it"
        raise InputError(f"{', '.join(given)} would be ignored by routes {mode}: drop {them}")


def run_data(args: argparse.Namespace) -> int:
    """``--file`` / ``--data``: the routes of every text, added up on the run engine into ``--out``
    (`attnflow.flow_routes.dataset.routes_over_data`)."""
    from attnflow.cli.common import quiet_loading
    from attnflow.runs.readers import ReadOptions

    if args.file is not None and args.data is not None:
        raise InputError("give either --file PATH or --data SOURCES, not both")
    if args.text is not None:
        raise InputError("give either TEXT or a dataset (--file, --data), not both")
    _refuse(args, _ONE_PROMPT, "over a dataset (one prompt's options)")
    if args.out is None:
        raise InputError("give --out DIR: summary.json, report.html and prompts.jsonl are written there")
    from attnflow.flow_routes.dataset import REPORT, SUMMARY_JSON, routes_over_data

    if args.versus is None and args.method is not None:
        raise InputError("--method would be ignored without --versus: drop it")
    sources = [args.file] if args.file is not None else [part.strip() for part in args.data.split(",") if part.strip()]
    reading = ReadOptions(
        text_field=args.text_field or "text", text_column=args.text_column or "text", skip_bad=args.skip_bad
    )
    quiet_loading(args.quiet)
    if args.versus is not None:
        return _run_versus(args, sources, reading)
    summary = routes_over_data(args.model, sources, args.out, **_data_options(args, reading))
    if not args.quiet:
        print(data_summary(summary))
    print(f"{args.out / REPORT} {args.out / SUMMARY_JSON}")
    return 0


def _data_options(args: argparse.Namespace, reading: Any) -> dict[str, Any]:
    """The keyword arguments of `routes_over_data` (and of `routes_versus`) from the flags; their
    errors name their flags (cli.main)."""
    from attnflow.flow_routes.dataset import DEFAULT_BATCH

    return {
        "samples": args.samples,
        "max_tokens": args.max_tokens,
        "threshold": args.threshold,
        "norm": args.norm,
        "batch_size": args.batch_size or DEFAULT_BATCH,
        "reading": reading,
        "parameter": "file" if args.file is not None else "data",
        "resume": args.resume,
        "overwrite": args.overwrite,
        "engine": engine_options(args),
        "dtype": args.dtype,
        "last_word": args.data is not None,
    }


def _run_versus(args: argparse.Namespace, sources: list[str], reading: Any) -> int:
    """``--versus MODEL``: `attnflow.dataset_audit.routes_versus.routes_versus` into ``--out``."""
    from attnflow.dataset_audit.routes_versus import DEFAULT_METHOD, REPORT, RESULTS, routes_versus

    options = _data_options(args, reading)
    results = routes_versus(args.model, args.versus, sources, args.out, method=args.method or DEFAULT_METHOD, **options)
    if not args.quiet:
        for entry in results["changes"]["lead"]:
            print(entry["sentence"])
    print(f"{args.out / REPORT} {args.out / RESULTS}")
    return 0


def data_summary(summary: dict[str, Any], count: int = 5) -> str:
    """A few lines: per domain, the prompts and the most important heads with their roles."""
    lines = [f"{summary['prompts']} prompts, {summary['seconds_per_prompt']:.3f} s each"]
    for domain in summary["domains"] + ([summary["all"]] if "all" in summary else []):
        heads = "; ".join(
            f"L{entry['layer']}.H{entry['head']} {entry['importance']:.3f} ({entry['role']})"
            for entry in domain["top_heads"][:count]
        )
        lines.append(f"{domain['name']} ({domain['prompts']} prompts): {heads}")
    return "\n".join(lines)
