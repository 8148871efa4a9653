"""One conformance suite for every adapter row (scikit-learn's ``check_estimator`` idea):
`check_adapter(row, model)` runs the model once on a small random input and checks, on that run,
the identities attnflow's methods rely on, wherever the row provides what a check reads.

The checks (`CHECKS`, each named in the error it raises):

- ``attention_weights``: every attention module of every stack returns softmax weights ``[batch,
  head, query, key]`` (rows sum to 1; a stack with ``sinks``: every weight ≥ 0, rows sum to at
  most 1) at the row's ``weights_index``, one per output projection;
- ``head_slices`` (rows with values): head h's ``d_head`` slice of the output projection's input
  ``[batch, token, head * d_head]`` is A_h V_h, the attention weights times the value projection's
  output, or its value columns where a `Fused` projection holds the values (grouped-query heads
  shared; a fused projection of the wrong layout fails here);
- ``head_factor`` (rows whose heads are A·V times a per-position factor, `Values.head_factor`): in
  every layer, adding a random change δ to the first token's value vectors (every other layer as it
  was) leaves the weights as they were and changes the output projection's input by D ⊙ (A·δV), D
  the factor on the unchanged run (`head_factor`): the factor is the same for every key and does not
  depend on the values (a norm between A·V and the output projection fails here);
- ``head_norm`` (rows with such a norm, `Values.head_norm`; ``head_factor`` then proves a factor up
  to the norm's input): in every layer the norm's output is its input times a per-position scalar
  and its per-feature gain (no centring: `per_position_scale`), and it is the output projection's
  input (so the whole factor is D ⊙ g / s_i, s_i fixed from the run);
- ``scores`` (rows whose query and key meet only in the scores, `Values.scores`): in every layer a
  softmax called inside the attention module returns the weights the module returns, so the rules
  acting at that softmax's input act on the scores Q·Kᵀ;
- ``attention_output`` (rows with sites, no norm after the output projection): Σ_h z_h W_O^h + b_O,
  from each head's slice and the projection's own weights, is what the attention site adds;
- ``residual_sum`` (rows with sites, no post-LN norm): block output = block input + attention site
  + MLP site, and each block's input is the previous block's output;
- ``post_norm`` (post-LN rows): the norm after the attention block reads y = block input +
  attention output and equals a layer norm recomputed from its weight, bias and eps;
- ``ffn_input`` (rows with streams and sites): the feed-forward block reads the stream the row's
  topology says (`Streams.mid`'s input): block input + attention site in a sequential block, the
  block input itself in a parallel one (`Streams.parallel`), the post-LN norm's output in a
  post-LN block; in a gated one (`Streams.gated`), a per-channel affine combination of block
  input and attention site, of which with the MLP site the block output is one too;
- ``norm_form`` (rows with `Norms`): every norm module of the model is named by the row's norms
  pattern, so are the norms the row names elsewhere (post-LN, sandwich, embedding), and each
  recomputes from its own weights in the form the row declares (a layer norm, or an RMS norm scaled
  by ``rms_offset`` + w, with the row's ``eps`` where the module names none);
- ``gated_product`` (rows with a gated MLP): in every layer the row's gated MLP pattern matches (a
  stack of dense and mixture-of-experts layers names its dense ones) the MLP holds the up
  projection and the activation the row names, and one of its modules reads their product;
- ``own_value`` (rows with sites): every activation site of every kind (`SITE_TABLE`), written
  with its own value through the kind's write function, changes nothing, bit for bit;
- ``knockout`` (rows with sites): blocking the edge from the first key to the last query in the
  first layer gives that weight exactly 0 and leaves the row summing to 1 (with sinks: at most 1).

`check_adapter` reports every check (pass, fail or n/a, `ConformanceReport`); a failure names the row,
the check, the layer and the numbers, and by default raises `AdapterCheckError` naming every failed check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NoReturn

import torch
from torch import nn

from attnflow.errors import AdapterCheckError, CaptureError
from attnflow.rows.adapters import (
    Adapter,
    GatedMLP,
    Norms,
    Stack,
    as_tokens,
    find_layers,
    head_factor,
    layer_index,
    norm_gains,
    per_position_scale,
    text_config,
)
from attnflow.rows.hook_points import HookPoint, Side, hooks, takes_input
from attnflow.rows.site_kinds import SITE_TABLE, SiteKind, Write
from attnflow.rows.tracing import affine_failure, off_the_gradient_path, softmax_inside

TOLERANCE = 1e-4  # relative to the largest magnitude compared


@dataclass
class Run:
    """One forward pass of the model under check: the row, the module, its inputs, the head count,
    what every hook point the row names saw (``seen[(what, layer)]``) and the names of the modules
    that look like norms and ran (``ran_norms``)."""

    row: Adapter
    model: nn.Module
    inputs: dict[str, torch.Tensor]
    n_heads: int
    seen: dict[tuple[str, int], Any]
    output: torch.Tensor
    ran_norms: set[str] = field(default_factory=set)

    def forward(self, hooked: list[tuple[HookPoint, Callable]]) -> torch.Tensor:
        """The model's first output (logits or last hidden states) with ``hooked`` in place."""
        with hooks(hooked), torch.no_grad():
            return self.model(**self.inputs, output_attentions=True)[0]

    def layers(self, what: str) -> list[Any]:
        """What ``what`` saw, per layer in order (a site a hybrid's blocks hold some of: those blocks')."""
        return [self.seen[key] for key in sorted(key for key in self.seen if key[0] == what)]

    def at(self, what: str) -> dict[int, Any]:
        """What ``what`` saw, by block (the sites are recorded at their block's index: a hybrid row
        whose blocks each hold one part, Nemotron-H's, has an attention site in some blocks only)."""
        return {key[1]: value for key, value in self.seen.items() if key[0] == what}


def _fail(run: Run, check: str, detail: str) -> NoReturn:
    raise AdapterCheckError(f"adapter row {run.row.family!r} fails {check}: {detail}")


def _close(run: Run, check: str, where: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.shape != expected.shape:
        _fail(run, check, f"{where}: shape {list(actual.shape)}, expected {list(expected.shape)}")
    error = float((actual.double() - expected.double()).abs().max())
    scale = max(float(expected.abs().max()), 1.0)
    if error > TOLERANCE * scale:
        _fail(run, check, f"{where}: largest difference {error:.2e} (allowed {TOLERANCE * scale:.1e})")


def _stacks(row: Adapter) -> list[tuple[str, Stack]]:
    stacks = [("stack", row.stack), ("decoder", row.decoder), ("cross", row.cross)]
    return [(name, stack) for name, stack in stacks if stack is not None]


def _recorded_points(row: Adapter) -> list[tuple[str, str, Side, int]]:
    """(what, pattern, side, tuple index) of every tensor the checks read (``norms``: every module
    the pattern matches; the others: one per layer, or the first match of a pattern without a layer)."""
    points: list[tuple[str, str, Side, int]] = []
    for name, stack in _stacks(row):
        points += [
            (f"{name}.weights", stack.attention, "output", stack.weights_index),
            (f"{name}.heads", stack.output_projection, "input", 0),
        ]
    sites, value = row.sites, row.projection("value")
    if value is not None:
        points.append(("values", value[0], "output", 0))
    for what, pattern in _named_norms(row).items():
        points += [(f"{what}.in", pattern, "input", 0), (f"{what}.out", pattern, "output", 0)]
    if row.norms is not None:
        points += [("norms.in", row.norms.modules, "input", 0), ("norms.out", row.norms.modules, "output", 0)]
    if row.streams is not None:
        points.append(("mid.in", row.streams.mid, "input", 0))
    if sites is not None:
        points += [
            ("block.in", sites.block, "input", 0),
            ("block.out", sites.block, "output", 0),
            ("attn", sites.attention, "output", 0),
            ("mlp", sites.mlp, "output", 0),
        ]
    return points


def _first_match(model: nn.Module, pattern: str, gaps: bool = False) -> list[tuple[str, nn.Module]]:
    """The modules of ``pattern`` by layer (``gaps``: a hybrid row's, whose per-head patterns name its
    attention layers only); a pattern without a layer group (an embedding norm) is layer 0."""
    if re.compile(pattern).groups:
        return find_layers(model, pattern, gaps=gaps)
    return [(name, module) for name, module in model.named_modules() if re.search(pattern, name)][:1]


def _every_match(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Every module whose name ``pattern`` matches, in the model's order."""
    regex = re.compile(pattern)
    return [(name, module) for name, module in model.named_modules() if name and regex.search(name)]


def record(row: Adapter, model: nn.Module, inputs: dict[str, torch.Tensor], n_heads: int) -> Run:
    """Run the model once, recording every tensor the checks read."""
    seen: dict[tuple[str, int], Any] = {}
    hooked: list[tuple[HookPoint, Callable]] = []
    for what, pattern, side, index in _recorded_points(row):
        gaps = row.stack.gaps
        modules = _every_match(model, pattern) if what.startswith("norms.") else _first_match(model, pattern, gaps)
        if not modules:
            raise AdapterCheckError(
                f"adapter row {row.family!r}: no module of {type(model).__name__} matches {pattern!r}"
            )
        batch = inputs["input_ids"].shape[0] if what in _STREAM_POINTS else 0
        by_block = what in ("attn", "mlp") and bool(re.compile(pattern).groups)
        for number, (name, module) in enumerate(modules):
            layer = layer_index(pattern, name) if by_block else number
            point = HookPoint(module, side, index=index, name=name)
            hooked.append((point, lambda tensor, key=(what, layer), b=batch: seen.__setitem__(key, _copied(tensor, b))))
    if row.gated_mlp is not None:
        try:
            mlps = find_layers(model, row.gated_mlp.module, gaps=True)
        except CaptureError:
            mlps = []  # the gated_product check finds them again and fails, naming the pattern
        for layer, (_, mlp) in enumerate(mlps):
            hooked += [
                (HookPoint(module, side), lambda tensor, key=(what, layer): seen.__setitem__(key, _copied(tensor)))
                for what, module, side in _gated_parts(row.gated_mlp, mlp)
            ]
    run = Run(row, model, inputs, n_heads, seen, torch.empty(0))
    hooked += [
        (HookPoint(module, "call"), lambda _args, _kwargs, name=name: run.ran_norms.add(name))
        for name, module in model.named_modules()
        if _looks_like_a_norm(module)
    ]
    run.output = run.forward(hooked)
    return run


# The points that hold the residual stream or what is added to it, ``[batch, token, d_model]``
# (flattened ``[batch * token, d_model]`` in some feed-forward blocks: `as_tokens`).
_STREAM_POINTS = ("mid.in", "block.in", "block.out", "attn", "mlp")


def _copied(tensor: Any, batch: int = 0) -> Any:
    """What a hook saw, copied: a model may change a module's output in place after the hook
    (Falcon adds the attention output into the MLP's with ``+=``); with ``batch``, a stream point,
    seen ``[batch, token, d]`` (`as_tokens`)."""
    copy = tensor.clone() if torch.is_tensor(tensor) else tensor
    return as_tokens(copy, batch) if batch else copy


def check_attention_weights(run: Run) -> None:
    """Every stack's attention modules return ``[batch, head, query, key]`` softmax weights, one
    per output projection."""
    for name, stack in _stacks(run.row):
        weights, heads = run.layers(f"{name}.weights"), run.layers(f"{name}.heads")
        if len(weights) != len(heads):
            _fail(
                run, "attention_weights", f"{len(weights)} {name} attention modules for {len(heads)} output projections"
            )
        for layer, found in enumerate(weights):
            if not torch.is_tensor(found) or found.dim() != 4 or found.shape[1] != run.n_heads:
                shape = list(found.shape) if torch.is_tensor(found) else type(found).__name__
                _fail(run, "attention_weights", f"{name} layer {layer} returned {shape} at its weights index, "
                      f"not [batch, {run.n_heads} heads, query, key]")  # fmt: skip
            sums = _row_sums(stack, found)
            _close(run, "attention_weights", f"{name} layer {layer} row sums", sums, torch.ones(()).expand(sums.shape))


def _row_sums(stack: Stack, weights: torch.Tensor) -> torch.Tensor:
    """``[...]`` each row's sum of ``weights [..., key]``, to be 1; with sinks, a row of
    non-negative weights summing to at most 1 counts as 1 (the sink takes the rest)."""
    sums = weights.sum(dim=-1)
    if not stack.sinks:
        return sums
    return sums.clamp(min=1.0) if bool((weights >= 0).all()) else torch.full_like(sums, -1.0)


def check_head_slices(run: Run) -> None:
    """Head h's slice of the output projection's input is A_h V_h (grouped-query value heads shared),
    V read from the value columns of a fused projection as its layout says (`Adapter.part_columns`)."""
    value = run.row.projection("value")
    assert value is not None  # the check applies to rows with values
    fused = value[1]
    where = "" if fused is None else f", V the value columns of a {fused.layout} fused projection"
    for layer, (weights, heads, projected) in enumerate(
        zip(run.layers("stack.weights"), run.layers("stack.heads"), run.layers("values"), strict=True)
    ):
        try:
            rows = run.row.value_rows(projected)  # [batch, token, width]
            values = rows[..., run.row.part_columns("value", rows.shape[-1], run.model.config)]
        except CaptureError as error:
            _fail(run, "head_slices", f"layer {layer}: {error}")
        batch, tokens, width = heads.shape
        d_head = width // run.n_heads
        per_kv_head = values.reshape(batch, tokens, -1, d_head).transpose(1, 2)  # [batch, kv_head, token, d_head]
        shared = per_kv_head.repeat_interleave(
            run.n_heads // per_kv_head.shape[1], dim=1
        )  # [batch, head, token, d_head]
        expected = (weights @ shared).transpose(1, 2).reshape(batch, tokens, width)  # [batch, token, head * d_head]
        _close(
            run,
            "head_slices",
            f"layer {layer}: the output projection's input against A·V per head{where}",
            heads,
            expected,
        )


def _value_heads(run: Run, projected: torch.Tensor) -> torch.Tensor:
    """``[batch, head, token, d_head]`` the value vectors of one layer's value projection output
    (its value columns; grouped-query heads shared by their query heads)."""
    rows = run.row.value_rows(projected)  # [batch, token, width]
    values = rows[..., run.row.part_columns("value", rows.shape[-1], run.model.config)]
    batch, tokens, width = values.shape
    d_head = run.layers("stack.heads")[0].shape[-1] // run.n_heads
    per_kv_head = values.reshape(batch, tokens, width // d_head, d_head).transpose(1, 2)
    return per_kv_head.repeat_interleave(run.n_heads // per_kv_head.shape[1], dim=1)


def _weighted(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[batch, token, head * d_head]`` A·V per head, laid out as the output projection reads it."""
    batch, heads, tokens, d_head = values.shape
    return (weights @ values).transpose(1, 2).reshape(batch, tokens, heads * d_head)


def check_head_factor(run: Run) -> None:
    """Per layer: a change δ to the first token's values (that layer only) leaves the weights and
    changes the output projection's input (a row with a `Values.head_norm`: that norm's input) by
    exactly D ⊙ (A·δV), D the factor of the unchanged run."""
    value = run.row.projection("value")
    assert value is not None and run.row.values is not None  # the check applies to rows with values
    modules = [module for _, module in find_layers(run.model, value[0], gaps=run.row.stack.gaps)]
    attention = [module for _, module in find_layers(run.model, run.row.stack.attention, gaps=run.row.stack.gaps)]
    normed = run.row.values.head_norm
    reader = run.row.stack.output_projection if normed is None else normed
    projections = [module for _, module in find_layers(run.model, reader, gaps=run.row.stack.gaps)]
    generator = torch.Generator().manual_seed(1)
    for layer, (weights, heads, projected) in enumerate(
        zip(
            run.layers("stack.weights"),
            run.layers("stack.heads" if normed is None else "head_norm.in"),
            run.layers("values"),
            strict=True,
        )
    ):
        factor = head_factor(heads, _weighted(weights, _value_heads(run, projected)))
        change = torch.zeros_like(projected)
        rows = run.row.value_rows(change)  # a view: [batch, token, width]
        columns = run.row.part_columns("value", rows.shape[-1], run.model.config)
        rows[:, 0, columns] = torch.randn(rows.shape[0], len(columns), generator=generator).to(rows) * float(
            run.row.value_rows(projected)[..., columns].std()
        )
        seen: dict[str, torch.Tensor] = {}
        run.forward(
            [
                (HookPoint(modules[layer], "output"), lambda tensor, change=change: tensor + change),
                (
                    HookPoint(attention[layer], "output", index=run.row.stack.weights_index),
                    lambda tensor, seen=seen: seen.__setitem__("weights", tensor.clone()),
                ),
                (
                    HookPoint(projections[layer], "input"),
                    lambda tensor, seen=seen: seen.__setitem__("heads", tensor.clone()),
                ),
            ]
        )
        reading = "output projection" if normed is None else "head norm"
        where = f"layer {layer}: the {reading}'s input after a change of the first token's values"
        _close(run, "head_factor", f"layer {layer}: the weights after a change of the values", seen["weights"], weights)
        expected = heads + factor * _weighted(weights, _value_heads(run, change))
        _close(run, "head_factor", f"{where}, against D ⊙ A·(V + δV)", seen["heads"], expected)


def check_head_norm(run: Run) -> None:
    """Per layer: the norm between A·V and the output projection (`Values.head_norm`; its input
    D ⊙ A·V, D proven by ``head_factor``) writes its input times a per-position scalar and its
    per-feature gain (no mean subtracted: each head carried alone), and its output is the output
    projection's input."""
    modules = [
        module for _, module in find_layers(run.model, _named_norms(run.row)["head_norm"], gaps=run.row.stack.gaps)
    ]
    for layer, (heads, read, written) in enumerate(
        zip(run.layers("stack.heads"), run.layers("head_norm.in"), run.layers("head_norm.out"), strict=True)
    ):
        scaled = [
            (per_position_scale(read, written, gain) * read.double() * gain.double().to(read.device)).to(written.dtype)
            for gain in norm_gains(modules[layer], read.shape[-1])
        ]  # c_i g ⊙ x_i, for each gain the module may have
        _close(
            run,
            "head_norm",
            f"layer {layer}: the head norm's output against its input times a per-position scalar and its gain",
            written,
            min(scaled, key=lambda candidate: float((candidate - written).abs().max())),
        )
        _close(
            run,
            "head_norm",
            f"layer {layer}: the output projection's input against the head norm's output",
            heads,
            written,
        )


def check_scores(run: Run) -> None:
    """In every layer, a softmax called inside the attention module returns the module's weights
    ``[batch, head, query, key]`` (a sink's column, beside the keys, left out)."""
    modules = [module for _, module in find_layers(run.model, run.row.stack.attention, gaps=run.row.stack.gaps)]
    called: dict[int, list[torch.Tensor]] = {}
    current = [-1]
    layer_of = {id(module): layer for layer, module in enumerate(modules)}

    def handle(_x: torch.Tensor, output: torch.Tensor, _dim: int, _dtype: Any, _rerun: Callable) -> torch.Tensor:
        called.setdefault(current[0], []).append(output.detach().clone())
        return output

    def enter(module: nn.Module) -> Callable:
        return lambda _args, _kwargs: current.__setitem__(0, layer_of[id(module)])

    with softmax_inside(modules, handle):
        run.forward([(HookPoint(module, "call"), enter(module)) for module in modules])
    for layer, weights in enumerate(run.layers("stack.weights")):
        found = [output[..., : weights.shape[-1]] for output in called.get(layer, [])]
        if not any(output.shape == weights.shape and _equal(output, weights) for output in found):
            _fail(run, "scores", f"layer {layer}: no softmax called inside the attention module returns its weights")


def check_attention_output(run: Run) -> None:
    """Σ_h z_h W_O^h + b_O, from the heads' slices and the projection's weights, is the attention site
    (of the same layer: a hybrid row's projections are in its attention layers only)."""
    stack = run.row.stack
    projections = find_layers(run.model, stack.output_projection, gaps=stack.gaps)
    sites = run.at("attn")
    for (name, projection), heads in zip(projections, run.layers("stack.heads"), strict=True):
        layer = layer_index(stack.output_projection, name)
        added = sites[layer]
        weight = run.row.in_by_out(projection)  # [in, out]
        width = heads.shape[-1]
        d_head = width // run.n_heads
        per_head = [
            heads[..., h * d_head : (h + 1) * d_head] @ weight[h * d_head : (h + 1) * d_head]
            for h in range(run.n_heads)
        ]
        bias = 0 if projection.bias is None else projection.bias
        _close(
            run,
            "attention_output",
            f"layer {layer}: Σ_h z_h W_O^h + b_O against the attention site",
            added,
            sum(per_head) + bias,
        )


def check_residual_sum(run: Run) -> None:
    """Block output = block input + attention site + MLP site (`Sites.gated`: a per-channel affine
    combination of the three, determined and exact on this run's rows); each block reads the
    previous one's output."""
    inputs, outputs = run.layers("block.in"), run.layers("block.out")
    gated = run.row.sites is not None and run.row.sites.gated
    attentions, mlps = run.at("attn"), run.at("mlp")
    empty = sorted(set(range(len(inputs))) - set(attentions) - set(mlps))
    if empty:
        _fail(run, "residual_sum", f"blocks {empty} hold no site")
    for layer, (before, after) in enumerate(zip(inputs, outputs, strict=True)):
        # a block of one part (a hybrid's, Nemotron-H's) adds its one site
        present = {name: site for name, site in (("attention", attentions.get(layer)), ("MLP", mlps.get(layer)))}
        parts = [site for site in present.values() if site is not None]
        for name, site in present.items():
            if site is not None and site.shape != before.shape:
                shapes = f"{list(site.shape)}, not the stream's {list(before.shape)}"
                _fail(run, "residual_sum", f"layer {layer}: the {name} site is {shapes}")
        named = " + ".join(name for name, site in present.items() if site is not None)
        where = f"layer {layer}: block output against input + {named}"
        if not gated:
            _close(run, "residual_sum", where, after, before + sum(parts))
            continue
        failure = affine_failure(after, (before, *parts), TOLERANCE)
        if failure is not None:
            _fail(run, "residual_sum", f"{where}, per-channel affine (the row declares a gated block): {failure}")
        if layer + 1 < len(inputs):
            _close(
                run,
                "residual_sum",
                f"layer {layer + 1}: block input against the previous output",
                inputs[layer + 1],
                after,
            )


def check_post_norm(run: Run) -> None:
    """The post-LN norm reads block input + attention output and is a layer norm of its weight, bias and eps."""
    norms = [module for _, module in find_layers(run.model, _named_norms(run.row)["norm"])]
    for layer, (read, written) in enumerate(zip(run.layers("norm.in"), run.layers("norm.out"), strict=True)):
        expected = run.layers("block.in")[layer] + run.layers("attn")[layer]
        _close(
            run, "post_norm", f"layer {layer}: the norm's input against block input + attention output", read, expected
        )
        norm = norms[layer]
        recomputed = Norms("", "layer").recompute(norm, read)
        _close(
            run,
            "post_norm",
            f"layer {layer}: the norm's output against a layer norm of its weights",
            written,
            recomputed,
        )


def check_ffn_input(run: Run) -> None:
    """`Streams.mid`'s input is block input + attention site (sequential), the block input
    (parallel), the post-LN norm's output, or (gated) per-channel affine in block input and
    attention site, the block output being so in it and the MLP site."""
    streams, values = run.row.streams, run.row.values
    assert streams is not None  # the check applies to rows with streams
    post_norm = values is not None and values.norm is not None
    for layer, (read, before, attention) in enumerate(
        zip(run.layers("mid.in"), run.layers("block.in"), run.layers("attn"), strict=True)
    ):
        if streams.gated:  # per-channel constants: mid on (x, attention), the block output on (mid, MLP)
            for what, whole, terms in (
                ("the feed-forward block's input on block input and attention", read, (before, attention)),
                ("the block output on the feed-forward block's input and the MLP site", run.layers("block.out")[layer],
                 (read, run.layers("mlp")[layer])),
            ):  # fmt: skip
                failure = affine_failure(whole, terms, TOLERANCE)
                if failure is not None:
                    _fail(
                        run,
                        "ffn_input",
                        f"layer {layer}: {what}, per-channel affine (the row declares a gated block): {failure}",
                    )
            continue
        if post_norm:
            expected, what = run.layers("norm.out")[layer], "the post-LN norm's output"
        elif streams.parallel:
            expected, what = before, "the block input (the row declares a parallel block)"
        else:
            expected, what = before + attention, "block input + attention (the row declares a sequential block)"
        _close(run, "ffn_input", f"layer {layer}: the feed-forward block's input against {what}", read, expected)


def _named_norms(row: Adapter) -> dict[str, str]:
    """``{what: pattern}`` of the norms the row names."""
    values = row.values
    named = {
        "norm": None if values is None else values.norm,
        "output_norm": None if values is None else values.output_norm,
        "head_norm": None if values is None else values.head_norm,
        "embedding_norm": row.embedding_norm,
    }
    return {what: pattern for what, pattern in named.items() if pattern is not None}


def check_norm_form(run: Run) -> None:
    """Every norm the model runs on a text is named by the row's norms pattern (and so is every
    norm the row names elsewhere), and each recomputes from its weights in the row's declared form
    (a vision tower's norms, which a text never reaches, are not the row's concern)."""
    norms = run.row.norms
    assert norms is not None  # the check applies to rows with norms
    named = _every_match(run.model, norms.modules)
    names = {name for name, _ in named}
    looking = [(name, module) for name, module in run.model.named_modules() if _looks_like_a_norm(module)]
    missed = [name for name, _ in looking if name in run.ran_norms and name not in names]
    if missed:  # a norm no gradient of the output reaches (read only through a top-k) is not the row's
        off = off_the_gradient_path(
            run.model, run.inputs, [(name, module) for name, module in looking if name in missed]
        )
        missed = [name for name in missed if name not in off]
    for what, pattern in _named_norms(run.row).items():
        named_there = _first_match(run.model, pattern, run.row.stack.gaps)
        missed += [f"{name} (the row's {what})" for name, _ in named_there if name not in names]
    if missed:
        _fail(run, "norm_form", f"{', '.join(missed[:3])} not matched by the norms pattern {norms.modules!r}")
    pairs = zip(run.layers("norms.in"), run.layers("norms.out"), strict=True)
    for (name, module), (read, written) in zip(named, pairs, strict=True):
        recomputed = _declared_norm(module, read, norms)
        if recomputed is None or not _equal(recomputed, written):
            form = f"{'a layer norm' if norms.form == 'layer' else 'an RMS norm'} scaled by {norms.rms_offset:g} + w"
            _fail(
                run, "norm_form", f"{name} ({type(module).__name__}) is not {form} of its weights, as the row declares"
            )


def _looks_like_a_norm(module: nn.Module) -> bool:
    """A torch layer norm, or a module class named like one (RMSNorm, T5LayerNorm): the norms a
    row's pattern must not miss (a check only; the row's pattern is what the methods use)."""
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


def _equal(candidate: torch.Tensor, written: torch.Tensor) -> bool:
    same_shape = candidate.shape == written.shape
    return same_shape and torch.allclose(candidate, written, rtol=TOLERANCE, atol=TOLERANCE)


def _declared_norm(module: nn.Module, x: Any, norms: Norms) -> torch.Tensor | None:
    """What a norm of the declared form (`Norms.recompute`) with ``module``'s weights gives ``x``;
    None when the module has a weight that is not over ``x``'s last axis (not a norm of that input)."""
    weight = getattr(module, "weight", None)
    if not torch.is_tensor(x) or (isinstance(weight, torch.Tensor) and weight.shape != x.shape[-1:]):
        return None
    return norms.recompute(module, x)


def _gated_parts(gated: GatedMLP, mlp: nn.Module) -> list[tuple[str, nn.Module, Side]]:
    """What `check_gated_product` reads of one layer's gated MLP: ``(what, module, side)`` for the up
    projection's and the activation's outputs and every other child's input."""
    up, activation = getattr(mlp, gated.up, None), getattr(mlp, gated.activation, None)
    parts: list[tuple[str, nn.Module, Side]] = [
        (what, module, "output")
        for what, module in (("gated.up", up), ("gated.act", activation))
        if isinstance(module, nn.Module)
    ]
    return parts + [
        (f"gated.reads.{child}", module, "input")
        for child, module in mlp.named_children()
        if module is not up and module is not activation and takes_input(module)
    ]


def check_gated_product(run: Run) -> None:
    """In every layer the gated MLP holds its up projection and its activation, and one of its
    modules reads their product: down(act(gate(x)) · up(x)), as the backward rules split it."""
    gated = run.row.gated_mlp
    assert gated is not None  # the check applies to rows with a gated MLP
    for layer, (name, _) in enumerate(find_layers(run.model, gated.module, gaps=True)):
        up, activation = run.seen.get(("gated.up", layer)), run.seen.get(("gated.act", layer))
        if not isinstance(up, torch.Tensor) or not isinstance(activation, torch.Tensor):
            _fail(run, "gated_product", f"layer {layer}: {name} has no module {gated.up!r} and {gated.activation!r}")
        read = [tensor for (what, at), tensor in run.seen.items() if at == layer and what.startswith("gated.reads.")]
        if not any(torch.is_tensor(tensor) and _equal(tensor, up * activation) for tensor in read):
            _fail(run, "gated_product", f"layer {layer}: no module of the gated MLP reads act(gate(x)) · up(x)")


def check_own_value(run: Run) -> None:
    """Writing every activation site of every kind with its own value changes nothing, bit for bit:
    all kinds in one forward pass, then, only when that changed the output, kind by kind to name it."""
    by_kind = {}
    for kind in (row for row in SITE_TABLE if row.is_activation):
        pattern = kind.pattern(run.row)
        modules = [module for _, module in find_layers(run.model, pattern, gaps=run.row.stack.gaps)] if pattern else []
        by_kind[kind.name] = [(point, _own_value_writer(run, kind)) for point in kind.hook_points(modules, run.row)]
    if torch.equal(run.forward([hook for hooked in by_kind.values() for hook in hooked]), run.output):
        return
    for name, hooked in by_kind.items():
        if not torch.equal(run.forward(hooked), run.output):
            _fail(run, "own_value", f"writing every {name} site with its own value changed the output")
    _fail(run, "own_value", "writing every site of every kind with its own value changed the output")


def _own_value_writer(run: Run, kind: SiteKind) -> Callable:
    """A hook writing every column of every batch row with the value it already has."""

    def write(tensor: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        assert kind.read is not None
        batch = run.inputs["input_ids"].shape[0]
        return kind.on_tokens(tensor, batch, lambda shaped: own(shaped, first))

    def own(tensor: torch.Tensor, first: torch.Tensor | None) -> torch.Tensor:
        assert kind.read is not None
        batch, columns = tensor.shape[0], kind.columns(tensor, run.n_heads)
        rows = torch.arange(batch).repeat_interleave(columns)
        indices = torch.arange(columns).repeat(batch)
        values = torch.stack(
            [kind.read(tensor[r].clone(), int(i), None, run.n_heads) for r, i in zip(rows, indices, strict=True)]
        )
        return kind.write(tensor, [Write(rows, indices, values, None)], run.n_heads, first)

    return write


def check_knockout(run: Run) -> None:
    """Blocking the edge from key 0 to the last query in layer 0 gives that weight exactly 0, the row
    summing to 1 (with sinks: at most 1)."""
    kind = next(row for row in SITE_TABLE if row.name == "knockout")
    pattern = kind.pattern(run.row)
    modules = [module for _, module in find_layers(run.model, pattern, gaps=run.row.stack.gaps)] if pattern else []
    query = run.inputs["input_ids"].shape[1] - 1
    batch = run.inputs["input_ids"].shape[0]
    block = Write(torch.arange(batch), torch.zeros(batch, dtype=torch.long), None, query)
    seen: list[torch.Tensor] = []
    point = kind.hook_points(modules)[0]
    weights = HookPoint(modules[0], "output", index=run.row.stack.weights_index)
    try:
        run.forward(
            [(point, lambda mask, first: kind.write(mask, [block], run.n_heads, first)), (weights, seen.append)]
        )
    except CaptureError as error:
        _fail(run, "knockout", str(error))
    row = seen[0][:, :, query]  # [batch, head, key]
    if not torch.equal(row[..., 0], torch.zeros_like(row[..., 0])):
        _fail(
            run,
            "knockout",
            f"the blocked weight A[{query}, 0] of layer 0 is {float(row[..., 0].abs().max()):.3g}, not 0",
        )
    _close(
        run, "knockout", "layer 0: the blocked row's sum", _row_sums(run.row.stack, row), torch.ones_like(row[..., 0])
    )


def _always(_row: Adapter) -> bool:
    return True


def _has_values(row: Adapter) -> bool:
    return row.projection("value") is not None


def _plain_heads(row: Adapter) -> bool:
    return _has_values(row) and not (row.values is not None and row.values.head_factor)


def _factored_heads(row: Adapter) -> bool:
    return _has_values(row) and row.values is not None and row.values.head_factor


def _normed_heads(row: Adapter) -> bool:
    return _has_values(row) and row.values is not None and row.values.head_norm is not None


def _at_scores(row: Adapter) -> bool:
    return row.values is not None and row.values.scores


def _has_norms(row: Adapter) -> bool:
    return row.norms is not None


def _has_gated_mlp(row: Adapter) -> bool:
    return row.gated_mlp is not None


def _has_sites(row: Adapter) -> bool:
    return row.sites is not None


def _projection_adds(row: Adapter) -> bool:
    """The attention site is the output projection's output (no norm after it): a row with values
    says so by naming no ``output_norm``; a row without (inference found no value vectors, so the
    norm after the projection has no `Values` to be named in) by an attention site that is the
    projection or the module holding it. Where neither holds, nothing splits the attention site
    into heads and the residual sum alone proves it."""
    if row.sites is None:
        return False
    if row.values is not None:
        return row.values.output_norm is None
    return _holds(row.sites.attention, row.stack.output_projection)


def _holds(outer: str, inner: str) -> bool:
    """Whether the pattern ``inner`` names the module ``outer`` names or one inside it (``outer``
    ending in ``$``, ``inner`` continuing it with an escaped dot)."""
    return inner == outer or (outer.endswith("$") and inner.startswith(outer[:-1] + r"\."))


def _pre_norm_sites(row: Adapter) -> bool:
    return row.sites is not None and (row.values is None or row.values.norm is None)


def _streams_and_sites(row: Adapter) -> bool:
    return row.streams is not None and row.sites is not None


def _post_norm_sites(row: Adapter) -> bool:
    return row.sites is not None and row.values is not None and row.values.norm is not None


@dataclass(frozen=True)
class Check:
    """One conformance check: its ``name``, whether it ``applies`` to a row, and the check itself."""

    name: str
    applies: Callable[[Adapter], bool]
    run: Callable[[Run], None]


# Run in this order, each on its own (a failure does not stop the next).
CHECKS: tuple[Check, ...] = (
    Check("attention_weights", _always, check_attention_weights),
    Check("head_slices", _plain_heads, check_head_slices),
    Check("head_factor", _factored_heads, check_head_factor),
    Check("head_norm", _normed_heads, check_head_norm),
    Check("scores", _at_scores, check_scores),
    Check("attention_output", _projection_adds, check_attention_output),
    Check("residual_sum", _pre_norm_sites, check_residual_sum),
    Check("post_norm", _post_norm_sites, check_post_norm),
    Check("ffn_input", _streams_and_sites, check_ffn_input),
    Check("norm_form", _has_norms, check_norm_form),
    Check("gated_product", _has_gated_mlp, check_gated_product),
    Check("own_value", _has_sites, check_own_value),
    Check("knockout", _has_sites, check_knockout),
)


Outcome = Literal["pass", "fail", "n/a"]


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome on one model: ``"pass"``, ``"fail"`` (``detail`` says where and by how
    much) or ``"n/a"`` (the row provides nothing the check reads)."""

    check: str
    outcome: Outcome
    detail: str = ""


@dataclass(frozen=True)
class ConformanceReport:
    """Every check of `CHECKS` on one row and model, in order (scikit-learn's per-check results)."""

    family: str
    results: tuple[CheckResult, ...]

    @property
    def passed(self) -> set[str]:
        return {result.check for result in self.results if result.outcome == "pass"}

    @property
    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(result for result in self.results if result.outcome == "fail")

    def outcome(self, check: str) -> Outcome:
        return next(result.outcome for result in self.results if result.check == check)

    def error(self) -> AdapterCheckError | None:
        """One line naming every failed check (None when all passed)."""
        if not self.failed:
            return None
        failures = "; ".join(f"{result.check}: {result.detail}" for result in self.failed)
        return AdapterCheckError(f"adapter row {self.family!r} fails {failures}")

    def __str__(self) -> str:
        width = max(len(check.name) for check in CHECKS)
        return "\n".join(
            f"{result.check:<{width}}  {result.outcome}" + (f"  {result.detail}" if result.detail else "")
            for result in self.results
        )


def check_adapter(row: Adapter, model: Any, *, seed: int = 0, strict: bool = True) -> ConformanceReport:
    """Run every check of `CHECKS` on ``model`` (a Hugging Face module or a loaded attnflow model;
    put in eval mode and eager attention for the run, restored after) with a seeded random input of
    2 rows × 7 tokens (or an image, or a source and a target), each on its own: a failed check does
    not stop the others. Returns the `ConformanceReport` (pass, fail or n/a per check); with
    ``strict`` (the default) a failure raises `AdapterCheckError` naming every failed check."""
    module: nn.Module = getattr(model, "hf_model", model)
    training = module.training
    implementation = getattr(module.config, "_attn_implementation", "eager")
    if implementation != "eager":
        module.set_attn_implementation("eager")
    module.eval()
    try:
        with torch.no_grad():
            report = _report(row, module, seed)
    finally:
        module.train(training)
        if implementation != "eager":
            module.set_attn_implementation(implementation)
    error = report.error()
    if strict and error is not None:
        raise error
    return report


def _report(row: Adapter, module: nn.Module, seed: int) -> ConformanceReport:
    prefix = f"adapter row {row.family!r} fails "
    try:
        run: Run | None = record(row, module, _inputs(row, module, seed), row.heads(module.config))
        unrecorded = ""
    except (AdapterCheckError, CaptureError) as error:
        run, unrecorded = None, str(error).removeprefix(f"adapter row {row.family!r}: ")
    results = []
    for check in CHECKS:
        if not check.applies(row):
            results.append(CheckResult(check.name, "n/a"))
            continue
        if run is None:
            results.append(CheckResult(check.name, "fail", unrecorded))
            continue
        try:
            check.run(run)
        except AdapterCheckError as error:
            detail = str(error).removeprefix(f"{prefix}{check.name}: ")
            results.append(CheckResult(check.name, "fail", detail))
        except (RuntimeError, ValueError, IndexError, KeyError, TypeError) as error:  # a part of the wrong shape
            results.append(CheckResult(check.name, "fail", f"{type(error).__name__}: {str(error).splitlines()[0]}"))
        else:
            results.append(CheckResult(check.name, "pass"))
    return ConformanceReport(row.family, tuple(results))


def _inputs(row: Adapter, model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A seeded random input of the kind ``row`` reads, on the model's device."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    device = next(model.parameters()).device
    if row.kind == "vision":
        size, channels = config.image_size, getattr(config, "num_channels", 3)
        return {"pixel_values": torch.randn(1, channels, size, size, generator=generator).to(device)}
    ids = torch.randint(4, min(int(text_config(config).vocab_size), 100), (2, 7), generator=generator).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if row.kind == "encoder-decoder":
        inputs["decoder_input_ids"] = ids[:, :4]
    return inputs
