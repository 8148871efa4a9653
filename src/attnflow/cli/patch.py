"""`attnflow patch`: which layers, positions and heads carry a prediction, by activation patching."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from attnflow.cli.common import (
    BATCH_SIZE,
    RUNS_NOTE,
    Progress,
    add_loading_arguments,
    add_run_arguments,
    argument_type,
    engine_options,
    load_model,
    positive_int,
    quiet_loading,
    target_of,
)
from attnflow.errors import InputError
from attnflow.methods.options import non_negative_int as parse_non_negative_int

non_negative_int = argument_type(parse_non_negative_int)
CHECK_THRESHOLD = 0.7  # `attnflow.causal.api.CHECK_THRESHOLD` (the help text reads it before torch loads)

DEFAULTS: dict[str, Any] = {
    "sites": None,  # the kinds that hold activations (`attnflow.causal.sites.SITE_KINDS`)
    "method": "exact,atp",
    "direction": "denoising",
    "samples": 10,
    "seed": 0,
    "batch_size": 32,
    "knockout_window": 1,
    "steps": 5,
    "check_sites": 48,  # `attnflow.causal.api.CHECK_SITES`
}
# Everything `attnflow patch` writes into --out, whichever analysis: an earlier run's, replaced
# only with --overwrite (a --file run's checkpoint is continued with --resume).
OUTPUT_FILES = (
    "patch.json",
    "patch.html",
    "versus.json",
    "versus.html",
    "edges.json",
    "edges.html",
    "summary.json",
    "summary.html",
    "pairs.jsonl",
)
VERSUS_HEADER = (
    "Spearman ρ per residual row between exact patching and each method's prediction, over positions "
    "(emb: the stream entering layer 0; Ln: leaving layer n):"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "patch",
        help="activation patching: which sites carry a prediction (exact, AtP, AtP*, RelP)",
        description=(
            "Run a corrupted input with one site at a time restored to its value on the clean input "
            "(denoising; --direction noising does the reverse) and report the normalised effect "
            "(m_patched - m_corrupted) / (m_clean - m_corrupted) of every site: the residual stream, "
            "attention and MLP outputs per (layer, position), and each head's output per layer; or, with "
            "--sites knockout, block one attention edge at a time (key -> --knockout-target) on the clean "
            "input in a window of layers (Geva et al. 2023), effect (m_clean - m_blocked) / (m_clean - "
            "m_corrupted). The "
            "corruption is a counterfactual text of the same token length (--corrupt) or Gaussian noise "
            "(3x the std of the embeddings) on the embeddings of chosen words (--noise, seeded, --samples "
            "draws averaged). The metric: a classifier's class logit, a causal LM's log p(next token), or "
            "with --contrast the logit difference target - contrast. The approximations (atp, atp*, "
            "relp, atp-ig) come with their Pearson and Spearman correlation with exact patching. Writes "
            "patch.json (every number) and patch.html (heatmaps) into --out."
        ),
        epilog=(
            "examples:\n"
            '  attnflow patch "The capital of France is" --corrupt "The capital of Italy is" \\\n'
            '      --model smollm2 --target " Paris" --contrast " Rome" --out out/patch\n'
            '  attnflow patch "The Eiffel Tower is in" --noise "Eiffel Tower" --model smollm2 --out out/noise\n'
            '  attnflow patch "The Eiffel Tower is in" --noise "Eiffel Tower" --model smollm2 --sites knockout \\\n'
            "      --knockout-window 9 --method exact --out out/knockout\n"
            "  attnflow patch --file pairs.jsonl --model smollm2 --sites heads --method exact,atp,relp "
            "--out out/pairs\n"
            "  attnflow patch --file pairs.jsonl --model smollm2 --sites heads --method exact,atp,relp "
            "--out out/pairs --resume\n"
            "  attnflow patch --file pairs.jsonl --model smollm2 --engine ray --workers 4 --out out/pairs-ray\n\n"
            'pairs.jsonl: one {"clean": ..., "corrupt": ... | "noise": ..., "target": ..., "contrast": ...} a line;\n'
            "--out receives pairs.jsonl (every pair's numbers), summary.json, summary.html and checkpoint.json.\n\n"
            + RUNS_NOTE.replace("runs (", "--file runs (")
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_input_arguments(parser)
    _add_sweep_arguments(parser)
    _add_run_arguments(parser)
    _add_other_analyses(parser)
    parser.set_defaults(handler=run, output_folder=lambda args: args.out, parameter_flags=BATCH_SIZE)


def _add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """The clean text, its corruption, the model and what the metric reads."""
    parser.add_argument("text", nargs="?", help="the clean text (omit with --file)")
    corruption = parser.add_mutually_exclusive_group()
    corruption.add_argument("--corrupt", metavar="TEXT", help="a counterfactual text of the same token length")
    corruption.add_argument("--noise", metavar="WORDS", help="comma-separated words of the text to add noise to")
    parser.add_argument("--model", default="smollm2", help="a causal LM or a classifier (default: smollm2)")
    parser.add_argument(
        "--target", metavar="CLASS|TOKEN", help="the class or next token the metric reads (default: the prediction)"
    )
    parser.add_argument("--contrast", metavar="CLASS|TOKEN", help="measure the logit difference target - contrast")


def _add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """Which sites, by which methods, in which direction; the noise draws and the batch. Their
    defaults (`DEFAULTS`) are filled in by `run`: a flag left out stays None, so a flag that the
    chosen analysis would ignore can be refused."""
    from attnflow.rows.site_kinds import SITE_TABLE

    default = ",".join(row.name for row in SITE_TABLE if row.is_activation)
    kinds = "; ".join(f"{row.name}: {row.help}" for row in SITE_TABLE)
    parser.add_argument("--sites", metavar="KINDS", help=f"comma-separated site kinds (default: {default}). {kinds}")
    parser.add_argument(
        "--method",
        help="exact, atp, atp* (AtP with GradDrop), relp (AtP with the AttnLRP backward), atp-ig (AtP with the "
        f"gradient integrated along the path between the two runs) (default: {DEFAULTS['method']})",
    )
    parser.add_argument(
        "--direction",
        choices=("denoising", "noising"),
        help="denoising: restore clean values into the corrupted run (default); noising: corrupt the clean run",
    )
    parser.add_argument(
        "--samples", type=positive_int, help=f"with --noise: noise draws averaged (default {DEFAULTS['samples']})"
    )
    parser.add_argument(
        "--seed",
        type=int,
        help=f"with --noise: seeds the noise; with an estimate: the sampled check's draw (default {DEFAULTS['seed']})",
    )
    parser.add_argument(
        "--check-sites",
        type=non_negative_int,
        metavar="N",
        help="with an estimate (atp, atp*, relp, atp-ig): also patch N sites of each kind exactly (a third the "
        "estimates' strongest, the rest drawn with --seed and weighted by the sites each stands for; about "
        "N x kinds / --batch-size forward passes, read "
        "from the sweep at no cost with exact) and print each estimate's correlation with exact on them, with a "
        f"warning below r {CHECK_THRESHOLD}; 0: no check (default {DEFAULTS['check_sites']})",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        help=f"rows per forward pass of the exact sweep (default {DEFAULTS['batch_size']})",
    )
    parser.add_argument(
        "--head-position",
        type=int,
        metavar="N",
        help="patch each head at token N only (-1: the last) instead of at every position",
    )
    _add_knockout_arguments(parser)


# (flag, type, metavar, help) of the options of --sites knockout (their defaults: None, or `DEFAULTS`)
KNOCKOUT_OPTIONS = (
    (
        "--knockout-target",
        int,
        "N",
        "the query token whose attention edges are blocked (-1: the last; default: the predicting token, the "
        "last or a classifier's first)",
    ),
    (
        "--knockout-window",
        positive_int,
        "K",
        f"block the edge in K layers centred on each layer (default {DEFAULTS['knockout_window']}; Geva et al. "
        "use 9 in GPT-2 XL)",
    ),
    ("--knockout-sources", str, "N,N", "the key tokens swept, comma-separated (-1: the last; default: all)"),
)


def _add_knockout_arguments(parser: argparse.ArgumentParser) -> None:
    """Where ``--sites knockout`` blocks attention edges."""
    for flag, kind, metavar, text in KNOCKOUT_OPTIONS:
        parser.add_argument(flag, type=kind, metavar=metavar, help=f"with --sites knockout: {text}")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """A file of pairs, the output folder, --overwrite, the run engine's options for a --file run,
    the device and the progress bar."""
    parser.add_argument("--file", type=Path, metavar="PAIRS.jsonl", help="patch every prompt pair of a file")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="output folder")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an earlier run's files in --out (other files are kept)"
    )
    add_run_arguments(parser.add_argument_group("runs of a --file (docs/runs.md)"), overwrite=False, scope="--file: ")
    add_loading_arguments(parser)
    parser.add_argument(
        "--quiet", "-q", action="store_true", help="no progress lines, bar or summary: only the paths written"
    )


def _add_other_analyses(parser: argparse.ArgumentParser) -> None:
    """Instead of the site sweep: methods against exact patching (--versus), or edge scores (--edges)."""
    parser.add_argument(
        "--versus",
        metavar="METHODS",
        help="instead: per layer, the Spearman correlation between exact residual patching and each of "
        "rollout,rollout_above,flow,grad_rollout,attnlrp,gim,routes,routes_counterfactual (comma-separated; "
        "'all'); writes versus.json",
    )
    parser.add_argument(
        "--edges",
        choices=("eap", "eap-ig"),
        help="instead: score every edge between embeddings, heads, MLPs and logits (pre-norm models) and "
        "print the top edges and the faithfulness of the top-k circuits; writes edges.json",
    )
    parser.add_argument(
        "--steps", type=positive_int, help=f"with --edges eap-ig: interpolation steps (default {DEFAULTS['steps']})"
    )


def run(args: argparse.Namespace) -> int:
    """Check the flags and the output folder (before the model loads), then run the chosen analysis
    (a --file run on the run engine, whose run folder checks --out before the model loads)."""
    mode = _mode(args)
    _check_flags(args, mode)
    if mode == "file":
        paths = run_file(args)
    else:
        _check_out(args)
        say = Progress(args.quiet)
        say(f"loading {args.model} …")
        model = load_model(args.model, args.device, args.quiet, args.dtype)
        paths = {"versus": run_versus, "edges": run_edges, "sweep": run_sweep}[mode](args, model, say)
    print(" ".join(str(path) for path in paths))
    return 0


def owned(name: str) -> bool:
    """Whether an entry of ``--out`` is something `attnflow patch` writes (an earlier run's output)."""
    return name in OUTPUT_FILES


def _mode(args: argparse.Namespace) -> str:
    """Which analysis the flags ask for: ``file`` (pairs), ``versus``, ``edges`` or ``sweep``."""
    if args.file is not None:
        return "file"
    if args.versus and args.edges:
        raise InputError("--versus and --edges are two analyses: run them one at a time (drop --edges or --versus)")
    return "versus" if args.versus else "edges" if args.edges else "sweep"


_KNOCKOUT = ("knockout_target", "knockout_window", "knockout_sources")  # read only with --sites knockout
# What each analysis reads besides the model, the device, --out and --quiet: a flag outside its
# set would be ignored, so it is refused instead (one line, before the model loads).
_RUNS = ("resume", "checkpoint_every", "engine", "workers", "ray_address")  # the run engine's: --file only
_READS = {
    "file": {"file", "sites", "method", "direction", "samples", "seed", "batch_size", "head_position", "check_sites"}
    | {*_KNOCKOUT, *_RUNS},
    "versus": {"text", "corrupt", "target", "contrast", "versus", "batch_size"},
    "edges": {"text", "corrupt", "target", "contrast", "edges", "steps"},
    "sweep": {"text", "corrupt", "noise", "target", "contrast", "sites", "method", "direction", "samples", "seed"}
    | {"batch_size", "head_position", "check_sites", *_KNOCKOUT},
}
_FLAGS = {
    "text": "TEXT",
    "corrupt": "--corrupt",
    "noise": "--noise",
    "target": "--target",
    "contrast": "--contrast",
    "sites": "--sites",
    "method": "--method",
    "direction": "--direction",
    "samples": "--samples",
    "seed": "--seed",
    "batch_size": "--batch-size",
    "head_position": "--head-position",
    "file": "--file",
    "resume": "--resume",
    "checkpoint_every": "--checkpoint-every",
    "engine": "--engine",
    "workers": "--workers",
    "ray_address": "--ray-address",
    "versus": "--versus",
    "edges": "--edges",
    "steps": "--steps",
    "check_sites": "--check-sites",
    "knockout_target": "--knockout-target",
    "knockout_window": "--knockout-window",
    "knockout_sources": "--knockout-sources",
}
_WHAT = {
    "file": "--file (the pairs file holds the texts, targets and contrasts)",
    "versus": "--versus (exact residual patching of TEXT --corrupt TEXT against each method)",
    "edges": "--edges (edge scores of TEXT --corrupt TEXT)",
    "sweep": "the site sweep",
}


def _check_flags(args: argparse.Namespace, mode: str) -> None:
    """One line for a flag the chosen analysis would ignore, and for what it lacks."""
    given = [
        dest
        for dest in _FLAGS
        if getattr(args, dest) not in (None, False) and (dest, args.engine) != ("engine", "local")
    ]
    ignored = [dest for dest in given if dest not in _READS[mode]]
    why = ""
    if mode == "sweep" and args.noise is None and {"samples", "seed"} & set(given):
        estimates = [name for name in (args.method or DEFAULTS["method"]).split(",") if name.strip() != "exact"]
        draws = ("samples",) if estimates and args.check_sites != 0 else ("samples", "seed")
        ignored += [dest for dest in draws if dest in given]
        why = " with --corrupt (--samples and --seed draw the noise of --noise; --seed also the sampled check's sites)"
    if mode == "edges" and args.edges != "eap-ig" and "steps" in given:
        ignored.append("steps")
        why = " eap (--steps are the interpolation steps of --edges eap-ig)"
    if mode in ("sweep", "file") and "knockout" not in (args.sites or "") and set(_KNOCKOUT) & set(given):
        ignored += [dest for dest in _KNOCKOUT if dest in given]
        why = " without knockout sites (--sites ...,knockout)"
    if ignored:
        flags = ", ".join(_FLAGS[dest] for dest in dict.fromkeys(ignored))
        them = "them" if len(set(ignored)) > 1 else "it"
        raise InputError(f"{flags} would be ignored by {_WHAT[mode]}{why}: drop {them}")
    if mode == "file":
        return
    if not args.text:
        raise InputError("give the clean TEXT (or --file PAIRS.jsonl)")
    if mode != "sweep" and args.corrupt is None:
        raise InputError(f"{_WHAT[mode]} needs a counterfactual: give --corrupt TEXT")
    if args.corrupt is None and args.noise is None:
        raise InputError("give --corrupt TEXT (same token length) or --noise WORDS")


def _check_out(args: argparse.Namespace) -> None:
    """An earlier run's files in ``--out`` need --overwrite, and ``--out`` must be writable: checked
    before the model loads (a --file run's folder: `attnflow.runs.checkpoint.RunFolder`)."""
    from attnflow.staging import check_writable, refuse_occupied

    refuse_occupied(args.out, owned, args.overwrite)
    check_writable(args.out)


def _sweep_options(args: argparse.Namespace) -> dict[str, Any]:
    """`attnflow.causal.patch`'s keywords from the flags, `DEFAULTS` where a flag was left out."""
    from attnflow.causal.api import parse_methods
    from attnflow.causal.sites import SITE_KINDS, parse_site_kinds

    def given(name: str) -> Any:
        value = getattr(args, name)
        return DEFAULTS[name] if value is None else value

    return {
        "sites": parse_site_kinds(args.sites or SITE_KINDS),
        "methods": parse_methods(given("method")),
        "direction": given("direction"),
        "samples": given("samples"),
        "seed": given("seed"),
        "batch_size": given("batch_size"),
        "head_position": args.head_position,
        "knockout_target": args.knockout_target,
        "knockout_window": given("knockout_window"),
        "knockout_sources": _positions(args.knockout_sources),
        "progress": not args.quiet,
        **({} if getattr(args, "check_sites", None) is None else {"check_sites": args.check_sites}),
    }


def _positions(text: str | None) -> list[int] | None:
    """``"1,-1"`` -> [1, -1] (None stays None)."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--knockout-sources takes comma-separated token positions, got {text!r}") from None


def run_file(args: argparse.Namespace) -> list[Path]:
    """``--file``: every pair patched into ``--out`` on the run engine (checkpointed, ``--resume``,
    ``--engine ray``: docs/runs.md); an earlier run's files of any analysis need --resume or --overwrite."""
    from attnflow.causal.dataset import ROWS, patch_file

    quiet_loading(args.quiet)
    summary = patch_file(
        args.model, args.file, args.out, resume=args.resume, overwrite=args.overwrite, engine=engine_options(args),
        dtype=args.dtype, owned=owned, **_sweep_options(args),
    )  # fmt: skip
    if not args.quiet:
        for method, kinds in summary["correlations"].items():
            agreement = ", ".join(f"{kind} r={values['pooled_pearson']:.2f}" for kind, values in kinds.items())
            print(f"{method} vs exact (pooled): {agreement}")
        print(f"{summary['pairs']} pairs ({len(summary['failed'])} left out)")
    return [args.out / "summary.html", args.out / "summary.json", args.out / ROWS]


def run_sweep(args: argparse.Namespace, model: Any, say: Progress) -> list[Path]:
    """One pair: every site of the chosen kinds, ``patch.json`` and ``patch.html``."""
    from attnflow.causal import patch
    from attnflow.staging import staged_output

    options = _sweep_options(args)
    say(f"patching with {', '.join(options['methods'])} …")
    result = patch(model, args.text, args.corrupt, noise=args.noise, target=target_of(args), **options)
    with staged_output(args.out, owned, args.overwrite) as scratch:
        result.save(scratch)
    if not args.quiet:
        print(result.summary())
    return [args.out / "patch.html", args.out / "patch.json"]


def run_versus(args: argparse.Namespace, model: Any, say: Progress) -> list[Path]:
    """``--versus``: one pair's per-layer Spearman table (`attnflow.causal.versus`), printed and
    written to ``--out``/versus.json and versus.html."""
    import numpy as np

    from attnflow.causal.report import versus_html
    from attnflow.causal.versus import VERSUS_METHODS, compare_with_patching, format_table, parse_versus_methods
    from attnflow.staging import staged_output

    methods = VERSUS_METHODS if args.versus == "all" else parse_versus_methods(args.versus)
    say(f"comparing exact residual patching with {', '.join(methods)} …")
    comparison = compare_with_patching(
        model,
        args.text,
        args.corrupt,
        target=target_of(args),
        methods=methods,
        batch_size=args.batch_size or DEFAULTS["batch_size"],
        progress=not args.quiet,
    )
    rhos = comparison.spearman()  # one pair: no standard error
    table = {method: {"mean": values, "se": np.full_like(values, np.nan)} for method, values in rhos.items()}
    data = {**comparison.to_dict(), "spearman": {method: values.tolist() for method, values in rhos.items()}}
    with staged_output(args.out, owned, args.overwrite) as scratch:
        (scratch / "versus.json").write_text(json.dumps(data), encoding="utf-8")
        (scratch / "versus.html").write_text(versus_html(comparison, rhos, model.name), encoding="utf-8")
    if not args.quiet:
        print(VERSUS_HEADER)
        print(format_table(table))
    return [args.out / "versus.html", args.out / "versus.json"]


def run_edges(args: argparse.Namespace, model: Any, say: Progress) -> list[Path]:
    """``--edges``: one pair's edge scores (`attnflow.causal.edges`), the ten strongest edges and the
    faithfulness of the top-k circuits, printed and written to ``--out``/edges.json and edges.html."""
    from attnflow.causal.edges import edge_scores
    from attnflow.causal.report import TOP_EDGES, edges_html
    from attnflow.staging import staged_output

    steps = args.steps or DEFAULTS["steps"]
    how = f"{args.edges}, {steps} steps" if args.edges == "eap-ig" else args.edges
    say(f"scoring every edge ({how}), then patching the top-k circuits …")
    result = edge_scores(model, args.text, args.corrupt, target=target_of(args), method=args.edges, steps=steps)
    with staged_output(args.out, owned, args.overwrite) as scratch:
        (scratch / "edges.json").write_text(json.dumps(result.to_dict()), encoding="utf-8")
        (scratch / "edges.html").write_text(edges_html(result, model.name), encoding="utf-8")
    if not args.quiet:
        print(f"top {TOP_EDGES} edges by |score| (upstream -> downstream, normalised score):")
        for up, down in result.top_edges(TOP_EDGES):
            print(f"{result.upstream[up]:>8} -> {result.downstream[down]:<8} {result.scores[up, down]:+.3f}")
        print("faithfulness: " + ", ".join(f"top {k} {value:.2f}" for k, value in result.faithfulness.items()))
    return [args.out / "edges.html", args.out / "edges.json"]
