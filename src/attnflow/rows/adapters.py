"""Per-architecture knowledge in one table: where attention weights, head outputs, values, the
patching sites, the parts the backward rules change and the residual streams information-flow
routes read live, and what each family therefore provides.

Each row names, as regular expressions over ``model.named_modules()`` (searched, so any
prefix such as ``bert.`` or ``model.`` matches), the attention modules whose forward output
holds the softmax weights ``[batch, head, query, key]`` at ``weights_index``, and the output
projections whose *input* is the concatenation of all heads' outputs ``[batch, token, head *
d_head]``. The first group of every pattern is the layer index. A new architecture is one new
row plus its tiny config in ``tests/tiny_models.py`` (``tiny_config`` and ``TEXT_FAMILIES`` or
``VISION_FAMILIES``), which the capture tests in ``tests/capture/test_capture.py`` then cover.

Methods never list families: each declares what it *requires* (`attnflow.trace.CAPABILITIES`) and a
family supports it when its row `Adapter.provides` them all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from attnflow.errors import CaptureError

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Stack:
    """One stack of attention layers: encoder self-, decoder self- or cross-attention.

    ``sinks``: the softmax has a learned sink logit per head beside the keys (GPT-OSS), with no
    value: a row of the returned weights sums to 1 minus the sink's share (< 1). Value-weighted
    sums and routes' parts stay exact (the sink adds a zero vector); what reads the weights as
    row-stochastic (rollout, flow) does not hold for such a stack. False: rows sum to 1.

    ``gaps``: a hybrid stack (`Mixers`): attention in some layers only, so the stack's patterns (and
    the row's other per-head patterns: values, query, key, fused projections) match those layers
    and leave the others out (`find_layers` with ``gaps``); False: one attention module per layer.
    """

    attention: str  # regex; module output[weights_index] is [batch, head, query, key]
    output_projection: str  # regex; module input is [batch, token, head * d_head]
    weights_index: int = 1
    sinks: bool = False
    gaps: bool = False  # a hybrid stack: the patterns name the attention layers only (`Adapter.mixers`)


@dataclass(frozen=True)
class Values:
    """Where a family's value-aware methods find their parts (regexes like `Stack`'s).

    ``value``: the value projection, output ``[batch, token, kv_heads * d_head]`` (bias included),
    or None where a `Fused` projection of the row holds the values (and the query and key);
    ``block``: the whole layer (its input is the residual stream entering the attention block;
    value zeroing reruns it); ``norm``: post-LN families only, the layer norm right after the
    attention block (its input is y = attention output + residual); None for pre-LN families.
    ``output_scale``: families with LayerScale (DINOv2): the module whose ``lambda1 [d_model]``
    multiplies the attention block's output before the residual; `CaptureModel.output_weights`
    folds it into W_O and its bias, so f_h(x_j) is what the block adds to the residual stream.
    ``query`` / ``key``: the query and key projections (LRP changes the gradient there), or None
    (none, or parts of a `Fused` projection).
    ``output_norm``: a norm between the output projection and the residual addition (Gemma 2/3's
    sandwich norm, OLMo-2's post-norm: ``post_attention_layernorm``). It divides the block's output
    by the statistic (RMS or σ) of query i's sum over heads and tokens, so what token j adds through
    head h is f_h(x_j) = v_j W_O^h through the norm with that statistic fixed (the value-aware
    methods read the norm as the trace's ``output_norms``); the norm's form is the row's `Norms`,
    without which the family does not provide the ``values`` capability.
    ``scores``: the query and key have no projections of their own (multi-head latent attention
    builds them from low-rank latents and a rotary part): they meet only in the attention scores
    Q·Kᵀ, the input of the softmax called inside the attention modules, where the backward rules
    for their product act instead (`attnflow.methods.model.lrp`; the conformance suite's ``scores``
    check proves that softmax returns the weights). False: the rules act at ``query`` and ``key``.
    ``head_factor``: a per-position factor multiplies each head's A·V before the output projection,
    the same for every key and independent of the values (a sigmoid gate computed from the block
    input: AFMoE, Beam, MiniCPM5-MoE; a sink's rescaling of the softmax weights after they are
    returned: Granite-SWA). The output projection's input at query i is then D_i ⊙ Σ_j A_ij v_j, so
    what token j adds through head h is A_hij (v_jh ⊙ D_ih) W_O^h, with D the ratio of the output
    projection's input to A·V on the run (`head_factor`; the conformance suite's ``head_factor``
    check proves it, changing one token's values and reading the heads again). The value-aware
    methods read it as the trace's ``head_factors``; routes as per-query head vectors
    (`attnflow.flow_routes.contributions.QueryVectors`); the backward rules hold D constant (the
    ``head_factor`` module kind of `attnflow.methods.model.lrp`: every sigmoid or softplus called
    inside the attention modules), their query and key rule acting at the scores (an inferred factored row
    names no query or key projection: ``scores`` is set, and proven by its own check).
    ``per_head``: the ``value`` module's output is ``[batch, token, kv_heads, d_head]``, the heads
    split before it (a weightless per-head norm after the value projection: Gemma 3n's and Gemma
    4's ``v_norm``); `Adapter.value_rows` flattens it. False: ``[batch, token, kv_heads * d_head]``.
    ``head_norm`` (with ``head_factor``): a norm between A·V and the output projection (BitNet's
    RMS ``attn_sub_norm``; Dory's weightless L2 one, after a gate), over all heads of query i
    together: the output projection's input is g ⊙ y_i / s_i, y the norm's input (A·V, or A·V times
    a per-position factor), the statistic s_i fixed from the run, so the factor D_i = g / s_i (times
    the factor before it) carries each head through as a gate's does. The conformance suite's
    ``head_factor`` check then reads the norm's input (whose factor does not depend on the values;
    the output projection's does) and its ``head_norm`` check proves that the norm writes its input
    times a per-position scalar and a per-feature gain (`per_position_scale`). A norm that
    subtracts a mean (a layer norm) mixes the heads and fails. None: no such norm.
    """

    value: str | None
    block: str
    norm: str | None = None
    output_scale: str | None = None
    query: str | None = None
    key: str | None = None
    output_norm: str | None = None
    scores: bool = False
    head_factor: bool = False
    per_head: bool = False
    head_norm: str | None = None

    @property
    def post_norm(self) -> bool:
        return self.norm is not None


@dataclass(frozen=True)
class Mixers:
    """A hybrid stack's layers whose token mixer is not attention (a state-space, recurrent,
    convolution or linear-attention module: Mamba, Gated DeltaNet, RG-LRU, a short convolution).

    ``module``: regex (group 1 the layer) naming each such layer's token mixer, the module whose
    output is what the layer's token mixing adds to the residual stream; ``layers``: those layers;
    ``kinds``: the mixers' module classes, for the refusal's wording only (nothing branches on them).
    Such a mixer returns no attention weights, so a method that reads the attention weights as the
    whole token mixing (rollout, attention flow, the value-aware maps, routes, the LRP rules) would
    miss what flows through these layers: the row then does not provide ``attention_mixing``
    (`reason` says why in one line). The residual stream, the MLP sites and the token mixer's
    output in every layer (`Sites.attention` names both kinds of mixer), the heads of the attention
    layers and every method that reads only the embeddings and the output stay exact.
    """

    module: str
    layers: tuple[int, ...]
    kinds: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        """Which layers mix tokens without attention, and through what (where inference proved it)."""
        many = len(self.layers) > 1
        layers = f"layer{'s' if many else ''} {', '.join(str(layer) for layer in self.layers)}"
        if self.kinds:
            return f"{layers} mix{'' if many else 'es'} tokens through {' and '.join(self.kinds)}"
        return f"{layers} ha{'ve' if many else 's'} no attention"  # no mixer proven: the layers only

    def reason(self, what: str) -> str:
        """Why ``what`` (a method's name, "routes") is refused: the layers, their mixers, and the flow it would miss."""
        if self.kinds:
            returns = f", which return{'s' if len(self.kinds) == 1 else ''} no attention weights"
        else:
            returns = ", and what mixes tokens there returns no attention weights"
        return f"{self.where}{returns}: {what} reads attention as the only token mixer and would miss that flow"


@dataclass(frozen=True)
class Sites:
    """Where activation patching reads and writes (regexes like `Stack`'s; group 1 is the layer).

    ``block``: the whole layer: its input (first positional argument) is the residual stream
    ``[batch, token, d_model]`` entering layer l, its output (first element of a tuple) the stream
    leaving it. ``attention`` / ``mlp``: the modules whose output (first element of a tuple)
    ``[batch, token, d_model]`` is what the attention block / the MLP adds to the residual stream
    (for post-LN families, before the norm that follows the addition; for sandwich-norm families
    such as Gemma and post-norm ones such as OLMo-2, the output of the norm that follows the
    block). One head's output is its
    ``d_head`` slice of the input of the stack's ``output_projection``. In a hybrid stack
    (`Mixers`) ``attention`` names each layer's token mixer: the attention block in the attention
    layers, the `Mixers` module in the others, so the sites still add up in every layer.
    ``gated``: the block output is not input + attention + MLP but a per-channel affine
    combination of the three, the same for every token (learned residual gates or scales, a
    branch multiplier, an interpolation between the stream and the branch: Doge, Ergo, Beam,
    MiniCPM3): patching a site is still exact; nothing adds the sites up as they are, so routes
    need `Streams.gated` (the per-channel constants of each update, fitted where routes run).
    """

    block: str
    attention: str
    mlp: str
    gated: bool = False


@dataclass(frozen=True)
class Streams:
    """What information-flow routes (`attnflow.routes`) read besides the stack, the `Values`, the
    `Sites` and the `Norms` of the row (regexes like `Stack`'s; group 1 is the layer).

    ``mid``: the module whose input (its forward's first parameter) is the residual stream the
    feed-forward block reads, ``[batch, token, d_model]``: in a sequential block, the stream after
    the attention block (pre-LN and sandwich families: the norm before the feed-forward block;
    OLMo-2, which has no pre-norms: the feed-forward block itself; post-LN families: the
    feed-forward block's first module, whose input is the attention block's layer-normed output);
    in a parallel block, the stream entering the block. ``ffn_norm``: post-LN families, the layer
    norm after the feed-forward block (its input is the feed-forward output plus the stream after
    attention). ``final_norm``: the norm before the unembedding (``get_output_embeddings()``), which
    the logit lens reads; None: no lens. The values are the ``"value"`` part of the row
    (`Adapter.projection`).

    ``parallel``: the block's topology. False (sequential): stream x → mid = x + attention update →
    mid + feed-forward update(mid). True (parallel attention and feed-forward: GPT-J, GPT-NeoX with
    ``use_parallel_residual``, Phi, Falcon, Cohere): both read the block's input x, block output =
    x + attention update(x) + feed-forward update(x), with no stream between them; routes then make
    the block one whole whose parts are x, every (source, head) term, the bias terms and the
    feed-forward output. A parallel block takes no norm reading a sum (no post-LN ``Values.norm``,
    no ``ffn_norm``); norms on each update alone (``Values.output_norm``, a ``Sites.mlp`` that is
    the norm after the feed-forward block) are allowed.

    ``gated`` (a sequential block with `Sites.gated`): each update joins the stream through
    per-channel constants, mid = c + r ⊙ x + g ⊙ attention and out = c′ + r′ ⊙ mid + g′ ⊙ MLP
    (Doge's and Ergo's learned residual gates, ESMC's and MiniCPM3's branch scale); routes fit the
    constants on a seeded run (`attnflow.flow_routes.forward.fit_gates`) and read r ⊙ x as the
    residual part, g as the scale of every other part and c as a bias.
    """

    mid: str
    ffn_norm: str | None = None
    final_norm: str | None = None
    parallel: bool = False
    gated: bool = False


NormForm = Literal["layer", "rms"]


@dataclass(frozen=True)
class Norms:
    """Every norm of the family and its form, declared (the backward rules recompute each with its
    1/σ detached; routes fold them; `check_adapter` recomputes each in this form).

    ``modules``: a regex matching every norm module's name (searched, like the other patterns; no
    layer group needed). ``form``: ``"layer"``, g ⊙ (y − mean(y)) / σ(y) + β, or ``"rms"``,
    g ⊙ y / rms(y), with g = ``rms_offset`` + w (Gemma's RMS norms and Nemotron's layer norms have
    offset 1: they multiply by 1 + w). A norm without a weight (OLMo's layer norms, Llama 4's q/k
    L2 norms) scales by 1; one without a bias shifts by 0. ``eps``: the epsilon of norms whose
    modules name none (OLMo's weightless layer norms compute with 1e-5 written in their forward),
    None where they do (`norm_epsilon`). `recompute` is the formula, in one place: the backward
    rules, routes, the conformance suite and inference all call it (or `gain_and_shift`).
    """

    modules: str
    form: NormForm
    rms_offset: float = 0.0
    eps: float | None = None

    def gain_and_shift(self, module: Any, width: int) -> tuple[Any, Any]:
        """``(g, β)`` of ``module`` in this form, float32 ``[width]`` each: g = w (layer) or
        ``rms_offset`` + w, 1 without a weight; β = the bias (layer), else 0."""
        import torch

        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if isinstance(weight, torch.Tensor):
            gain = weight.detach().float() + self.rms_offset
        else:
            gain = torch.ones(width)
        if self.form == "layer" and isinstance(bias, torch.Tensor):
            return gain, bias.detach().float()
        return gain, torch.zeros_like(gain)

    def recompute(self, module: Any, x: Any, *, constant_scale: bool = False) -> Any:
        """``module``'s output recomputed from its input ``x [..., d]`` in this form, in float32 at
        least and rounded to x's precision as the modules compute it; ``constant_scale``: 1/σ (1/rms)
        detached, as the backward rules hold it."""
        import torch

        eps = self.epsilon(module)
        wide = x.float()
        centred = wide - wide.mean(dim=-1, keepdim=True) if self.form == "layer" else wide
        scale = torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + (1e-6 if eps is None else eps))
        normed = centred * (scale.detach() if constant_scale else scale)
        weight = getattr(module, "weight", None)
        if self.form == "rms" and self.rms_offset == 0 and isinstance(weight, torch.Tensor):
            return weight * normed.to(x.dtype)  # Llama's order: the weight multiplies in the model's precision
        gain, shift = self.gain_and_shift(module, x.shape[-1])
        return (normed * gain.to(x.device) + shift.to(x.device)).to(x.dtype)

    def epsilon(self, module: Any) -> float | None:
        """``module``'s epsilon (`norm_epsilon`), else the row's ``eps`` (None when neither names one)."""
        found = norm_epsilon(module)
        return self.eps if found is None else found


def token_rows(output: Any, *, heads: bool = False) -> Any:
    """A projection's output as ``[batch, token, width]``: multi-head latent attention runs its
    ``kv_b_proj`` on the latent viewed as one head, ``[batch, 1, token, rank]``, so its output is
    ``[batch, 1, token, width]``; ``heads``: the output is ``[batch, token, head, d_head]``
    (`Values.per_head`), flattened (a view where it is contiguous, so writing into it writes the
    output); any other output is returned as it is."""
    if heads:
        return output.flatten(-2)
    if output.dim() == 4 and output.shape[1] == 1:
        return output[:, 0]
    return output


def head_factor(heads: Any, products: Any) -> Any:
    """``[..., width]`` D = ``heads`` / ``products`` (the output projection's input over A·V, per
    position and feature), computed as heads · p / (p² + ε²) with ε a millionth of the largest
    |A·V| given, so that where A·V is 0 (nothing to carry) D is 0 rather than a ratio of rounding
    errors (`Values.head_factor`). Torch tensors or numpy arrays."""
    eps = 1e-6 * max(float(abs(products).max()), 1e-30)
    return heads * products / (products * products + eps * eps)


def norm_gains(module: Any, width: int) -> list[Any]:
    """The per-feature gains a norm ``module`` may multiply by, float32 ``[width]`` each: 1 for a
    weightless one, else its weight w and 1 + w (`per_position_scale` tries each)."""
    import torch

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != (width,):
        return [torch.ones(width)]
    return [weight.detach().float(), weight.detach().float() + 1]


def per_position_scale(read: Any, written: Any, gain: Any) -> Any:
    """``[..., 1]`` the scalar c per position for which ``written`` ≈ c · gain ⊙ ``read`` (least
    squares; ``[..., width]`` tensors, gain ``[width]``): a norm without centring (RMS, L2) with its
    statistic fixed is that map (`Values.head_norm`); whether it holds is the caller's check."""
    scaled = read.double() * gain.double().to(read.device)
    return (written.double() * scaled).sum(-1, keepdim=True) / (scaled * scaled).sum(-1, keepdim=True).clamp_min(1e-300)


def as_tokens(tensor: Any, batch: int) -> Any:
    """A stream tensor as ``[batch, token, width]``: some feed-forward blocks run on the tokens
    flattened, ``[batch * token, width]`` (OPT's fc1/fc2 and the norm before them, Llama 4's
    mixture of experts), so what they read and add arrives 2-D; a view of it is returned (writing
    into it writes the flattened tensor). Any other tensor is returned as it is."""
    if not hasattr(tensor, "dim") or tensor.dim() != 2 or tensor.shape[0] % batch:
        return tensor
    return tensor.view(batch, tensor.shape[0] // batch, tensor.shape[-1])


def norm_epsilon(module: Any) -> float | None:
    """A norm module's epsilon (``eps``, ``variance_epsilon`` or ``epsilon``), None when it names none."""
    for name in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


FusedLayout = Literal["side_by_side", "per_head", "per_group"]
HEAD_PARTS = ("query", "key", "value")  # parts split into heads: query n_heads of them, key and value n_kv_heads


@dataclass(frozen=True)
class Fused:
    """A projection whose output holds several projections: ``module`` (regex, group 1 the layer),
    the ``parts`` in their order along the output's last axis, and their ``layout``.

    Head parts (`HEAD_PARTS`) are ``d_head``-wide heads: a query part has n_heads of them, a key or
    value part n_kv_heads (`Adapter.kv_heads`); other parts (a fused gate-up projection's
    ``"gate"`` and ``"up"``) are equal slices. The output is cut into G equal groups, each holding
    its share of every part's heads, in ``parts`` order:

    - ``"side_by_side"`` (G = 1): each part whole, one after the other (GPT-2's ``c_attn``: q | k | v;
      Phi-3's ``qkv_proj``: q of n_heads heads, then k and v of n_kv_heads each);
    - ``"per_head"`` (G = the heads of each part, all equal): head 0's q, k, v, then head 1's, ...
      (GPT-NeoX's and Bloom's ``query_key_value``, viewed as ``[..., head, 3 * d_head]``);
    - ``"per_group"`` (G = n_kv_heads, or ``groups``): per group, its share of each part's heads in
      ``parts`` order (Falcon's new decoder architecture: per key/value group, its n_heads /
      n_kv_heads query heads, then its key head, then its value head; CodeGen's ``qkv_proj``:
      ``groups`` = 4 model-parallel shards, each its query, then value, then key heads, ``parts``
      ``("query", "value", "key")``).

    ``groups``: G of a ``"per_group"`` layout where it is not n_kv_heads (0: n_kv_heads).

    ``widths``: the features per head of each part, where they differ from one another (multi-head
    latent attention: DeepSeek's ``kv_b_proj`` holds, per head, the key's position-free half, then
    the value, ``("other", "value")`` with widths ``(qk_nope_head_dim, v_head_dim)``). With widths
    every part is a head part (a query part n_heads heads, any other n_kv_heads) and a part that no
    capability reads may take any name (``"other"``); empty: every head part is ``d_head`` wide.
    """

    module: str
    parts: tuple[str, ...]
    layout: FusedLayout = "side_by_side"
    widths: tuple[int, ...] = ()
    groups: int = 0

    def __post_init__(self) -> None:
        if self.groups and (self.layout != "per_group" or self.groups < 0):
            raise ValueError(f"fused groups {self.groups} need the per_group layout and a positive count")
        if self.layout not in ("side_by_side", "per_head", "per_group"):
            raise ValueError(f"unknown fused layout {self.layout!r}; choose side_by_side, per_head or per_group")
        if self.widths and (len(self.widths) != len(self.parts) or min(self.widths) <= 0):
            raise ValueError(f"fused widths {self.widths} do not give one positive width per part of {self.parts}")
        heads = [part in HEAD_PARTS or bool(self.widths) for part in self.parts]
        if len(set(self.parts)) != len(self.parts) or (any(heads) and not all(heads)):
            raise ValueError(f"fused parts {self.parts} repeat a part or mix head parts with others")
        if not any(heads) and self.layout != "side_by_side":
            raise ValueError(f"fused parts {self.parts} are equal slices: their layout is side_by_side")

    def columns(self, part: str, width: int, n_heads: int, n_kv_heads: int) -> Any:
        """The output features holding ``part`` in an output ``width`` wide: a LongTensor, head-major
        (``[heads of the part * d_head]``: head 0's d_head features, then head 1's, ...)."""
        import torch

        if part not in self.parts:
            raise CaptureError(f"the fused projection {self.module!r} holds {self.parts}, not {part!r}")
        if part not in HEAD_PARTS and not self.widths:  # equal slices, side by side
            size, rest = divmod(width, len(self.parts))
            if rest:
                raise CaptureError(f"{self.module!r}: {width} features do not split into {len(self.parts)} parts")
            start = self.parts.index(part) * size
            return torch.arange(start, start + size)
        heads = [n_heads if name == "query" else n_kv_heads for name in self.parts]
        if self.widths:
            sizes, rest = list(self.widths), width - sum(h * w for h, w in zip(heads, self.widths, strict=True))
        else:
            d_head, rest = divmod(width, sum(heads))
            sizes = [d_head] * len(heads)
        groups = {"side_by_side": 1, "per_head": heads[0], "per_group": self.groups or n_kv_heads}[self.layout]
        if rest or any(count % groups for count in heads) or (self.layout == "per_head" and len(set(heads)) > 1):
            raise CaptureError(
                f"{self.module!r}: {width} features do not hold {dict(zip(self.parts, heads, strict=True))} heads "
                f"laid out {self.layout}" + (f" with widths {self.widths}" if self.widths else "")
            )
        per_group = [count // groups for count in heads]  # [part] heads of each part in one group
        index = self.parts.index(part)
        offset = sum(count * size for count, size in zip(per_group[:index], sizes, strict=False))  # in a group
        group = torch.arange(groups)[:, None] * sum(c * w for c, w in zip(per_group, sizes, strict=True))  # [group, 1]
        inside = offset + torch.arange(per_group[index] * sizes[index])  # [heads in a group * the part's width]
        return (group + inside).reshape(-1)


@dataclass(frozen=True)
class GatedMLP:
    r"""A gated MLP ``down(act(gate(x)) * up(x))`` (Llama's SwiGLU): ``module`` (regex) and the
    attribute names of its up projection and its activation, whose product the rules split.

    ``module`` may match only some layers (``find_layers(..., gaps=True)``): a stack whose first
    layers are dense and the others mixtures of experts (DeepSeek's ``first_k_dense_replace``,
    ERNIE 4.5's, GLM-4.5's) names its dense layers, ``(0|1)`` in place of ``(\d+)``.
    """

    module: str
    up: str = "up_proj"
    activation: str = "act_fn"


@dataclass(frozen=True)
class Experts:
    """A mixture of experts in place of the MLP (`attnflow.rows.experts` computes with it, and
    `attnflow.rows.experts.find_experts` infers it from a module and one traced call).

    ``block``: the MoE block (regex, group 1 the layer): its input x ``[batch, token, d_model]``
    feeds the router and every expert, its output (first element of a tuple) is Σ_k g_k(x) E_k(x)
    plus the shared expert's part. The other modules are attribute paths below the block.
    ``router``: called on x ``[N, d_model]`` (tokens flattened), returns a tuple holding the
    routing weights g ``[N, k]`` at ``weights_index`` and the chosen experts ``[N, k]`` at
    ``indices_index`` (what the experts module receives). ``experts``: holds the fused parameters,
    leading axis the expert: ``first`` ``[E, out, d_model]`` and ``down`` ``[E, d_model, inter]``
    (``transposed``: ``[E, d_model, out]`` and ``[E, inter, d_model]``), their biases ``first_bias``
    and ``down_bias`` ``[E, ·]`` with ``bias``. One expert is down(act(first(x))), ``activation``
    the experts module's attribute applied to the first projection's output: gated experts
    ``_apply_gate`` (``[.., 2 inter]`` -> ``[.., inter]``), plain ones ``act_fn``. ``shared``: a
    module every token goes through (x -> ``[.., d_model]``), scaled by the sigmoid of
    ``shared_gate``'s output ``[.., 1]`` (None: unscaled).
    """

    block: str
    router: str = "gate"
    experts: str = "experts"
    weights_index: int = 1
    indices_index: int = 2
    first: str = "gate_up_proj"
    down: str = "down_proj"
    transposed: bool = False
    bias: bool = False
    activation: str = "_apply_gate"
    shared: str | None = None
    shared_gate: str | None = None


@dataclass(frozen=True)
class Adapter:
    """One family's row: its name, kind, the ``config.model_type`` values it covers, where its
    attention stacks, values, patching sites, norms, embedding norm, gated MLP and fused projections
    live, the config attribute holding its head count and how its projections store their weights
    (`provides` derives what methods may require of it)."""

    family: str
    kind: str  # "encoder" | "decoder" | "vision" | "encoder-decoder"
    model_types: tuple[str, ...]  # config.model_type values this row covers
    stack: Stack  # the encoder (or the only) stack
    decoder: Stack | None = None  # encoder-decoder: decoder self-attention
    cross: Stack | None = None  # encoder-decoder: cross-attention (decoder query x encoder key)
    n_prefix_tokens: int = 0  # vision: tokens before the first patch (CLS, distillation, ...)
    position_offset: int = 0  # positions reserved by the embedding (RoBERTa-style padding_idx + 1)
    values: Values | None = None  # value-aware methods (norm, norm_rollout, alti, value_zeroing)
    sites: Sites | None = None  # activation patching
    embedding_norm: str | None = None  # regex; its input is the embedding sum (else: the word embeddings)
    gated_mlp: GatedMLP | None = None
    streams: Streams | None = None  # information-flow routes
    norms: Norms | None = None  # every norm and its form (the backward rules, routes, the conformance suite)
    fused: tuple[Fused, ...] = ()  # projections whose output holds several (GPT-2's c_attn: q, k and v)
    head_count: str = "num_attention_heads"  # the config attribute with the heads per layer
    weights_in_out: bool = False  # projections store their weight as [in, out] (GPT-2's Conv1D), not [out, in]
    experts: Experts | None = None  # a mixture of experts in place of the MLP
    mixers: Mixers | None = None  # a hybrid stack: the layers that mix tokens without attention
    inferred: bool = False  # found by `attnflow.rows.infer` from the model itself, not written by hand
    unverified: tuple[str, ...] = ()  # inferred rows: the checks that failed ("check: detail"), their parts left out
    missing: tuple[str, ...] = ()  # inferred rows: the parts inference did not find, and why ("part: reason")

    def __post_init__(self) -> None:
        held = [part for fused in self.fused for part in fused.parts]
        twice = sorted({part for part in held if held.count(part) > 1 or getattr(self.values, part, None)})
        if twice:
            raise ValueError(f"the {self.family} row names {twice} twice (in Values or in several Fused entries)")

    def heads(self, config: Any) -> int:
        """The heads per layer: the config attribute ``head_count`` names (of the text config, for a
        model whose config nests one: `text_config`)."""
        value = config_value(text_config(config), self.head_count)
        if not isinstance(value, int) or value <= 0:
            raise CaptureError(
                f"{type(config).__name__} has no head count {self.head_count!r} (the {self.family} row's head_count)"
            )
        return value

    def in_by_out(self, projection: Any) -> Any:
        """A projection's weight as ``[in, out]``, stored as the row says (``weights_in_out``)."""
        return projection.weight if self.weights_in_out else projection.weight.T

    def kv_heads(self, config: Any) -> int:
        """The key/value heads per layer: ``num_key_value_heads`` where the config has it, 1 for a
        multi-query config (``multi_query=True``), else the heads (`heads`)."""
        text = text_config(config)
        value = config_value(text, "num_key_value_heads")
        if isinstance(value, int) and value > 0:
            return value
        return 1 if getattr(text, "multi_query", False) is True else self.heads(config)

    def projection(self, part: str) -> tuple[str, Fused | None] | None:
        """Where ``part`` (``"query"``, ``"key"``, ``"value"``, ``"up"``, ...) is computed: ``(the
        module regex, the `Fused` entry holding it)``, the entry None for a projection of its own
        (the `Values` field of that name); None when the row names it nowhere."""
        for fused in self.fused:
            if part in fused.parts:
                return fused.module, fused
        own = getattr(self.values, part, None) if part in HEAD_PARTS else None
        return None if own is None else (own, None)

    def value_rows(self, output: Any) -> Any:
        """The value module's output (`projection`) as ``[batch, token, width]`` (`token_rows`,
        the heads flattened where `Values.per_head` says they are split)."""
        return token_rows(output, heads=self.values is not None and self.values.per_head)

    def part_columns(self, part: str, width: int, config: Any) -> Any:
        """The features of ``part`` in its projection's output ``width`` wide (`projection`), as
        `Fused.columns` gives them (a LongTensor, head-major); every feature for a projection of its own."""
        import torch

        where = self.projection(part)
        if where is None:
            raise CaptureError(f"the {self.family} row names no {part} projection")
        fused = where[1]
        if fused is None:
            return torch.arange(width)
        return fused.columns(part, width, self.heads(config), self.kv_heads(config))

    @property
    def withheld(self) -> dict[str, str]:
        """The capabilities the row's parts would give but a part of it withholds, with why: a norm
        between A·V and the output projection (`Values.head_norm`) withholds ``query_key``, since no
        backward rule holds its statistic constant yet (routes and the value-aware methods fix it
        from the run and carry the heads through it)."""
        if self.values is None or self.values.head_norm is None:
            return {}
        return {
            "query_key": "its heads pass through a norm before the output projection (Values.head_norm), "
            "whose statistic no backward rule holds constant yet"
        }

    @property
    def note(self) -> str:
        """What a refusal adds for an inferred row: the checks that failed (their parts left out) or
        that inference did not find the part, and where to learn to write it by hand."""
        if not self.inferred:
            return ""
        found = [f"inference did not find {'; '.join(self.missing)}"] if self.missing else []
        if self.unverified:
            found.append(f"checks failed ({'; '.join(self.unverified)})")
        said = " and ".join(found) or "inference did not find the part"
        return f" (the {self.family} row is inferred and {said}: {EXTENDING} shows how to write it by hand)"

    @property
    def default_row(self) -> str:
        return "last" if self.kind in ("decoder", "encoder-decoder") else "cls"

    @property
    def auto_class(self) -> str:
        """The ``transformers`` Auto class that loads this family with its head (an encoder folder
        whose config names a ``*ForSequenceClassification`` architecture loads with that instead)."""
        return auto_class(self.kind)

    @property
    def target_kind(self) -> str | None:
        """What a target of this family is: ``"next_token"`` (decoders), ``"class"`` (encoders; a
        sentence encoder without a head explains a similarity instead), None (no target)."""
        return {"decoder": "next_token", "encoder": "class"}.get(self.kind)

    @property
    def provides(self) -> frozenset[str]:
        """The `attnflow.trace.CAPABILITIES` this row provides."""
        values = self.values
        provided = {
            "text_target": self.target_kind is not None,
            "values": values is not None
            and (values.output_norm is None or self.norms is not None)
            and self.projection("value") is not None,
            "post_norm": values is not None and values.post_norm,
            "query_key": self.projection("value") is not None
            and "query_key" not in self.withheld
            and (
                all(self.projection(part) is not None for part in HEAD_PARTS) or (values is not None and values.scores)
            ),
            "gated_mlp": self.gated_mlp is not None,
            "sites": self.sites is not None,
            "streams": self.streams is not None
            and self.mixers is None
            and self.norms is not None
            and self.sites is not None
            and self.projection("value") is not None,
            "norms": self.norms is not None,
            "experts": self.experts is not None,
            "attention_mixing": self.mixers is None,
        }
        return frozenset(name for name, present in provided.items() if present)


EXTENDING = "docs/extending.md, 'A model family'"

_BERT_LIKE = Stack(r"layer\.(\d+)\.attention\.self$", r"layer\.(\d+)\.attention\.output\.dense$")
_BERT_VALUES = Values(
    r"layer\.(\d+)\.attention\.self\.value$",
    r"encoder\.layer\.(\d+)$",
    r"layer\.(\d+)\.attention\.output\.LayerNorm$",
    query=r"layer\.(\d+)\.attention\.self\.query$",
    key=r"layer\.(\d+)\.attention\.self\.key$",
)
_BERT_SITES = Sites(
    r"encoder\.layer\.(\d+)$", r"layer\.(\d+)\.attention\.output\.dense$", r"layer\.(\d+)\.output\.dense$"
)
_BERT_EMBEDDING_NORM = r"embeddings\.LayerNorm$"  # its input: word + position (+ token type) embeddings
_BERT_STREAMS = Streams(r"layer\.(\d+)\.intermediate$", ffn_norm=r"layer\.(\d+)\.output\.LayerNorm$")
_BERT_NORMS = Norms(r"LayerNorm$", "layer")  # embeddings.LayerNorm and two per layer
_LLAMA_SITES = Sites(r"layers\.(\d+)$", r"layers\.(\d+)\.self_attn$", r"layers\.(\d+)\.mlp$")
_VIT_LIKE = Stack(r"layers?\.(\d+)\.attention$", r"layers?\.(\d+)\.attention\.o_proj$")
# ViT/DeiT: layers.N (layernorm_before, attention.{q,k,v,o}_proj); DINOv2: encoder.layer.N (norm1,
# attention.{q,k,v,o}_proj, layer_scale1, norm2, mlp, layer_scale2). Both pre-LN.
_VIT_VALUES = Values(r"layers?\.(\d+)\.attention\.v_proj$", r"layers?\.(\d+)$")
_VIT_NORMS = Norms(r"\blayernorm(_before|_after)?$", "layer")

ADAPTERS: tuple[Adapter, ...] = (
    Adapter(
        "bert",
        "encoder",
        ("bert", "electra"),
        _BERT_LIKE,
        values=_BERT_VALUES,
        sites=_BERT_SITES,
        embedding_norm=_BERT_EMBEDDING_NORM,
        streams=_BERT_STREAMS,
        norms=_BERT_NORMS,
    ),
    Adapter(
        "roberta",
        "encoder",
        ("roberta", "xlm-roberta", "camembert"),
        _BERT_LIKE,
        position_offset=2,
        values=_BERT_VALUES,
        sites=_BERT_SITES,
        embedding_norm=_BERT_EMBEDDING_NORM,
        streams=_BERT_STREAMS,
        norms=_BERT_NORMS,
    ),
    Adapter(
        "distilbert",
        "encoder",
        ("distilbert",),
        Stack(r"transformer\.layer\.(\d+)\.attention$", r"transformer\.layer\.(\d+)\.attention\.out_lin$"),
        values=Values(
            r"transformer\.layer\.(\d+)\.attention\.v_lin$",
            r"transformer\.layer\.(\d+)$",
            r"transformer\.layer\.(\d+)\.sa_layer_norm$",
            query=r"transformer\.layer\.(\d+)\.attention\.q_lin$",
            key=r"transformer\.layer\.(\d+)\.attention\.k_lin$",
        ),
        sites=Sites(
            r"transformer\.layer\.(\d+)$", r"transformer\.layer\.(\d+)\.attention$", r"transformer\.layer\.(\d+)\.ffn$"
        ),
        embedding_norm=_BERT_EMBEDDING_NORM,
        streams=Streams(r"transformer\.layer\.(\d+)\.ffn$", ffn_norm=r"transformer\.layer\.(\d+)\.output_layer_norm$"),
        norms=Norms(r"(LayerNorm|sa_layer_norm|output_layer_norm)$", "layer"),
        head_count="n_heads",
    ),
    Adapter(
        "mpnet",
        "encoder",
        ("mpnet",),
        Stack(r"layer\.(\d+)\.attention\.attn$", r"layer\.(\d+)\.attention\.attn\.o$"),
        position_offset=2,
        values=Values(
            r"layer\.(\d+)\.attention\.attn\.v$",
            r"encoder\.layer\.(\d+)$",
            r"layer\.(\d+)\.attention\.LayerNorm$",
            query=r"layer\.(\d+)\.attention\.attn\.q$",
            key=r"layer\.(\d+)\.attention\.attn\.k$",
        ),
        sites=Sites(r"encoder\.layer\.(\d+)$", r"layer\.(\d+)\.attention\.attn$", r"layer\.(\d+)\.output\.dense$"),
        embedding_norm=_BERT_EMBEDDING_NORM,
        streams=_BERT_STREAMS,
        norms=_BERT_NORMS,
    ),
    Adapter(
        "gpt2",
        "decoder",
        ("gpt2",),
        Stack(r"\bh\.(\d+)\.attn$", r"\bh\.(\d+)\.attn\.c_proj$"),
        values=Values(None, r"\bh\.(\d+)$"),  # q, k and v: the fused c_attn
        sites=Sites(r"\bh\.(\d+)$", r"\bh\.(\d+)\.attn$", r"\bh\.(\d+)\.mlp$"),
        streams=Streams(r"\bh\.(\d+)\.ln_2$", final_norm=r"\bln_f$"),
        norms=Norms(r"\bln_(1|2|f)$", "layer"),
        fused=(Fused(r"\bh\.(\d+)\.attn\.c_attn$", ("query", "key", "value")),),  # q, k and v are one Conv1D
        head_count="n_head",
        weights_in_out=True,
    ),
    Adapter(
        "llama",
        "decoder",
        ("llama", "mistral", "qwen2", "qwen3"),
        Stack(r"layers\.(\d+)\.self_attn$", r"layers\.(\d+)\.self_attn\.o_proj$"),
        values=Values(
            r"layers\.(\d+)\.self_attn\.v_proj$",
            r"layers\.(\d+)$",
            query=r"layers\.(\d+)\.self_attn\.q_proj$",
            key=r"layers\.(\d+)\.self_attn\.k_proj$",
        ),
        sites=_LLAMA_SITES,
        gated_mlp=GatedMLP(r"layers\.(\d+)\.mlp$"),
        streams=Streams(r"layers\.(\d+)\.post_attention_layernorm$", final_norm=r"model\.norm$"),
        norms=Norms(r"(layernorm|\bnorm|\bq_norm|\bk_norm)$", "rms"),  # Qwen3 adds q and k norms
    ),
    Adapter(
        "gemma3",
        "decoder",
        ("gemma3_text",),
        Stack(r"layers\.(\d+)\.self_attn$", r"layers\.(\d+)\.self_attn\.o_proj$"),
        values=Values(
            r"layers\.(\d+)\.self_attn\.v_proj$",
            r"layers\.(\d+)$",
            query=r"layers\.(\d+)\.self_attn\.q_proj$",
            key=r"layers\.(\d+)\.self_attn\.k_proj$",
            output_norm=r"layers\.(\d+)\.post_attention_layernorm$",
        ),
        # Sandwich norms: what a block adds to the residual stream is the output of the norm after it.
        sites=Sites(
            r"layers\.(\d+)$",
            r"layers\.(\d+)\.post_attention_layernorm$",
            r"layers\.(\d+)\.post_feedforward_layernorm$",
        ),
        gated_mlp=GatedMLP(r"layers\.(\d+)\.mlp$"),
        streams=Streams(r"layers\.(\d+)\.pre_feedforward_layernorm$", final_norm=r"model\.norm$"),
        # Four norms per layer, q and k norms, the final norm: RMS norms that multiply by (1 + w).
        norms=Norms(r"(layernorm|\bnorm|\bq_norm|\bk_norm)$", "rms", rms_offset=1.0),
    ),
    Adapter("vit", "vision", ("vit",), _VIT_LIKE, n_prefix_tokens=1, values=_VIT_VALUES, norms=_VIT_NORMS),
    Adapter(
        "dinov2",
        "vision",
        ("dinov2",),
        _VIT_LIKE,
        n_prefix_tokens=1,
        values=Values(_VIT_VALUES.value, _VIT_VALUES.block, output_scale=r"layers?\.(\d+)\.layer_scale1$"),
        norms=Norms(r"(\bnorm1|\bnorm2|\blayernorm)$", "layer"),
    ),
    Adapter(
        "deit", "vision", ("deit",), _VIT_LIKE, n_prefix_tokens=2, values=_VIT_VALUES, norms=_VIT_NORMS
    ),  # CLS + distillation token
    Adapter(
        "t5",
        "encoder-decoder",
        ("t5", "mt5"),
        Stack(
            r"encoder\.block\.(\d+)\.layer\.0\.SelfAttention$",
            r"encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.o$",
            -1,
        ),
        decoder=Stack(
            r"decoder\.block\.(\d+)\.layer\.0\.SelfAttention$",
            r"decoder\.block\.(\d+)\.layer\.0\.SelfAttention\.o$",
            -1,
        ),
        cross=Stack(
            r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention$",
            r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.o$",
            -1,
        ),
        norms=Norms(r"layer_norm$", "rms"),  # T5's "layer norm" scales by w / rms(x) and subtracts no mean
        head_count="num_heads",
    ),
    Adapter(
        "bart",
        "encoder-decoder",
        ("bart", "mbart", "marian"),
        Stack(r"encoder\.layers\.(\d+)\.self_attn$", r"encoder\.layers\.(\d+)\.self_attn\.out_proj$"),
        decoder=Stack(r"decoder\.layers\.(\d+)\.self_attn$", r"decoder\.layers\.(\d+)\.self_attn\.out_proj$"),
        cross=Stack(r"decoder\.layers\.(\d+)\.encoder_attn$", r"decoder\.layers\.(\d+)\.encoder_attn\.out_proj$"),
        norms=Norms(r"(layer_norm|layernorm_embedding)$", "layer"),
        head_count="encoder_attention_heads",
    ),
)


def text_config(config: Any) -> Any:
    """The config of the language model: ``config.get_text_config()`` where a multimodal config
    nests one (Gemma 3's), the config itself otherwise."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def config_value(config: Any, name: str) -> Any:
    """``config.name``, None where absent; for a config that sets it per layer (transformers'
    heterogeneous configs refuse the global read), the value every layer shares, refused where the
    layers differ (a row has one value for every layer)."""
    try:
        return getattr(config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        values = [getattr(layer, name, None) for layer in config.per_layer_config]
        if len(set(values)) > 1:
            raise CaptureError(
                f"{type(config).__name__} sets {name} per layer and its layers differ ({values}): an adapter row "
                f"has one value for every layer ({EXTENDING})"
            ) from None
        return values[0] if values else None


def auto_class(kind: str) -> str:
    """The ``transformers`` Auto class that loads a model of ``kind`` with its head."""
    return {"decoder": "AutoModelForCausalLM", "encoder-decoder": "AutoModelForSeq2SeqLM"}.get(kind, "AutoModel")


_ADDED: list[Adapter] = []  # rows added at run time (`register_adapter`), searched before ADAPTERS


def register_adapter(adapter: Adapter) -> None:
    """Add a family row (a user's architecture, or a test's toy family); it takes precedence over a
    built-in row for the same ``model_type``. `unregister_adapter` removes it."""
    if any(row.family == adapter.family for row in _ADDED):
        raise ValueError(f"adapter family {adapter.family!r} is registered twice")
    _ADDED.insert(0, adapter)


def unregister_adapter(family: str) -> None:
    """Remove a row added with `register_adapter` (nothing happens for an unknown family)."""
    _ADDED[:] = [row for row in _ADDED if row.family != family]


def hand_row(model_type: str) -> Adapter | None:
    """The row written for a ``config.model_type`` (registered ones first), or None."""
    return next((row for row in (*_ADDED, *ADAPTERS) if model_type in row.model_types), None)


def adapter_for(model_type: str, class_name: str) -> Adapter:
    """The table row for a ``config.model_type``; a clear error naming the class otherwise."""
    row = hand_row(model_type)
    if row is not None:
        return row
    rows = (*_ADDED, *ADAPTERS)
    supported = sorted({t for adapter in rows for t in adapter.model_types})
    raise CaptureError(
        f"{class_name} (model_type {model_type!r}) is not in attnflow's adapter table; "
        f"supported model types: {', '.join(supported)}"
    )


def find_layers(model: nn.Module, pattern: str, *, gaps: bool = False) -> list[tuple[str, nn.Module]]:
    """Modules whose name matches ``pattern`` (first group = layer index), sorted by layer: one per
    layer 0..L-1, or (``gaps``: a part only some layers have, a `GatedMLP`) any layers."""
    regex = re.compile(pattern)
    found: dict[int, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        match = regex.search(name)
        if match:
            layer = int(match.group(1))
            if layer in found:
                raise CaptureError(f"two modules match layer {layer} of {pattern!r}: {found[layer][0]}, {name}")
            found[layer] = (name, module)
    if not gaps and sorted(found) != list(range(len(found))):
        raise CaptureError(f"layers matching {pattern!r} are not numbered 0..L-1: {sorted(found)}")
    return [found[layer] for layer in sorted(found)]


def layer_index(pattern: str, name: str) -> int:
    """The layer index in a module name (the first group of ``pattern``)."""
    match = re.search(pattern, name)
    if match is None:
        raise CaptureError(f"{name} does not match {pattern!r}")
    return int(match.group(1))
