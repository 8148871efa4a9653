"""Backward-rule methods for transformers — `cp_lrp`, `attnlrp` and `gim` — as rule sets (zennit's composites).

Each is gradient × input (or × (input − baseline)) on a modified backward pass: one forward and one
backward pass of the model, during which temporary hooks (removed on exit, also when the forward pass
raises) leave every forward value as it is and change how the gradient flows through a few kinds of
module. A rule set (`BackwardRules`) maps a **module kind** (`MODULE_KINDS`) to a **rule** (a small
`Rule` object); one engine (`backward_rules`) finds each kind's modules in the family's adapter row
and applies the rule there. The relevance of token j is R_j = Σ_d (e_{j,d} − b_{j,d}) · ∂̃y/∂e_{j,d}
at the embedding sum e (the input of the row's embedding norm, else of its first block: GPT-2's word
+ position embeddings, the word embeddings of RoPE families), with b = 0 or the embedding of the pad
token at every position (``baseline``).

The module kinds and where the engine finds them (``∂̃``: the modified gradient):

- ``norm``: every norm the adapter row declares (`attnflow.rows.adapters.Norms`: a pattern and
  the form, layer or RMS with its offset);
- ``activation``: the element-wise activation modules (GELU, SiLU, tanh, ...: transformers' ``ACT2FN``);
- ``query_key`` / ``value``: the query and key / the value projections of the row (`Adapter.projection`):
  the row's `Values`, or their columns of a `Fused` projection (the rule acts on those columns of
  its output, the others keep the plain gradient);
- ``gated_product``: both operands of a gated MLP's product down(act(gate(x)) · up(x)), the up
  projection's output and the activation's (the row's `GatedMLP`, in the layers it names: the
  mixture-of-experts layers of a stack that mixes them with dense ones keep their plain gradient,
  as every layer of an all-MoE stack does);
- ``softmax``: every softmax called inside the row's attention modules, however it is called
  (``torch.nn.functional.softmax``, ``torch.softmax``, ``Tensor.softmax``: a torch-function mode
  sees all three);
- ``head_factor``: in a row whose heads are A·V times a per-position factor D before the output
  projection (`attnflow.rows.adapters.Values.head_factor`: AFMoE's, Beam's, MiniCPM5-MoE's sigmoid
  gate, Granite-SWA's sink rescaling sigmoid(lse − sink), Laguna's softplus gate), every sigmoid or
  softplus called inside its attention modules, where D is made (the same torch-function mode; a
  forward pass of such a row in which none is found raises a CaptureError rather than leaving D
  on the gradient's path unnamed);
- ``router``: a mixture of experts' routing weights g (`attnflow.rows.adapters.Experts`: the
  router's output at ``weights_index``, in every MoE block) and its shared expert's gate logit
  (``shared_gate``, whose sigmoid scales the shared expert).

The rules:

- `ConstantNorm`: 1/σ (1/rms) is a constant — the norm's output recomputed from its input, in the
  form the row declares, with σ detached, so the norm is linear;
- `Scale` (factor): ∂̃ × factor at the module's output (0 stops the gradient);
- `Identity`: an activation passes relevance on unchanged, ∂̃ × f(x)/x;
- `TemperedSoftmax` (T): the softmax keeps its forward value, and its backward is
  s_T ⊙ (g − ⟨g, s_T⟩) with s_T = softmax(x / T) (GIM's temperature-adjusted gradient; T = 1 is the
  plain gradient).

- ``Scale`` (0) at ``head_factor``: the factor D is held constant, as the rule sets hold the norms'
  1/σ: D ⊙ (A·V) is then linear in A·V, so all of its relevance passes to A·V (and on through the
  rules for A·V), none to the gate's input (a sigmoid, which no rule conserves through);
- ``Scale`` (0) at ``router``: the routing weights are gates, held constant, the choice of experts
  fixed (a top-k has no gradient anyway): Σ_k g_k E_k(x) is then linear in the experts' outputs,
  so all of the block's relevance passes to the experts and none to the router's logits (a softmax
  or sigmoid of them, then a top-k and a renormalisation, which no rule conserves through).

Several rules on one module compose: a gated MLP's activation under ``activation`` = `Identity` and
``gated_product`` = `Scale` (½) passes ½ · f(x)/x.

The rule sets (Ali et al. 2022; Achtibat et al. 2024; Edin et al. 2025):

Every rule set below holds a head factor D and the routing weights constant (``head_factor``,
``router``: `Scale` (0)). Inside an expert, the fused experts' gated product act(gate) · up is
computed on slices of one parameter tensor, not by modules the rules can reach: it keeps its plain
gradient (``gated_product`` acts only on a dense gated MLP's modules), so the experts do not
conserve relevance under ``attnlrp`` and ``gim`` (an activation module, ``act_fn``, still gets the
``activation`` rule).

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
the biases' share. A new rule set is one `BackwardRules` value, registered with `register_rules`:
it is then a method (``attnflow explain --method NAME``, ``evaluate --methods NAME``), runnable by
name in `lrp_relevance` and as RelP's backward in activation patching (``relp:NAME``).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Literal, Mapping, Sequence

import numpy as np

from attnflow.errors import CaptureError, InputError
from attnflow.methods.extras import Scored
from attnflow.methods.registry import missing_capabilities, register, unregister
from attnflow.model_like import ModelLike
from attnflow.trace import Trace

if TYPE_CHECKING:
    from attnflow.rows.hook_points import HookPoint

NORM_CHECK_TOLERANCE = 1e-4  # a recomputed norm must match the module's own output this closely (float32)

# The module kinds a rule can be keyed by, in the order their rules apply to one module's output
# (a module's bias is read between the value-replacing rules and the scaling ones).
MODULE_KINDS = {
    "norm": "every norm the adapter row declares (Norms)",
    "activation": "element-wise activation modules (GELU, SiLU, tanh, ...)",
    "query_key": "the query and key projections (Values.query, Values.key, or their columns of a Fused one)",
    "value": "the value projections (Values.value, or their columns of a Fused one)",
    "gated_product": "both operands of a gated MLP's product: the up projection's and the activation's outputs",
    "softmax": "every softmax called inside the attention modules",
    "head_factor": "every sigmoid or softplus inside the attention modules of a row with a per-position head factor",
    "router": "a mixture of experts' routing weights (the router's output) and its shared expert's gate",
}
_VALUE_KINDS = ("norm", "activation")  # rules that recompute the output (before a bias is read)


class Rule:
    """One backward rule: how the gradient passes a module of the kinds in ``kinds``; the forward
    value never changes. `apply` returns the module's output rebuilt so that autograd takes the
    rule's path (``x``: the module's first input; ``norms``: the row's `Norms`)."""

    kinds: ClassVar[tuple[str, ...]] = ()

    @property
    def active(self) -> bool:
        """False when the rule is the plain gradient (nothing to hook)."""
        return True

    def apply(self, module: Any, x: Any, output: Any, norms: Any, /) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class ConstantNorm(Rule):
    """1/σ (1/rms) detached: the output recomputed from the input in the form the row declares."""

    kinds: ClassVar[tuple[str, ...]] = ("norm",)

    def apply(self, module: Any, x: Any, output: Any, norms: Any, /) -> Any:
        return _constant_scale_norm(module, x, output, norms)


@dataclass(frozen=True)
class Scale(Rule):
    """∂̃ × ``factor`` at the module's output (0: the gradient stops there)."""

    factor: float
    kinds: ClassVar[tuple[str, ...]] = ("query_key", "value", "gated_product", "activation", "head_factor", "router")

    @property
    def active(self) -> bool:
        return self.factor != 1

    def apply(self, _module: Any, _x: Any, output: Any, _norms: Any, /) -> Any:
        scale_gradient, _, _ = _rule_functions()
        return output.detach() if self.factor == 0 else scale_gradient.apply(output, self.factor)


@dataclass(frozen=True)
class Identity(Rule):
    """An activation passes relevance on unchanged: the gradient reaches x times f(x)/x."""

    kinds: ClassVar[tuple[str, ...]] = ("activation",)

    def apply(self, _module: Any, x: Any, output: Any, _norms: Any, /) -> Any:
        _, identity_rule, _ = _rule_functions()
        return identity_rule.apply(x, output)


@dataclass(frozen=True)
class TemperedSoftmax(Rule):
    """The softmax's backward s_T ⊙ (g − ⟨g, s_T⟩), s_T = softmax(x / ``temperature``)."""

    temperature: float
    kinds: ClassVar[tuple[str, ...]] = ("softmax",)

    @property
    def active(self) -> bool:
        return self.temperature != 1


@dataclass(frozen=True)
class BackwardRules:
    """A rule set: ``rules`` maps module kinds (`MODULE_KINDS`) to `Rule` objects (a kind left out
    keeps its plain gradient); ``baseline``: ``"zero"`` (gradient × input) or ``"pad"`` (× (input −
    the pad token's embedding)). Forward values never change."""

    name: str
    summary: str
    rules: Mapping[str, Rule] = field(default_factory=dict)
    baseline: Literal["zero", "pad"] = "zero"

    def __post_init__(self) -> None:
        for kind, rule in self.rules.items():
            if kind not in MODULE_KINDS:
                raise ValueError(
                    f"rule set {self.name!r}: unknown module kind {kind!r}; known: {', '.join(MODULE_KINDS)}"
                )
            if kind not in rule.kinds:
                raise ValueError(f"rule set {self.name!r}: {type(rule).__name__} does not apply to {kind!r} modules")
        if self.baseline not in ("zero", "pad"):
            raise ValueError(f"rule set {self.name!r}: baseline must be 'zero' or 'pad', got {self.baseline!r}")

    def rule(self, kind: str) -> Rule | None:
        """The active rule for ``kind``, or None (the plain gradient)."""
        rule = self.rules.get(kind)
        return rule if rule is not None and rule.active else None

    @property
    def requires(self) -> tuple[str, ...]:
        """What a model family must provide (`attnflow.trace.CAPABILITIES`): a target; the query, key
        and value projections when a rule changes their gradients; declared norms for a norm rule;
        with any rule active, attention as every layer's only token mixer (the rules conserve
        relevance through attention, norms and products, not through a hybrid's state-space or
        recurrent layers; a set with none active is the plain gradient)."""
        needed = ["text_target"]
        if self.rule("query_key") or self.rule("value"):
            needed.append("query_key")
        if self.rule("norm"):
            needed.append("norms")
        if any(self.rule(kind) for kind in self.rules):
            needed.append("attention_mixing")
        return tuple(needed)


RULE_TABLE: tuple[BackwardRules, ...] = (
    BackwardRules(
        "cp_lrp",
        "CP-LRP (Ali et al. 2022): gradient x input at the embedding sum, attention and norms' 1/sigma constant",
        {"norm": ConstantNorm(), "query_key": Scale(0.0), "head_factor": Scale(0.0), "router": Scale(0.0)},
    ),
    BackwardRules(
        "attnlrp",
        "AttnLRP (Achtibat et al. 2024): gradient x input at the embedding sum, with LRP rules for norms, "
        "activations, softmax and products",
        {
            "norm": ConstantNorm(),
            "query_key": Scale(0.25),
            "value": Scale(0.5),
            "activation": Identity(),
            "gated_product": Scale(0.5),
            "head_factor": Scale(0.0),
            "router": Scale(0.0),
        },
    ),
    BackwardRules(
        "gim",
        "GIM (Edin et al. 2025): gradient x (embedding - pad embedding) with frozen norms, a temperature-2 "
        "softmax backward and halved products",
        {
            "norm": ConstantNorm(),
            "query_key": Scale(0.25),
            "value": Scale(0.5),
            "gated_product": Scale(0.5),
            "softmax": TemperedSoftmax(2.0),
            "head_factor": Scale(0.0),
            "router": Scale(0.0),
        },
        baseline="pad",
    ),
)
RULES: dict[str, BackwardRules] = {}  # every registered rule set by name (the table's and `register_rules`')


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
    """Register a rule set by its name: a method (one forward and one backward pass, a signed score
    per token, a batch form that explains many traces in one padded pass; ``attnflow explain
    --method NAME``, ``evaluate --methods NAME``, the docs' table of methods), a name `lrp_relevance`
    takes, and RelP's backward in activation patching (``relp:NAME``). `unregister_rules` undoes it."""

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
    RULES[rules.name] = rules


def unregister_rules(name: str) -> None:
    """Remove a rule set registered with `register_rules` (its method and its name)."""
    unregister(name)
    RULES.pop(name, None)


for _rules in RULE_TABLE:
    register_rules(_rules)


def rules_named(rules: BackwardRules | str) -> BackwardRules:
    """A registered rule set by name (a `BackwardRules` is returned as it is); ValueError naming the
    registered ones otherwise."""
    if isinstance(rules, BackwardRules):
        return rules
    if rules not in RULES:
        raise InputError(f"unknown backward rules {rules!r}; choose one of {', '.join(RULES)}")
    return RULES[rules]


def check_rules_supported(model: ModelLike, rules: BackwardRules, what: str | None = None) -> None:
    """One line naming what ``model``'s family lacks for ``rules`` (an InputError), else nothing."""
    missing = missing_capabilities(rules.requires, model.adapter)
    if missing:
        raise InputError(
            f"{what or rules.name} does not support the {model.adapter.family} family ({model.name}): it requires "
            + "; ".join(missing)
            + model.adapter.note
        )


def lrp_relevance(model: ModelLike, traces: Sequence[Trace], rules: BackwardRules | str) -> list[Relevance]:
    """Relevance by the rule set ``rules`` (a `BackwardRules` or a registered name) for each trace,
    explaining its ``target``; traces with the same kind of target are explained together, in one
    padded forward and one backward pass."""
    from attnflow.targets import same_objective_groups

    rules = rules_named(rules)
    check_rules_supported(model, rules)
    results: list[Relevance | None] = [None] * len(traces)
    for members in same_objective_groups(traces):
        batch = _explain_batch(model, [traces[i] for i in members], rules)
        for position, relevance in zip(members, batch, strict=True):
            results[position] = relevance
    return [relevance for relevance in results if relevance is not None]


def _explain_batch(model: ModelLike, traces: list[Trace], rules: BackwardRules) -> list[Relevance]:
    """One padded forward and backward pass for traces whose targets share one objective; a target
    still to resolve (``Trace.request``) is resolved in this same forward pass and recorded."""
    import torch

    from attnflow.targets import objective_of

    objective = objective_of(model, traces[0])  # outside the hooks (similarity runs the model)
    lengths = [trace.n_tokens for trace in traces]
    input_ids = torch.full((len(traces), max(lengths)), model.tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, trace in enumerate(traces):
        input_ids[row, : trace.n_tokens] = torch.as_tensor(np.asarray(trace.token_ids))
        attention_mask[row, : trace.n_tokens] = 1
    index = None
    if traces[0].target is not None and traces[0].target.index is not None:
        index = torch.as_tensor([trace.target.index for trace in traces], device=model.device)
    with backward_rules(model, rules) as recording, torch.enable_grad():
        y, found, probability = objective(
            attention_mask.to(model.device), input_ids=input_ids.to(model.device), index=index
        )
    for row, trace in enumerate(traces):
        if trace.target is None:
            p = None if probability is None else float(probability[row].detach())
            trace.resolved(objective.describe(float(y[row].detach()), None if found is None else int(found[row]), p))
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
    embeddings = model.hf_model.get_input_embeddings()
    return (embeddings(input_ids) - embeddings(torch.full_like(input_ids, model.tokenizer.pad_token_id))).detach()


@dataclass
class RuleRecording:
    """What the rules' hooks saw in one forward pass: the embedding sum ``[batch, token, d_model]``
    (a leaf that requires grad), for every module with a bias ``(bias, output)`` (the output as the
    modified backward pass reaches the bias), and how many softmax calls inside the attention
    modules were given the ``softmax`` rule (``tempered_softmax``) and how many sigmoid or softplus calls inside
    them the ``head_factor`` rule (``head_factors``)."""

    embedding_sum: Any = None
    biased_outputs: list[tuple[Any, Any]] = field(default_factory=list)
    tempered_softmax: int = 0
    head_factors: int = 0


def rule_modules(model: ModelLike, rules: BackwardRules) -> dict[Any, list[tuple[str, Rule, str | None]]]:
    """Every module a rule of ``rules`` applies to, with its ``(kind, rule, part)`` triples in
    `MODULE_KINDS` order: ``part`` names the slice of a `Fused` projection's output the rule acts on
    (``"query"``, ``"key"``, ``"value"``), None for the whole output (the softmax and head-factor
    rules, which apply inside the attention modules, are not among them)."""
    from attnflow.rows.adapters import find_layers

    hf_model, adapter = model.hf_model, model.adapter

    def modules_of(pattern: str | None) -> list[Any]:
        return [] if pattern is None else [module for _, module in find_layers(hf_model, pattern)]

    def projections(*parts: str) -> list[tuple[Any, str | None]]:
        found = []
        for part in parts:
            where = adapter.projection(part)
            if where is not None:
                found += [(module, None if where[1] is None else part) for module in modules_of(where[0])]
        return found

    def whole(modules: list[Any]) -> list[tuple[Any, str | None]]:
        return [(module, None) for module in modules]

    found: dict[str, list[tuple[Any, str | None]]] = {kind: [] for kind in MODULE_KINDS}
    norms = adapter.norms
    if rules.rule("norm") is not None:
        if norms is None:
            raise CaptureError(f"the {adapter.family} row declares no norms: the norm rule cannot find them")
        found["norm"] = whole(_matching(hf_model, norms.modules))
    found["activation"] = whole([module for module in hf_model.modules() if isinstance(module, _elementwise())])
    found["query_key"] = [] if _at_scores(adapter) else projections("query", "key")
    found["value"] = projections("value")
    if adapter.gated_mlp is not None:
        gated = adapter.gated_mlp
        for _, mlp in find_layers(hf_model, gated.module, gaps=True):  # its layers (dense ones beside MoE)
            found["gated_product"] += whole([getattr(mlp, gated.up), getattr(mlp, gated.activation)])
    applied: dict[Any, list[tuple[str, Rule, str | None]]] = {}
    for kind, modules in found.items():
        rule = rules.rule(kind)
        if rule is not None:
            for module, part in modules:
                applied.setdefault(module, []).append((kind, rule, part))
    return applied


def _matching(hf_model: Any, pattern: str) -> list[Any]:
    """Every module whose name ``pattern`` matches (no layer group needed)."""
    import re

    regex = re.compile(pattern)
    return [module for name, module in hf_model.named_modules() if name and regex.search(name)]


@contextmanager
def backward_rules(model: ModelLike, rules: BackwardRules) -> Iterator[RuleRecording]:
    """Hooks that apply ``rules`` to the forward passes run inside the block (the module docstring
    lists each module kind and where it is found); removed on exit, also when the block raises."""
    import torch

    from attnflow.rows.adapters import find_layers
    from attnflow.rows.hook_points import HookPoint, hooks
    from attnflow.rows.tracing import calls_inside

    adapter, hf_model = model.adapter, model.hf_model
    applied = rule_modules(model, rules)
    recording = RuleRecording()

    def rules_at(module: Any, chain: list[tuple[str, Rule, str | None]]) -> Any:
        value_rules = [(rule, part) for kind, rule, part in chain if kind in _VALUE_KINDS]
        scale_rules = [(rule, part) for kind, rule, part in chain if kind not in _VALUE_KINDS]
        bias = getattr(module, "bias", None)

        def apply(rule: Rule, part: str | None, output: Any, x: Any) -> Any:
            ruled = rule.apply(module, x, output, adapter.norms)
            if part is None:
                return ruled
            # a fused projection: the rule's path for the part's columns, the plain one elsewhere
            on_part = torch.zeros(output.shape[-1], dtype=torch.bool, device=output.device)
            on_part[adapter.part_columns(part, output.shape[-1], model.config).to(output.device)] = True
            return torch.where(on_part, ruled, output)

        def apply_rules(output: Any, x: Any) -> Any:
            for rule, part in value_rules:
                output = apply(rule, part, output, x)
            if isinstance(bias, torch.Tensor):
                recording.biased_outputs.append((bias.detach(), output))
            for rule, part in scale_rules:
                output = apply(rule, part, output, x)
            return output

        return apply_rules

    def take_embedding_sum(embedding_sum: Any) -> Any:
        recording.embedding_sum = embedding_sum.detach().requires_grad_(True)
        return recording.embedding_sum

    hooked: list[tuple[HookPoint, Any]] = [(_embedding_sum(model), take_embedding_sum)]
    biased = [m for m in hf_model.modules() if _biased_projection(m)]
    hooked += [
        (HookPoint(module, "output", with_input=True), rules_at(module, applied.get(module, [])))
        for module in dict.fromkeys([*applied, *biased])
    ]
    router = rules.rule("router")
    if router is not None:
        hooked += [
            (HookPoint(module, "output", index=index, name="router"), _held(router))
            for module, index in _routers(model)
        ]
    softmax = rules.rule("softmax")
    scores = rules.rule("query_key") if _at_scores(adapter) else None
    factor = rules.rule("head_factor") if adapter.values is not None and adapter.values.head_factor else None
    with ExitStack() as stack:
        if isinstance(softmax, TemperedSoftmax) or scores is not None or factor is not None:
            attention = [module for _, module in find_layers(hf_model, adapter.stack.attention)]
            tempered = softmax if isinstance(softmax, TemperedSoftmax) else None
            handle = _inside_attention(_softmax_rules(tempered, scores, recording), factor, recording)
            stack.enter_context(calls_inside(attention, handle))
        stack.enter_context(hooks(hooked))
        yield recording
    if factor is not None and recording.embedding_sum is not None and not recording.head_factors:
        raise CaptureError(
            f"the {adapter.family} row's head factor (Values.head_factor) is not a sigmoid or softplus called "
            "inside its attention modules: the backward rules cannot hold it constant"
        )


def _inside_attention(softmax: Any, factor: Rule | None, recording: RuleRecording) -> Any:
    """The `attnflow.rows.tracing.calls_inside` handler of the attention modules: each softmax call
    to ``softmax`` (a `attnflow.rows.tracing.SoftmaxHandler`), each sigmoid's or softplus' output through the
    ``head_factor`` rule ``factor`` (None: as it is), counted in ``recording``."""
    from attnflow.rows.tracing import GATES, softmax_handler

    on_softmax = softmax_handler(softmax)

    def handle(func: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        if factor is not None and func in GATES and getattr(output, "requires_grad", False):
            recording.head_factors += 1
            return factor.apply(None, None, output, None)
        return on_softmax(func, args, kwargs, output)

    return handle


def _held(rule: Rule) -> Any:
    """A hook function passing a module's output through ``rule`` (a `Scale`)."""
    return lambda output: rule.apply(None, None, output, None)


def _routers(model: ModelLike) -> list[tuple[Any, int]]:
    """``(module, index)`` of every tensor the ``router`` rule acts on: each MoE block's router and
    the element of its tuple output holding the routing weights, and its shared expert's gate
    (`attnflow.rows.adapters.Experts`); none for a row without experts."""
    from attnflow.rows.adapters import find_layers

    row = model.adapter.experts
    if row is None:
        return []
    found = []
    for _, block in find_layers(model.hf_model, row.block, gaps=True):
        found.append((block.get_submodule(row.router), row.weights_index))
        if row.shared_gate is not None:
            found.append((block.get_submodule(row.shared_gate), 0))
    return found


def _at_scores(adapter: Any) -> bool:
    """Whether the row's query and key meet only in the attention scores (`Values.scores`: no
    projections of their own), so that the ``query_key`` rule acts at the softmax's input."""
    values = adapter.values
    return values is not None and values.scores


def _softmax_rules(tempered: TemperedSoftmax | None, scores: Rule | None, recording: RuleRecording) -> Any:
    """The handler (`attnflow.rows.tracing.softmax_inside`) giving each attention softmax its rules:
    ``scores`` (a `Scale`) on its input, the scores Q·Kᵀ — for a product Q and K reach the output only
    through, the same gradient at each factor as that rule at the query and key projections — and
    the ``tempered`` backward."""

    def handle(x: Any, output: Any, dim: int, dtype: Any, rerun: Any) -> Any:
        if not x.requires_grad:
            return output
        if scores is not None:
            x = scores.apply(None, None, x, None)
            output = rerun(x)
        if tempered is None:
            return output
        recording.tempered_softmax += 1
        _, _, rule = _rule_functions()
        return rule.apply(x if dtype is None else x.to(dtype), output, dim, tempered.temperature)

    return handle


def _embedding_sum(model: ModelLike) -> HookPoint:
    """Where the embedding sum e ``[batch, token, d_model]`` is: the input of the row's embedding norm,
    else of its first block (`Sites.block`: word + position embeddings where the family adds
    positions, as GPT-2 does), else the word embeddings' output."""
    import re

    from attnflow.rows.adapters import find_layers
    from attnflow.rows.hook_points import HookPoint

    adapter, hf_model = model.adapter, model.hf_model
    if adapter.embedding_norm:
        pattern = re.compile(adapter.embedding_norm)
        norm = next((module for name, module in hf_model.named_modules() if pattern.search(name)), None)
        if norm is not None:
            return HookPoint(norm, "input")
    if adapter.sites is not None:
        return HookPoint(find_layers(hf_model, adapter.sites.block)[0][1], "input")
    return HookPoint(hf_model.get_input_embeddings(), "output")


def _biased_projection(module: Any) -> bool:
    """A projection with a bias: a 2-D weight (torch's Linear, transformers' ``[in, out]`` Conv1D)."""
    import torch

    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and isinstance(bias, torch.Tensor)


@cache
def _elementwise() -> tuple[type, ...]:
    """The element-wise activation classes (transformers' ``ACT2FN`` table: GELU, SiLU, tanh, ...)."""
    from transformers.activations import ACT2CLS

    return tuple({entry if isinstance(entry, type) else entry[0] for entry in ACT2CLS.values()})


def _constant_scale_norm(module: Any, x: Any, output: Any, norms: Any) -> Any:
    """The norm's output recomputed from its input ``x [..., d]`` with 1/σ detached, in the form the
    adapter row declares (`Norms.recompute`). It must equal the module's own ``output`` (a
    CaptureError naming the declared form otherwise)."""
    import torch

    form = norms.form
    recomputed = norms.recompute(module, x, constant_scale=True)
    # a 16-bit model's norm output is rounded to its precision: two rounding steps apart at most
    tolerance = max(NORM_CHECK_TOLERANCE, 2 * torch.finfo(output.dtype).eps)
    if not torch.allclose(recomputed, output, rtol=tolerance, atol=tolerance):
        raise CaptureError(
            f"{type(module).__name__} is not the {form} norm its adapter row declares: the backward rules cannot "
            "linearise it (check the row with attnflow.rows.check_adapter)"
        )
    return recomputed


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
        """Forward: ``output`` = f(x); backward: the gradient reaches ``x`` times f(x)/x (0 where
        x = 0, which contributes nothing), so x · ∂̃ = f(x) · ∂̃y/∂f(x)."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x, output)
            return output.view_as(output)

        @staticmethod
        def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
            x, output = ctx.saved_tensors
            zero = x == 0
            ratio = torch.where(zero, torch.zeros_like(x), output / torch.where(zero, torch.ones_like(x), x))
            return gradient * ratio, None

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
