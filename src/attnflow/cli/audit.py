"""`attnflow audit`: what a classifier relies on across a dataset (words, errors, terms, swaps)."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnflow.cli.common import BATCH_SIZE, RUNS_NOTE, add_loading_arguments, add_run_arguments

EPILOG = """\
examples:
  attnflow audit --model minilm-sentiment --task rotten-tomatoes --samples 2000 --out out/audit
  attnflow audit --model minilm-sentiment --task rotten-tomatoes --terms he,she,his,her \\
      --swap he:she,his:her,him:her,man:woman --out out/audit-gender
  attnflow audit --model minilm-topics --file texts.txt --out out/topics      # unlabelled texts
  attnflow audit --resume --model minilm-sentiment --task rotten-tomatoes --out out/audit
  attnflow audit --engine ray --workers 2 --model minilm-sentiment --out out/audit
  attnflow audit --model minilm-sentiment-ft --versus minilm-sentiment --samples 1000 \
      --terms good,bad,best,worst,funny,boring,dull --out out/what-fine-tuning-changed
  attnflow audit --model minilm-sentiment --data rotten-tomatoes --versus-data tweets --samples 300 \
      --out out/domain-shift

words: a run of letters and digits joined by ' or - (don't, coming-of-age), punctuation not included;
a clitic ('s 'd 'll 're 've 'm, a possessive ') stays with its word, which counts as the part before it
(he's, He'd, film's: he, he, film; don't stays don't). --terms and --swap use the same words; a swap
keeps case and clitic (He's -> She's). A word in two pairs (her in his:her,him:her) has no single
partner: texts holding it are reported as ambiguous and not swapped.

words per class: ranked by their relevance for the class, i.e. with a signed method (the default
attnlrp, cp_lrp, grad_x_input ...) the positive part of each text's signed word relevance; the
contrast tables (words that separate the classes, error words) use the same positive parts.

output folder: results.json (every number), report.html (tables, bar charts, the error gallery;
offline) and checkpoint.json (for --resume). Definitions of every number: docs/audit.md.

--versus MODEL: a second classifier with the same classes audited over the same texts (a fine-tune
and the model before it): the words whose share of relevance moved (paired per text, with 95 %
intervals; word level, so the tokenizers may differ), the predictions that changed (fixed errors,
new errors) with both maps, the --terms' share of relevance in both, and per layer and head the
attention entropy and the shares on special tokens and on the previous token when both have the
same layers and heads, and the words' share of the attention rollout and of the value-aware
(norm-based) rollout. Changes read as MODEL minus the --versus model.

--versus-data DATA: the one classifier over a second domain (rotten-tomatoes, wiki-topics, tweets or
a labelled CSV/JSONL file; tweets: its texts labelled with the classifier's classes) beside --data:
the same report, unpaired (each text read once; intervals from both sides' spreads; --samples
drawn from each domain). Changes read as --data minus --versus-data.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    from attnflow.dataset_audit.step import DEFAULT_METHOD, DEFAULT_MIN_COUNT

    parser = subparsers.add_parser(
        "audit",
        help="what a classifier relies on across a dataset: words per class, errors, terms, swaps",
        description=(
            "Explain every text of a labelled (or unlabelled) set with one method, merge the token scores "
            "into words and aggregate them per predicted class: the words the model relies on, the words "
            "that separate the classes, its errors, the relevance of a term list against words of matched "
            "frequency, and counterfactual word swaps. Streamed, checkpointed and resumable."
        ),
        epilog=EPILOG + "\n" + RUNS_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    data = parser.add_argument_group("model and data")
    data.add_argument(
        "--model", default="minilm-sentiment", help="a classifier alias or path (default: minilm-sentiment)"
    )
    data.add_argument(
        "--versus",
        metavar="MODEL",
        help="a second classifier (same classes) audited over the same texts: what changed from it to --model",
    )
    source = data.add_mutually_exclusive_group()
    data.add_argument(
        "--versus-data",
        metavar="DATA",
        help="a second domain (task, tweets or labelled file) the classifier reads beside --data: what moved",
    )
    source.add_argument(
        "--task",
        "--data",
        metavar="rotten-tomatoes|wiki-topics|PATH",
        help="a built-in task (its held-out 20 %%) or a labelled CSV/JSONL file; default: the classifier's own task",
    )
    source.add_argument("--file", metavar="F", help="unlabelled texts: .txt (one per line), .jsonl, .csv or .parquet")
    data.add_argument("--text-column", default="text", help="text column (CSV) or field (JSONL) (default: text)")
    data.add_argument("--label-column", default="label", help="label column of a --task file (default: label)")
    data.add_argument("--samples", type=int, metavar="N", help="texts drawn (seeded) from the data (default: all)")
    data.add_argument("--seed", type=int, default=0, help="seeds the drawing of --samples (default: 0)")
    what = parser.add_argument_group("what to audit")
    what.add_argument(
        "--method", default=DEFAULT_METHOD, help=f"the relevance method (default: {DEFAULT_METHOD}, see docs/audit.md)"
    )
    what.add_argument("--terms", metavar="a,b,...|FILE", help="words whose share of relevance is audited")
    what.add_argument("--swap", metavar="he:she,...|FILE", help="word pairs swapped in every text that holds one")
    what.add_argument(
        "--min-count",
        type=int,
        default=DEFAULT_MIN_COUNT,
        metavar="K",
        help=f"rank only words in K or more texts (default: {DEFAULT_MIN_COUNT})",
    )
    run = parser.add_argument_group("run")
    run.add_argument("--out", required=True, type=Path, metavar="DIR", help="output folder")
    run.add_argument("--batch-size", type=int, default=16, metavar="N", help="texts per traced pass (default: 16)")
    add_run_arguments(run, checkpoint_every=10)
    add_loading_arguments(run, devices=None, device_help="cpu, cuda or auto (default)")
    run.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run_audit_command, output_folder=lambda args: args.out, parameter_flags=BATCH_SIZE)


def run_audit_command(args: argparse.Namespace) -> int:
    from attnflow.dataset_audit.engine import REPORT, RESULTS, run_audit
    from attnflow.dataset_audit.step import AuditOptions
    from attnflow.evaluate.api import check_task_name

    check_task_name(args.task)
    options = AuditOptions(
        model=args.model,
        versus=args.versus,
        versus_data=args.versus_data,
        task=args.task,
        file=args.file,
        method=args.method,
        samples=args.samples,
        seed=args.seed,
        terms=args.terms,
        swap=args.swap,
        min_count=args.min_count,
        text_column=args.text_column,
        label_column=args.label_column,
        batch_size=args.batch_size,
        checkpoint_every=args.checkpoint_every,
        engine=args.engine,
        workers=args.workers,
        ray_address=args.ray_address,
        device=args.device,
        dtype=args.dtype,
        quiet=args.quiet,
    )
    results = run_audit(options, args.out, resume=args.resume, overwrite=args.overwrite)
    errors = results.get("errors")
    accuracy = f", accuracy {errors['accuracy']:.3f}" if errors else ""
    if "changes" in results:
        accuracy = _versus_line(results)
    print(f"{results['run']['samples']} texts{accuracy}: {args.out / RESULTS}, {args.out / REPORT}")
    return 0


def _versus_line(results: dict) -> str:
    """What a two-side audit prints after the number of texts: the sides and their accuracies."""
    predictions = results["changes"]["predictions"]
    found = f" ({' against '.join(results['run']['sides'])})"
    if "model_accuracy" in predictions:
        found += f", accuracy {predictions['model_accuracy']:.3f} against {predictions['versus_accuracy']:.3f}"
    if "fixed" in predictions:
        found += f", {predictions['fixed']} errors fixed, {predictions['new_errors']} new"
    elif results["changes"]["paired"]:
        found += f", {predictions['changed']} predictions changed"
    return found
