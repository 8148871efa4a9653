"""Fast estimates of every site's patching effect from one forward and one backward pass.

Each estimates Δm(site) = m(base run with the site set to its source value) − m(base run):

- ``atp`` (attribution patching, Nanda 2023): (a_source − a_base) · ∂m/∂a on the base run;
- ``atp*`` (Kramár et al. 2024, GradDrop): for each layer ℓ, AtP with no gradient flowing back
  through layer ℓ's attention and MLP outputs (only through its skip connection); the estimate is
  Σ_ℓ |AtP_ℓ| / (L − 1), the paper's guard against paths that cancel, given AtP's sign so that it
  compares with signed effects. (The paper's other fix, recomputing the attention softmax for
  patched queries and keys, concerns query and key sites, which a sweep of outputs does not have.)
- ``relp`` (arXiv 2508.21258): (a_source − a_base) · ∂̃m/∂a with ∂̃ the AttnLRP rules' backward
  (`attnflow.methods.model.lrp`, rule set ``attnlrp``) instead of the gradient; ``relp:NAME`` takes
  any registered rule set NAME instead (``relp:gim``, or one of your own: `register_rules`).
- ``atp-ig`` (integrated gradients along the path between the two runs, as EAP-IG does for edges,
  Hanna et al. 2024): (a_source − a_base) · the mean of ∂m/∂a over `IG_STEPS` runs whose word
  embeddings lie on the straight line from the base run's to the source run's, at the midpoints
  α = (k + ½) / `IG_STEPS`; one forward and one backward pass of `IG_STEPS` × samples rows. AtP
  reads the gradient at the base run only (α = 0), where a saturated softmax or a non-linearity
  the patch crosses hides the effect.

Arrays per site kind as in `attnflow.causal.sites`; each is averaged over the base run's samples.
Each kind's row in the site table says how its products are summed per site (``dot``); a kind
without one (the knockout, an intervention with no value to differentiate along) is not estimated.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Sequence

import numpy as np
import torch

from attnflow.causal.patching import BaseRun, PatchRunner, stacked
from attnflow.causal.sites import site_kind

APPROXIMATIONS = ("atp", "atp*", "relp", "atp-ig")
IG_STEPS = 3  # points of the path `atp-ig` averages the gradient over
RELP_DEFAULT_RULES = "attnlrp"


def relp_rules(method: str) -> Any:
    """The rule set (`attnflow.methods.model.lrp.BackwardRules`) of a RelP method: ``relp`` ->
    AttnLRP's, ``relp:NAME`` -> the registered NAME; None for a method that is not RelP or names no
    registered rule set."""
    from attnflow.methods.model.lrp import RULES

    if method == "relp":
        return RULES[RELP_DEFAULT_RULES]
    prefix, _, name = method.partition(":")
    return RULES.get(name) if prefix == "relp" and name else None


def estimate(
    method: str, runner: PatchRunner, base: BaseRun, kinds: tuple[str, ...], head_position: int | None = None
) -> dict[str, np.ndarray]:
    """Δm estimated by ``method`` (`APPROXIMATIONS`) per site kind in ``kinds`` that the approximations
    estimate (`estimable`), for the ``base`` run patched with its source (broadcast over samples);
    heads patched at ``head_position`` only, or everywhere."""
    kinds = estimable(kinds)
    if method == "atp*":
        return _graddrop(runner, base, kinds, head_position)
    if method == "atp-ig":
        return _integrated(runner, base, kinds, head_position)
    rules = None
    rule_set = relp_rules(method)
    if rule_set is not None:
        from attnflow.methods.model.lrp import backward_rules

        rules = backward_rules(runner.model, rule_set)
    gradients, activations = _gradients(runner, base.input_ids, base.noise, base.samples, rules)
    return {
        kind: runner.modules.spread(
            kind, _dot(kind, base.source[kind], activations[kind], gradients[kind], runner.n_heads, head_position)
        ).mean(axis=0)
        for kind in kinds
    }


def _gradients(
    runner: PatchRunner,
    input_ids: torch.Tensor,
    noise: torch.Tensor | None,
    rows: int,
    rules: Any = None,
    drop_gradient_rows: dict[int, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """∂m/∂a (or the rules' ∂̃m/∂a) and a itself at every site of the base run, stacked like `stacked`."""
    with torch.enable_grad(), rules if rules is not None else nullcontext():
        metric, recorded = runner.forward(
            input_ids, rows, noise=noise, record=True, leaf_embeddings=True, drop_gradient_rows=drop_gradient_rows
        )
        kinds = list(recorded)
        tensors = [tensor for kind in kinds for tensor in recorded[kind]]
        grads = torch.autograd.grad(metric.sum(), tensors, allow_unused=True)
    gradients: dict[str, torch.Tensor] = {}
    start = 0
    for kind in kinds:
        count = len(recorded[kind])
        layer_grads = [
            torch.zeros_like(tensor) if grad is None else grad
            for tensor, grad in zip(tensors[start : start + count], grads[start : start + count], strict=True)
        ]
        gradients[kind] = torch.stack(layer_grads, dim=1)
        start += count
    return gradients, stacked(recorded)


def estimable(kinds: Sequence[str]) -> tuple[str, ...]:
    """The kinds of ``kinds`` whose row says how the approximations sum a site (``dot``)."""
    return tuple(kind for kind in kinds if site_kind(kind).dot is not None)


def _dot(
    kind: str,
    source: torch.Tensor,
    base: torch.Tensor,
    gradient: torch.Tensor,
    n_heads: int,
    head_position: int | None = None,
) -> np.ndarray:
    """(a_source − a_base) · gradient per sample and site: ``[sample, layer, position]`` or
    ``[sample, layer, head]`` (a head summed over every position, or read at ``head_position``)."""
    rows = len(base)
    difference = source.repeat(rows // len(source), 1, 1, 1) - base  # source: 1 or a divisor of rows samples
    product = (difference.double() * gradient.double()).cpu()  # [sample, layer, token, width]
    dot = site_kind(kind).dot
    assert dot is not None  # `estimable` kinds only
    return dot(product, head_position, n_heads).numpy()


def _graddrop(
    runner: PatchRunner, base: BaseRun, kinds: tuple[str, ...], head_position: int | None = None
) -> dict[str, np.ndarray]:
    """AtP* (GradDrop): one forward and one backward pass of ``L × samples`` rows, rows of group ℓ
    passing no gradient through layer ℓ's attention and MLP outputs."""
    n_layers, samples = runner.n_layers, base.samples
    rows = n_layers * samples
    group = torch.arange(rows) // samples  # [rows] the dropped layer of each row
    drops = {layer: group == layer for layer in range(n_layers)}
    batch_noise = None if base.noise is None else base.noise.repeat(n_layers, 1, 1)
    gradients, activations = _gradients(runner, base.input_ids, batch_noise, rows, drop_gradient_rows=drops)
    plain, plain_activations = _gradients(runner, base.input_ids, base.noise, samples)
    estimates = {}
    for kind in kinds:
        source = base.source[kind]
        dropped = _dot(kind, source, activations[kind], gradients[kind], runner.n_heads, head_position)  # [rows, ...]
        per_layer = dropped.reshape(n_layers, samples, *dropped.shape[1:])  # [dropped layer, sample, ...]
        magnitude = np.abs(per_layer).sum(axis=0) / max(n_layers - 1, 1)  # [sample, ...]
        sign = np.sign(_dot(kind, source, plain_activations[kind], plain[kind], runner.n_heads, head_position))
        estimates[kind] = runner.modules.spread(kind, (sign * magnitude).mean(axis=0))
    return estimates


def _integrated(
    runner: PatchRunner,
    base: BaseRun,
    kinds: tuple[str, ...],
    head_position: int | None = None,
    steps: int | None = None,
) -> dict[str, np.ndarray]:
    """AtP with the gradient averaged along the path from the base run's word embeddings to the
    source run's (`IG_STEPS` midpoints, one batch of ``steps × samples`` rows), times the difference
    of the activations between the two runs."""
    if base.source_embeddings is None:
        raise ValueError("atp-ig needs the source run's word embeddings (BaseRun.source_embeddings)")
    steps = steps or IG_STEPS
    samples = base.samples
    start = base.embeddings(runner)  # [1 or samples, token, d_model]
    offset = (base.source_embeddings.to(start.device, start.dtype) - start).expand(samples, -1, -1)
    alphas = (torch.arange(steps, dtype=start.dtype, device=start.device) + 0.5) / steps  # [step]
    base_noise = torch.zeros_like(offset) if base.noise is None else base.noise.to(start.device, start.dtype)
    noise = (base_noise[None] + alphas[:, None, None, None] * offset[None]).reshape(steps * samples, *offset.shape[1:])
    gradients, _ = _gradients(runner, base.input_ids, noise, steps * samples)
    with torch.no_grad():
        _, recorded = runner.forward(base.input_ids, samples, noise=base.noise, record=True)
    activations = stacked(recorded)
    return {
        kind: runner.modules.spread(
            kind,
            _dot(
                kind,
                base.source[kind],
                activations[kind],
                gradients[kind].reshape(steps, samples, *gradients[kind].shape[1:]).mean(dim=0),
                runner.n_heads,
                head_position,
            ).mean(axis=0),
        )
        for kind in kinds
    }
