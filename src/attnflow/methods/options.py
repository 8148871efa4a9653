"""The options that several methods share, declared once (`Option`: name, help, parser, flag).

A method lists the ones it takes in its `register` call; the CLI builds one flag per option name.
The parsers turn command-line text into values and raise ValueError with a one-line reason.
"""

from __future__ import annotations

from typing import Any

from attnflow.errors import InputError
from attnflow.methods.registry import Option


def number(text: str, kind: type, expected: str | None = None) -> Any:
    """``kind(text)`` (int or float; NaN refused) or a ValueError saying what was expected."""
    try:
        value = kind(text)
    except ValueError:
        raise InputError(f"expected {expected or kind.__name__}, got {text!r}") from None
    if kind is float and value != value:
        raise InputError(f"expected a number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """Command-line text -> an integer >= 1 (ValueError with a message otherwise)."""
    value = number(text, int)
    if value < 1:
        raise InputError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """Command-line text -> an integer >= 0."""
    value = number(text, int)
    if value < 0:
        raise InputError(f"must be an integer >= 0, got {text}")
    return value


def ratio(text: str) -> float:
    """Command-line text -> a number in [0, 1)."""
    value = number(text, float)
    if not 0.0 <= value < 1.0:
        raise InputError(f"must lie in [0, 1), got {text}")
    return value


def residual(text: str) -> str | float:
    """Command-line text -> a residual mode (half, renorm, none, norm) or a weight in [0, 1]."""
    if text in ("half", "renorm", "none", "norm"):
        return text
    value = number(text, float, "half, renorm, none, norm or a number in [0, 1]")
    if not 0.0 <= value <= 1.0:
        raise InputError(f"a residual weight must lie in [0, 1], got {text}")
    return value


def head_weights(text: str) -> list[float]:
    """Command-line ``"w1,w2,..."`` -> non-negative head weights, not all zero."""
    weights = [number(part.strip(), float, "comma-separated numbers") for part in text.split(",") if part.strip()]
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise InputError(f"need non-negative head weights, not all zero, got {text!r}")
    return weights


HEAD_FUSION = Option(
    "head_fusion",
    "fuse heads: mean (default), max, min; none: one matrix per head (per-head rollout or flow, averaged)",
    choices=("mean", "max", "min", "none"),
)
HEAD_WEIGHTS = Option(
    "weights",
    "weighted head fusion, one weight per head (normalised; instead of --head-fusion)",
    parse=head_weights,
    metavar="W1,W2,..",
    flag="--head-weights",
)
RESIDUAL = Option(
    "residual",
    "residual correction: half (default), renorm, none, a weight ALPHA in [0, 1], or norm (norm_rollout only)",
    parse=residual,
    metavar="half|renorm|none|ALPHA|norm",
)
START_LAYER = Option("start_layer", "first layer composed (default: 0)", parse=non_negative_int, metavar="N")
TOP_K = Option("top_k", "keep the K largest entries of each row", parse=positive_int, metavar="K")
THRESHOLD = Option("threshold", "drop entries below T in each row (T in [0, 1))", parse=ratio, metavar="T")
DISCARD_RATIO = Option(
    "discard_ratio", "drop the smallest fraction Q of each row (Q in [0, 1))", parse=ratio, metavar="Q"
)
PRUNE_ON = Option(
    "prune_on",
    "what --top-k/--threshold/--discard-ratio prune: the head-fused attention before the residual is added "
    "(default), or the residual-corrected matrix (its diagonal is >= 1/2, so strong pruning keeps only the diagonal)",
    choices=("attention", "residual"),
)
LAYER = Option(
    "layer",
    "raw, norm: the layer shown (0-based, negative from the end; default: the last); "
    "flow: flows from the output of the first N layers (1..L; default: L)",
    parse=int,
    metavar="N",
)
SEED = Option("seed", "seed of the random scores (default: 0)", parse=non_negative_int, metavar="S")
N_STEPS = Option("n_steps", "integration steps (default: 32)", parse=positive_int, metavar="N", flag="--steps")
BATCH_SIZE = Option(
    "batch_size",
    "altered inputs per forward pass of perturbation methods (default: 32)",
    parse=positive_int,
    metavar="N",
    flag="--perturbation-batch",
)
KEEP_IDENTITY = Option(
    "keep_identity", "grad_rollout: keep the identity R starts from (Chefer et al.'s R itself)", parse=None
)
SIGNED = Option(
    "signed",
    "grad_x_input, integrated_gradients: signed scores (the sum over embedding dimensions: > 0 for the target, "
    "< 0 against it) instead of norms",
    parse=None,
)
