"""What `--method auto` says beside its badge on short factual prompts (docs/methods.md).

Two sets of 8 short factual prompts (tests/evaluate/short_facts.json), none from the docs: ``tune``, the set the rule of
`attnflow.explanation.faithfulness_level` was set on (also `tests/evaluate/test_per_input.py`'s), and
``held-out``, not used to set it. For each prompt, auto on ``--model`` (leave-one-out and random
rankings beside it): the next token and its probability, auto's choice and its AOPC comprehensiveness,
its NAOPC (the badge), random rankings' mean and each of their 5 draws, leave-one-out's AOPC, the exact
bounds, the level (the badge's colour) under the rule and under the previous one (above random's mean
by half of it), and whether auto warned, and how.

    OMP_NUM_THREADS=1 python benchmarks/bench_auto_warning.py [--model smollm2] [--set tune|held-out|both]
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import numpy as np

import attnflow
from attnflow.evaluate import per_input
from attnflow.explanation import faithfulness_level

# The prompts: tests/evaluate/short_facts.json ("tune" is also the test's set).
SETS: dict[str, list[str]] = json.loads(
    (Path(__file__).resolve().parent.parent / "tests" / "evaluate" / "short_facts.json").read_text(encoding="utf-8")
)


def previous_level(record: dict) -> str:
    """The rule before: no better than random's mean, or above it by less than half of it (or 0.01)."""
    mine, chance = record["aopc_comprehensiveness"], record["random"]["aopc_comprehensiveness"]
    if mine <= chance:
        return "weak"
    return "marginal" if mine - chance < max(0.5 * chance, 0.01) else "clear"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--set", choices=[*SETS, "both"], default="both")
    args = parser.parse_args()
    model = attnflow.load(args.model, progress=False)
    plan = per_input.plan_methods(model, ["auto", "leave_one_out", "random"], {})
    for name in SETS if args.set == "both" else [args.set]:
        counts: dict[str, int] = {}
        for text in SETS[name]:
            trace = model.trace_for(list(plan.per_method), text)[0]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                auto, loo, _ = per_input.explain_planned(model, trace, plan)
            record = auto.faithfulness
            said = [str(w.message).split(":")[0] for w in caught if "on this input" in str(w.message)]
            level, before = faithfulness_level(record), previous_level(record)
            for key in (f"now {level}", f"before {before}"):
                counts[key] = counts.get(key, 0) + 1
            draws = ", ".join(f"{d:.3f}" for d in record["random"]["draws"])
            print(
                f"[{name}] {text!r} -> {record['target']!r} (p {record['probability']:.3f}): {auto.method} "
                f"{record['aopc_comprehensiveness']:.3f}, NAOPC {record['naopc_comprehensiveness']:.3f}; random "
                f"{record['random']['aopc_comprehensiveness']:.3f} ({draws}); leave_one_out "
                f"{loo.faithfulness['aopc_comprehensiveness']:.3f}; bounds "
                f"{np.round(record['bounds']['comprehensiveness'], 3).tolist()}; level {level} (before: {before}); "
                f"said: {said or 'nothing'}",
                flush=True,
            )
        print(f"[{name}] " + ", ".join(f"{key}: {value}" for key, value in sorted(counts.items())))


if __name__ == "__main__":
    main()
