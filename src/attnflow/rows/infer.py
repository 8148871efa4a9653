"""Adapter rows inferred from a model that no hand row covers: the parts are found from the module
tree, the config and one traced forward pass on a seeded input (which modules run, in what order,
with what inputs and outputs), never from class names; every part is kept only where the traced
numbers prove it (the attention weights are softmax rows, A·V per head is the output projection's
input, the residual stream is the sum of the parts, a norm recomputes in its form).

`infer_row(hf_model, kind)` returns an ordinary `Adapter`; `verified_row` then runs the conformance
suite on it (`attnflow.rows.conformance.check_adapter`) and leaves out each part whose check fails,
so a row right on nine counts enables what those prove and names the tenth (``Adapter.unverified``).
`row_for` is what loading asks: the hand row of the model type, else the verified inferred row.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Callable, get_args

import torch
from torch import nn

from attnflow.errors import CaptureError, InferenceError
from attnflow.rows.adapters import (
    EXTENDING,
    Adapter,
    Fused,
    FusedLayout,
    GatedMLP,
    Mixers,
    NormForm,
    Norms,
    Sites,
    Stack,
    Streams,
    Values,
    as_tokens,
    config_value,
    hand_row,
    head_factor,
    norm_epsilon,
    norm_gains,
    per_position_scale,
    text_config,
    token_rows,
)
from attnflow.rows.experts import find_experts
from attnflow.rows.hook_points import output_tensor
from attnflow.rows.tracing import Call, affine_failure, off_the_gradient_path, trace

TOLERANCE = 1e-4  # relative to the largest magnitude compared
_BATCH, _TOKENS = 2, 7


# The parts of an inferred row each check proves: a failure leaves them out ("part.field": that
# field of the part). A gated product the rules cannot find leaves the rules nowhere to apply: the
# query and key go too (the backward rules require them).
_PROVEN_BY = {
    "head_slices": ("values",),
    "head_factor": ("values",),
    "head_norm": ("values",),
    "scores": ("values.scores",),
    "post_norm": ("values",),
    "attention_output": ("sites", "streams"),
    "residual_sum": ("sites", "streams"),
    "ffn_input": ("streams",),
    "own_value": ("sites", "streams"),
    "knockout": ("sites", "streams"),
    "norm_form": ("norms", "streams"),
    "gated_product": ("gated_mlp", "values.query", "values.key", "values.scores"),
}


_VALUE_CHECKS = ("head_slices", "head_factor", "head_norm")


def _not_found(what: str) -> InferenceError:
    """The error for a part inference could not find, pointing to where a hand row says it."""
    return InferenceError(f"{what}; a row written by hand can say where it is ({EXTENDING})")


def kind_of(config: Any, class_name: str = "") -> str:
    """``"encoder"`` (a classifier or a plain encoder) or ``"decoder"`` (a causal LM) for a model type
    with no hand row, from the class that loads it (``class_name`` or the config's architectures: a
    causal LM by its name's ending or by its place in transformers' causal-LM table, which also
    holds ``BertGenerationDecoder``, ``Gemma3ForConditionalGeneration`` and
    ``ReformerModelWithLMHead``), else from that table's model types; encoder-decoder models are
    refused (no inference yet)."""
    if getattr(config, "is_encoder_decoder", False):
        raise InferenceError(
            f"{type(config).__name__} is an encoder-decoder model: attnflow infers rows of decoder-only and "
            f"encoder-only models; a row written by hand can map it ({EXTENDING})"
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = [class_name] if class_name else list(getattr(config, "architectures", None) or ())
    causal = {name for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for name in _names(value)}
    if any(name.endswith(("ForCausalLM", "LMHeadModel")) or name in causal for name in names):
        return "decoder"
    if names or getattr(config, "model_type", None) not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "encoder"
    return "decoder"


def _names(value: Any) -> tuple[str, ...]:
    """The class names of one entry of a transformers model table (a name or a tuple of them)."""
    return tuple(value) if isinstance(value, (list, tuple)) else (str(value),)


def row_for(hf_model: nn.Module) -> Adapter:
    """The hand row of ``hf_model``'s model type, else `verified_row` (its kind from its class)."""
    row = hand_row(str(getattr(hf_model.config, "model_type", "")))
    return row or verified_row(hf_model, kind_of(hf_model.config, type(hf_model).__name__))


def verified_row(hf_model: nn.Module, kind: str) -> Adapter:
    """`infer_row`, checked by the conformance suite: each failed check leaves out the parts it
    proves (and with them the capabilities that need them), recorded in ``unverified``; a model
    whose attention weights fail their check is refused."""
    from attnflow.rows.conformance import CHECKS, check_adapter

    row = infer_row(hf_model, kind)
    for _ in CHECKS:
        report = check_adapter(row, hf_model, strict=False)
        if not report.failed:
            return row
        if report.outcome("attention_weights") == "fail":
            raise InferenceError(f"{report.error()}; a row written by hand can say where they are ({EXTENDING})")
        gated = _as_gated(row, hf_model, report.outcome("residual_sum"))
        if gated is not None:  # the sites hold, the plain sum does not (a bias outside the modules)
            detail = next(result.detail for result in report.failed if result.check == "residual_sum")
            kept = f"residual_sum: {detail}; the sites hold as a gated block, without streams"
            row = replace(gated, unverified=(*row.unverified, kept))
            continue
        # values that fail go first: the checks of what names them (an output norm) then run without them
        failed = [result for result in report.failed if result.check in _VALUE_CHECKS] or report.failed
        left_out = {part for result in failed for part in _PROVEN_BY[result.check]}
        failures = tuple(f"{result.check}: {result.detail}" for result in failed)
        row = _without(replace(row, unverified=row.unverified + failures), left_out)
    return row


def _as_gated(row: Adapter, hf_model: nn.Module, residual_sum: str) -> Adapter | None:
    """``row`` with its sites declared gated (`Sites.gated`) and no streams, where its plain sum
    failed on a layer inference did not trace (the first block's sum holds, a later block adds a
    constant or scales its stream) and the gated check passes; else None."""
    from attnflow.rows.conformance import check_adapter

    if residual_sum != "fail" or row.sites is None or row.sites.gated:
        return None
    gated = replace(row, sites=replace(row.sites, gated=True), streams=None)
    return gated if check_adapter(gated, hf_model, strict=False).outcome("residual_sum") == "pass" else None


def _without(row: Adapter, parts: set[str]) -> Adapter:
    """``row`` with each of ``parts`` (a field, or ``"part.field"``) set to None."""
    fields: dict[str, Any] = {}
    for part in sorted(parts):  # whole parts sort before their fields
        name, _, inner = part.partition(".")
        current = fields[name] if name in fields else getattr(row, name)
        if not inner:
            fields[name] = None
        elif current is not None:
            fields[name] = replace(current, **{inner: None})
    return replace(row, **fields)


def _close(actual: Any, expected: Any) -> bool:
    if not (torch.is_tensor(actual) and torch.is_tensor(expected)) or actual.shape != expected.shape:
        return False
    scale = max(float(expected.abs().max()), 1.0)
    return float((actual.double() - expected.double()).abs().max()) <= TOLERANCE * scale


def _pattern(name: str, blocks: str) -> str:
    """A row pattern for ``name``: the block index becomes the layer group, everything else literal."""
    if name.startswith(blocks + "."):
        rest = name[len(blocks) + 1 :]
        index, _, tail = rest.partition(".")
        if index.isdigit():
            return rf"^{re.escape(blocks)}\.(\d+)" + (rf"\.{re.escape(tail)}$" if tail else "$")
    return rf"^{re.escape(name)}$"


def _head_count(config: Any) -> tuple[str, int]:
    """(the config attribute with the heads per layer, its value)."""
    text = text_config(config)
    for attribute in ("num_attention_heads", "n_head", "num_heads", "n_heads"):
        value = config_value(text, attribute)
        if isinstance(value, int) and value > 0:
            return attribute, value
    raise _not_found(f"{type(config).__name__} has no head count (num_attention_heads)")


def _block_list(model: nn.Module, traced: dict[str, Call], n_heads: int) -> tuple[str, int]:
    """The layer stack, found from the traced run, not from the blocks' classes or the config's layer
    count: the ``nn.ModuleList`` whose blocks hold the calls that returned softmax weights (the
    shallowest list above each; where several lists do, the one with the most such blocks, the last
    in the module order on a tie: a vision tower before the language model). Its name and block
    count; every block must have run once, in index order, and hold one attention module."""
    lists = {name: len(module) for name, module in model.named_modules() if name and isinstance(module, nn.ModuleList)}
    attending = [call for call in traced.values() if _softmax_weights(call, n_heads) is not None]
    leaves = [call for call in attending if not any(other.name.startswith(call.name + ".") for other in attending)]
    holding: dict[str, dict[int, list[str]]] = {}
    for call in leaves:
        parts = call.name.split(".")
        parent = next((end for end in range(1, len(parts) - 1) if ".".join(parts[:end]) in lists), None)
        if parent is not None and parts[parent].isdigit():
            holding.setdefault(".".join(parts[:parent]), {}).setdefault(int(parts[parent]), []).append(call.name)
    if not leaves:
        other = _other_softmax(traced)
        seen = f" (the nearest: {other})" if other else ""
        raise _not_found(
            f"no module of {type(model).__name__} returned [batch, {n_heads} heads, query, key] softmax weights over "
            f"the input's tokens with output_attentions=True{seen} (an architecture without attention, one whose "
            "attention does not return its weights, or one that attends over positions added to the input)"
        )
    if not holding:
        owner, _, index = leaves[0].name.rpartition(".")
        where = (
            f"is itself an element of {owner} and no module inside it returns them (no block holds attention and "
            "feed-forward together, or the weights come back nested)"
            if owner in lists and index.isdigit()
            else "is not inside a block of an nn.ModuleList"
        )
        raise _not_found(
            f"{leaves[0].name}, which returns the softmax weights, {where}: attnflow cannot find the layer stack"
        )
    order = list(lists)
    blocks = max(holding, key=lambda name: (len(holding[name]), order.index(name)))
    n_layers = lists[blocks]
    calls = [traced.get(f"{blocks}.{index}") for index in range(n_layers)]
    ran = [call for call in calls if call is not None]
    if len(ran) < n_layers or any(call.count > 1 for call in ran):
        shared = next((call for call in ran if call.count > 1), None)
        missing = next(f"{blocks}.{index}" for index, call in enumerate(calls) if call is None) if not shared else ""
        what = f"{shared.name} ran {shared.count} times" if shared else f"{missing} did not run"
        raise _not_found(
            f"the blocks of {blocks} do not each run once ({what}): an adapter row maps one module per layer"
        )
    if [call.start for call in ran] != sorted(call.start for call in ran):
        raise _not_found(f"the blocks of {blocks} do not run in index order: attnflow cannot find the layer stack")
    several = next((names for names in holding[blocks].values() if len(names) > 1), None)
    if several:
        raise _not_found(
            f"a block of {blocks} holds {len(several)} attention modules ({', '.join(several)}): an adapter row "
            "names one attention module per layer"
        )
    return blocks, n_layers


def _other_softmax(traced: dict[str, Call]) -> str | None:
    """Where the first call returned 4-D softmax rows, said in words, when no attention module did
    as the config says (another head count, keys beyond the input's tokens, a softmax module whose
    whole output is the weights), or None."""
    for call in sorted(traced.values(), key=lambda call: call.start):
        for index, found in sorted(call.outputs.items()):
            if torch.is_tensor(found) and found.dim() == 4 and found.is_floating_point() and bool((found >= 0).all()):
                sums = found.sum(dim=-1)
                if found.shape[0] == _BATCH and _close(sums, torch.ones(sums.shape)):
                    return f"{call.name} returned softmax rows {list(found.shape)} as output {index}"
    return None


def _trace(model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, Call]:
    """Run the model once, recording the first call of every module; ``""``: the model's logits."""
    watched = [(name, module) for name, module in model.named_modules() if name]
    traced, outputs = trace(watched, lambda: model(**inputs, output_attentions=True))
    traced[""] = Call("", model, outputs={0: getattr(outputs, "logits", None)})
    return traced


def _linear_weight(call: Call) -> torch.Tensor | None:
    """``[in, out]`` when the call is an affine map x W + b of its 2-D weight (either storage), else None."""
    weight = getattr(call.module, "weight", None)
    x, y = call.input, call.output
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2 and torch.is_tensor(x) and torch.is_tensor(y)):
        return None
    if not x.is_floating_point():
        return None
    bias = getattr(call.module, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else 0
    for in_by_out in (weight.T, weight):
        if in_by_out.shape == (x.shape[-1], y.shape[-1]) and _close(y, x @ in_by_out + bias):
            return in_by_out
    return None


def _softmax_weights(call: Call, n_heads: int, extra_keys: bool = False) -> tuple[int, bool] | None:
    """Where the call returned ``[batch, head, query, key]`` softmax rows (the tuple index), and
    whether its rows sum to less than 1 (a sink logit in the softmax, GPT-OSS's), or None;
    ``extra_keys``: also over keys beyond the input's tokens (DeepSeek-V4's compressed ones)."""
    for index, found in sorted(call.outputs.items()):
        if not (
            index > 0
            and torch.is_tensor(found)
            and found.dim() == 4
            and found.shape[:2] == (_BATCH, n_heads)
            and found.shape[2] == _TOKENS
            and (found.shape[3] == _TOKENS or (extra_keys and found.shape[3] > _TOKENS))
            and bool((found >= 0).all())
        ):
            continue
        sums = found.sum(dim=-1)
        if _close(sums, torch.ones(sums.shape)):
            return index, False
        if bool((sums > 0).all()) and bool((sums <= 1 + TOLERANCE).all()):
            return index, True
    return None


@dataclass
class _Block:
    """The first block's calls, with what inference has found so far."""

    calls: list[Call]  # inside the block, by start
    block: Call
    n_heads: int

    @property
    def stream_in(self) -> torch.Tensor:
        return self.block.input

    @property
    def stream_out(self) -> torch.Tensor:
        out = self.block.output
        return out

    def streams(self, after: int = -1) -> list[Call]:
        """Calls whose output has the stream's shape, started after ``after``."""
        return [
            call
            for call in self.calls
            if call.start > after and torch.is_tensor(call.output) and call.output.shape == self.stream_in.shape
        ]


def infer_row(hf_model: nn.Module, kind: str) -> Adapter:
    """The adapter row of ``hf_model`` (kind ``"decoder"`` or ``"encoder"``), found from its module tree,
    its config and one traced forward pass of a seeded ``2 × 7`` input; raises `InferenceError`
    naming the part it could not find when there is no attention stack."""
    with torch.no_grad():
        return _infer_row(hf_model, kind)


def _infer_row(hf_model: nn.Module, kind: str) -> Adapter:
    config = hf_model.config
    family = str(getattr(config, "model_type", type(hf_model).__name__))
    head_count, n_heads = _head_count(config)
    generator = torch.Generator().manual_seed(0)
    vocab = int(getattr(text_config(config), "vocab_size", 100))
    device = next(hf_model.parameters()).device
    ids = torch.randint(4, max(5, min(vocab, 100)), (_BATCH, _TOKENS), generator=generator).to(device)
    traced = _trace(hf_model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    blocks, n_layers = _block_list(hf_model, traced, n_heads)
    _unflatten(traced, blocks)
    first = traced[f"{blocks}.0"]
    attending = _attention_layers(traced, blocks, n_layers, n_heads)
    # The block the row is read from: the first, or a hybrid's first attention layer.
    reference = traced.get(f"{blocks}.{attending[0]}", first) if attending else first
    block = _Block(_calls_inside(traced, reference.name), reference, n_heads)
    weights_call, (weights_index, sinks) = _attention(block)
    sinks = sinks or _sinks_later(traced, blocks, weights_call.name[len(reference.name) :], n_layers, n_heads)
    scope = _scope(weights_call.name, reference.name)
    output_projection, in_by_out = _output_projection(block, scope)
    row: dict[str, Any] = {
        "stack": Stack(
            _pattern(weights_call.name, blocks), _pattern(output_projection.name, blocks), weights_index, sinks=sinks
        ),
        "head_count": head_count,
        "weights_in_out": in_by_out is getattr(output_projection.module, "weight", None),
    }
    kv_heads = Adapter(family, kind, (), row["stack"], head_count=head_count).kv_heads(config)
    found = _value_parts(block, scope, weights_call.outputs[weights_index], output_projection, kv_heads)
    row |= _residual(block, blocks, scope, output_projection, traced, n_layers)
    one_part = row.pop("one_part", None)
    values_norm = row.pop("values_norm", None)
    output_norm = row.pop("output_norm", None)
    if found.value is None and found.fused is None:
        row["missing"] = (
            f"values: no projection of {scope}, split into heads, times the attention weights gives the input of "
            f"{output_projection.name} (something acts between A·V and the output projection that inference "
            "cannot carry the heads through: a gate, a norm, a rescaled or a second attention map)",
        )
    else:
        if found.fused is not None:
            row["fused"] = (replace(found.fused, module=_pattern(found.fused.module, blocks)),)
        named = {part: None if name is None else _pattern(name, blocks) for part, name in found.names.items()}
        row["values"] = Values(
            **named,
            block=_pattern(first.name, blocks),
            norm=values_norm,
            output_norm=output_norm,
            scores=found.scores,
            head_factor=found.factored,
            per_head=found.per_head,
        )
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    row["norms"] = _norms(traced, blocks, [name for name, _ in hf_model.named_modules()], hf_model, inputs)
    row["embedding_norm"] = _embedding_norm(traced, blocks, first)
    if len(attending) < n_layers:
        row = _hybrid(row, traced, blocks, attending, n_layers, one_part)
    elif "sites" not in row and (beside := _mixer_beside(block, scope)) is not None:
        row["mixers"] = Mixers(_pattern(beside.name, blocks), tuple(range(n_layers)), (type(beside.module).__name__,))
        row.pop("streams", None)
    return Adapter(family, kind, (family,), inferred=True, **row)


@dataclass
class _ValueParts:
    """Where the first attention block's values are (module names, not yet patterns)."""

    value: str | None = None
    query: str | None = None
    key: str | None = None
    fused: Fused | None = None  # the values are columns of it (value, query and key then None)
    per_head: bool = False  # `Values.per_head`
    factored: bool = False  # `Values.head_factor`
    head_norm: str | None = None  # `Values.head_norm`

    @property
    def names(self) -> dict[str, str | None]:
        """The `Values` fields that name modules."""
        return {"value": self.value, "query": self.query, "key": self.key, "head_norm": self.head_norm}

    @property
    def scores(self) -> bool:
        """`Values.scores`: no query or key projection (multi-head latent attention; a factored row,
        whose query may share a projection with its gate, names none)."""
        if self.fused is not None:
            return "query" not in self.fused.parts
        return self.query is None


def _value_parts(
    block: _Block, scope: str, weights: torch.Tensor, output_projection: Call, kv_heads: int
) -> _ValueParts:
    """The values, in the first form A·V proves: projections of their own or a fused one's columns
    (`_projections`), heads split before a module (`_per_head_values`), or either times a
    per-position factor (`_factored_value`, with a norm between A·V and the output projection
    where there is one, `_head_norm`); an empty `_ValueParts` where none."""
    value, query, key, fused = _projections(block, scope, weights, output_projection, kv_heads)
    if value is not None or fused is not None:
        return _ValueParts(value, query, key, fused)
    value, query, key = _per_head_values(block, scope, weights, output_projection)
    if value is not None:
        return _ValueParts(value, query, key, per_head=True)
    value, fused = _factored_value(block, scope, weights, output_projection, kv_heads)
    if value is None:
        return _ValueParts()
    head_norm = _head_norm(block, scope, output_projection)
    return _ValueParts(None if fused is not None else value, fused=fused, factored=True, head_norm=head_norm)


def _unflatten(traced: dict[str, Call], blocks: str) -> None:
    """Each tensor of the blocks' calls that runs on the tokens flattened (`as_tokens`: a
    feed-forward block's ``[batch * token, width]``, a router's input and logits), viewed ``[batch,
    token, width]`` like the stream, in place: an affine map stays one on the views."""
    for call in traced.values():
        if call.name.startswith(blocks + ".") and 0 in call.outputs:
            call.input = _as_traced_tokens(call.input)
            call.outputs[0] = _as_traced_tokens(call.outputs[0])


def _as_traced_tokens(tensor: Any) -> Any:
    """`as_tokens` for a tensor of the traced run, whose ``batch * token`` is known."""
    if torch.is_tensor(tensor) and tensor.dim() == 2 and tensor.shape[0] == _BATCH * _TOKENS:
        return as_tokens(tensor, _BATCH)
    return tensor


def _mixer_beside(block: _Block, scope: str) -> Call | None:
    """A token mixer beside the attention block (Falcon-H1's Mamba mixer, in every layer): a module
    as deep as the attention block that reads what it reads (not a norm), whose output the block
    adds with the attention block's and one more module's (the MLP) to its input, proven on the
    traced rows; None where the block holds none (or its sum is not so proven)."""
    attention = next((call for call in block.calls if call.name == scope), None)
    x, out = block.stream_in, block.stream_out
    if attention is None or not torch.is_tensor(attention.input) or not torch.is_tensor(out):
        return None
    beside = [
        call
        for call in block.streams()
        if call.name.count(".") == scope.count(".") and call is not attention and not _norm_forms(call)
    ]
    for mixer in beside:
        if not (torch.is_tensor(mixer.input) and _close(mixer.input, attention.input)):
            continue
        if any(_close(out, x + attention.output + mixer.output + mlp.output) for mlp in beside if mlp is not mixer):
            return mixer
    return None


def _calls_inside(traced: dict[str, Call], name: str) -> list[Call]:
    """The calls of the modules inside ``name``, by start."""
    return sorted((call for call in traced.values() if call.name.startswith(name + ".")), key=lambda c: c.start)


def _attention_layers(traced: dict[str, Call], blocks: str, n_layers: int, n_heads: int) -> list[int]:
    """The layers whose block holds a module that returned ``[batch, head, query, key]`` softmax
    weights: every layer, or (a hybrid stack) some of them."""
    return [
        layer
        for layer in range(n_layers)
        if any(
            _softmax_weights(call, n_heads, extra_keys=True) is not None
            for call in _calls_inside(traced, f"{blocks}.{layer}")
        )
    ]


def _attention(block: _Block) -> tuple[Call, tuple[int, bool]]:
    """The deepest call in the block that returned softmax weights, where in its output and whether
    with a sink; a stack with no such call in any block is refused."""
    found = [(call, where) for call in block.calls if (where := _softmax_weights(call, block.n_heads)) is not None]
    if not found:
        raise _not_found(
            f"no module of {block.block.name} returned [batch, {block.n_heads} heads, query, key] softmax weights "
            "with output_attentions=True (an architecture without attention, or one whose attention does not "
            "return its weights)"
        )
    return max(found, key=lambda pair: pair[0].name.count("."))


def _sinks_later(traced: dict[str, Call], blocks: str, tail: str, n_layers: int, n_heads: int) -> bool:
    """Whether a later layer's attention module (at ``tail`` in its block) returns rows summing to less
    than 1 (sinks in some layers only: the row then declares them for every layer)."""
    for layer in range(1, n_layers):
        call = traced.get(f"{blocks}.{layer}{tail}")
        found = None if call is None else _softmax_weights(call, n_heads)
        if found is not None and found[1]:
            return True
    return False


def _scope(weights: str, block: str) -> str:
    """The attention block: the child of the block that holds the weights module."""
    rest = weights[len(block) + 1 :].split(".")
    return f"{block}.{rest[0]}"


def _output_projection(block: _Block, scope: str) -> tuple[Call, torch.Tensor]:
    """The last affine map of the attention block onto the stream's width whose input splits into
    heads; where the block carries several residual streams side by side (hyper-connections,
    Qwen4-Exp: ``[batch, token, streams * d_model]``), onto a width that divides the stream's."""
    d_model = block.stream_in.shape[-1]
    projections = [
        (call, weight)
        for call in block.calls
        if call.inside(scope)
        and (weight := _linear_weight(call)) is not None
        and d_model % weight.shape[1] == 0
        and weight.shape[0] % block.n_heads == 0
    ]
    candidates = [pair for pair in projections if pair[1].shape[1] == d_model] or projections
    if not candidates:
        raise _not_found(f"no output projection (heads × d_head → {d_model}) found in {scope}")
    return max(candidates, key=lambda pair: pair[0].start)


def _maps_before(block: _Block, scope: str, end: int) -> list[Call]:
    """The affine maps of the attention block ``scope`` started before ``end``, with a ``[batch,
    token, features]`` output (`token_rows`)."""
    return [
        call
        for call in block.calls
        if call.inside(scope)
        and call.start < end
        and _linear_weight(call) is not None
        and torch.is_tensor(call.output)
        and token_rows(call.output).dim() == 3
    ]


def _per_head(values: torch.Tensor, d_head: int) -> torch.Tensor:
    """``[batch, token, heads * d_head]`` → ``[batch, heads, token, d_head]``."""
    batch, tokens, width = values.shape
    return values.reshape(batch, tokens, width // d_head, d_head).transpose(1, 2)


def _explains_heads(values: torch.Tensor, weights: torch.Tensor, heads: torch.Tensor) -> bool:
    """A·V per head (key/value heads shared by groups of query heads) is the output projection's input."""
    n_heads = weights.shape[1]
    if values.shape[1] == 0 or n_heads % values.shape[1]:
        return False
    shared = values.repeat_interleave(n_heads // values.shape[1], dim=1)  # [batch, head, token, d_head]
    batch, tokens, width = heads.shape
    return _close(heads, (weights @ shared).transpose(1, 2).reshape(batch, tokens, width))


def _projections(
    block: _Block, scope: str, weights: torch.Tensor, output_projection: Call, kv_heads: int
) -> tuple[str | None, str | None, str | None, Fused | None]:
    """The value, query and key projections (names; None where not proven), or the `Fused`
    projection holding the values: the value is the affine map (or the fused map's value columns, in
    the layout that works: q, k and v together, or multi-head latent attention's value beside
    another part in every head) whose output, split into heads, times the weights is the output
    projection's input; query and key are the other two maps of the block with a head width."""
    heads = output_projection.input
    d_head = heads.shape[-1] // block.n_heads
    maps = _maps_before(block, scope, output_projection.start)
    headed = [call for call in maps if call.output.shape[-1] % d_head == 0]
    value = next(
        (call for call in headed if _explains_heads(_per_head(token_rows(call.output), d_head), weights, heads)), None
    )
    if value is None:
        fused = next((found for call in headed if (found := _fused(call, block.n_heads, d_head, weights, heads))), None)
        if fused is None:
            fused = next(
                (found for call in maps if (found := _latent(call, block.n_heads, kv_heads, d_head, weights, heads))),
                None,
            )
        return None, None, None, fused
    kv_width = value.output.shape[-1] // d_head
    others = [
        call for call in headed if call is not value and call.output.shape[-1] // d_head in (block.n_heads, kv_width)
    ]
    if len(others) != 2:
        return value.name, None, None, None
    query, key = sorted(others, key=lambda call: (call.output.shape[-1] != block.n_heads * d_head, call.start))
    return value.name, query.name, key.name, None


def _per_head_values(
    block: _Block, scope: str, weights: torch.Tensor, output_projection: Call
) -> tuple[str | None, str | None, str | None]:
    """Values whose heads are split before a module that returns them ``[batch, token, kv_heads,
    d_head]`` (`Values.per_head`: Gemma 4's weightless per-head ``v_norm`` after ``v_proj``): the
    module of the attention block, before the output projection, whose output so shaped times the
    weights is the output projection's input; the query and key are then the block's two other
    affine maps with a head width, beside the one that feeds that module. ``(None, None, None)``
    where no module so proven."""
    heads = output_projection.input  # [batch, token, head * d_head]
    d_head = heads.shape[-1] // block.n_heads
    batch, tokens, _ = heads.shape
    value = next(
        (
            call
            for call in block.calls
            if call.inside(scope)
            and call.start < output_projection.start
            and torch.is_tensor(call.output)
            and call.output.dim() == 4
            and tuple(call.output.shape[:2]) == (batch, tokens)
            and call.output.shape[-1] == d_head
            and _explains_heads(_per_head(call.output.flatten(-2), d_head), weights, heads)
        ),
        None,
    )
    if value is None:
        return None, None, None
    kv_width = value.output.shape[-2]
    widths = (block.n_heads * d_head, kv_width * d_head)
    maps = [call for call in _maps_before(block, scope, value.start) if call.output.shape[-1] in widths]
    feeding = [
        call for call in maps if torch.is_tensor(value.input) and _close(call.output.flatten(), value.input.flatten())
    ]
    others = [call for call in maps if call not in feeding]
    if len(feeding) != 1 or len(others) != 2:
        return value.name, None, None
    query, key = sorted(others, key=lambda call: (call.output.shape[-1] != block.n_heads * d_head, call.start))
    return value.name, query.name, key.name


def _factored_value(
    block: _Block, scope: str, weights: torch.Tensor, output_projection: Call, kv_heads: int
) -> tuple[str | None, Fused | None]:
    """The projection whose output, split into heads, times the weights gives the output projection's
    input up to a per-position factor (`Values.head_factor`), with the `Fused` entry where the values
    are its latent-attention value columns (`_latent_layouts`; None: the whole output): of the
    block's maps before the output projection, the one whose ratio heads / A·V varies least over
    each head's features, where it varies less than half as much as for any other (the conformance
    suite then proves the factor); ``(None, None)`` where no map stands out so (differential
    attention: two softmaxes, no one factor)."""
    heads = output_projection.input  # [batch, token, head * d_head]
    d_head = heads.shape[-1] // block.n_heads
    spreads: list[tuple[float, str, Fused | None]] = []
    for call in block.calls:
        if not (call.inside(scope) and call.start < output_projection.start and _linear_weight(call) is not None):
            continue
        rows = token_rows(call.output)
        if rows.dim() != 3:
            continue
        options: list[tuple[Fused | None, torch.Tensor]] = [(None, rows)]
        options += [
            (fused, rows[..., fused.columns("value", rows.shape[-1], block.n_heads, kv_heads)])
            for fused in _latent_layouts(call, kv_heads, d_head)
        ]
        for fused, columns in options:
            if columns.shape[-1] % d_head or block.n_heads % (columns.shape[-1] // d_head):
                continue
            values = _per_head(columns, d_head).repeat_interleave(block.n_heads // (columns.shape[-1] // d_head), dim=1)
            batch, tokens, _ = heads.shape
            products = (weights @ values).transpose(1, 2).reshape(batch, tokens, block.n_heads, d_head)
            ratio = head_factor(heads.reshape(products.shape), products).double()  # [batch, token, head, d_head]
            spread = float((ratio.std(dim=-1) / ratio.abs().mean(dim=-1).clamp_min(1e-12)).median())
            spreads.append((spread, call.name, fused))
    if not spreads:
        return None, None
    spreads.sort(key=lambda found: found[0])
    best, name, fused = spreads[0]
    if best < 1 and all(best < 0.5 * other for other, _, _ in spreads[1:]):
        return name, fused
    return None, None


def _head_norm(block: _Block, scope: str, output_projection: Call) -> str | None:
    """The module between A·V and the output projection (`Values.head_norm`: BitNet's sub-norm,
    Dory's L2 one after a gate): of the attention block's modules before the output projection, one
    whose output is the output projection's input and its input (changed) times a per-position
    scalar and a per-feature gain (`per_position_scale`: a norm that subtracts no mean); its input
    is then A·V times a per-position factor, which the conformance suite's ``head_factor`` check
    proves. None where no module so found."""
    heads = output_projection.input  # [batch, token, head * d_head]
    for call in block.calls:
        if not (call.inside(scope) and call.start < output_projection.start and torch.is_tensor(call.input)):
            continue
        if call.input.shape != heads.shape or not _close(call.output, heads) or _close(call.output, call.input):
            continue
        for gain in norm_gains(call.module, heads.shape[-1]):  # c_i g ⊙ x_i
            if _close(call.output, per_position_scale(call.input, call.output, gain) * call.input * gain):
                return call.name
    return None


# The orders of a fused projection's head parts tried (the value's place proven by A·V; the query and
# key, which only the backward rules read and with one rule for both, told apart by their head counts
# where they differ, else the first named the query).
_FUSED_ORDERS = (("query", "key", "value"), ("query", "value", "key"), ("value", "query", "key"))


def _fused(call: Call, n_heads: int, d_head: int, weights: torch.Tensor, heads: torch.Tensor) -> Fused | None:
    """The layout (and order, and groups) in which ``call``'s output holds query, key and value
    heads, proven by A·V on the value columns."""
    kv_heads, rest = divmod(call.output.shape[-1] // d_head - n_heads, 2)
    if rest or kv_heads <= 0 or n_heads % kv_heads:
        return None
    shards = [count for count in range(2, kv_heads) if kv_heads % count == 0]  # per_group G other than kv_heads
    candidates = [(layout, 0) for layout in get_args(FusedLayout)] + [("per_group", count) for count in shards]
    for parts in _FUSED_ORDERS:
        for layout, groups in candidates:
            fused = Fused(call.name, parts, layout, groups=groups)
            try:
                columns = fused.columns("value", call.output.shape[-1], n_heads, kv_heads)
            except CaptureError:
                continue
            if _explains_heads(_per_head(token_rows(call.output)[..., columns], d_head), weights, heads):
                return fused
    return None


def _latent_layouts(call: Call, kv_heads: int, d_head: int) -> list[Fused]:
    """The layouts in which ``call``'s output may be multi-head latent attention's ``kv_b_proj``: per
    key/value head, the value (``d_head`` wide) and one other part of another width (the key's
    position-free half), in either order; none where the width does not split so."""
    width = call.output.shape[-1]
    per_head, rest = divmod(width, kv_heads)
    if rest or per_head <= d_head:
        return []
    other = per_head - d_head
    return [
        Fused(call.name, parts, "per_head", widths)
        for parts, widths in ((("other", "value"), (other, d_head)), (("value", "other"), (d_head, other)))
    ]


def _latent(
    call: Call, n_heads: int, kv_heads: int, d_head: int, weights: torch.Tensor, heads: torch.Tensor
) -> Fused | None:
    """The `_latent_layouts` of ``call`` whose value columns A·V proves."""
    for fused in _latent_layouts(call, kv_heads, d_head):
        columns = fused.columns("value", call.output.shape[-1], n_heads, kv_heads)
        if _explains_heads(_per_head(token_rows(call.output)[..., columns], d_head), weights, heads):
            return fused
    return None


def _residual(
    block: _Block, blocks: str, scope: str, output_projection: Call, traced: dict[str, Call], n_layers: int
) -> dict[str, Any]:
    """Sites, streams, the gated MLP and the norms around the blocks, from the residual sums they satisfy."""
    found: dict[str, Any] = {}
    x, out = block.stream_in, block.stream_out
    streams = block.streams()
    by_depth = sorted(streams, key=lambda call: (call.name.count("."), call.start))
    pair = next(
        (
            (attention, mlp)
            for attention in by_depth
            if attention.start >= output_projection.start or attention.name == scope
            for mlp in by_depth
            if mlp.start > attention.start
            and not mlp.inside(attention.name)
            and _close(out, x + attention.output + mlp.output)
        ),
        None,
    )
    affine = pair is None
    if pair is None:
        post_norm = _post_norm(block, blocks, output_projection)
        pair = None if post_norm else _gated_pair(block, scope, output_projection)
        if pair is None and not post_norm:
            one = _one_part(block, lambda call: call.start >= output_projection.start or call.name == scope)
            return {} if one is None else {"one_part": one}  # a hybrid's block of one part (`_one_part_sites`)
        if pair is None:
            return post_norm
    attention, mlp = pair
    found["sites"] = Sites(
        _pattern(block.block.name, blocks), _pattern(attention.name, blocks), _pattern(mlp.name, blocks), affine
    )
    if not attention.inside(scope):
        found["output_norm"] = _pattern(attention.name, blocks)
    if not affine:
        found |= _streams(block, attention, traced, blocks, n_layers)
    else:  # a gated block: each update joins the stream through per-channel constants
        found |= _gated_streams(block, attention, mlp, traced, blocks, n_layers)
    feed_forward = _producer(block, mlp)
    gated = _gated_mlp(block, feed_forward)
    if gated is not None:
        found["gated_mlp"] = GatedMLP(_gated_layers(traced, blocks, feed_forward, gated, n_layers), *gated)
    elif feed_forward is mlp:  # a mixture of experts is split where its output is the MLP site
        found["experts"] = find_experts(_pattern(mlp.name, blocks), mlp.module, mlp.input)
    return found


def _streams(block: _Block, attention: Call, traced: dict[str, Call], blocks: str, n_layers: int) -> dict[str, Any]:
    """The streams of a block that adds its sites up: where the feed-forward block reads x + attention."""
    x = block.stream_in
    mid = next(
        (call for call in block.calls if call.start > attention.start and _close(call.input, x + attention.output)),
        None,
    )
    final = _final_norm(traced, blocks, n_layers)
    if mid is not None:
        return {"streams": Streams(_pattern(mid.name, blocks), final_norm=final)}
    # parallel attention and feed-forward: no module reads the stream between them; both read x
    entering = next((call for call in block.calls if _close(call.input, x)), None)
    if entering is None:
        return {}
    return {"streams": Streams(_pattern(entering.name, blocks), final_norm=final, parallel=True)}


def _gated_streams(
    block: _Block, attention: Call, mlp: Call, traced: dict[str, Call], blocks: str, n_layers: int
) -> dict[str, Any]:
    """The streams of a gated sequential block (`Streams.gated`): the first module after the
    attention site that reads a per-channel affine combination of the block input and the
    attention site, of which with the MLP site the block output is one too; none in a parallel or
    otherwise mixed block."""
    x, out = block.stream_in, block.stream_out
    mid = next(
        (
            call
            for call in block.calls
            if attention.start < call.start < mlp.start
            and torch.is_tensor(call.input)
            and call.input.shape == x.shape
            and affine_failure(call.input, (x, attention.output), TOLERANCE) is None
            and affine_failure(out, (call.input, mlp.output), TOLERANCE) is None
        ),
        None,
    )
    if mid is None:
        return {}
    return {
        "streams": Streams(_pattern(mid.name, blocks), final_norm=_final_norm(traced, blocks, n_layers), gated=True)
    }


def _gated_pair(block: _Block, scope: str, output_projection: Call) -> tuple[Call, Call] | None:
    """(attention site, MLP site) of a block whose output is a per-channel affine combination of its
    input and the two (`Sites.gated`), proven on the traced rows (`affine_misfit`): the shallowest,
    earliest pair, the attention site from the output projection on, the MLP site after it."""
    x, out = block.stream_in, block.stream_out
    if not torch.is_tensor(out):
        return None
    by_depth = sorted(block.streams(), key=lambda call: (call.name.count("."), call.start))
    for attention in by_depth:
        if attention.start < output_projection.start and attention.name != scope:
            continue
        for mlp in by_depth:
            if mlp.start <= attention.start or mlp.inside(attention.name):
                continue
            if affine_failure(out, (x, attention.output, mlp.output), TOLERANCE) is None:
                return attention, mlp
    return None


def _post_norm(block: _Block, blocks: str, output_projection: Call) -> dict[str, Any]:
    """Sites and streams of a post-LN block (BERT's): LN1(x + attention) then LN2(LN1 + MLP) is the output."""
    x, out = block.stream_in, block.stream_out
    attention = min(
        (
            call
            for call in block.calls
            if call.start <= output_projection.start and _close(call.output, output_projection.output)
        ),
        key=lambda call: (call.name.count("."), call.start),
        default=output_projection,
    )
    if not (torch.is_tensor(x) and torch.is_tensor(attention.output) and attention.output.shape == x.shape):
        return {}  # the block's stream is not the attention's width (several streams, mixed by the block)
    first = next((call for call in block.calls if _close(call.input, x + attention.output)), None)
    if first is None or not _close(first.output, _layer_norm_of(first)):
        return {}
    after = block.streams(first.start)
    pair = next(
        (
            (mlp, second)
            for second in after
            if _close(second.output, out)
            for mlp in sorted(after, key=lambda call: (call.name.count("."), call.start))
            if mlp.start < second.start and _close(second.input, first.output + mlp.output)
        ),
        None,
    )
    mid = next((call for call in block.calls if call.start > first.start and _close(call.input, first.output)), None)
    if pair is None or mid is None:
        return {}
    mlp, second = pair
    return {
        "sites": Sites(
            _pattern(block.block.name, blocks), _pattern(attention.name, blocks), _pattern(mlp.name, blocks)
        ),
        "streams": Streams(_pattern(mid.name, blocks), ffn_norm=_pattern(second.name, blocks)),
        "values_norm": _pattern(first.name, blocks),
    }


def _layer_norm_of(call: Call) -> torch.Tensor | None:
    return call.output if ("layer", 0.0) in _norm_forms(call) else None


def _embedding_norm(traced: dict[str, Call], blocks: str, first: Call) -> str | None:
    """The norm outside the blocks whose output the first block reads (BERT's embeddings.LayerNorm)."""
    norms = [
        call
        for call in traced.values()
        if call.name and not call.name.startswith(blocks) and _norm_forms(call) and _close(call.output, first.input)
    ]
    return rf"^{re.escape(norms[0].name)}$" if norms else None


def _producer(block: _Block, site: Call) -> Call:
    """The feed-forward module behind a site: the site itself, or (a norm after the block, Gemma's
    sandwich) the shallowest call whose output the site reads."""
    if any(call.name.startswith(site.name + ".") and _linear_weight(call) is not None for call in block.calls):
        return site
    producers = [call for call in block.calls if call.start < site.start and _close(call.output, site.input)]
    return min(producers, key=lambda call: (call.name.count("."), call.start), default=site)


def _final_norm(traced: dict[str, Call], blocks: str, n_layers: int) -> str | None:
    """The module outside the blocks that reads the last block's output, just before the unembedding."""
    last = traced.get(f"{blocks}.{n_layers - 1}")
    if last is None or not torch.is_tensor(last.output):
        return None
    reading = [
        call
        for call in traced.values()
        if call.name
        and not call.name.startswith(blocks)
        and call.start > last.start
        and _close(call.input, last.output)
        and torch.is_tensor(call.output)
        and call.output.shape == last.output.shape
    ]
    return rf"^{re.escape(reading[0].name)}$" if reading else None


def _gated_layers(traced: dict[str, Call], blocks: str, first: Call, gated: tuple[str, str], n_layers: int) -> str:
    r"""The pattern of the gated MLP the row's block's ``first`` is, over the layers whose module at
    the same place is that gated MLP too, proven on their traced calls: every layer's (``(\d+)``),
    or, in a stack whose later layers are mixtures of experts (or a hybrid's whose feed-forward
    blocks differ), those layers' (``(0|1)``)."""
    pattern = _pattern(first.name, blocks)
    tail = re.sub(rf"^{re.escape(blocks)}\.\d+", "", first.name)  # the module's place inside a block
    layers = []
    for layer in range(n_layers):
        name, owner = f"{blocks}.{layer}{tail}", traced.get(f"{blocks}.{layer}")
        call = traced.get(name)
        if call is None or owner is None:
            continue
        if _gated_mlp(_Block(_calls_inside(traced, name), owner, 0), call) == gated:
            layers.append(layer)
    if len(layers) == n_layers or not layers:
        return pattern
    return _only(pattern, layers)


def _gated_mlp(block: _Block, mlp: Call) -> tuple[str, str] | None:
    """(up, activation) attribute names when the MLP is down(act(gate(x)) · up(x)), proven on the traced call."""
    children = dict(mlp.module.named_children())
    calls = {call.name[len(mlp.name) + 1 :]: call for call in block.calls if call.name.startswith(mlp.name + ".")}
    maps = {name: call for name, call in calls.items() if name in children and _linear_weight(call) is not None}
    for activation_name, activation in calls.items():
        if activation_name not in children or activation_name in maps:
            continue
        gate = next((call for call in maps.values() if _close(activation.input, call.output)), None)
        if gate is None:
            continue
        for up_name, up in maps.items():
            if up is gate or not torch.is_tensor(activation.output) or up.output.shape != activation.output.shape:
                continue
            product = activation.output * up.output
            if any(_close(call.input, product) for call in maps.values()):
                return up_name, activation_name
    return None


_FORMS: tuple[tuple[NormForm, float], ...] = (("layer", 0.0), ("layer", 1.0), ("rms", 0.0), ("rms", 1.0))


def _norm_forms(call: Call) -> dict[tuple[NormForm, float], float | None]:
    """The forms (`Norms` form and offset) in which the call is a norm over its input's last axis,
    each with the epsilon it computes with where the module names none (measured on the call,
    `_measured_epsilon`; None where it names one): one form for a norm with a weight; both offsets
    for a weightless norm (it scales by 1 either way). A module without a weight counts only as a
    leaf that changes its input (a wrapper, or a dropout after a norm, is not the norm)."""
    x, y, module = call.input, call.output, call.module
    if not (torch.is_tensor(x) and torch.is_tensor(y) and x.is_floating_point() and x.shape == y.shape):
        return {}
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.shape != x.shape[-1:]:
        return {}
    if not isinstance(weight, torch.Tensor) and (any(True for _ in module.children()) or _close(y, x)):
        return {}
    found: dict[tuple[NormForm, float], float | None] = {}
    for form, offset in _FORMS:
        eps = None if norm_epsilon(module) is not None else _measured_epsilon(call, form, offset)
        if _close(y, Norms("", form, offset, eps).recompute(module, x)):
            found[(form, offset)] = eps
    return found


def _measured_epsilon(call: Call, form: NormForm, offset: float) -> float | None:
    """The epsilon a norm of ``form`` computes with, from its traced input x and output y: per row,
    (y − β) / g = P(x) / s with P the centring (layer) or the identity (rms) and s = sqrt(stat(x) +
    eps), so s is the least-squares ratio of P(x) to (y − β) / g and eps = s² − stat(x); the median
    over rows, to two significant digits. None where a gain is 0 (no ratio to read)."""
    x, y = call.input.double(), call.output.double()
    gain, shift = Norms("", form, offset).gain_and_shift(call.module, x.shape[-1])
    if bool((gain.abs() < 1e-6).any()):
        return None
    centred = x - x.mean(dim=-1, keepdim=True) if form == "layer" else x
    target = (y - shift.double().to(y.device)) / gain.double().to(y.device)  # P(x) / s
    ratio = (centred * target).sum(dim=-1) / (target * target).sum(dim=-1).clamp_min(1e-30)  # s per row
    eps = float((ratio.pow(2) - centred.pow(2).mean(dim=-1)).median())
    return float(f"{max(eps, 0.0):.1e}") if eps == eps else None


def _norms(
    traced: dict[str, Call], blocks: str, modules: list[str], model: nn.Module, inputs: dict[str, torch.Tensor]
) -> Norms | None:
    """Every norm the traced run called (in every block and outside them), when they share one form:
    the pattern of each per layer, unless it would also name a module of ``modules`` (the model's
    names) that is not such a norm (ModernBERT's first layer has an identity in place of its
    attention norm): then the norms it names one by one. Where they do not share one, the norms no
    gradient of the output reaches (`off_the_gradient_path`: DeepSeek-V3.2's indexer norm, read
    only through a top-k) are left out, and the rest must share one."""
    forms = {call.name: found for call in traced.values() if call.name and (found := _norm_forms(call))}
    if not forms:
        return None
    shared = set.intersection(*(set(found) for found in forms.values()))
    if not shared:
        off = off_the_gradient_path(model, inputs, [(name, traced[name].module) for name in forms])
        forms = {name: found for name, found in forms.items() if name not in off}
        shared = set.intersection(*(set(found) for found in forms.values())) if forms else set()
    if not shared:
        return None
    form, offset = min(shared)  # a weightless norm alone: offset 0
    measured = sorted(eps for found in forms.values() if (eps := found[(form, offset)]) is not None)
    by_pattern: dict[str, list[str]] = {}
    for name in forms:
        by_pattern.setdefault(_pattern(name, blocks).replace(r"(\d+)", r"\d+"), []).append(name)
    names = []
    for pattern, members in by_pattern.items():
        regex = re.compile(pattern)
        if all(name in forms for name in modules if name and regex.search(name)):
            names.append(pattern)
        else:
            names += [rf"^{re.escape(name)}$" for name in members]
    eps = measured[len(measured) // 2] if measured else None
    return Norms("|".join(sorted(names)), form, rms_offset=offset, eps=eps)


def _only(pattern: str, layers: Sequence[int]) -> str:
    r"""``pattern`` naming ``layers`` only: its layer group ``(\d+)`` becomes ``(1|3)``."""
    return pattern.replace(r"(\d+)", "(" + "|".join(str(layer) for layer in layers) + ")", 1)


def _at(blocks: str, tails: dict[str, list[int]]) -> str:
    """One pattern (group 1 the layer) naming, in each layer listed under a tail, the module at that
    place inside the block (``{".self_attn": [1], ".linear_attn": [0]}``): a lookahead per tail."""
    ahead = "|".join(
        f"(?:{'|'.join(str(layer) for layer in layers)}){re.escape(tail)}$" for tail, layers in tails.items()
    )
    return rf"^{re.escape(blocks)}\.(?={ahead})(\d+)"


def _named(traced: dict[str, Call], pattern: str, blocks: str) -> dict[int, str]:
    """``{layer: the module's place inside its block}`` for every traced module ``pattern`` names."""
    regex, found = re.compile(pattern), {}
    for name in traced:
        match = regex.search(name) if name else None
        if match is not None:
            found[int(match.group(1))] = re.sub(rf"^{re.escape(blocks)}\.\d+", "", name)
    return found


def _hybrid(
    row: dict[str, Any],
    traced: dict[str, Call],
    blocks: str,
    attending: list[int],
    n_layers: int,
    one_part: Call | None = None,
) -> dict[str, Any]:
    """The row of a hybrid stack, read from its first attention layer: the per-head patterns
    (the stack, the values, query, key, fused projections, the norm after the output projection)
    name the attention layers only (`Stack.gaps`); `Mixers` names the other layers and, where each
    block's output is its input + a token mixer's output + the MLP site's (proven on the traced
    rows), that mixer, which `Sites.attention` then names in its layer. The streams stay (the logit
    lens reads the final norm), but the row does not provide them: routes read attention as the
    only token mixer (`Adapter.provides`). A mixture of experts only some layers have is named there."""
    stack = row["stack"]
    row["stack"] = replace(
        stack,
        attention=_only(stack.attention, attending),
        output_projection=_only(stack.output_projection, attending),
        gaps=True,
    )
    values = row.get("values")
    if values is not None:
        parts = {part: getattr(values, part) for part in ("value", "query", "key", "output_norm", "norm", "head_norm")}
        row["values"] = replace(
            values, **{part: None if p is None else _only(p, attending) for part, p in parts.items()}
        )
    row["fused"] = tuple(replace(fused, module=_only(fused.module, attending)) for fused in row.get("fused", ()))
    others = [layer for layer in range(n_layers) if layer not in attending]
    sites: Sites | None = row.get("sites")
    mixers = None if sites is None else _mixer_sites(traced, blocks, sites, others)
    one_parts = sites is None and one_part is not None
    split = _one_part_sites(traced, blocks, others, one_part, attending) if one_parts and one_part else None
    if split is not None:
        row["sites"], row["mixers"] = split
    elif sites is None or mixers is None:
        row.pop("sites", None)
        row["mixers"] = Mixers(_only(rf"^{re.escape(blocks)}\.(\d+)$", others), tuple(others))
    else:
        tails, kinds, moved = mixers
        row["mixers"] = Mixers(_at(blocks, tails), tuple(others), kinds)
        row["sites"] = replace(
            sites,
            attention=_at(blocks, _merged(tails, _named(traced, sites.attention, blocks), attending)),
            mlp=_at(blocks, _merged(moved, _named(traced, sites.mlp, blocks), range(n_layers))) if moved else sites.mlp,
        )
    experts = row.get("experts")
    if experts is not None:
        reference = traced[f"{blocks}.{attending[0]}{_named(traced, experts.block, blocks)[attending[0]]}"]
        same = [
            layer
            for layer, tail in _named(traced, experts.block, blocks).items()
            if type(traced[f"{blocks}.{layer}{tail}"].module) is type(reference.module)
        ]
        if len(same) < n_layers:
            row["experts"] = replace(experts, block=_only(experts.block, sorted(same)))
    return row


def _one_part(block: _Block, allowed: Callable[[Call], bool] = lambda _call: True) -> Call | None:
    """The shallowest, earliest module of ``block`` (one ``allowed``) whose output alone adds up with
    the block's input to its output: a block of one part (Nemotron-H's: attention, Mamba, MLP or MoE)."""
    x, out = block.stream_in, block.stream_out
    if not torch.is_tensor(out):
        return None
    by_depth = sorted(block.streams(), key=lambda call: (call.name.count("."), call.start))
    return next((call for call in by_depth if allowed(call) and _close(out, x + call.output)), None)


def _mixes_tokens(call: Call) -> bool:
    """Whether ``call``'s module mixes positions: run again on its traced input with position 0
    changed, its output at a later position changes (a module that cannot run on its input alone, or
    returns something else, counts as mixing: what reads attention as the only mixer is refused)."""
    x = call.input
    if not (torch.is_tensor(x) and x.dim() == 3 and x.shape[1] > 1 and torch.is_tensor(call.output)):
        return True
    changed = x.clone()
    changed[:, 0] += 1.0
    try:
        again = call.module(changed)
    except (TypeError, ValueError, RuntimeError, IndexError, AttributeError):
        return True
    again = output_tensor(again)
    if not torch.is_tensor(again) or again.numel() != call.output.numel():
        return True
    return not _close(again.reshape(call.output.shape)[:, 1:], call.output[:, 1:])


def _one_part_sites(
    traced: dict[str, Call], blocks: str, layers: list[int], attention: Call, attending: list[int]
) -> tuple[Sites, Mixers] | None:
    """The sites of a hybrid whose blocks each hold one part (Nemotron-H: block output = input + its
    one mixer, attention, Mamba, an MLP or a mixture of experts; ``attention``: the attention
    block's part): in each of ``layers`` the part (`_one_part`), a token mixer (the ``attn`` site,
    named in `Mixers`) where it mixes positions (`_mixes_tokens`), else the ``mlp`` site. None where
    a block has no such part, or no block holds an MLP or a token mixer besides attention;
    ``attending``: the attention blocks, whose part is at ``attention``'s place."""
    mixing: dict[str, list[int]] = {}
    feeding: dict[str, list[int]] = {}
    kinds: list[str] = []
    for layer in layers:
        owner = traced.get(f"{blocks}.{layer}")
        part = None if owner is None else _one_part(_Block(_calls_inside(traced, owner.name), owner, 0))
        if owner is None or part is None:
            return None
        mixes = _mixes_tokens(part)
        (mixing if mixes else feeding).setdefault(part.name[len(owner.name) :], []).append(layer)
        if mixes:
            kinds.append(type(part.module).__name__)
    if not mixing or not feeding:
        return None
    reference = f"{blocks}.{attending[0]}"
    tail = attention.name[len(reference) :]
    merged = {name: list(found) for name, found in mixing.items()}
    merged[tail] = sorted([*merged.get(tail, []), *attending])
    sites = Sites(_pattern(reference, blocks), _at(blocks, merged), _at(blocks, feeding))
    mixed = tuple(sorted(layer for found in mixing.values() for layer in found))
    return sites, Mixers(_at(blocks, mixing), mixed, tuple(dict.fromkeys(kinds)))


def _merged(tails: dict[str, list[int]], named: dict[int, str], layers: Sequence[int]) -> dict[str, list[int]]:
    """``tails`` ({tail: layers}) with each of ``layers`` that ``named`` ({layer: tail}) names added
    under its tail, except the layers ``tails`` holds already."""
    merged = {tail: list(found) for tail, found in tails.items()}
    taken = {layer for found in tails.values() for layer in found}
    for layer, tail in named.items():
        if layer in layers and layer not in taken:
            merged[tail] = sorted([*merged.get(tail, []), layer])
    return merged


def _mixer_sites(
    traced: dict[str, Call], blocks: str, sites: Sites, layers: list[int]
) -> tuple[dict[str, list[int]], tuple[str, ...], dict[str, list[int]]] | None:
    """In each of ``layers`` (a hybrid's layers without attention), the token mixer: the shallowest,
    earliest module of the block, before the MLP site and outside it, whose output adds up with the
    block's input and the MLP site's output to the block's output (``sites.gated``: combines with
    them per channel, `affine_failure`). The MLP site is the row's ``sites.mlp`` where the layer has
    that module; else (OLMo-Hybrid: post-norm attention layers, pre-norm linear-attention ones) the
    shallowest, earliest module after the mixer that adds up so. ``({tail: layers} of the mixers,
    the mixers' classes, {tail: layers} of the MLP sites found in other places)``, or None where a
    layer has no such pair."""
    mlps = _named(traced, sites.mlp, blocks)
    tails: dict[str, list[int]] = {}
    moved: dict[str, list[int]] = {}
    kinds: list[str] = []
    for layer in layers:
        owner = traced.get(f"{blocks}.{layer}")
        if owner is None or not torch.is_tensor(owner.output):
            return None
        named = traced.get(f"{blocks}.{layer}{mlps[layer]}") if layer in mlps else None
        found = _mixer_and_mlp(traced, owner, sites.gated, named)
        if found is None:
            return None
        mixer, feed_forward = found
        tails.setdefault(mixer.name[len(owner.name) :], []).append(layer)
        if named is None:
            moved.setdefault(feed_forward.name[len(owner.name) :], []).append(layer)
        # a norm after the mixer (a sandwich) is the site; the module it normalises is the mixer
        mixing = _producer(_Block(_calls_inside(traced, owner.name), owner, 0), mixer) if _norm_forms(mixer) else mixer
        kinds.append(type(mixing.module).__name__)
    return tails, tuple(dict.fromkeys(kinds)), moved


def _mixer_and_mlp(traced: dict[str, Call], owner: Call, gated: bool, named: Call | None) -> tuple[Call, Call] | None:
    """(token mixer, MLP site) of one block whose output is its input plus the two (``gated``: a
    per-channel affine combination of the three): the MLP site ``named`` when given, else the
    shallowest, earliest module that adds up so; the mixer the shallowest, earliest before it."""
    x, out = owner.input, owner.output
    calls = _calls_inside(traced, owner.name)
    shaped = sorted(
        (call for call in calls if torch.is_tensor(call.output) and call.output.shape == x.shape),
        key=lambda call: (call.name.count("."), call.start),
    )
    for feed_forward in [named] if named is not None else shaped:
        for call in shaped:
            if call.start >= feed_forward.start or call.inside(feed_forward.name) or feed_forward.inside(call.name):
                continue
            parts = (x, call.output, feed_forward.output)
            if affine_failure(out, parts, TOLERANCE) is None if gated else _close(out, sum(parts)):
                return call, feed_forward
    return None
