"""Leave-one-out, value zeroing and integrated gradients: methods that run the model again.

Each takes the `AttentionModel` and the `Trace` of the unaltered input (whose ``target`` fixes the
class or token, so that every altered input is scored for the same output) and returns numpy:
``[token]`` scores (leave-one-out, integrated gradients) or a ``[query, key]`` matrix (value
zeroing). Torch is imported inside the functions: registering them costs nothing.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from attnflow.errors import ExplanationWarning
from attnflow.methods import options
from attnflow.methods.registry import register
from attnflow.methods.relevance import GRADIENT_FAMILIES, POST_LN_FAMILIES
from attnflow.methods.rollout import rollout
from attnflow.trace import Trace

COMPLETENESS_TOLERANCE = 0.05  # integrated gradients: a larger relative completeness error is reported


def _objective(model: Any, trace: Trace) -> Any:
    from attnflow.targets import Objective

    if trace.target is None:
        raise ValueError("this method needs the trace's target: use model.explain(text, method=...)")
    return Objective.for_target(model, trace.target)


@register(
    "leave_one_out",
    "leave-one-out: y(x) - y(x without token j), tokens removed from the ids (one score per token)",
    takes="model",
    needs=("attentions", "target", "model"),
    options=(options.BATCH_SIZE,),
    families=GRADIENT_FAMILIES,
    scores_only=True,
    signed=True,
    cost="expensive",
)
def leave_one_out(model: Any, trace: Trace, batch_size: int = 32) -> np.ndarray:
    """``[token]`` y(x) − y(x with token j removed) for content tokens; special tokens score 0.

    The altered sequences are rebuilt from the ids (token j deleted, nothing re-tokenised) and
    scored in batches for the target class/token of the unaltered input.
    """
    import torch

    objective = _objective(model, trace)
    ids = np.asarray(trace.token_ids)
    content = np.flatnonzero(~np.asarray(trace.special_mask))
    index = trace.target.index
    scores = np.zeros(len(ids))
    with torch.no_grad():
        reference = _score(objective, ids[None], index, model.device)[0]
        for start in range(0, len(content), max(1, batch_size)):
            removed = content[start : start + batch_size]
            variants = np.stack([np.delete(ids, j) for j in removed])  # [batch, n - 1], no padding needed
            scores[removed] = reference - _score(objective, variants, index, model.device)
    return scores


def _score(objective: Any, ids: np.ndarray, index: int | None, device: Any) -> np.ndarray:
    import torch

    input_ids = torch.as_tensor(ids, dtype=torch.long, device=device)
    fixed = None if index is None else torch.full((len(ids),), index, device=device)
    y, _, _ = objective(torch.ones_like(input_ids), input_ids=input_ids, index=fixed)
    return y.double().cpu().numpy()


@register(
    "integrated_gradients",
    "integrated gradients (captum, on the word embeddings; pad-token baseline, special tokens kept)",
    takes="model",
    needs=("attentions", "target", "model"),
    options=(options.N_STEPS,),
    families=GRADIENT_FAMILIES,
    scores_only=True,
    cost="expensive",
)
def integrated_gradients(model: Any, trace: Trace, n_steps: int = 32, internal_batch_size: int = 16) -> np.ndarray:
    """``[token]`` ‖IG_j‖₂ of `integrated_gradient_attributions`. When the completeness error
    (captum's convergence delta) exceeds `COMPLETENESS_TOLERANCE` of |y(x) − y(baseline)|, an
    `ExplanationWarning` says so (and the Explanation keeps it in its notes)."""
    attributions, delta, difference = integrated_gradient_attributions(
        model, trace, n_steps, internal_batch_size, return_delta=True
    )
    if abs(delta) > COMPLETENESS_TOLERANCE * max(abs(difference), 1e-12):
        warnings.warn(
            f"integrated gradients: completeness error {abs(delta):.3g} is "
            f"{100 * abs(delta) / max(abs(difference), 1e-12):.0f} % of y(x) - y(baseline) = {difference:.3g} "
            f"with {n_steps} steps; raise --steps",
            ExplanationWarning,
            stacklevel=2,
        )
    return np.linalg.norm(attributions, axis=-1)


def integrated_gradient_attributions(
    model: Any, trace: Trace, n_steps: int = 32, internal_batch_size: int = 16, return_delta: bool = False
) -> Any:
    """``[token, d_model]`` captum's layer integrated gradients on the word-embedding layer, from a
    baseline whose content tokens are the pad token (special tokens kept), ``n_steps`` steps.
    They sum to y(x) − y(baseline) up to the integral's discretisation error; ``return_delta``
    also returns that error (captum's convergence delta, attributions' sum minus the difference)
    and the difference y(x) − y(baseline): ``(attributions, delta, difference)``."""
    import torch
    from captum.attr import LayerIntegratedGradients

    if isinstance(n_steps, bool) or int(n_steps) != n_steps or n_steps < 1:
        raise ValueError(f"n_steps must be a positive integer, got {n_steps}")
    objective = _objective(model, trace)
    input_ids = torch.as_tensor(np.asarray(trace.token_ids), dtype=torch.long, device=model.device)[None]
    baseline = input_ids.clone()
    baseline[0, torch.as_tensor(~np.asarray(trace.special_mask))] = model.tokenizer.pad_token_id
    index = trace.target.index

    def forward(ids: torch.Tensor) -> torch.Tensor:
        fixed = None if index is None else torch.full((len(ids),), index, device=ids.device)
        return objective(torch.ones_like(ids), input_ids=ids, index=fixed)[0]

    integrated = LayerIntegratedGradients(forward, model.model.get_input_embeddings())
    attributions, delta = integrated.attribute(
        input_ids,
        baselines=baseline,
        n_steps=int(n_steps),
        internal_batch_size=internal_batch_size,
        return_convergence_delta=True,
    )  # [1, token, d_model], [1]
    result = attributions[0].double().detach().cpu().numpy()
    if not return_delta:
        return result
    with torch.no_grad():
        difference = float(forward(input_ids)[0] - forward(baseline)[0])
    return result, float(delta[0]), difference


@register(
    "value_zeroing",
    "value zeroing (Mohebbi et al.): 1 - cos of each layer's output with token j's values zeroed, composed",
    takes="model",
    needs=("attentions", "model"),
    options=(options.BATCH_SIZE,),
    families=POST_LN_FAMILIES,
    cost="expensive",
)
def value_zeroing(model: Any, trace: Trace, batch_size: int = 32) -> np.ndarray:
    """``[query, key]`` rollout (no extra residual) of the row-normalised value-zeroing matrices
    VZ⁽ˡ⁾[i, j] = 1 − cos(x̂_i, x̂_i^¬j), x̂ the layer's output and x̂^¬j the output of the same
    layer rerun alone, on the same input, with token j's value vectors zeroed in every head.
    The variants of a layer run as batches of ``batch_size``."""
    import torch

    from attnflow.capture.hooks import find_layers, record_calls, record_tensors

    blocks = find_layers(model.model, model.adapter.values.block)
    value_projections = find_layers(model.model, model.adapter.values.value)
    input_ids = torch.as_tensor(np.asarray(trace.token_ids), dtype=torch.long, device=model.device)[None]
    with record_calls(blocks) as calls, record_tensors(blocks) as outputs, torch.no_grad():
        model.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    n = trace.n_tokens
    matrices = np.zeros((len(blocks), n, n))
    for layer, ((name, block), (_, value_projection)) in enumerate(zip(blocks, value_projections, strict=True)):
        args, kwargs = calls[name]
        original = outputs[name][0]  # [token, d_model]
        for start in range(0, n, max(1, batch_size)):
            zeroed = torch.arange(
                start, min(n, start + batch_size), device=model.device
            )  # variant b zeroes token zeroed[b]

            def zero_value(
                _module: Any, _inputs: Any, output: torch.Tensor, zeroed: torch.Tensor = zeroed
            ) -> torch.Tensor:
                output = output.clone()
                output[torch.arange(len(zeroed)), zeroed] = 0.0  # [variant, token, kv_head * d_head]
                return output

            handle = value_projection.register_forward_hook(zero_value)
            try:
                with torch.no_grad():
                    altered = block(*_repeat(args, len(zeroed)), **_repeat(kwargs, len(zeroed)))
            finally:
                handle.remove()
            altered = altered[0] if isinstance(altered, (tuple, list)) else altered  # [variant, token, d_model]
            # float64: a token that barely moves an output gives 1 - cos near float32's rounding step
            cosine = torch.nn.functional.cosine_similarity(altered.double(), original[None].double(), dim=-1)
            matrices[layer][:, zeroed.cpu().numpy()] = (1.0 - cosine).clamp(min=0.0).T.cpu().numpy()  # [query, variant]
    sums = matrices.sum(axis=-1, keepdims=True)
    matrices = np.divide(matrices, sums, out=np.zeros_like(matrices), where=sums > 0)
    return rollout(matrices[:, None], residual="none")


def _repeat(value: Any, copies: int) -> Any:
    """Repeat every batch-of-one tensor in a layer's call arguments ``copies`` times (batch first)."""
    import torch

    if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == 1:
        return value.expand(copies, *value.shape[1:])
    if isinstance(value, (tuple, list)):
        return type(value)(_repeat(item, copies) for item in value)
    if isinstance(value, dict):
        return {key: _repeat(item, copies) for key, item in value.items()}
    return value
