"""`attnflow explain --file PATH`: explain every text of a file (or of stdin, ``--file -``).

One model load, batched forward passes, one explanation per text in a numbered folder
(``DIR/001/explanation.{json,html,png}``, ...) and ``DIR/index.html`` linking them all. Formats:
``.txt`` (one text per non-blank line), ``.jsonl`` (the text in ``--text-field``, default
``text``), ``.csv`` (the text in ``--text-column``, default ``text``). Standard input is read as
lines of text, or as JSON lines / CSV when --text-field / --text-column say so. With ``--json``
the explanations are printed as JSON lines (one object per text) on stdout.

The texts run on the run engine (`attnflow.runs.engine`): a batch of texts is one batch of the
engine (`ExplainStep`, in this process or on model replicas as Ray actors); after each batch its
folders are written (each one whole, through a temporary folder) and the checkpoint
(``DIR/checkpoint.json``) counts them, so ``--resume`` explains only the texts not yet written.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from attnflow.capture.texts import check_row_fits, check_texts
from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.runs.checkpoint import RunFolder, digest
from attnflow.runs.engine import Job, Rows, run
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


CHECKPOINT = "checkpoint.json"
CHECKPOINT_FORMAT = 1


def run_file(args: argparse.Namespace, load: Callable[..., Any], say: Callable[[str], None]) -> int:
    """The --file variant of `attnflow explain` (see the module docstring): ``load(model, device,
    quiet, dtype)`` loads the model, ``say`` reports progress. Without --method: auto where the model has a
    target (each text gets the most comprehensive one-pass target method on it), rollout otherwise."""
    from attnflow.cli.common import engine_options, given_method_options
    from attnflow.cli.outputs import output_folder, owned

    if args.text is not None or args.image is not None:
        raise InputError("give either TEXT, --image or --file, not several")
    texts = read_texts(args.file, args.text_field, args.text_column, args.skip_bad)
    check_row_fits(args.row, texts, args.max_length)
    out = output_folder(args)
    if out is None and (args.save_trace or args.resume):
        raise InputError(f"{'--save-trace' if args.save_trace else '--resume'} works on files: give --out DIR")
    engine = engine_options(args)
    fields = {
        "model": args.model,
        "dtype": args.dtype,
        "texts": digest(texts),
        "method": args.method,
        "method_options": given_method_options(args),
        **{name: getattr(args, name) for name in ("row", "target", "target_token", "target_text", "contrast")},
        **{name: getattr(args, name) for name in ("max_length", "faithfulness", "save_trace")},
    }
    folder = RunFolder(
        out, kind="explain --file", checkpoint=CHECKPOINT, owned=owned, state_format=CHECKPOINT_FORMAT,
        resume=args.resume, overwrite=args.overwrite, fields=fields,
    ) if out is not None else None  # fmt: skip
    with folder or nullcontext():
        say(f"loading {args.model} …")
        model = load(args.model, engine.driver_device, args.quiet, args.dtype)
        step = explain_step(model, args)
        written = Written(out, max(3, len(str(len(texts)))), args.json)
        job = Job(
            name="explaining",
            unit="text",
            total=len(texts),
            fields=fields,
            step=step,
            result=Rows(),
            batches=lambda start: (
                TextBatch(first, tuple(texts[first : first + args.batch_size]))
                for first in range(start, len(texts), args.batch_size)
            ),
            absorb=written,
        )
        rows = run(job, folder, engine, context=model).result.rows
        if out is not None:
            written.index(rows, source=args.file)
    if out is not None and not args.quiet and not args.json:
        print(f"explained {len(texts)} texts; wrote {out / 'index.html'} and {len(texts)} folders")
    return 0


def _print_json(explanations: list[Any]) -> None:
    """One JSON line per text: the explanation, or the list of them when several methods ran."""
    data = [explanation.to_dict() for explanation in explanations]
    json.dump(data[0] if len(data) == 1 else data, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")


@dataclass(frozen=True)
class TextBatch:
    """Consecutive texts of the file: ``first`` is the index of the first."""

    first: int
    texts: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.texts)


def explain_step(model: ModelLike, args: argparse.Namespace) -> "ExplainStep":
    """What every text gets (`ExplainStep`), resolved on ``model``: the methods (auto's candidates
    when asked for), their options, the row and the target."""
    from attnflow.cli.common import given_method_options, options_per_method, target_of
    from attnflow.evaluate.per_input import (
        AUTO,
        auto_methods,
        default_methods,
        has_target,
        no_target_error,
        with_candidates,
    )

    targeted = has_target(model, target_of(args))
    requested = args.method or default_methods(targeted)
    if AUTO in requested and not targeted:
        raise no_target_error(model, image=False)
    family = model.adapter if AUTO in requested else None
    per_method = options_per_method(
        with_candidates(requested, family, target_kind=model.target_kind), given_method_options(args)
    )
    candidates = (
        [name for name in auto_methods(model.adapter, model.target_kind) if name in per_method]
        if AUTO in requested
        else []
    )
    return ExplainStep(
        model=args.model,
        dtype=args.dtype,
        per_method=per_method,
        requested=list(requested),
        candidates=candidates,
        row=args.row if args.row is not None else getattr(model, "default_row", None),
        target=target_of(args),
        max_length=args.max_length,
        batch_size=args.batch_size,
        faithfulness=args.faithfulness is not False,
        save_trace=bool(args.save_trace),
    )


@dataclass(frozen=True)
class ExplainStep:
    """`explain --file`'s `attnflow.runs.engine.Step`: a model replica; per text of a batch, its
    trace (kept with ``save_trace``) and one explanation per requested method, each with its
    per-input faithfulness when the trace has a class or next-token target (auto: the most
    comprehensive of its ``candidates`` on that text); one traced pass per batch."""

    model: str
    dtype: str
    per_method: dict[str, dict[str, Any]]
    requested: list[str]
    candidates: list[str]
    row: Any
    target: Any  # an attnflow.targets.Target
    max_length: int | None
    batch_size: int
    faithfulness: bool
    save_trace: bool

    def load(self, device: str) -> ModelLike:
        from attnflow.model import load

        return load(self.model, device=device, dtype=self.dtype)

    def empty(self, model: ModelLike) -> Rows:  # noqa: ARG002 - the Step protocol
        return Rows()

    def run(self, model: ModelLike, rows: Rows, batch: TextBatch) -> Rows:
        from attnflow.evaluate.per_input import AUTO, add_faithfulness, choose_most_comprehensive
        from attnflow.explanation import explain_traces

        traces = model.trace_for(
            list(self.per_method),
            list(batch.texts),
            target=self.target,
            max_length=self.max_length,
            batch_size=self.batch_size,
        )
        # [method][text]: a method with a batch form (the LRP rules) runs once for the batch
        per_trace = [
            explain_traces(traces, method=m, row=self.row, model=model, **o) for m, o in self.per_method.items()
        ]
        for index, trace in enumerate(traces):
            computed = {name: explained[index] for name, explained in zip(self.per_method, per_trace, strict=True)}
            if self.faithfulness:  # with a class or next-token target
                add_faithfulness(model, trace, list(computed.values()))
            if self.candidates:
                computed[AUTO] = choose_most_comprehensive([computed[name] for name in self.candidates])
            # auto's choice where auto was asked for, each explanation once
            explanations = list({id(computed[name]): computed[name] for name in self.requested}.values())
            rows.rows[str(batch.first + index)] = (trace if self.save_trace else None, explanations)
        return rows


class Written:
    """The engine's ``absorb`` of `explain --file`: each text's new row written to its numbered
    folder (and printed with ``--json``), then kept as the folder of its first explanation."""

    def __init__(self, out: Path | None, width: int, print_json: bool) -> None:
        self.out, self.width, self.print_json = out, width, print_json

    def __call__(self, rows: Rows) -> None:
        from attnflow.cli.outputs import save_explanations
        from attnflow.staging import building

        for key in sorted((key for key, row in rows.rows.items() if isinstance(row, tuple)), key=int):
            trace, explanations = rows.rows.pop(key)
            if self.print_json:
                _print_json(explanations)
            if self.out is None:
                continue
            name = f"{int(key) + 1:0{self.width}d}"
            with building(self.out / name) as folder:
                save_explanations(folder, explanations, trace)
            rows.rows[key] = name if len(explanations) == 1 else f"{name}/{explanations[0].method}"

    def index(self, rows: dict[str, str], source: str) -> None:
        """``DIR/index.html``: every text's first explanation, read back from its folder."""
        from attnflow.explanation import Explanation
        from attnflow.staging import atomic_file
        from attnflow.viz.index import index_html

        assert self.out is not None
        entries = [(rows[key].split("/")[0], Explanation.load(self.out / rows[key])) for key in sorted(rows, key=int)]
        with atomic_file(self.out / "index.html") as handle:
            handle.write(index_html(entries, source=source).encode("utf-8"))
