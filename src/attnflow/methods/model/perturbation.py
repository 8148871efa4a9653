"""Leave-one-out, Shapley values, value zeroing and integrated gradients: methods that run the model again.

Each takes the `AttentionModel` and the `Trace` of the unaltered input (whose ``target`` fixes the
class or token, so that every altered input is scored for the same output) and returns numpy:
``[token]`` scores (leave-one-out, shap, integrated gradients) or a ``[query, key]`` matrix (value
zeroing). Torch is imported inside the functions: registering them costs nothing.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import numpy as np

from attnflow.errors import ExplanationWarning, InputError
from attnflow.methods import options
from attnflow.methods.registry import Option, register
from attnflow.methods.relevance import GRADIENTS, POST_LN
from attnflow.methods.rollout import rollout
from attnflow.methods.transforms import normalise_rows
from attnflow.model_like import ModelLike
from attnflow.shared_prefix import forward_batches
from attnflow.trace import Trace

COMPLETENESS_TOLERANCE = 0.05  # integrated gradients: a larger relative completeness error is reported


def _leave_one_out(model: ModelLike, traces: Sequence[Trace], batch_size: int) -> list[np.ndarray]:
    """`leave_one_out` of each trace; the variants of all traces that share an objective are
    scored together (the method's batch form: one batched set of forward passes)."""
    from attnflow.targets import same_objective_groups

    results: list[np.ndarray] = [np.empty(0)] * len(traces)
    for members in same_objective_groups(traces):
        variants: list[tuple[int, ...]] = []
        owners: list[int] = []
        spans = []  # per member: (its unaltered input's position, content positions)
        for k, i in enumerate(members):
            ids = tuple(int(token) for token in traces[i].token_ids)
            content = np.flatnonzero(~np.asarray(traces[i].special_mask))
            spans.append((len(variants), content))
            variants += [ids] + [ids[:j] + ids[j + 1 :] for j in content]
            owners += [k] * (1 + len(content))
        group = [traces[i] for i in members]
        values = target_values(model, group, variants, batch_size, owners, [first for first, _ in spans])
        for i, (first, content) in zip(members, spans, strict=True):
            scores = np.zeros(traces[i].n_tokens)
            scores[content] = values[first] - values[first + 1 : first + 1 + len(content)]
            results[i] = scores
    return results


def _leave_one_out_batch(model: ModelLike, traces: Sequence[Trace], batch_size: int = 32) -> list[np.ndarray]:
    """The batch form of `leave_one_out` (``MethodSpec.batch``): each trace's scores."""
    return _leave_one_out(model, traces, batch_size)


@register(
    "leave_one_out",
    "leave-one-out: y(x) - y(x without token j), tokens removed from the ids (one score per token)",
    takes="model",
    needs=("attentions", "target", "model"),
    options=(options.BATCH_SIZE,),
    requires=GRADIENTS,
    scores_only=True,
    signed=True,
    cost="expensive",
    batch=_leave_one_out_batch,
)
def leave_one_out(model: ModelLike, trace: Trace, batch_size: int = 32) -> np.ndarray:
    """``[token]`` y(x) − y(x with token j removed) for content tokens; special tokens score 0.

    The altered sequences are rebuilt from the ids (token j deleted, nothing re-tokenised) and
    scored in batches for the target class/token of the unaltered input.
    """
    (scores,) = _leave_one_out(model, [trace], batch_size)
    return scores


def target_values(
    model: ModelLike,
    traces: Trace | Sequence[Trace],
    sequences: Sequence[Sequence[int]],
    batch_size: int = 32,
    owners: Sequence[int] | None = None,
    unaltered: Sequence[int] = (0,),
) -> np.ndarray:
    """``[sequence]`` y for token-id sequences of any lengths, each scored for the target of its trace
    (``traces``: one, or several that share one objective, `attnflow.targets.same_objective_groups`;
    ``owners[i]``: the trace of sequence i, default the first): right-padded, sorted by length into
    batches of at most ``batch_size`` sequences, one forward pass per batch without gradients. For a
    causal LM's next token, each sequence's start shared with its trace's unaltered input comes from
    that input's key/value cache (`attnflow.shared_prefix`).

    A trace's resolved target fixes the class or token its sequences are scored for. A trace whose
    target is still to resolve (``Trace.request``) takes the `attnflow.targets.Target`'s own, or what
    its unaltered input (``sequences[unaltered[k]]`` for trace k) predicts, read from this same pass;
    the resolved target is recorded in the trace (no pass of its own)."""
    import torch

    from attnflow.targets import objective_of

    group = [traces] if isinstance(traces, Trace) else list(traces)
    owner = np.zeros(len(sequences), dtype=np.int64) if owners is None else np.asarray(owners, dtype=np.int64)
    objective = objective_of(model, group[0])
    resolved = group[0].target is not None
    lengths = [len(sequence) for sequence in sequences]
    values = np.zeros(len(sequences))
    gathered: list[tuple[np.ndarray, Any]] = []  # targets still to resolve: (batch positions, choices)
    rows = max(1, batch_size)
    bases = [sequences[first] for first in unaltered] if objective.reads_last_token else None
    with torch.no_grad():
        for batch in forward_batches(model, sequences, rows * max(lengths, default=1), rows, bases, owner):
            choices = objective.choices(batch.attention_mask, input_ids=batch.input_ids, **batch.options)
            if resolved:
                indices = [group[k].target.index for k in owner[batch.rows]]
                fixed = None if indices[0] is None else torch.as_tensor(indices, device=model.device)
                values[batch.rows] = objective.pick(choices, fixed)[0].double().cpu().numpy()
            else:
                gathered.append((batch.rows, choices.cpu()))  # [batch, choice]
    if gathered:
        values = _resolve(objective, group, gathered, owner, unaltered)
    return values


def _resolve(
    objective: Any,
    traces: list[Trace],
    gathered: list[tuple[np.ndarray, Any]],
    owner: np.ndarray,
    unaltered: Sequence[int],
) -> np.ndarray:
    """``[sequence]`` y once each trace's class or token is known from its unaltered input's choices
    (``gathered``: per batch, its sequence positions and ``[batch, choice]``); each trace's resolved
    target recorded in it."""
    import torch

    positions = np.concatenate([batch for batch, _ in gathered])
    choices = torch.cat([chosen for _, chosen in gathered])[np.argsort(positions)]  # [sequence, choice]
    y, index, probability = objective.pick(choices[list(unaltered)])  # the unaltered inputs' own targets
    for k, trace in enumerate(traces):
        p = None if probability is None else float(probability[k])
        trace.resolved(objective.describe(float(y[k]), None if index is None else int(index[k]), p))
    per_sequence = None if index is None else index[torch.as_tensor(owner)]
    return objective.pick(choices, per_sequence)[0].double().numpy()


MAX_EVALS = Option(
    "max_evals",
    "shap: the most coalitions scored (default: 512; exact Shapley values when all 2^m fit, else sampled orders; "
    "at least m + 1 for m content tokens)",
    parse=options.positive_int,
    metavar="N",
)
REPLACE = Option(
    "replace",
    "shap: what an absent token becomes: remove (deleted from the ids, default) or mask (the mask token)",
    choices=("remove", "mask"),
)


@register(
    "shap",
    "Shapley values of the content tokens for the target (exact up to max_evals coalitions, else sampled "
    "orders; absent tokens removed from the ids or masked)",
    takes="model",
    needs=("attentions", "target", "model"),
    options=(MAX_EVALS, REPLACE, options.SEED, options.BATCH_SIZE),
    requires=GRADIENTS,
    scores_only=True,
    signed=True,
    cost="expensive",
)
def shap(
    model: ModelLike, trace: Trace, max_evals: int = 512, replace: str = "remove", seed: int = 0, batch_size: int = 32
) -> np.ndarray:
    """``[token]`` Shapley values φ_j of the ``m`` content tokens for y; special tokens are always
    present and score 0.

    A coalition S of content tokens is scored as y(x with the content tokens outside S absent):
    deleted from the ids (``replace="remove"``, like leave-one-out) or replaced by the mask token
    (its pad token when it has none; ``replace="mask"``). When all 2^m coalitions fit in
    ``max_evals`` they are all scored and φ is exact,
    φ_j = Σ_{S ⊆ M∖{j}} |S|! (m − |S| − 1)! / m! · (y(S ∪ {j}) − y(S));
    otherwise P = (max_evals − 2) // (m − 1) seeded random orders each add the tokens one by one
    (2 + P (m − 1) coalitions) and φ_j is token j's mean marginal contribution as it joins. Both
    sum exactly to y(x) − y(no content token) (efficiency). A ``max_evals`` below the m + 1
    coalitions of one order is raised to it, with a warning. Every coalition is scored once, by
    `target_values`, in batches of ``batch_size``.
    """
    from attnflow.methods.deletion import REPLACE_MODES, perturb

    if replace not in REPLACE_MODES:
        raise InputError(
            f"unknown replacement {replace!r} ({{replace}}); choose one of {', '.join(REPLACE_MODES)}",
            parameter="replace",
        )
    ids = tuple(int(i) for i in trace.token_ids)
    content = np.flatnonzero(~np.asarray(trace.special_mask))
    m = len(content)
    scores = np.zeros(len(ids))
    if m == 0:
        return scores
    if int(max_evals) < m + 1:
        warnings.warn(
            f"shap: max_evals {max_evals} is below the {m + 1} coalitions that one order of {m} content tokens "
            f"needs; raised to {m + 1}",
            ExplanationWarning,
            stacklevel=2,
        )
        max_evals = m + 1
    exact = 2**m <= max_evals
    if exact:
        present = ((np.arange(2**m)[:, None] >> np.arange(m)) & 1).astype(bool)  # [coalition, token]: index bit j
    else:
        orders = np.random.default_rng(seed).permuted(
            np.tile(np.arange(m), (max(1, (max_evals - 2) // (m - 1)), 1)), axis=1
        )
        ranks = np.argsort(orders, axis=1)  # [order, content token]: where each token joins
        present = (ranks[:, None, :] < np.arange(m + 1)[None, :, None]).reshape(-1, m)  # [order * (m + 1), token]
    unique, slots = np.unique(present, axis=0, return_inverse=True)
    mask_id = (
        model.tokenizer.mask_token_id if model.tokenizer.mask_token_id is not None else model.tokenizer.pad_token_id
    )
    variants = [perturb(ids, content[~row], replace, mask_id) for row in unique]
    # unique rows sort with every token present last: the unaltered input
    y = target_values(model, trace, variants, batch_size, unaltered=[len(unique) - 1])[slots.reshape(-1)]
    if exact:
        sizes = present.sum(axis=1)
        weights = np.array([math.factorial(s) * math.factorial(m - s - 1) / math.factorial(m) for s in range(m)])
        for j in range(m):
            without = ~present[:, j]  # coalitions S without j; S ∪ {j} is index + 2^j
            scores[content[j]] = np.sum(weights[sizes[without]] * (y[np.flatnonzero(without) + 2**j] - y[without]))
        return scores
    steps = y.reshape(len(orders), m + 1)  # [order, tokens present]: y as the order adds token after token
    gains = np.diff(steps, axis=1)  # [order, step]: the marginal contribution of the token that joins
    scores[content] = np.take_along_axis(gains, ranks, axis=1).mean(axis=0)
    return scores


@register(
    "integrated_gradients",
    "integrated gradients (captum, on the word embeddings; pad-token baseline, special tokens kept; ||IG_j|| or, "
    "signed, sum_d IG_j)",
    takes="model",
    needs=("attentions", "target", "model"),
    options=(options.N_STEPS, options.SIGNED),
    requires=GRADIENTS,
    scores_only=True,
    cost="expensive",
    low_precision="its path integral sums a gradient per step, each taken on interpolated embeddings rounded to "
    "16 bits, and drifts furthest of all methods from float32's map (smollm2: Spearman 0.87, top-5 overlap 0.75)",
)
def integrated_gradients(
    model: ModelLike, trace: Trace, n_steps: int = 32, internal_batch_size: int = 16, signed: bool = False
) -> np.ndarray:
    """``[token]`` ‖IG_j‖₂ of `integrated_gradient_attributions`, or with ``signed`` Σ_d IG_jd (the
    signed scores sum to y(x) − y(baseline), up to the completeness error). When the completeness error
    (captum's convergence delta) exceeds `COMPLETENESS_TOLERANCE` of |y(x) − y(baseline)|, an
    `ExplanationWarning` says so (and the Explanation keeps it in its notes)."""
    attributions, delta, difference = integrated_gradient_attributions(
        model, trace, n_steps, internal_batch_size, return_delta=True
    )
    if abs(delta) > COMPLETENESS_TOLERANCE * max(abs(difference), 1e-12):
        warnings.warn(
            f"integrated gradients: completeness error {abs(delta):.3g} is "
            f"{100 * abs(delta) / max(abs(difference), 1e-12):.0f} % of y(x) - y(baseline) = {difference:.3g} "
            f"with {n_steps} steps; raise n_steps (--steps)",
            ExplanationWarning,
            stacklevel=2,
        )
    return attributions.sum(axis=-1) if signed else np.linalg.norm(attributions, axis=-1)


def integrated_gradient_attributions(
    model: ModelLike, trace: Trace, n_steps: int = 32, internal_batch_size: int = 16, return_delta: bool = False
) -> Any:
    """``[token, d_model]`` captum's layer integrated gradients on the word-embedding layer, from a
    baseline whose content tokens are the pad token (special tokens kept), ``n_steps`` steps.
    They sum to y(x) − y(baseline) up to the integral's discretisation error; ``return_delta``
    also returns that error (captum's convergence delta, attributions' sum minus the difference)
    and the difference y(x) − y(baseline): ``(attributions, delta, difference)``."""
    import torch
    from captum.attr import LayerIntegratedGradients

    from attnflow.targets import objective_of

    if isinstance(n_steps, bool) or int(n_steps) != n_steps or n_steps < 1:
        raise InputError(f"{{n_steps}} must be a positive integer, got {n_steps}", parameter="n_steps")
    objective = objective_of(model, trace)
    input_ids = torch.as_tensor(np.asarray(trace.token_ids), dtype=torch.long, device=model.device)[None]
    baseline = input_ids.clone()
    baseline[0, torch.as_tensor(~np.asarray(trace.special_mask))] = model.tokenizer.pad_token_id
    if trace.target is None:  # still to resolve: the input's own prediction, from one pass without gradients
        with torch.no_grad():
            y, found, probability = objective(torch.ones_like(input_ids), input_ids=input_ids)
        trace.resolved(
            objective.describe(
                float(y[0]),
                None if found is None else int(found[0]),
                None if probability is None else float(probability[0]),
            )
        )
    index = trace.target.index

    def forward(ids: torch.Tensor) -> torch.Tensor:
        fixed = None if index is None else torch.full((len(ids),), index, device=ids.device)
        return objective(torch.ones_like(ids), input_ids=ids, index=fixed)[0]

    integrated = LayerIntegratedGradients(forward, model.hf_model.get_input_embeddings())
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
    requires=POST_LN,
    cost="expensive",
)
def value_zeroing(model: ModelLike, trace: Trace, batch_size: int = 32) -> np.ndarray:
    """``[query, key]`` rollout (no extra residual) of the row-normalised value-zeroing matrices
    VZ⁽ˡ⁾[i, j] = 1 − cos(x̂_i, x̂_i^¬j), x̂ the layer's output and x̂^¬j the output of the same
    layer rerun alone, on the same input, with token j's value vectors zeroed in every head.
    The variants of a layer run as batches of ``batch_size``."""
    import torch

    from attnflow.capture.hooks import record_calls, record_tensors
    from attnflow.rows.adapters import find_layers
    from attnflow.rows.hook_points import HookPoint, hooks, output_tensor

    adapter = model.adapter
    blocks = find_layers(model.hf_model, adapter.values.block)
    value_projections = find_layers(model.hf_model, adapter.projection("value")[0])
    input_ids = torch.as_tensor(np.asarray(trace.token_ids), dtype=torch.long, device=model.device)[None]
    with record_calls(blocks) as calls, record_tensors(blocks) as outputs, torch.no_grad():
        model.hf_model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    n = trace.n_tokens
    matrices = np.zeros((len(blocks), n, n))
    for layer, ((name, block), (_, value_projection)) in enumerate(zip(blocks, value_projections, strict=True)):
        args, kwargs = calls[name]
        original = outputs[name][0]  # [token, d_model]
        for start in range(0, n, max(1, batch_size)):
            zeroed = torch.arange(
                start, min(n, start + batch_size), device=model.device
            )  # variant b zeroes token zeroed[b]

            def zero_value(output: torch.Tensor, zeroed: torch.Tensor = zeroed) -> torch.Tensor:
                output = output.clone(memory_format=torch.contiguous_format)
                rows = adapter.value_rows(output)  # a view: [variant, token, width], the values or a fused q/k/v
                columns = adapter.part_columns("value", rows.shape[-1], model.config).to(output.device)
                variants = torch.arange(len(zeroed), device=output.device)
                rows[variants[:, None], zeroed[:, None], columns] = 0.0
                return output

            with hooks([(HookPoint(value_projection, "output"), zero_value)]), torch.no_grad():
                altered = block(*_repeat(args, len(zeroed)), **_repeat(kwargs, len(zeroed)))
            altered = output_tensor(altered)  # [variant, token, d_model]
            # float64: a token that barely moves an output gives 1 - cos near float32's rounding step
            cosine = torch.nn.functional.cosine_similarity(altered.double(), original[None].double(), dim=-1)
            matrices[layer][:, zeroed.cpu().numpy()] = (1.0 - cosine).clamp(min=0.0).T.cpu().numpy()  # [query, variant]
    return rollout(normalise_rows(matrices)[:, None], residual="none")


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
