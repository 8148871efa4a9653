"""Backward-rule methods for transformers — `cp_lrp`, `attnlrp` and `gim` — as rows of one table.

Each is gradient × input (or × (input − baseline)) on a modified backward pass: one forward and one
backward pass of the model, during which temporary forward hooks (removed on exit, also when the
forward pass raises) leave every forward value as it is and change how the gradient flows through a
few places. A `BackwardRules` row says what changes where; the relevance of token j is
R_j = Σ_d (e_{j,d} − b_{j,d}) · ∂̃y/∂e_{j,d} at the embedding sum e (the input of the embedding norm
for BERT-like families, the word embeddings otherwise: RoPE adds no position embedding), with b = 0
or the embedding of the pad token at every position.

The rule fields and the hook point each uses (``∂̃``: the modified gradient):

- ``norms_constant``: every layer norm and RMS norm's 1/σ is a constant (the norm's output is
  recomputed from its input with σ detached, so the norm is linear) — a forward hook on each norm;
- ``query_key`` / ``value``: ∂̃ × factor at the query and key / value projections' outputs (0 stops
  it) — forward hooks on the projections named by the family's adapter row;
- ``identity_activations``: element-wise activations (GELU, SiLU, tanh, ...) pass relevance on
  unchanged, ∂̃ × f(x)/x — a forward hook on each activation module;
- ``gated_operands``: ∂̃ × factor at each operand of a gated MLP's product down(act(gate(x)) · up(x))
  (the up projection's output and the activation's) — forward hooks on the family's gated MLP;
- ``softmax_temperature`` T: the attention softmax keeps its forward value, and its backward is
  s_T ⊙ (g − ⟨g, s_T⟩) with s_T = softmax(x / T) (GIM's temperature-adjusted gradient; T = 1 is the
  plain gradient) — the softmax called inside the family's attention modules;
- ``baseline``: ``"zero"`` (gradient × input) or ``"pad"`` (× (input − the pad token's embedding)).

The rows (Ali et al. 2022; Achtibat et al. 2024; Edin et al. 2025):

- ``cp_lrp``: norms constant; A constant where it multiplies V (Q and K reach the output only
  through A, so the gradient is stopped at the query and key projections);
- ``attnlrp``: norms constant; AttnLRP's softmax rule R_in,i = x_i (R_i − s_i Σ_k R_k) is x_i · (the
  plain gradient), so the softmax keeps its gradient; the uniform rule gives each factor of QKᵀ and
  of A·V half: × ½ at V and × ¼ at Q and K (½ for their own product, ½ for A's half of A·V, passed
  back linearly through the softmax); identity rule for activations; × ½ at each gated operand;
- ``gim``: norms constant, × ¼ at Q and K, × ½ at V and at each gated operand (as AttnLRP's uniform
  rule), the temperature-2 softmax backward, plain activation gradients, the pad-token baseline.

Conservation: y = Σ_j R_j + Σ_b b · ∂̃y/∂b (relevance absorbed by the biases) + what a rule does
not conserve (``cp_lrp``: non-linear activations and gated products; ``attnlrp``: the softmax
rule's absorbed term; ``gim``: its softmax backward and activations; all: a non-linear target such
as a log-probability or a cosine; a baseline other than zero). `Relevance` reports Σ_j R_j / y and
the biases' share. A new rule-based method is one more row, registered with `register_rules`.
"""

from __future__ import annotations

import re
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, Iterator, Literal, Sequence

import numpy as np

from attnflow.errors import CaptureError, InputError
from attnflow.methods.extras import Scored
from attnflow.methods.registry import register
from attnflow.model_like import ModelLike
from attnflow.trace import CAPABILITIES, Trace

if TYPE_CHECKING:
    from attnflow.capture.hook_points import HookPoint

NORM_CHECK_TOLERANCE = 1e-4  # a recomputed norm must match the module's own output this closely


@dataclass(frozen=True)
class BackwardRules:
    """One row of the rule table: how a method's backward pass differs from the plain gradient
    (each field and the hook point it uses: the module docstring). Forward values never change."""

    name: str
    summary: str
    norms_constant: bool = True
    query_key: float = 1.0
    value: float = 1.0
    identity_activations: bool = False
    gated_operands: float = 1.0
    softmax_temperature: float = 1.0
    baseline: Literal["zero", "pad"] = "zero"

    @property
    def requires(self) -> tuple[str, ...]:
        """What a model family must provide (`attnflow.trace.CAPABILITIES`): a target, and the
        query, key and value projections when the row scales their gradients."""
        scaled = self.query_key != 1 or self.value != 1
        return ("text_target", "query_key") if scaled else ("text_target",)


RULE_TABLE: tuple[BackwardRules, ...] = (
    BackwardRules(
        "cp_lrp",
        "CP-LRP (Ali et al. 2022): gradient x input at the embedding sum, attention and norms' 1/sigma constant",
        query_key=0.0,
    ),
    BackwardRules(
        "attnlrp",
        "AttnLRP (Achtibat et al. 2024): gradient x input at the embedding sum, with LRP rules for norms, "
        "activations, softmax and products",
        query_key=0.25,
        value=0.5,
        identity_activations=True,
        gated_operands=0.5,
    ),
    BackwardRules(
        "gim",
        "GIM (Edin et al. 2025): gradient x (embedding - pad embedding) with frozen norms, a temperature-2 "
        "softmax backward and halved products",
        query_key=0.25,
        value=0.5,
        gated_operands=0.5,
        softmax_temperature=2.0,
        baseline="pad",
    ),
)
RULES = {rules.name: rules for rules in RULE_TABLE}


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


def register_rules(rules: BackwardRules) -> None:
    """Register a rule row as a method (one forward and one backward pass, a signed score per
    token, a batch form that explains many traces in one padded pass)."""

    def explain_one(model: ModelLike, trace: Trace) -> Scored:
        (relevance,) = lrp_relevance(model, [trace], rules)
        return Scored(relevance.scores, relevance.extras())

    def explain_batch(model: ModelLike, traces: Sequence[Trace]) -> list[Scored]:
        return [Scored(relevance.scores, relevance.extras()) for relevance in lrp_relevance(model, traces, rules)]

    explain_one.__doc__ = f"``[token]`` signed {rules.name} relevance R_j of the trace's target (`BackwardRules`)."
    register(
        rules.name,
        rules.summary,
        takes="model",
        needs=("attentions", "target", "model"),
        requires=rules.requires,
        scores_only=True,
        signed=True,
        cost="backward",
        batch=explain_batch,
    )(explain_one)


for _rules in RULE_TABLE:
    register_rules(_rules)


def lrp_relevance(model: ModelLike, traces: Sequence[Trace], rules: BackwardRules | str) -> list[Relevance]:
    """Relevance by the backward rules ``rules`` (a `RULE_TABLE` row or its name) for each trace,
    explaining its ``target``; traces with the same kind of target are explained together, in one
    padded forward and one backward pass."""
    from attnflow.targets import same_objective_groups

    if isinstance(rules, str):
        if rules not in RULES:
            raise ValueError(f"unknown backward rules {rules!r}; choose one of {', '.join(RULES)}")
        rules = RULES[rules]
    missing = sorted(set(rules.requires) - model.adapter.provides)
    if missing:
        raise InputError(
            f"{rules.name} does not support the {model.adapter.family} family ({model.name}): it requires "
            + "; ".join(f"{name} ({CAPABILITIES[name]})" for name in missing)
        )
    results: list[Relevance | None] = [None] * len(traces)
    for members in same_objective_groups([trace.target for trace in traces]):
        batch = _explain_batch(model, [traces[i] for i in members], rules)
        for position, relevance in zip(members, batch, strict=True):
            results[position] = relevance
    return [relevance for relevance in results if relevance is not None]


def _explain_batch(model: ModelLike, traces: list[Trace], rules: BackwardRules) -> list[Relevance]:
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
    with backward_rules(model, rules) as recording, torch.enable_grad():
        y, _, _ = objective(attention_mask.to(model.device), input_ids=input_ids.to(model.device), index=index)
    embedding_sum = recording.embedding_sum
    if embedding_sum is None:
        raise CaptureError(f"{model.name}: the forward pass never reached the embedding sum")
    outputs = [output for _, output in recording.biased_outputs]
    gradients = torch.autograd.grad(y.sum(), [embedding_sum, *outputs], allow_unused=True)
    attributed = _attributed(model, rules, embedding_sum, input_ids.to(model.device))
    scores = (attributed * gradients[0]).sum(dim=-1).double().cpu().numpy()  # [batch, token]
    bias_relevance = torch.zeros(len(traces), dtype=torch.float64, device=y.device)
    for (bias, _), gradient in zip(recording.biased_outputs, gradients[1:], strict=True):
        if gradient is not None:  # None: no gradient reached it (a stopped query or key projection)
            bias_relevance += (gradient * bias).double().reshape(len(traces), -1).sum(dim=1)
    values = y.detach().double().cpu().numpy()
    return [Relevance(scores[row, :n], float(values[row]), float(bias_relevance[row])) for row, n in enumerate(lengths)]


def _attributed(model: ModelLike, rules: BackwardRules, embedding_sum: Any, input_ids: Any) -> Any:
    """What the modified gradient multiplies ``[batch, token, d_model]``: the embedding sum e, or
    e − b with b the same sum with the pad token's word embedding at every position, i.e. the word
    embeddings minus the pad token's (positions and token types cancel in the difference), both as
    the embedding module returns them (Gemma's scales its table by √d_model)."""
    import torch

    if rules.baseline == "zero":
        return embedding_sum.detach()
    embeddings = model.model.get_input_embeddings()
    return (embeddings(input_ids) - embeddings(torch.full_like(input_ids, model.tokenizer.pad_token_id))).detach()


@dataclass
class RuleRecording:
    """What the rules' hooks saw in one forward pass: the embedding sum ``[batch, token, d_model]``
    (a leaf that requires grad) and, for every module with a bias, ``(bias, output)`` (the output
    as the modified backward pass reaches the bias)."""

    embedding_sum: Any = None
    biased_outputs: list[tuple[Any, Any]] = field(default_factory=list)


def lrp_rules(model: ModelLike, rule: str) -> Any:
    """`backward_rules` for a `RULE_TABLE` row named ``rule``."""
    return backward_rules(model, RULES[rule])


@contextmanager
def backward_rules(model: ModelLike, rules: BackwardRules) -> Iterator[RuleRecording]:
    """Forward hooks that apply ``rules`` to the forward passes run inside the block (the module
    docstring lists each hook point); removed on exit, also when the block raises."""
    import torch

    from attnflow.capture.hook_points import HookPoint, hooks
    from attnflow.capture.hooks import find_layers

    def modules_of(pattern: str | None) -> list[Any]:
        return [] if pattern is None else [module for _, module in find_layers(model.model, pattern)]

    adapter = model.adapter
    modules = dict(model.model.named_modules())
    norms = {module for module in modules.values() if _is_norm(module)} if rules.norms_constant else set()
    activations: dict[Any, float] = {}  # activation module -> factor of its identity rule
    gradient_factors: dict[Any, float] = {}
    values = adapter.values
    if values is not None:
        gradient_factors.update(dict.fromkeys(modules_of(values.query) + modules_of(values.key), rules.query_key))
        gradient_factors.update(dict.fromkeys(modules_of(values.value), rules.value))
    if rules.identity_activations:
        activations.update(dict.fromkeys((m for m in modules.values() if isinstance(m, _elementwise())), 1.0))
    if adapter.gated_mlp is not None and rules.gated_operands != 1:
        for mlp in modules_of(adapter.gated_mlp.module):
            activation = getattr(mlp, adapter.gated_mlp.activation)
            gradient_factors[getattr(mlp, adapter.gated_mlp.up)] = rules.gated_operands
            if activation in activations:
                activations[activation] = rules.gated_operands
            else:
                gradient_factors[activation] = rules.gated_operands
    gradient_factors = {module: factor for module, factor in gradient_factors.items() if factor != 1}
    recording = RuleRecording()
    scale_gradient, identity_rule, _ = _rule_functions()

    def rules_at(module: Any) -> Any:
        def apply_rules(output: Any, x: Any) -> Any:
            if module in norms:
                output = _constant_scale_norm(module, x, output)
            if module in activations:
                output = identity_rule.apply(x, output, activations[module])
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                recording.biased_outputs.append((bias.detach(), output))
            if module in gradient_factors:
                factor = gradient_factors[module]
                output = output.detach() if factor == 0 else scale_gradient.apply(output, factor)
            return output

        return apply_rules

    def take_embedding_sum(embedding_sum: Any) -> Any:
        recording.embedding_sum = embedding_sum.detach().requires_grad_(True)
        return recording.embedding_sum

    embedding_norm = next(
        (m for name, m in modules.items() if adapter.embedding_norm and re.search(adapter.embedding_norm, name)),
        None,
    )
    hooked: list[tuple[HookPoint, Any]] = [
        (HookPoint(embedding_norm, "input"), take_embedding_sum)
        if embedding_norm is not None
        else (HookPoint(model.model.get_input_embeddings(), "output"), take_embedding_sum)
    ]
    changed = norms | set(activations) | set(gradient_factors)
    changed |= {m for m in modules.values() if isinstance(m, torch.nn.Linear) and m.bias is not None}
    hooked += [(HookPoint(module, "output", with_input=True), rules_at(module)) for module in changed]
    with ExitStack() as stack:
        if rules.softmax_temperature != 1:
            hooked += _tempered_softmax_inside(modules_of(adapter.stack.attention), rules.softmax_temperature)
            stack.callback(_SoftmaxPatch().remove)
        stack.enter_context(hooks(hooked))
        yield recording


_SOFTMAX = threading.local()  # .temperature: the softmax backward's T while an attention module runs here


def _tempered_softmax_inside(attention_modules: list[Any], temperature: float) -> list[tuple[HookPoint, Any]]:
    """Hooks that give every softmax called inside ``attention_modules`` (in this thread) the
    temperature-``temperature`` backward, while a `_SoftmaxPatch` is alive."""
    from attnflow.capture.hook_points import HookPoint

    def enter(_args: tuple, _kwargs: dict) -> None:
        _SOFTMAX.temperature = temperature

    def leave(_output: Any) -> None:
        _SOFTMAX.temperature = None

    return [(HookPoint(module, "call"), enter) for module in attention_modules] + [
        (HookPoint(module, "output"), leave) for module in attention_modules
    ]


class _SoftmaxPatch:
    """``torch.nn.functional.softmax`` routed through `_softmax` while at least one patch is alive
    (counted, so concurrent rule blocks in several threads restore it once)."""

    _lock = threading.Lock()
    _alive = 0
    _original: Any = None

    def __init__(self) -> None:
        import torch.nn.functional as functional

        with _SoftmaxPatch._lock:
            if _SoftmaxPatch._alive == 0:
                _SoftmaxPatch._original = functional.softmax
                functional.softmax = _softmax
            _SoftmaxPatch._alive += 1

    def remove(self) -> None:
        import torch.nn.functional as functional

        with _SoftmaxPatch._lock:
            _SoftmaxPatch._alive -= 1
            if _SoftmaxPatch._alive == 0:
                functional.softmax = _SoftmaxPatch._original
        _SOFTMAX.temperature = None


def _softmax(input: Any, dim: int | None = None, _stacklevel: int = 3, dtype: Any = None) -> Any:
    """`torch.nn.functional.softmax` whose backward is tempered inside a patched attention module."""
    temperature = getattr(_SOFTMAX, "temperature", None)
    output = _SoftmaxPatch._original(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)
    if temperature is None or not input.requires_grad:
        return output
    _, _, tempered = _rule_functions()
    return tempered.apply(input if dtype is None else input.to(dtype), output, dim, temperature)


def _is_norm(module: Any) -> bool:
    import torch

    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


@cache
def _elementwise() -> tuple[type, ...]:
    """The element-wise activation classes (transformers' ``ACT2FN`` table: GELU, SiLU, tanh, ...)."""
    from transformers.activations import ACT2CLS

    return tuple({entry if isinstance(entry, type) else entry[0] for entry in ACT2CLS.values()})


def _constant_scale_norm(module: Any, x: Any, output: Any) -> Any:
    """The norm's output recomputed from its input ``x [..., d_model]`` with 1/σ detached; it must
    equal the module's own ``output`` (a norm of another form is refused). RMS norms scale by
    ``weight`` or, in Gemma's form, by ``1 + weight``: whichever reproduces the output."""
    import torch

    if isinstance(module, torch.nn.LayerNorm):
        centred = x - x.mean(dim=-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + module.eps).detach()
        recomputed = normed if module.weight is None else normed * module.weight
        candidates = [recomputed if module.bias is None else recomputed + module.bias]
    else:  # RMSNorm: x / sqrt(mean(x²) + eps) · weight (or · (1 + weight))
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps).detach()
        candidates = [module.weight * normed.to(x.dtype), (normed * (1.0 + module.weight.float())).to(x.dtype)]
    for recomputed in candidates:
        if torch.allclose(recomputed, output, rtol=NORM_CHECK_TOLERANCE, atol=NORM_CHECK_TOLERANCE):
            return recomputed
    raise CaptureError(f"{type(module).__name__} is not a plain layer/RMS norm: the backward rules cannot linearise it")


@cache
def _rule_functions() -> tuple[Any, Any, Any]:
    """``(ScaleGradient, IdentityRule, TemperedSoftmax)``: autograd functions with an identity
    forward (defined on first use, so that registering the methods does not import torch)."""
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

    class TemperedSoftmax(torch.autograd.Function):
        """Forward: ``output`` = softmax(x) as computed; backward: s_T ⊙ (g − ⟨g, s_T⟩) along
        ``dim``, s_T = softmax(x / T) (the plain softmax backward at T = 1)."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, output: torch.Tensor, dim: int, temperature: float) -> torch.Tensor:
            ctx.save_for_backward(x)
            ctx.dim, ctx.temperature = dim, temperature
            return output.view_as(output)

        @staticmethod
        def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
            (x,) = ctx.saved_tensors
            tempered = torch.softmax(x / ctx.temperature, dim=ctx.dim).to(gradient.dtype)
            inner = (gradient * tempered).sum(dim=ctx.dim, keepdim=True)
            return (tempered * (gradient - inner)).to(x.dtype), None, None, None

    return ScaleGradient, IdentityRule, TemperedSoftmax
