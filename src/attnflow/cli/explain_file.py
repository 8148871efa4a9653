"""`attnflow explain --file PATH`: explain every text of a file (or of stdin, ``--file -``).

One model load, batched forward passes, one explanation per text in a numbered folder
(``DIR/001/explanation.{json,html,png}``, ...) and ``DIR/index.html`` linking them all. Formats:
``.txt`` (one text per non-blank line), ``.jsonl`` (the text in ``--text-field``, default
``text``), ``.csv`` (the text in ``--text-column``, default ``text``). Standard input is read as
lines of text, or as JSON lines / CSV when --text-field / --text-column say so. With ``--json``
the explanations are printed as JSON lines (one object per text) on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from attnflow.capture.texts import check_row_fits, check_texts
from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.runs.readers import KINDS, Corpus, ReadOptions

FILE_KINDS = ("txt", "jsonl", "csv")
log = logging.getLogger(__name__)


def read_texts(
    source: str, text_field: str | None = None, text_column: str | None = None, skip_bad: bool = False
) -> list[str]:
    """The texts of ``source`` (a .txt/.jsonl/.csv path, or ``-`` for stdin). Blank lines of a
    .txt are skipped; empty records of a .jsonl/.csv are skipped with a warning that counts them;
    a malformed JSON line stops the reading, or with ``skip_bad`` is skipped and counted."""
    if text_field is not None and text_column is not None:
        raise InputError("give --text-field (JSON lines) or --text-column (CSV), not both")
    if source == "-":
        kind = "jsonl" if text_field is not None else "csv" if text_column is not None else "txt"
        with tempfile.TemporaryDirectory(prefix="attnflow-stdin-") as folder:
            path = Path(folder) / f"stdin.{kind}"
            path.write_bytes(sys.stdin.buffer.read())
            return _read(Corpus("-", kind, path, _reading(text_field, text_column, skip_bad)), "standard input")
    path = Path(source).expanduser()
    if not path.is_file():
        raise InputError(f"--file {source}: no such file" + (" (it is a folder)" if path.is_dir() else ""))
    kind = KINDS.get(path.suffix.lower(), "")
    if kind not in FILE_KINDS:
        raise InputError(
            f"--file {source}: unknown file type {path.suffix or '(no extension)'!r}; use .txt, .jsonl or .csv"
        )
    return _read(Corpus(source, kind, path, _reading(text_field, text_column, skip_bad)), source)


def _reading(text_field: str | None, text_column: str | None, skip_bad: bool) -> ReadOptions:
    return ReadOptions(text_field=text_field or "text", text_column=text_column or "text", skip_bad=skip_bad)


def _read(corpus: Corpus, name: str) -> list[str]:
    texts = list(corpus)
    skipped = [
        f"{count} {what}"
        for count, what in ((corpus.empty_records, "empty record(s)"), (corpus.bad_lines, "bad line(s)"))
        if count
    ]
    if skipped:
        log.warning(
            "--file %s: skipped %s; the numbered folders count the texts explained", name, " and ".join(skipped)
        )
    if not texts:
        raise InputError(f"--file {name} holds no text")
    check_texts(texts)  # undecodable characters are reported before the model loads
    return texts


def run_file(args: argparse.Namespace, load: Callable[[str, str, bool], Any], say: Callable[[str], None]) -> int:
    """The --file variant of `attnflow explain` (see the module docstring): ``load(model, device,
    quiet)`` loads the model, ``say`` reports progress. Without --method: auto where the model has a
    target (each text gets the most comprehensive one-pass target method on it), rollout otherwise."""
    from attnflow.cli.common import given_method_options, options_per_method
    from attnflow.cli.outputs import owned, prepare_output, save_explanations
    from attnflow.evaluate.per_input import AUTO, default_methods, has_target, no_target_message, with_candidates
    from attnflow.staging import staged_output
    from attnflow.viz.index import index_html

    if args.text is not None or args.image is not None:
        raise InputError("give either TEXT, --image or --file, not several")
    texts = read_texts(args.file, args.text_field, args.text_column, args.skip_bad)
    check_row_fits(args.row, texts, args.max_length)
    out = prepare_output(args)

    say(f"loading {args.model} …")
    model = load(args.model, args.device, args.quiet)
    targeted = has_target(model, args.target_text)
    requested = args.method or default_methods(targeted)
    if AUTO in requested and not targeted:
        raise InputError(no_target_message(model, image=False))
    family = model.adapter if AUTO in requested else None
    per_method = options_per_method(
        with_candidates(requested, family, target_kind=model.target_kind), given_method_options(args)
    )
    row = args.row if args.row is not None else getattr(model, "default_row", None)
    width = max(3, len(str(len(texts))))
    explained = _explain_all(model, texts, args, row, per_method, requested)
    if out is None:
        for _, explanations in explained:
            _print_json(explanations)
        return 0
    summaries = []
    with staged_output(out, owned, args.overwrite) as scratch:
        for number, (trace, explanations) in enumerate(explained, start=1):
            folder = scratch / f"{number:0{width}d}"
            save_explanations(folder, explanations, trace if args.save_trace else None)
            summaries.append((folder.name, explanations[0]))
            if args.json:
                _print_json(explanations)
        (scratch / "index.html").write_text(index_html(summaries, source=args.file), encoding="utf-8")
    if not args.quiet and not args.json:
        print(f"explained {len(texts)} texts; wrote {out / 'index.html'} and {len(texts)} folders")
    return 0


def _print_json(explanations: list[Any]) -> None:
    """One JSON line per text: the explanation, or the list of them when several methods ran."""
    data = [explanation.to_dict() for explanation in explanations]
    json.dump(data[0] if len(data) == 1 else data, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")


def _explain_all(
    model: ModelLike,
    texts: list[str],
    args: argparse.Namespace,
    row: Any,
    per_method: dict[str, dict],
    requested: list[str],
) -> Iterator[tuple[Any, list[Any]]]:
    """(trace, one explanation per ``requested`` method, each with its per-input faithfulness when the
    trace has a class or next-token target; auto: the most comprehensive of its candidates on that
    text) per text, tracing ``args.batch_size`` texts per forward pass."""
    from tqdm.auto import tqdm

    from attnflow.evaluate.per_input import AUTO, add_faithfulness, auto_methods, choose_most_comprehensive
    from attnflow.explanation import explain_traces

    candidates = (
        [name for name in auto_methods(model.adapter, model.target_kind) if name in per_method]
        if AUTO in requested
        else []
    )

    with tqdm(total=len(texts), desc="explaining", unit="text", disable=args.quiet, file=sys.stderr) as bar:
        for start in range(0, len(texts), args.batch_size):
            batch = texts[start : start + args.batch_size]
            target = args.target if args.target is not None else args.target_token
            traces = model.trace_for(
                list(per_method),
                batch,
                target=target,
                target_text=args.target_text,
                max_length=args.max_length,
                batch_size=args.batch_size,
                contrast=args.contrast,
            )
            # [method][text]: a method with a batch form (the LRP rules) runs once for the batch
            per_trace = [explain_traces(traces, method=m, row=row, model=model, **o) for m, o in per_method.items()]
            for index, trace in enumerate(traces):
                computed = {name: explained[index] for name, explained in zip(per_method, per_trace, strict=True)}
                if args.faithfulness is not False:  # with a class or next-token target
                    add_faithfulness(model, trace, list(computed.values()))
                if candidates:
                    computed[AUTO] = choose_most_comprehensive([computed[name] for name in candidates])
                # auto's choice where auto was asked for, each explanation once
                yield trace, list({id(computed[name]): computed[name] for name in requested}.values())
                bar.update(1)
