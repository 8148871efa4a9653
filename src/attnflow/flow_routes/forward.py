"""The one forward pass information-flow routes read, recorded through hooks removed in ``finally``.

Where each tensor lives comes from the family's adapter row: the blocks and what each
feed-forward block adds from `Sites`, the stream each feed-forward block reads from `Streams.mid`,
each chosen expert's part of a mixture of experts from `Experts` (recomputed from the recorded
input of each MoE block: `attnflow.rows.experts`),
the values from the row's value projection (or its part of a `Fused` one), the attention weights and
the output projections from the `Stack`. The pass stops once the last block has run: the
unembedding, a pooler or a head compute nothing routes read (the logit lens applies the final
norm and the unembedding itself). This module holds all of routes' hook code, and the reading of
the weights routes need (output projections, norms, unembedding).
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from attnflow.capture.hooks import (
    StopForward,
    find_layers,
    float_weights,
    record_stack,
    record_tensors,
    stack_recorded,
)
from attnflow.errors import CaptureError, InputError
from attnflow.flow_routes.contributions import Norm
from attnflow.model_like import ModelLike
from attnflow.rows import hook_points
from attnflow.rows.adapters import NormForm, Norms, as_tokens, head_factor
from attnflow.rows.experts import n_experts, shared_part, slots
from attnflow.rows.hook_points import HookPoint
from attnflow.trace import CAPABILITIES


@dataclass
class ExpertParts:
    """One MoE layer's parts at each of ``T`` positions: ``indices [T, k]`` the chosen experts,
    ``parts [T, k, d]`` what each adds (g_k · E_{i_k}(x)), ``shared [T, d]`` the shared expert's
    part (None without one); ``n_experts`` E, the routed experts (a shared one is column E)."""

    indices: torch.Tensor
    parts: torch.Tensor
    shared: torch.Tensor | None
    n_experts: int

    def to(self, dtype: torch.dtype) -> ExpertParts:
        shared = None if self.shared is None else self.shared.to(dtype)
        return ExpertParts(self.indices, self.parts.to(dtype), shared, self.n_experts)


@dataclass
class Recording:
    """One text's residual streams, float32 on the model's device (``T`` tokens, ``d`` = d_model).

    ``inputs [L + 1, T, d]``: the stream entering each layer; row L is the stream leaving the last
    layer (what the final norm reads). ``mids [L, T, d]``: the stream each feed-forward block reads
    (`Streams.mid`): after the attention block; in a parallel block, the one entering the layer.
    ``attentions [L, H, T, T]`` ``[layer, head, query, key]``. ``values [L, T, KV, d_head]``: the
    value vectors of the KV heads, value bias included (query head h reads KV head
    h // (H / KV)). ``attention_outputs [L, T, d]``: the attention output projection's output,
    bias included, before any norm and the residual addition. ``ffn_outputs [L, T, d]``: what each
    feed-forward block adds to the stream (`Sites.mlp`'s output; post-LN families: before the
    layer norm that follows the addition). ``experts``: rows with a mixture of experts, each
    layer's `ExpertParts` (they and the shared part sum to ``ffn_outputs``); None otherwise.
    ``factors [L, T, H, d_head]``: rows whose heads are A·V times a per-position factor
    (`attnflow.rows.adapters.Values.head_factor`), D at each query (`head_factor`); None otherwise.
    """

    inputs: torch.Tensor
    mids: torch.Tensor
    attentions: torch.Tensor
    values: torch.Tensor
    attention_outputs: torch.Tensor
    ffn_outputs: torch.Tensor
    experts: list[ExpertParts] | None = None
    dtype: torch.dtype = torch.float32  # the precision the model computed them in (they are stored float32)
    factors: torch.Tensor | None = None

    @property
    def n_layers(self) -> int:
        return int(self.mids.shape[0])


PRECISION = torch.float64  # of the per-layer arithmetic (a proximity is a difference of two close norms)


@dataclass
class Layer:
    """One layer's tensors, in `PRECISION`: ``inputs`` the stream entering it, ``mid`` the one its
    feed-forward block reads, ``out`` leaving it (``[T, d]`` each), ``attention [H, T, T]``,
    ``values [T, KV, d_head]``, ``attention_output`` and ``ffn_output`` ``[T, d]``, ``experts`` (see
    `Recording`), ``output_weights [H, d_head, d]``, ``output_bias [d]``, its norms, whether the
    block is ``parallel`` (see `Weights`) and the precision the model ``computed_in``."""

    inputs: torch.Tensor
    mid: torch.Tensor
    out: torch.Tensor
    attention: torch.Tensor
    values: torch.Tensor
    attention_output: torch.Tensor
    ffn_output: torch.Tensor
    output_weights: torch.Tensor
    output_bias: torch.Tensor
    attention_norm: Norm | None
    attention_norm_first: bool
    ffn_norm: Norm | None
    parallel: bool
    experts: ExpertParts | None = None
    computed_in: torch.dtype = torch.float32  # the model's precision (`Recording.dtype`)
    gates: tuple[torch.Tensor, ...] | None = None  # a gated block's constants (`Gates.layer`)
    factors: torch.Tensor | None = None  # [T, H, d_head] a factored row's D (`Recording.factors`)


def layer_view(recording: Recording, weights: Weights, index: int) -> Layer:
    """Layer ``index`` of a recording with its weights, in `PRECISION`."""

    def exact(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(PRECISION)

    return Layer(
        inputs=exact(recording.inputs[index]),
        mid=exact(recording.mids[index]),
        out=exact(recording.inputs[index + 1]),
        attention=exact(recording.attentions[index]),
        values=exact(recording.values[index]),
        attention_output=exact(recording.attention_outputs[index]),
        ffn_output=exact(recording.ffn_outputs[index]),
        output_weights=exact(weights.output_weights[index]),
        output_bias=exact(weights.output_bias[index]),
        attention_norm=None if weights.attention_norm is None else weights.attention_norm.layer(index, PRECISION),
        attention_norm_first=weights.attention_norm_first,
        ffn_norm=None if weights.ffn_norm is None else weights.ffn_norm.layer(index, PRECISION),
        parallel=weights.parallel,
        experts=None if recording.experts is None else recording.experts[index].to(PRECISION),
        computed_in=recording.dtype,
        gates=None if weights.gates is None else weights.gates.layer(index, PRECISION),
        factors=None if recording.factors is None else exact(recording.factors[index]),
    )


@dataclass
class Weights:
    """What routes read of the weights. ``output_weights [L, H, d_head, d]``: each head's slice of
    the output projection W_O; ``output_bias [L, d]`` (zeros without one). ``attention_norm``:
    post-LN families, the layer norm after each attention block (``attention_norm_first`` False:
    it reads the sum residual + attention output); sandwich families, the norm on the attention
    output alone before the residual addition (``attention_norm_first`` True); None for pre-LN.
    ``ffn_norm``: post-LN families, the layer norm after each feed-forward block. Norm parameters
    are ``[L, d]``. ``final_norm`` ``[d]`` and ``unembedding`` (``W_U [vocabulary, d]``) for the
    logit lens, None where the model has no language-model head; ``softcap``: the model's final
    logit soft-capping c (logits = c tanh(z / c)), or None. ``parallel``: the row's blocks are
    parallel (`Streams.parallel`: one whole per layer, no stream between the two updates).
    """

    output_weights: torch.Tensor
    output_bias: torch.Tensor
    attention_norm: Norm | None
    attention_norm_first: bool
    ffn_norm: Norm | None
    final_norm: Norm | None
    final_norm_module: nn.Module | None
    unembedding: nn.Module | None
    softcap: float | None
    parallel: bool
    gates: Gates | None = None


@dataclass
class Gates:
    """The per-channel constants of a gated block (`Streams.gated`), each ``[L, d]``: the stream
    after attention is ``shift + residual ⊙ x + branch ⊙ attention site`` and the stream leaving
    the block ``ffn_shift + ffn_residual ⊙ mid + ffn_branch ⊙ MLP site``; fitted by `fit_gates`."""

    shift: torch.Tensor
    residual: torch.Tensor
    branch: torch.Tensor
    ffn_shift: torch.Tensor
    ffn_residual: torch.Tensor
    ffn_branch: torch.Tensor

    def layer(self, index: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Layer ``index``'s six ``[d]`` constants, in the order of the fields, in ``dtype``."""
        fields = (self.shift, self.residual, self.branch, self.ffn_shift, self.ffn_residual, self.ffn_branch)
        return tuple(field[index].to(dtype) for field in fields)


GATE_PROBE = (4, 16)  # the seeded input [batch, token] the gates are fitted on: 64 rows for 3 constants a channel


def fit_gates(model: ModelLike, weights: Weights) -> Gates:
    """`Gates` of a gated row, fitted per channel by least squares on the streams of a seeded input
    (`GATE_PROBE`, random token ids), where the model's own streams give them exactly: a fit that
    leaves a residual or is not determined is a `CaptureError` (the row does not match the model).
    The attention site is the output projection's output through ``weights.attention_norm`` where
    the row has a norm on the attention output alone (Ergo's)."""
    from attnflow.rows.tracing import affine_constants, affine_failure

    generator = torch.Generator().manual_seed(0)
    vocab = int(getattr(model.tokenizer, "vocab_size", 100) or 100)
    ids = torch.randint(4, max(5, min(vocab, 100)), GATE_PROBE, generator=generator)
    recordings = [record(model, row[None]) for row in ids]
    stacked = {
        name: torch.cat([getattr(found, name).double() for found in recordings], dim=1)  # [L (+ 1), rows, d]
        for name in ("inputs", "mids", "attention_outputs", "ffn_outputs")
    }
    fitted: list[list[torch.Tensor]] = [[] for _ in range(6)]
    for layer in range(model.n_layers):
        attention = stacked["attention_outputs"][layer]
        if weights.attention_norm is not None and weights.attention_norm_first:
            attention = weights.attention_norm.layer(layer, torch.float64)(attention)
        x, mid, out = stacked["inputs"][layer], stacked["mids"][layer], stacked["inputs"][layer + 1]
        for offset, (whole, terms) in enumerate(((mid, (x, attention)), (out, (mid, stacked["ffn_outputs"][layer])))):
            failure = affine_failure(whole, terms, _GATE_TOLERANCE)
            if failure is not None:
                raise CaptureError(
                    f"{model.name}: layer {layer}'s gated block ({'attention' if offset == 0 else 'feed-forward'} "
                    f"update) is not per-channel affine in the stream and the update: {failure}; the adapter row "
                    "does not match this model"
                )
            for k, constant in enumerate(affine_constants(whole, terms)):  # shift, the stream's, the update's
                fitted[3 * offset + k].append(constant)
    return Gates(*(torch.stack(constants).to(model.device) for constants in fitted))


_GATE_TOLERANCE = 1e-4  # relative to the largest magnitude fitted, as the conformance checks'


def check_supported(model: ModelLike) -> None:
    """One line naming what the model's adapter row lacks for routes (vision and encoder-decoder
    rows have no residual streams mapped; a row needs `Streams`, `Sites` and its values)."""
    adapter = model.adapter
    if "streams" in adapter.provides:
        return
    if adapter.mixers is not None:
        raise InputError(
            f"information-flow routes do not support the {adapter.family} family ({model.name}): "
            f"{adapter.mixers.reason('routes')}"
        )
    missing = []
    if adapter.streams is None:
        missing.append(f"streams ({CAPABILITIES['streams']})")
    if adapter.sites is None:
        missing.append(f"sites ({CAPABILITIES['sites']})")
    if adapter.norms is None:
        missing.append(f"norms ({CAPABILITIES['norms']})")
    if adapter.projection("value") is None:
        missing.append("values (where the value vectors are)")
    raise InputError(
        f"information-flow routes do not support the {adapter.family} family ({model.name}): "
        f"its adapter row has no {'; no '.join(missing)}{adapter.note}"
    )


def record(model: ModelLike, input_ids: torch.Tensor) -> Recording:
    """One forward pass over ``input_ids [1, T]`` with every stream routes read recorded."""
    adapter, hf_model = model.adapter, model.hf_model
    streams, sites = adapter.streams, adapter.sites
    value_pattern = _value_location(model)
    located = {
        "blocks": find_layers(hf_model, sites.block),
        "mids": find_layers(hf_model, streams.mid),
        "values": find_layers(hf_model, value_pattern),
        "attention_outputs": find_layers(hf_model, adapter.stack.output_projection),
        "ffn_outputs": find_layers(hf_model, sites.mlp),
        **({"moe": find_layers(hf_model, adapter.experts.block)} if adapter.experts is not None else {}),
    }
    wrong = {name: len(found) for name, found in located.items() if len(found) != model.n_layers}
    if wrong:
        raise CaptureError(
            f"{model.name}: the adapter row's patterns found {wrong} modules for {model.n_layers} layers"
        )
    with ExitStack() as hooks, torch.no_grad():
        factored = adapter.values is not None and adapter.values.head_factor  # D needs the heads
        attention = hooks.enter_context(record_stack(hf_model, adapter.stack, head_outputs=factored))
        first_input = hooks.enter_context(record_tensors(located["blocks"][:1], inputs=True, copies=True))
        mids = hooks.enter_context(record_tensors(located["mids"], inputs=True, copies=True))
        moe_inputs = hooks.enter_context(record_tensors(located.get("moe", []), inputs=True, copies=True))
        outputs = {
            name: hooks.enter_context(record_tensors(located[name], copies=True))
            for name in ("blocks", "values", "attention_outputs", "ffn_outputs")
        }
        last_block = located["blocks"][-1][1]  # registered last: its hook runs after the recording
        hooks.enter_context(hook_points.hooks([(HookPoint(last_block, "output", name="last block"), _stop)]))
        try:
            hf_model(input_ids=input_ids.to(model.device), output_attentions=True)
        except StopForward:
            pass
    # A flattened feed-forward block (`as_tokens`) holds its stream [T, d]: seen [1, T, d] like the rest.
    mids = {name: as_tokens(tensor, 1) for name, tensor in mids.items()}
    outputs["ffn_outputs"] = {name: as_tokens(tensor, 1) for name, tensor in outputs["ffn_outputs"].items()}
    rows = {name: adapter.value_rows(tensor) for name, tensor in outputs["values"].items()}  # [1, T, width] each
    widths = sorted({int(tensor.shape[-1]) for tensor in rows.values()})
    if len(widths) > 1:  # layers of different shapes (MiMo-V2-Flash's local and global layers)
        raise CaptureError(
            f"{model.name}: the layers' value projections differ in width ({', '.join(map(str, widths))}): "
            "routes read one value width in every layer"
        )
    values = stack_recorded(rows, located["values"])[0]  # [L, T, width]
    values = values[..., adapter.part_columns("value", values.shape[-1], model.config).to(values.device)]
    first = stack_recorded(first_input, located["blocks"][:1])[0]  # [1, T, d]
    values = values.reshape(*values.shape[:2], -1, model.d_head)  # [L, T, KV, d_head]
    weights = attention.stacked_weights()[0]  # [L, H, T, T]
    factors = None
    if factored:
        per_head = values.to(weights.dtype).repeat_interleave(weights.shape[1] // values.shape[2], dim=2)
        products = torch.einsum("lhqk,lkhd->lqhd", weights, per_head)  # A·V [L, T, H, d_head]
        heads = attention.stacked_head_outputs(model.n_heads)[0].to(products)
        factors = torch.stack([head_factor(heads[i], products[i]) for i in range(len(products))]).float()
    return Recording(
        inputs=torch.cat([first, stack_recorded(outputs["blocks"], located["blocks"])[0]]).float(),
        mids=stack_recorded(mids, located["mids"])[0].float(),
        attentions=float_weights(weights),
        values=values.float(),
        attention_outputs=stack_recorded(outputs["attention_outputs"], located["attention_outputs"])[0].float(),
        ffn_outputs=stack_recorded(outputs["ffn_outputs"], located["ffn_outputs"])[0].float(),
        experts=_expert_parts(model, located["moe"], moe_inputs) if "moe" in located else None,
        dtype=first.dtype,
        factors=factors,
    )


def _expert_parts(
    model: ModelLike, blocks: list[tuple[str, nn.Module]], inputs: dict[str, torch.Tensor]
) -> list[ExpertParts]:
    """Each MoE block's parts, recomputed from its recorded input ``[1, T, d]`` (float32)."""
    row = model.adapter.experts
    assert row is not None  # the caller records MoE blocks only for rows with experts
    found = []
    with torch.no_grad():
        for name, block in blocks:
            hidden = inputs[name][0]  # [T, d]
            chosen, shared = slots(row, block, hidden), shared_part(row, block, hidden)
            shared = None if shared is None else shared.float()
            found.append(ExpertParts(chosen.indices, chosen.parts.float(), shared, n_experts(row, block)))
    return found


def _stop(_output: Any) -> None:
    raise StopForward


def _value_location(model: ModelLike) -> str:
    """The regex of the modules whose output holds the values (`Adapter.projection`)."""
    where = model.adapter.projection("value")
    assert where is not None  # check_supported refused a row without values
    return where[0]


def read_weights(model: ModelLike) -> Weights:
    """The weights routes read (see `Weights`), on the model's device."""
    adapter, hf_model = model.adapter, model.hf_model
    streams, values = adapter.streams, adapter.values
    shared = model.shared_fields(frozenset({"output_weights"}))
    attention_norm, first = None, False
    if values is not None and values.norm is not None:
        attention_norm = _layer_norms(model, values.norm)
    elif values is not None and values.output_norm is not None:
        attention_norm, first = _layer_norms(model, values.output_norm), True
    final_module = _find_one(hf_model, streams.final_norm) if streams.final_norm else None
    unembedding = hf_model.get_output_embeddings() if final_module is not None else None
    softcap = getattr(model.config, "final_logit_softcapping", None)
    found = Weights(
        output_weights=torch.as_tensor(shared["output_weights"], device=model.device),
        output_bias=torch.as_tensor(shared["output_bias"], device=model.device),
        attention_norm=attention_norm,
        attention_norm_first=first,
        ffn_norm=_layer_norms(model, streams.ffn_norm) if streams.ffn_norm else None,
        final_norm=None if final_module is None else _norm_of_row(model, [final_module]),
        final_norm_module=final_module,
        unembedding=unembedding if isinstance(unembedding, nn.Module) else None,
        softcap=float(softcap) if softcap else None,
        parallel=streams.parallel,
    )
    if streams.gated:
        found.gates = fit_gates(model, found)
    return found


def _layer_norms(model: ModelLike, pattern: str) -> Norm:
    modules = [module for _, module in find_layers(model.hf_model, pattern)]
    if len(modules) != model.n_layers:
        raise CaptureError(f"{model.name}: found {len(modules)} norms for {model.n_layers} layers ({pattern!r})")
    return _norm_of_row(model, modules)


def _norm_of_row(model: ModelLike, modules: list[nn.Module]) -> Norm:
    """`norm_of` in the form the adapter row declares (`Norms`)."""
    norms = model.adapter.norms
    return norm_of(modules, norms.form, norms.rms_offset, model.d_model, norms.eps)


def norm_of(modules: list[nn.Module], kind: str, rms_offset: float, width: int, eps: float | None = None) -> Norm:
    """The parameters of norms of one form over ``width`` features, stacked (``[len(modules), d]``;
    one module: ``[d]``); ``eps``: the row's, for modules that name none (`Norms.eps`)."""
    if kind not in ("layer", "rms"):
        raise CaptureError(f"unknown norm form {kind!r} in the adapter row (layer or rms)")
    form = Norms("", cast(NormForm, kind), rms_offset, eps)
    gains, shifts = zip(*(form.gain_and_shift(module, width) for module in modules), strict=True)
    eps = form.epsilon(modules[0])
    if eps is None:
        raise CaptureError(f"{type(modules[0]).__name__} names no epsilon (eps or variance_epsilon)")
    stack = (lambda tensors: tensors[0]) if len(modules) == 1 else torch.stack
    return Norm(kind, stack(list(gains)), stack(list(shifts)), eps)


def _find_one(model: nn.Module, pattern: str) -> nn.Module:
    regex = re.compile(pattern)
    found = [module for name, module in model.named_modules() if regex.search(name)]
    if len(found) != 1:
        raise CaptureError(f"{len(found)} modules match {pattern!r}; the adapter row's final norm names one")
    return found[0]
