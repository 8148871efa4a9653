"""Which architectures of the installed transformers attnflow explains: every causal-LM and
sequence-classification model type is built tiny from its own config (`attnflow.rows.tiny`), loaded
like a user's folder and put through each capability; the architecture × capability table is written
to Markdown (with a JSON of the results beside it), generated, never typed.

    python scripts/architectures.py                              # both tasks -> docs/architectures.md
    python scripts/architectures.py --only llama,gpt2 --task causal-lm --out /tmp/some.md

Each architecture runs in a worker process with a time limit (``--timeout``): a hang or a crash
costs that architecture only (the worker is replaced). One progress line per architecture.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

TASKS = ("causal-lm", "sequence-classification")
TEXT = "the movie was terrible but the acting was great"
CLEAN, CORRUPT = "the cat sat on the mat", "the dog sat on the mat"  # equal lengths on the tiny tokenizer
N_BATCH, N_TOKENS = 2, 7  # the forward check's input [batch, token]

# The steps in order, with their column headings: the chain (each runs only when the one before it
# passed), then the capabilities of the loaded model, each run on its own.
STEPS: dict[str, str] = {
    "build": "build",
    "forward": "forward",
    "load": "load",
    "conformance": "check_adapter",
    "rollout": "rollout",
    "value_aware": "norm / alti",
    "relevance": "attnlrp / gim",
    "routes": "routes",
    "patching": "patching",
}
GROUPS = {
    "decoder": "decoder-only causal LMs with attention",
    "encoder": "encoder and encoder-decoder families' causal-LM classes, with attention",
    "classifier": "sequence classifiers with attention",
}
CHAIN = ("build", "forward", "load")
REASON_LENGTH = 160


@dataclass
class Outcome:
    """One step of one architecture: passed, failed (``reason``: the error's first line, trimmed),
    or not run (an earlier step failed, or the architecture has no attention)."""

    ok: bool | None
    reason: str = ""
    detail: str = ""  # what ran, when there is a choice (the value-aware or relevance method)


@dataclass
class Result:
    """Every step of one architecture for one task."""

    model_type: str
    task: str
    group: str
    attention: bool | None = None  # None: unknown (the forward pass did not run)
    seconds: float = 0.0
    steps: dict[str, Outcome] = field(default_factory=dict)


def one_line(error: BaseException) -> str:
    """The error's type and the first line of its message, trimmed."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
    return text if len(text) <= REASON_LENGTH else text[: REASON_LENGTH - 1] + "…"


def group_of(model_type: str, task: str) -> str:
    """``classifier`` for sequence classification; for a causal LM ``encoder`` where the family is an
    encoder (it has a masked-LM class) or an encoder-decoder (a sequence-to-sequence class, or a config
    class that says so), else ``decoder``."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    if task == "sequence-classification":
        return "classifier"
    families = (MODEL_FOR_MASKED_LM_MAPPING_NAMES, MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    encoder = any(model_type in names for names in families)
    return "encoder" if encoder or transformers.CONFIG_MAPPING[model_type].is_encoder_decoder is True else "decoder"


def conformance(model: Any) -> str:
    """`attnflow.rows.check_adapter` on the loaded model's row: the checks that passed (raises on a
    failure, naming every failed check). The one call of the suite in this script."""
    from attnflow.rows import check_adapter

    return ", ".join(sorted(check_adapter(model.adapter, model).passed))


def forward_attentions(folder: Path, model_type: str, task: str) -> int:
    """The number of attention weight tensors ``[batch, head, query, key]`` (self-, encoder, decoder,
    cross-attention) a forward pass of the tiny model in ``folder`` returns with ``output_attentions=True``
    on a [2, 7] input (first token [CLS], last [SEP], like the tokenizer's); what RWKV returns under
    that name, ``[batch, token, channel]``, is not counted."""
    import torch

    from attnflow.rows.tiny import model_class

    model = model_class(model_type, task).from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.randint(5, 150, (N_BATCH, N_TOKENS), generator=torch.Generator().manual_seed(0))
    ids[:, 0], ids[:, -1] = 2, 3
    with torch.no_grad():
        output = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
    stacks = [value for name, value in output.items() if name.endswith("attentions") and value is not None]
    return sum(_is_attention(weights) for stack in stacks for weights in stack)


def _is_attention(weights: Any) -> bool:
    return weights is not None and weights.dim() == 4 and weights.shape[0] == N_BATCH and weights.shape[2] == N_TOKENS


def _first_of(model: Any, names: Sequence[str]) -> str:
    """The first of ``names`` the model's row supports (else the first, which then says why not)."""
    from attnflow.methods.registry import methods_for

    supported = methods_for(model.adapter)
    return next((name for name in names if name in supported), names[0])


def _explain(model: Any, names: Sequence[str]) -> str:
    method = _first_of(model, names)
    model.explain(TEXT, method=method)
    return method


def _routes(model: Any) -> str:
    """`attnflow.routes`: building the graph checks that every layer's parts add up to the model's
    own streams (a `CaptureError` where they do not)."""
    import attnflow

    routes = attnflow.routes(model, TEXT, lens="none")
    return f"{len(routes.edges)} edges"


def _patching(model: Any) -> str:
    import attnflow

    attnflow.patch(model, CLEAN, CORRUPT, sites="residual", methods="exact", progress=False)
    return "residual, exact"


# The capabilities on the loaded model: step -> the call (returning a detail to record).
CAPABILITIES: dict[str, Callable[[Any], str]] = {
    "conformance": conformance,
    "rollout": lambda model: _explain(model, ["rollout"]),
    "value_aware": lambda model: _explain(model, ["norm", "alti"]),
    "relevance": lambda model: _explain(model, ["attnlrp", "gim"]),
    "routes": _routes,
    "patching": _patching,
}


def probe(model_type: str, task: str, folder: Path | str, steps: Sequence[str] = tuple(STEPS)) -> Result:
    """Build ``model_type`` tiny for ``task`` in ``folder`` and run ``steps`` (in `STEPS` order) on
    it, each step only when the ones before it passed; an architecture whose forward pass returns no
    attention weights is refused there."""
    import attnflow
    from attnflow.rows.tiny import build_tiny

    start = time.perf_counter()
    result = Result(model_type, task, group_of(model_type, task))
    folder = Path(folder)
    loaded: dict[str, Any] = {}

    def build() -> str:
        build_tiny(model_type, folder, task)
        return ""

    def load() -> str:
        loaded["model"] = attnflow.load(str(folder), device="cpu", progress=False)
        return loaded["model"].adapter.family

    actions: dict[str, Callable[[], str]] = {
        "build": build,
        "forward": lambda: f"{forward_attentions(folder, model_type, task)} attention tensors",
        "load": load,
        **{step: (lambda call=call: call(loaded["model"])) for step, call in CAPABILITIES.items()},
    }
    for step in [step for step in STEPS if step in steps]:
        try:
            result.steps[step] = Outcome(True, detail=actions[step]())
        except Exception as error:  # a row of the table: any failure is recorded, none stops the sweep
            result.steps[step] = Outcome(False, one_line(error).replace(str(folder), "the tiny model's folder"))
        if step == "forward" and result.steps[step].ok:
            result.attention = not result.steps[step].detail.startswith("0 ")
            if not result.attention:
                result.steps[step] = Outcome(None, "refused: no attention weights over the input tokens returned")
        if step in CHAIN and not result.steps[step].ok:
            break  # the capabilities need a built, attending, loaded model
    result.seconds = round(time.perf_counter() - start, 2)
    return result


def _worker(connection: Connection) -> None:
    """Probe each (model type, task) received until None, answering with the result."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    while (job := connection.recv()) is not None:
        model_type, task = job
        with tempfile.TemporaryDirectory(prefix=f"tiny-{model_type}-") as folder:
            connection.send(asdict(probe(model_type, task, folder)))


class Workers:
    """One worker process at a time, replaced when it runs past the time limit or dies."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.process: multiprocessing.process.BaseProcess | None = None

    def _start(self) -> Connection:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        self.process = context.Process(target=_worker, args=(theirs,), daemon=True)
        self.process.start()
        self.connection = ours
        return ours

    def run(self, model_type: str, task: str) -> dict[str, Any]:
        connection = self.connection if self.process is not None and self.process.is_alive() else self._start()
        connection.send((model_type, task))
        failure = f"timeout: no result within {self.timeout:.0f} s"
        if connection.poll(self.timeout):
            try:
                return connection.recv()
            except EOFError:
                failure = f"crash: the worker process died (exit code {self.process and self.process.exitcode})"
        if self.process is not None:
            self.process.kill()  # stuck or dead: the next architecture gets a fresh worker
            self.process = None
        return asdict(Result(model_type, task, group_of(model_type, task), steps={"build": Outcome(False, failure)}))

    def stop(self) -> None:
        """End the worker: asked to, or killed if it does not within 5 s (or is stuck past the limit)."""
        if self.process is not None and self.process.is_alive():
            try:
                self.connection.send(None)
            except OSError:
                pass
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
        self.process = None


def sweep(jobs: Sequence[tuple[str, str]], timeout: float, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """`probe` every (model type, task) of ``jobs`` in a worker process, one progress line each."""
    workers, results = Workers(timeout), []
    try:
        for index, (model_type, task) in enumerate(jobs, 1):
            result = workers.run(model_type, task)
            results.append(result)
            say(f"[{index}/{len(jobs)}] {task} {model_type}: {_progress(result)}")
    finally:
        workers.stop()
    return results


def _progress(result: dict[str, Any]) -> str:
    passed = [step for step, out in result["steps"].items() if out["ok"]]
    reasons = _reasons(result)
    return f"{len(passed)}/{len(STEPS)} passed in {result['seconds']:.1f} s" + (f"; {reasons}" if reasons else "")


# ---- the report: every sentence and number below is filled from the results ----


def _mark(result: dict[str, Any], step: str) -> str:
    out = result["steps"].get(step)
    if out is None or out["ok"] is None:
        return "–"
    return "✓" if out["ok"] else "✗"


def _clause(reason: str) -> str:
    """A reason up to its first "; " (what follows lists alternatives: supported types, methods)."""
    return reason.split("; ")[0]


def _reasons(result: dict[str, Any]) -> str:
    """Each failed or refused step with its reason (the steps not run after a failure left out)."""
    failed = [
        f"{STEPS[step]}: {_clause(out['reason'])}" for step, out in result["steps"].items() if out["ok"] is not True
    ]
    return "; ".join(failed).replace("|", "\\|").replace("`", "'")  # no table cell or code span broken


def _with_attention(results: list[dict[str, Any]], group: str) -> list[dict[str, Any]]:
    return [result for result in results if result["group"] == group and result["attention"] is not False]


def summary(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per group: how many architectures with attention (or unknown: failed before the forward pass),
    how many refused for having none, and per step how many passed."""
    counts: dict[str, dict[str, Any]] = {}
    for group in GROUPS:
        members = _with_attention(results, group)
        if not members:
            continue
        refused = [r for r in results if r["group"] == group and r["attention"] is False]
        passed = {step: sum(bool(r["steps"].get(step, {}).get("ok")) for r in members) for step in STEPS}
        counts[group] = {"architectures": len(members), "refused": len(refused), "passed": passed}
    return counts


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The coverage page: header, summary per group, then one table per task."""
    lines = [
        "# Architectures",
        "",
        f"Generated by `{meta['command']}` on {meta['date']} with transformers {meta['transformers']} "
        f"({len(results)} architecture × task pairs in {meta['seconds']:.0f} s). Do not edit: rerun the command.",
        "",
        "Each architecture is built tiny from its own config (`attnflow.rows.tiny.build_tiny`: 2 layers, hidden 64,"
        " random weights), run forward with `output_attentions=True` on a "
        f"{N_BATCH}×{N_TOKENS} input, loaded with `attnflow.load(folder)`, then put through"
        f" {', '.join(f'`{STEPS[step]}`' for step in list(STEPS)[3:])}. A step runs only when the ones before it"
        " passed (– : not run); the capabilities after `load` run each on its own. The last column gives each"
        " failure's first line. A hybrid stack (attention in some layers, a state-space, recurrent or"
        " linear-attention mixer in the others or beside it) loads, and its patching runs on every layer's"
        " residual stream, token mixer and MLP; rollout, the value-aware maps, the backward rules and routes,"
        " which read attention as the only token mixer, are refused naming the layers and their mixer.",
        "",
        "## Summary",
        "",
        "| group | architectures | " + " | ".join(STEPS.values()) + " |",
        "|---|---:|" + "---:|" * len(STEPS),
    ]
    for group, counts in summary(results).items():
        total = counts["architectures"]
        cells = [f"{n} ({100 * n / total:.0f} %)" for n in counts["passed"].values()]
        lines.append(f"| {GROUPS[group]} | {total} | " + " | ".join(cells) + " |")
    refused = sorted({r["model_type"] for r in results if r["attention"] is False})
    if refused:
        lines += [
            "",
            f"Refused, no attention weights over the input tokens returned ({len(refused)}): {', '.join(refused)}.",
        ]
    for task in TASKS:
        rows = [r for r in results if r["task"] == task]
        if not rows:
            continue
        lines += ["", f"## {task}", "", "| architecture | " + " | ".join(STEPS.values()) + " | failures |"]
        lines.append("|---|" + ":-:|" * len(STEPS) + "---|")
        for result in sorted(rows, key=lambda r: r["model_type"]):
            marks = " | ".join(_mark(result, step) for step in STEPS)
            lines.append(f"| {result['model_type']} | {marks} | {_reasons(result)} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="scripts/architectures.py")
    parser.add_argument("--task", choices=[*TASKS, "both"], default="both")
    parser.add_argument("--only", default="", help="comma-separated model types (default: every one of the task)")
    parser.add_argument("--out", default="docs/architectures.md", help="the Markdown table")
    parser.add_argument("--json", default=None, help="the results (default: --out with .json)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per architecture")
    args = parser.parse_args(argv)
    from attnflow.rows.tiny import architectures

    tasks = TASKS if args.task == "both" else (args.task,)
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    jobs = [(t, task) for task in tasks for t in architectures(task) if not only or t in only]
    unknown = sorted(set(only) - {t for t, _ in jobs})
    if unknown:
        parser.error(f"no {' or '.join(tasks)} class for: {', '.join(unknown)}")
    import transformers

    start = time.perf_counter()
    results = sweep(jobs, args.timeout)
    meta = {
        "command": " ".join(["python scripts/architectures.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "transformers": transformers.__version__,
        "seconds": round(time.perf_counter() - start, 1),
        "threads": os.environ.get("OMP_NUM_THREADS", "default"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(results, meta), encoding="utf-8")
    json_path = Path(args.json) if args.json else out.with_suffix(".json")
    document = {**meta, "summary": summary(results), "results": results}
    json_path.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out} and {json_path} ({meta['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
