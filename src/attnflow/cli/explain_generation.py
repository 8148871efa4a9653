"""`attnflow explain PROMPT --generate N` / `--continuation TEXT`: explain every generated token.

One model load, the continuation (greedy, or the given text teacher-forced), then each method
(`attnflow.generation`). Writes DIR/generation.{json,html,png}; with several methods each goes to
DIR/METHOD/ and DIR/comparison.html shows them side by side. With --json and no --out it only
prints the JSON (a list for several methods).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from attnflow.errors import InputError
from attnflow.tokens import display_token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The generation options, in their own group of `attnflow explain`."""
    group = parser.add_argument_group(
        "generation (causal LMs: explain every generated token by what came before it; docs/generation.md)"
    )
    group.add_argument(
        "--generate",
        type=int,
        metavar="N",
        help="generate N tokens greedily after TEXT and explain each one (y_k = log p(t_k | everything before))",
    )
    group.add_argument(
        "--continuation", metavar="TEXT", help="explain this continuation of TEXT token by token (teacher-forced)"
    )
    group.add_argument(
        "--faithfulness",
        action="store_const",
        const=True,
        default=None,
        help="per step: p(t_k) after removing its top sources, as attnflow evaluate does (AOPC per step; "
        "computed anyway when auto chooses)",
    )
    group.add_argument(
        "--steps-per-pass",
        type=int,
        metavar="N",
        help="steps per forward pass (and batched backward) of the target methods (default: 8; more: fewer "
        "passes, more unused positions and memory)",
    )


def wants_generation(args: argparse.Namespace) -> bool:
    return args.generate is not None or args.continuation is not None


def run_generation(args: argparse.Namespace, load: Callable[..., Any], say: Callable[[str], None]) -> int:
    """The generation variant of `attnflow explain` (see the module docstring): ``load(model, device,
    quiet, dtype)`` loads the model, ``say`` reports progress. Default method: auto, the one-pass target
    method whose top sources' removal drops p(t_k) most over the steps (per-step faithfulness of
    every candidate is computed to choose it)."""
    from attnflow.cli.common import given_method_options
    from attnflow.cli.outputs import prepare_output
    from attnflow.generation import (
        DEFAULT_STEPS_PER_PASS,
        explain_planned_generation,
        plan_generation,
        prepare_continuation,
    )

    check_arguments(args)
    out = prepare_output(args)
    say(f"loading {args.model} …")
    model = load(args.model, args.device, args.quiet, args.dtype)
    plan = plan_generation(model, args.method, given_method_options(args))
    say("generating …" if args.generate is not None else "tokenizing the continuation …")
    sequence = prepare_continuation(model, args.text, max_new_tokens=args.generate, continuation=args.continuation)
    say(f"explaining {sequence.n_steps} tokens with {', '.join(plan.per_method)} …")
    explanations = explain_planned_generation(
        model,
        sequence,
        plan,
        args.faithfulness is True,  # auto computes it anyway: it chooses by the per-step faithfulness
        args.steps_per_pass or DEFAULT_STEPS_PER_PASS,
        contrast=getattr(args, "contrast", None),
    )
    chosen_by = next((explanation.chosen_by for explanation in explanations if explanation.chosen_by), None)
    paths = _save(out, explanations, chosen_by, args.overwrite) if out is not None else {}
    if args.json:
        data = [explanation.to_dict() for explanation in explanations]
        json.dump(data[0] if len(data) == 1 else data, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    elif not args.quiet:
        _print_steps(explanations, chosen_by)
        for path in paths.values():
            print(f"wrote {path}")
    return 0


def _save(out: Path, explanations: list[Any], chosen_by: str | None, overwrite: bool) -> dict[str, Path]:
    """Each explanation's files in ``out`` (in ``out/METHOD/`` and a comparison page for several),
    written through a scratch folder; returns what was written, by name."""
    from attnflow.cli.outputs import COMPARISON_FILE, owned
    from attnflow.staging import staged_output
    from attnflow.viz.generation import generation_comparison_html

    paths: dict[str, Path] = {}
    with staged_output(out, owned, overwrite) as scratch:
        for explanation in explanations:
            folder = scratch if len(explanations) == 1 else scratch / explanation.method
            for kind, path in explanation.save(folder).items():
                paths[f"{explanation.method} {kind}"] = out / path.relative_to(scratch)
        if len(explanations) > 1:
            page = generation_comparison_html(explanations, chosen_by)
            (scratch / COMPARISON_FILE).write_text(page, encoding="utf-8")
            paths["comparison"] = out / COMPARISON_FILE
    return paths


def _print_steps(explanations: list[Any], chosen_by: str | None) -> None:
    """The continuation, then per method and step: the token, its probability and its top sources."""
    first = explanations[0]
    print(f"{first.mode} continuation: {first.continuation!r}")
    if chosen_by:
        print(chosen_by)
    for explanation in explanations:
        print(f"{explanation.method}: step, token, p(token), top sources")
        for step in range(explanation.n_steps):
            top = ", ".join(f"{display_token(t)} {score:.3g}" for _, t, score in explanation.top_sources(step))
            token = display_token(explanation.generated[step])
            print(f"  {step + 1:>3} {token:<14} {explanation.probabilities[step]:.3f}  {top}")
        if explanation.faithfulness is not None:
            print(f"  mean AOPC over steps: {explanation.faithfulness['mean_aopc']:.4f}")


def check_arguments(args: argparse.Namespace) -> None:
    """One line for every option that does not go with a generation, before any model loads
    (`attnflow explain` and `attnflow explore`; the options only one of them has are looked up
    with a default)."""
    if args.generate is not None and args.continuation is not None:
        raise InputError("give either --generate N (greedy) or --continuation TEXT (teacher-forced), not both")
    if args.generate is not None and args.generate < 1:
        raise InputError(f"--generate takes the number of new tokens, at least 1; got {args.generate}")
    if args.steps_per_pass is not None and args.steps_per_pass < 1:
        raise InputError(f"--steps-per-pass must be at least 1, got {args.steps_per_pass}")
    if getattr(args, "image", None) is not None or getattr(args, "file", None) is not None:
        raise InputError("--generate / --continuation explain one prompt (TEXT): drop --image / --file")
    if args.text is None:
        raise InputError("--generate / --continuation need a prompt: give TEXT")
    if any(getattr(args, name, None) is not None for name in ("target", "target_token", "target_text")):
        raise InputError("with --generate / --continuation each step's target is its own token: drop --target*")
    if args.row is not None:
        raise InputError("--row does not apply with --generate / --continuation: step k reads the row predicting t_k")
    if args.max_length is not None:
        raise InputError(
            "--max-length does not apply with --generate / --continuation: the prompt is never truncated "
            "(the prompt and the continuation must fit the model's context)"
        )
    if getattr(args, "save_trace", False):
        raise InputError("--save-trace is not available with --generate / --continuation")
