"""`attnflow corpus` (run a corpus study) and `attnflow report` (redraw its report)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from attnflow.cli.common import BATCH_SIZE, RUNS_NOTE, add_loading_arguments, add_run_arguments

CORPUS_EPILOG = """\
examples:
  attnflow corpus --samples 2000 --out out/study           # minilm on 2,000 windows of the wiki text
  attnflow corpus --samples 2000 --model mpnet --out out/mpnet
  attnflow corpus --data wiki --samples 20000 --stride 50 --out out/study   # overlap to reach 20,000
  attnflow corpus --data reviews.jsonl --text-field body --skip-bad --samples 500 --out out/reviews
  attnflow corpus --data table.parquet --text-column text --out out/table
  attnflow corpus --resume --out out/study                 # continue after a crash or Ctrl-C
  attnflow corpus --engine ray --ray-address auto --out out/study   # on a running Ray cluster

windows: documents are tokenized without special tokens and packed end to end in corpus order;
each window is the next seq_len-2 wordpieces plus the model's own special tokens ([CLS] ... [SEP]),
exactly --seq-len tokens, no padding. --stride S starts a window every S wordpieces (overlap when
S < seq_len-2). Sentences come from pysbd on the raw text. The wiki corpus gives ~8,000 disjoint
128-token windows; 20,000 need --stride 50.

output folder: summary.json (every scalar, per layer and head), stats.npz (arrays), heads.csv
(one row per head), report.html (figures, offline) and checkpoint.npz (for --resume).
"""

REPORT_EPILOG = """\
examples:
  attnflow report out/study          # rewrite out/study/report.html from summary.json + stats.npz
  attnflow report out/study --png out/figures   # and save each figure as a PNG file
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "corpus",
        help="per-head context-similarity and attention statistics over a corpus",
        description=(
            "Run the corpus study: split a corpus into fixed-length windows, capture every head's "
            "attention and outputs, and accumulate per-layer and per-head statistics (distance, "
            "sentence, repetition, anchor tokens, signal/noise, attention targets), streamed and resumable."
        ),
        epilog=CORPUS_EPILOG + "\n" + RUNS_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_study_arguments(parser.add_argument_group("what to study"))
    _add_reading_arguments(parser.add_argument_group("reading the corpus"))
    _add_running_arguments(parser.add_argument_group("running"))
    parser.set_defaults(handler=run, output_folder=lambda args: Path(args.out), parameter_flags=BATCH_SIZE)
    _register_report(subparsers)


def _add_study_arguments(what: argparse._ArgumentGroup) -> None:
    """The model, the corpus, the windows and the statistics' thresholds."""
    what.add_argument(
        "--model", default="minilm", help="alias (minilm, mpnet, smollm2), local folder or hub id (default: minilm)"
    )
    what.add_argument(
        "--data",
        default="wiki",
        metavar="wiki|PATH",
        help="'wiki' (embedded Wikipedia summaries) or a .txt, .jsonl, .csv or .parquet file (default: wiki)",
    )
    what.add_argument(
        "--samples", type=int, default=20000, metavar="N", help="windows to process, at most (default: 20000)"
    )
    what.add_argument(
        "--seq-len",
        type=int,
        default=128,
        metavar="N",
        help="tokens per window, special tokens included (default: 128)",
    )
    what.add_argument(
        "--stride",
        type=int,
        default=None,
        metavar="S",
        help="wordpieces between window starts (default: seq_len-2, no overlap)",
    )
    what.add_argument(
        "--high",
        default="top-percent:2",
        metavar="RULE",
        help="high-similarity pairs per matrix: top-percent:P, top-k-per-row:K or zscore:Z (default: top-percent:2)",
    )
    what.add_argument(
        "--attention-top-percent",
        type=float,
        default=2.0,
        metavar="P",
        help="high-attention pairs M: top P %% by max(A_ij, A_ji) (default: 2)",
    )


def _add_reading_arguments(reading: argparse._ArgumentGroup) -> None:
    """How the documents are read from a .txt, .jsonl, .csv or .parquet file."""
    reading.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    reading.add_argument("--text-column", default="text", help="CSV/Parquet column holding the text (default: text)")
    reading.add_argument(
        "--txt-docs",
        choices=("line", "paragraph"),
        default="line",
        help=".txt files: one document per line, or per blank-line-separated paragraph (default: line)",
    )
    reading.add_argument("--skip-bad", action="store_true", help="count and skip bad JSONL lines instead of stopping")


def _add_running_arguments(running: argparse._ArgumentGroup) -> None:
    """The output folder, resuming, batches, checkpoints, engine, device and output."""
    running.add_argument(
        "--out", required=True, metavar="DIR", help="output folder (an earlier run there: --resume or --overwrite)"
    )
    running.add_argument(
        "--batch-size", type=int, default=16, metavar="B", help="windows per forward pass (default: 16)"
    )
    add_run_arguments(running, checkpoint_every=20)
    add_loading_arguments(running, device_help="auto: a GPU when present (default)")
    running.add_argument("--quiet", action="store_true", help="no progress bar")
    running.add_argument("--json", action="store_true", help="print the summary's layer table as JSON on stdout")


def _register_report(subparsers: argparse._SubParsersAction) -> None:
    """`attnflow report DIR`."""
    report = subparsers.add_parser(
        "report",
        help="rebuild a corpus study's report.html from its saved statistics",
        description="Redraw DIR/report.html from DIR/summary.json and DIR/stats.npz (no model needed).",
        epilog=REPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("dir", metavar="DIR", help="the --out folder of `attnflow corpus`")
    report.add_argument("--png", metavar="FOLDER", default=None, help="also save every figure as FOLDER/<name>.png")
    report.add_argument("--json", action="store_true", help="print the report path as JSON")
    report.set_defaults(handler=run_report, output_folder=lambda args: Path(args.dir))


def run(args: argparse.Namespace) -> int:
    from attnflow.corpus.engine import StudyOptions, run_study
    from attnflow.corpus.stats import StudyConfig
    from attnflow.runs.readers import ReadOptions

    options = StudyOptions(
        model=args.model,
        data=args.data,
        samples=args.samples,
        seq_len=args.seq_len,
        stride=args.stride,
        batch_size=args.batch_size,
        statistics=StudyConfig(high=args.high, attention_top_percent=args.attention_top_percent),
        reading=ReadOptions(
            text_field=args.text_field, text_column=args.text_column, txt_docs=args.txt_docs, skip_bad=args.skip_bad
        ),
        device=args.device,
        dtype=args.dtype,
        engine=args.engine,
        workers=args.workers,
        ray_address=args.ray_address,
        checkpoint_every=args.checkpoint_every,
        quiet=args.quiet or args.json,
    )
    summary = run_study(options, args.out, resume=args.resume, overwrite=args.overwrite)
    if args.json:
        keys = (
            "mean_distance_high",
            "mean_distance_all",
            "same_sentence_share",
            "same_sentence_chance",
            "repeat_share",
            "repeat_chance",
            "signal_share",
        )
        layers = [{"layer": layer["layer"], **{key: layer.get(key) for key in keys}} for layer in summary["layers"]]
        json.dump({"out": str(args.out), "samples": summary["samples"], "layers": layers}, sys.stdout, indent=1)
        print()
    elif not args.quiet:
        print(f"{summary['samples']} windows studied; report: {args.out}/report.html")
    return 0


def run_report(args: argparse.Namespace) -> int:
    from attnflow.corpus.engine import rebuild_report

    path = rebuild_report(args.dir, png_dir=args.png)
    if args.json:
        print(json.dumps({"report": str(path)}))
    else:
        print(path)
    return 0
