"""Layer-wise relevance propagation for transformers: `cp_lrp` and `attnlrp` (definitions: docs/methods.md).

Both are gradient × input on a modified backward pass: one forward and one backward pass of the
model, during which temporary forward hooks (removed on exit, also when the forward pass raises)
leave every forward value as it is and change how the gradient flows through a few modules. The
relevance of token j is R_j = Σ_d e_{j,d} · ∂̃y/∂e_{j,d} at the embedding sum e: the input of the
embedding layer norm for BERT-like models (word + position (+ token type) embeddings), the word
embeddings for Llama (the first layer's input: RoPE adds no position embedding).

What each rule does to the gradient (∂̃: the modified gradient):

- every layer norm and RMS norm (both variants): 1/σ is a constant (the norm's output is
  recomputed from its input with σ detached, so the norm is linear);
- attention, ``cp_lrp`` (Ali et al. 2022): A is a constant where it multiplies V. Q and K reach
  the output only through A, so this is the gradient stopped at the query and key projections;
- attention, ``attnlrp`` (Achtibat et al. 2024): AttnLRP's softmax rule R_in,i = x_i (R_i − s_i Σ_k R_k)
  is x_i · (the plain gradient), so the softmax keeps its gradient; the uniform rule gives each
  factor of QKᵀ and of A·V half: ∂̃ × ½ at V, and × ¼ at Q and K (½ for their own product, ½
  for A's half of A·V, passed back linearly through the softmax);
- element-wise activations (``attnlrp``; GELU, SiLU, tanh, ...): the identity rule, ∂̃ × f(x)/x,
  so R_in = R_out;
- gated MLPs (``attnlrp``; Llama's SwiGLU down(act(gate(x)) · up(x))): the uniform rule, ∂̃ × ½
  at up(x) and at act(gate(x)) (whose identity rule then passes its half on).

Conservation: y = Σ_j R_j + Σ_b b · ∂̃y/∂b (relevance absorbed by the biases) + what a rule does
not conserve (``cp_lrp``: non-linear activations and gated products; ``attnlrp``: the softmax
rule's absorbed term; both: a non-linear target such as a log-probability or a cosine).
`Relevance` reports Σ_j R_j / y and the biases' share.
"""

from __future__ import annotations

import functools
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Iterator, Sequence

import numpy as np

from attnflow.errors import CaptureError, InputError
from attnflow.methods.extras import report_extras
from attnflow.methods.registry import register
from attnflow.trace import Trace

RULES = ("cp_lrp", "attnlrp")
LRP_FAMILIES = ("bert", "roberta", "distilbert", "mpnet", "llama")
EMBEDDING_NORM = r"embeddings\.LayerNorm$"  # BERT-like: its input is the embedding sum
NORM_CHECK_TOLERANCE = 1e-4  # a recomputed norm must match the module's own output this closely


@dataclass(frozen=True)
class Relevance:
    """LRP of one input: ``scores [token]`` R_j (special tokens included), the explained
    ``target_value`` y and ``bias_relevance`` Σ_b b · ∂̃y/∂b over every bias of the model."""

    scores: np.ndarray
    target_value: float
    bias_relevance: float

    @property
    def conservation(self) -> float:
        """Σ_j R_j / y: 1 when all of y reaches the tokens (NaN when y = 0)."""
        return _share(float(self.scores.sum()), self.target_value)

    @property
    def bias_share(self) -> float:
        """Σ_b b · ∂̃y/∂b / y: the part of y that the biases absorb (NaN when y = 0)."""
        return _share(self.bias_relevance, self.target_value)

    def extras(self) -> dict[str, float]:
        """What an Explanation of these scores reports besides them (its ``extras``)."""
        return {
            "conservation": self.conservation,
            "bias_share": self.bias_share,
            "relevance_sum": float(self.scores.sum()),
            "bias_relevance": self.bias_relevance,
            "target_value": self.target_value,
        }


def _share(part: float, whole: float) -> float:
    return part / whole if whole != 0 else float("nan")


# What both rules declare: one forward and one backward pass of the model, a signed score per token.
_DECLARATION: dict[str, Any] = dict(
    takes="model",
    needs=("attentions", "target", "model"),
    families=LRP_FAMILIES,
    scores_only=True,
    signed=True,
    cost="backward",
)


def _batch_form(model: Any, traces: Sequence[Trace], rule: str) -> list[tuple[np.ndarray, dict[str, Any]]]:
    """The rules' batch form (``MethodSpec.batch``): each trace's scores and extras, from one padded
    forward and backward pass per kind of target (`lrp_relevance`)."""
    return [(relevance.scores, relevance.extras()) for relevance in lrp_relevance(model, traces, rule)]


@register(
    "cp_lrp",
    "CP-LRP (Ali et al. 2022): gradient x input at the embedding sum, attention and norms' 1/sigma constant",
    batch=functools.partial(_batch_form, rule="cp_lrp"),
    **_DECLARATION,
)
def cp_lrp(model: Any, trace: Trace) -> np.ndarray:
    """``[token]`` signed CP-LRP relevance R_j of the trace's target (see the module docstring)."""
    return _explain(model, trace, "cp_lrp")


@register(
    "attnlrp",
    "AttnLRP (Achtibat et al. 2024): gradient x input at the embedding sum, with LRP rules for norms, "
    "activations, softmax and products",
    batch=functools.partial(_batch_form, rule="attnlrp"),
    **_DECLARATION,
)
def attnlrp(model: Any, trace: Trace) -> np.ndarray:
    """``[token]`` signed AttnLRP relevance R_j of the trace's target (see the module docstring)."""
    return _explain(model, trace, "attnlrp")


def _explain(model: Any, trace: Trace, rule: str) -> np.ndarray:
    """One trace's scores; its conservation goes to the Explanation's extras."""
    (relevance,) = lrp_relevance(model, [trace], rule)
    report_extras(**relevance.extras())
    return relevance.scores


def lrp_relevance(model: Any, traces: Sequence[Trace], rule: str) -> list[Relevance]:
    """LRP with ``rule`` (``"cp_lrp"`` or ``"attnlrp"``) for each trace, explaining its ``target``;
    traces with the same kind of target are explained together, in one padded forward and one
    backward pass."""
    if rule not in RULES:
        raise ValueError(f"unknown LRP rule {rule!r}; choose one of {', '.join(RULES)}")
    if model.adapter.family not in LRP_FAMILIES:
        raise InputError(
            f"{rule} does not support the {model.adapter.family} family ({model.name}); "
            f"it supports: {', '.join(LRP_FAMILIES)}"
        )
    from attnflow.targets import same_objective_groups

    results: list[Relevance | None] = [None] * len(traces)
    for members in same_objective_groups([trace.target for trace in traces]):
        for position, relevance in zip(members, _explain_batch(model, [traces[i] for i in members], rule), strict=True):
            results[position] = relevance
    return [relevance for relevance in results if relevance is not None]


def _explain_batch(model: Any, traces: list[Trace], rule: str) -> list[Relevance]:
    """One padded forward and backward pass for traces whose targets share one objective."""
    import torch

    from attnflow.targets import Objective

    objective = Objective.for_target(model, traces[0].target)  # outside the hooks (similarity runs the model)
    lengths = [trace.n_tokens for trace in traces]
    input_ids = torch.full((len(traces), max(lengths)), model.tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, trace in enumerate(traces):
        input_ids[row, : trace.n_tokens] = torch.as_tensor(np.asarray(trace.token_ids))
        attention_mask[row, : trace.n_tokens] = 1
    index = None
    if traces[0].target.index is not None:
        index = torch.as_tensor([trace.target.index for trace in traces], device=model.device)
    with lrp_rules(model, rule) as recording, torch.enable_grad():
        y, _, _ = objective(attention_mask.to(model.device), input_ids=input_ids.to(model.device), index=index)
    embedding_sum = recording.embedding_sum
    if embedding_sum is None:
        raise CaptureError(f"{model.name}: the forward pass never reached the embedding sum")
    outputs = [output for _, output in recording.biased_outputs]
    gradients = torch.autograd.grad(y.sum(), [embedding_sum, *outputs], allow_unused=True)
    scores = (embedding_sum.detach() * gradients[0]).sum(dim=-1).double().cpu().numpy()  # [batch, token]
    bias_relevance = torch.zeros(len(traces), dtype=torch.float64, device=y.device)
    for (bias, _), gradient in zip(recording.biased_outputs, gradients[1:], strict=True):
        if gradient is not None:  # None: no gradient reached it (a stopped query or key projection)
            bias_relevance += (gradient * bias).double().reshape(len(traces), -1).sum(dim=1)
    values = y.detach().double().cpu().numpy()
    return [Relevance(scores[row, :n], float(values[row]), float(bias_relevance[row])) for row, n in enumerate(lengths)]


@dataclass
class RuleRecording:
    """What the rules' hooks saw in one forward pass: the embedding sum ``[batch, token, d_model]``
    (a leaf that requires grad) and, for every module with a bias, ``(bias, output)`` (the output
    as the modified backward pass reaches the bias)."""

    embedding_sum: Any = None
    biased_outputs: list[tuple[Any, Any]] = field(default_factory=list)


@contextmanager
def lrp_rules(model: Any, rule: str) -> Iterator[RuleRecording]:
    """Forward hooks that apply ``rule`` to the forward passes run inside the block (see the
    module docstring); removed on exit, also when the block raises."""
    import torch

    modules = dict(model.model.named_modules())
    norms = {module for module in modules.values() if _is_norm(module)}
    activations: dict[Any, float] = {}
    gradient_factors: dict[Any, float] = {}
    values = model.adapter.values
    if values is None or values.query is None or values.key is None:
        raise InputError(f"LRP needs the query and key projections of the {model.adapter.family} family")
    from attnflow.capture.hooks import find_layers

    queries_keys = [module for pattern in (values.query, values.key) for _, module in find_layers(model.model, pattern)]
    if rule == "cp_lrp":
        gradient_factors.update(dict.fromkeys(queries_keys, 0.0))
    else:
        gradient_factors.update(dict.fromkeys(queries_keys, 0.25))
        gradient_factors.update(dict.fromkeys((module for _, module in find_layers(model.model, values.value)), 0.5))
        activations.update(dict.fromkeys((m for m in modules.values() if isinstance(m, _elementwise())), 1.0))
        for module in modules.values():
            if all(hasattr(module, name) for name in ("gate_proj", "up_proj", "act_fn")):  # a gated MLP
                gradient_factors[module.up_proj] = 0.5
                activations[module.act_fn] = 0.5
    recording = RuleRecording()
    scale_gradient, identity_rule = _rule_functions()

    def apply_rules(module: Any, inputs: tuple, output: Any) -> Any:
        if module in norms:
            output = _constant_scale_norm(module, inputs[0], output)
        if module in activations:
            output = identity_rule.apply(inputs[0], output, activations[module])
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            recording.biased_outputs.append((bias.detach(), output))
        if module in gradient_factors:
            factor = gradient_factors[module]
            output = output.detach() if factor == 0 else scale_gradient.apply(output, factor)
        return output

    def take_embedding_sum(_module: Any, args: tuple) -> tuple:
        recording.embedding_sum = args[0].detach().requires_grad_(True)
        return (recording.embedding_sum, *args[1:])

    def take_word_embeddings(_module: Any, _inputs: tuple, output: Any) -> Any:
        recording.embedding_sum = output.detach().requires_grad_(True)
        return recording.embedding_sum

    handles = []
    try:
        embedding_norm = next((module for name, module in modules.items() if re.search(EMBEDDING_NORM, name)), None)
        if embedding_norm is not None:
            handles.append(embedding_norm.register_forward_pre_hook(take_embedding_sum))
        else:
            handles.append(model.model.get_input_embeddings().register_forward_hook(take_word_embeddings))
        hooked = norms | set(activations) | set(gradient_factors)
        hooked |= {m for m in modules.values() if isinstance(m, torch.nn.Linear) and m.bias is not None}
        for module in hooked:
            handles.append(module.register_forward_hook(apply_rules))
        yield recording
    finally:
        for handle in handles:
            handle.remove()


def _is_norm(module: Any) -> bool:
    import torch

    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


@cache
def _elementwise() -> tuple[type, ...]:
    """The element-wise activation classes (transformers' ``ACT2FN`` table: GELU, SiLU, tanh, ...)."""
    from transformers.activations import ACT2CLS

    return tuple({entry[0] if isinstance(entry, tuple) else entry for entry in ACT2CLS.values()})


def _constant_scale_norm(module: Any, x: Any, output: Any) -> Any:
    """The norm's output recomputed from its input ``x [..., d_model]`` with 1/σ detached; it must
    equal the module's own ``output`` (a norm of another form is refused)."""
    import torch

    if isinstance(module, torch.nn.LayerNorm):
        centred = x - x.mean(dim=-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + module.eps).detach()
        recomputed = normed if module.weight is None else normed * module.weight
        recomputed = recomputed if module.bias is None else recomputed + module.bias
    else:  # RMSNorm: x / sqrt(mean(x²) + eps) · weight
        wide = x.float()
        scale = torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + module.variance_epsilon).detach()
        recomputed = module.weight * (wide * scale).to(x.dtype)
    if not torch.allclose(recomputed, output, rtol=NORM_CHECK_TOLERANCE, atol=NORM_CHECK_TOLERANCE):
        raise CaptureError(f"{type(module).__name__} is not a plain layer/RMS norm: LRP cannot linearise it")
    return recomputed


@cache
def _rule_functions() -> tuple[Any, Any]:
    """``(ScaleGradient, IdentityRule)``: autograd functions with an identity forward (defined on
    first use, so that registering the methods does not import torch)."""
    import torch

    class ScaleGradient(torch.autograd.Function):
        """Backward multiplies the gradient by ``factor``."""

        @staticmethod
        def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
            ctx.factor = factor
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
            return gradient * ctx.factor, None

    class IdentityRule(torch.autograd.Function):
        """Forward: ``output`` = f(x); backward: the gradient reaches ``x`` times ``factor`` · f(x)/x
        (0 where x = 0, which contributes nothing), so x · ∂̃ = factor · f(x) · ∂̃y/∂f(x)."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, output: torch.Tensor, factor: float) -> torch.Tensor:
            ctx.save_for_backward(x, output)
            ctx.factor = factor
            return output.view_as(output)

        @staticmethod
        def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            x, output = ctx.saved_tensors
            zero = x == 0
            ratio = torch.where(zero, torch.zeros_like(x), output / torch.where(zero, torch.ones_like(x), x))
            return gradient * ratio * ctx.factor, None, None

    return ScaleGradient, IdentityRule
