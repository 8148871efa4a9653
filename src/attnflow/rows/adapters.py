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
    """One stack of attention layers: encoder self-, decoder self- or cross-attention."""

    attention: str  # regex; module output[weights_index] is [batch, head, query, key]
    output_projection: str  # regex; module input is [batch, token, head * d_head]
    weights_index: int = 1


@dataclass(frozen=True)
class Values:
    """Where a family's value-aware methods find their parts (regexes like `Stack`'s).

    ``value``: the value projection, output ``[batch, token, kv_heads * d_head]`` (bias included);
    ``block``: the whole layer (its input is the residual stream entering the attention block;
    value zeroing reruns it); ``norm``: post-LN families only, the layer norm right after the
    attention block (its input is y = attention output + residual); None for pre-LN families.
    ``output_scale``: families with LayerScale (DINOv2): the module whose ``lambda1 [d_model]``
    multiplies the attention block's output before the residual; `CaptureModel.output_weights`
    folds it into W_O and its bias, so f_h(x_j) is what the block adds to the residual stream.
    ``query`` / ``key``: the query and key projections (LRP changes the gradient there), or None.
    ``output_norm``: a norm between the output projection and the residual addition (Gemma's
    sandwich norm, ``post_attention_layernorm``). It divides the block's output by the RMS of the
    sum over heads and tokens, so f_h(x_j) = v_j W_O^h is no longer what token j adds through head
    h: such a family does not provide the ``values`` capability (value-aware methods are refused),
    although its projections are mapped for the backward rules.
    """

    value: str
    block: str
    norm: str | None = None
    output_scale: str | None = None
    query: str | None = None
    key: str | None = None
    output_norm: str | None = None

    @property
    def post_norm(self) -> bool:
        return self.norm is not None


@dataclass(frozen=True)
class Sites:
    """Where activation patching reads and writes (regexes like `Stack`'s; group 1 is the layer).

    ``block``: the whole layer: its input (first positional argument) is the residual stream
    ``[batch, token, d_model]`` entering layer l, its output (first element of a tuple) the stream
    leaving it. ``attention`` / ``mlp``: the modules whose output (first element of a tuple)
    ``[batch, token, d_model]`` is what the attention block / the MLP adds to the residual stream
    (for post-LN families, before the norm that follows the addition; for sandwich-norm families
    such as Gemma, the output of the norm that follows the block). One head's output is its
    ``d_head`` slice of the input of the stack's ``output_projection``.
    """

    block: str
    attention: str
    mlp: str


@dataclass(frozen=True)
class Streams:
    """What information-flow routes (`attnflow.routes`) read besides the stack, the `Values`, the
    `Sites` and the `Norms` of the row (regexes like `Stack`'s; group 1 is the layer).

    ``mid``: the module whose input (its forward's first parameter) is the residual stream after the
    attention block, ``[batch, token, d_model]``: pre-LN families, the norm before the feed-forward
    block; post-LN families, the feed-forward block's first module (its input is the attention
    block's layer-normed output). ``ffn_norm``: post-LN families, the layer norm after the
    feed-forward block (its input is the feed-forward output plus the stream after attention).
    ``final_norm``: the norm before the unembedding (``get_output_embeddings()``), which the logit
    lens reads; None: no lens. The values are the output of ``Values.value``, or the ``"value"``
    part of a `Fused` projection of the row.
    """

    mid: str
    ffn_norm: str | None = None
    final_norm: str | None = None


NormForm = Literal["layer", "rms"]


@dataclass(frozen=True)
class Norms:
    """Every norm of the family and its form, declared (the backward rules recompute each with its
    1/σ detached; routes fold them; `check_adapter` recomputes each in this form).

    ``modules``: a regex matching every norm module's name (searched, like the other patterns; no
    layer group needed). ``form``: ``"layer"``, g ⊙ (y − mean(y)) / σ(y) + β, or ``"rms"``,
    (``rms_offset`` + w) ⊙ y / rms(y) (Gemma's offset is 1: its norms multiply by 1 + w).
    """

    modules: str
    form: NormForm
    rms_offset: float = 0.0


@dataclass(frozen=True)
class Fused:
    """A projection whose output is several projections side by side (GPT-2's ``c_attn``: query,
    key and value; a fused gate-up projection: gate and up): ``module`` (regex, group 1 the layer)
    and the ``parts`` in the order they sit along the output's last axis, equal slices of it."""

    module: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class GatedMLP:
    """A gated MLP ``down(act(gate(x)) * up(x))`` (Llama's SwiGLU): ``module`` (regex) and the
    attribute names of its up projection and its activation, whose product the rules split."""

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
    fused: tuple[Fused, ...] = ()  # projections whose output is several side by side (GPT-2's c_attn)
    head_count: str = "num_attention_heads"  # the config attribute with the heads per layer
    weights_in_out: bool = False  # projections store their weight as [in, out] (GPT-2's Conv1D), not [out, in]
    experts: Experts | None = None  # a mixture of experts in place of the MLP

    def heads(self, config: Any) -> int:
        """The heads per layer: the config attribute ``head_count`` names."""
        value = getattr(config, self.head_count, None)
        if not isinstance(value, int) or value <= 0:
            raise CaptureError(
                f"{type(config).__name__} has no head count {self.head_count!r} (the {self.family} row's head_count)"
            )
        return value

    def in_by_out(self, projection: Any) -> Any:
        """A projection's weight as ``[in, out]``, stored as the row says (``weights_in_out``)."""
        return projection.weight if self.weights_in_out else projection.weight.T

    def fused_part(self, part: str) -> tuple[str, int, int] | None:
        """Where a fused projection holds ``part`` (``"value"``, ``"up"``, ...): ``(its regex, the
        part's index, the number of equal parts)``; None when no fused projection of the row has it."""
        for fused in self.fused:
            if part in fused.parts:
                return fused.module, fused.parts.index(part), len(fused.parts)
        return None

    @property
    def default_row(self) -> str:
        return "last" if self.kind in ("decoder", "encoder-decoder") else "cls"

    @property
    def auto_class(self) -> str:
        """The ``transformers`` Auto class that loads this family with its head (an encoder folder
        whose config names a ``*ForSequenceClassification`` architecture loads with that instead)."""
        return {"decoder": "AutoModelForCausalLM", "encoder-decoder": "AutoModelForSeq2SeqLM"}.get(
            self.kind, "AutoModel"
        )

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
            "values": values is not None and values.output_norm is None,
            "post_norm": values is not None and values.post_norm,
            "query_key": values is not None and values.query is not None and values.key is not None,
            "gated_mlp": self.gated_mlp is not None,
            "sites": self.sites is not None,
            "streams": self.streams is not None
            and self.norms is not None
            and self.sites is not None
            and (values is not None or self.fused_part("value") is not None),
            "norms": self.norms is not None,
            "experts": self.experts is not None,
        }
        return frozenset(name for name, present in provided.items() if present)


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


def adapter_for(model_type: str, class_name: str) -> Adapter:
    """The table row for a ``config.model_type``; a clear error naming the class otherwise."""
    rows = (*_ADDED, *ADAPTERS)
    for adapter in rows:
        if model_type in adapter.model_types:
            return adapter
    supported = sorted({t for adapter in rows for t in adapter.model_types})
    raise CaptureError(
        f"{class_name} (model_type {model_type!r}) is not in attnflow's adapter table; "
        f"supported model types: {', '.join(supported)}"
    )


def find_layers(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Modules whose name matches ``pattern`` (first group = layer index), sorted by layer."""
    regex = re.compile(pattern)
    found: dict[int, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        match = regex.search(name)
        if match:
            layer = int(match.group(1))
            if layer in found:
                raise CaptureError(f"two modules match layer {layer} of {pattern!r}: {found[layer][0]}, {name}")
            found[layer] = (name, module)
    if sorted(found) != list(range(len(found))):
        raise CaptureError(f"layers matching {pattern!r} are not numbered 0..L-1: {sorted(found)}")
    return [found[layer] for layer in sorted(found)]


def layer_index(pattern: str, name: str) -> int:
    """The layer index in a module name (the first group of ``pattern``)."""
    match = re.search(pattern, name)
    if match is None:
        raise CaptureError(f"{name} does not match {pattern!r}")
    return int(match.group(1))
