"""Mixtures of experts: each chosen expert's part of a MoE block's output, computed from the fused
parameters the `Experts` row names, and `find_experts`, which infers that row from the block and
one traced call (parameters with a leading expert axis, a router whose output holds the top-k
choice, a shared expert), never from class names.

A MoE block maps x ``[N, d_model]`` (tokens flattened) to Σ_k g_k(x) E_{i_k}(x) + s(x): the router
gives each token its ``k`` experts i ``[N, k]`` and their weights g ``[N, k]``, each expert is
down(act(first(x))) with its own slice of the fused parameters, and s is the shared expert's part
(σ(gate(x)) · shared(x), or shared(x) with no gate; 0 with no shared expert).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from attnflow.rows.adapters import Experts
from attnflow.rows.hook_points import output_tensor
from attnflow.rows.tracing import Call, trace

TOLERANCE = 1e-4  # relative to the largest magnitude compared, when a traced call confirms a layout


@dataclass
class Slots:
    """The routing of ``N`` tokens and what each chosen expert computes: ``indices [N, k]`` (the
    experts), ``weights [N, k]`` (g), ``outputs [N, k, d_model]`` (E_i(x), unweighted)."""

    indices: torch.Tensor
    weights: torch.Tensor
    outputs: torch.Tensor

    @property
    def parts(self) -> torch.Tensor:
        """``[N, k, d_model]`` g_k · E_{i_k}(x): what each chosen expert adds, in the outputs' dtype."""
        return (self.outputs * self.weights[..., None]).to(self.outputs.dtype)


def routing(row: Experts, block: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for ``hidden [N, d_model]``: ``(weights [N, k], indices [N, k])``."""
    routed = block.get_submodule(row.router)(hidden)
    return routed[row.weights_index], routed[row.indices_index]


def expert_output(row: Experts, experts: nn.Module, hidden: torch.Tensor, expert: int) -> torch.Tensor:
    """``[n, d_model]`` expert ``expert``'s output on ``hidden [n, d_model]``, unweighted:
    down(act(first(x))) from its slice of the fused parameters."""
    inner = _project(row, experts, row.first, hidden, expert)
    return _project(row, experts, row.down, getattr(experts, row.activation)(inner), expert)


def _project(row: Experts, experts: nn.Module, name: str, x: torch.Tensor, expert: int) -> torch.Tensor:
    weight = getattr(experts, name)[expert]  # [out, in], or [in, out] when transposed
    y = x @ weight if row.transposed else nn.functional.linear(x, weight)
    return y + getattr(experts, f"{name}_bias")[expert] if row.bias else y


def slots(row: Experts, block: nn.Module, hidden: torch.Tensor) -> Slots:
    """The router's choice for ``hidden [N, d_model]`` and each chosen expert's output (one call
    per expert hit, on the tokens routed to it)."""
    weights, indices = routing(row, block, hidden)
    return Slots(indices, weights, _outputs(row, block.get_submodule(row.experts), hidden, indices))


def _outputs(row: Experts, experts: nn.Module, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``[N, k, d_model]`` the output of expert ``indices[t, k]`` on token t of ``hidden [N, d_model]``."""
    outputs = hidden.new_zeros(*indices.shape, hidden.shape[-1])
    for expert in indices.unique().tolist():
        tokens, slot = torch.where(indices == expert)
        outputs[tokens, slot] = expert_output(row, experts, hidden[tokens], expert).to(outputs.dtype)
    return outputs


def shared_part(row: Experts, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """``[N, d_model]`` the shared expert's part σ(gate(x)) · shared(x) (no gate: shared(x)), or
    None without a shared expert."""
    if row.shared is None:
        return None
    part = block.get_submodule(row.shared)(hidden)
    if row.shared_gate is None:
        return part
    return torch.sigmoid(block.get_submodule(row.shared_gate)(hidden)) * part


def n_experts(row: Experts, block: nn.Module) -> int:
    """E, a block's routed experts: the fused parameters' leading axis."""
    return int(getattr(block.get_submodule(row.experts), row.first).shape[0])


def n_columns(row: Experts, block: nn.Module) -> int:
    """The columns of `contributions`: E, plus one for a shared expert."""
    return n_experts(row, block) + (row.shared is not None)


def contributions(row: Experts, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``[..., E (+ 1), d_model]`` what every expert adds at each token of ``hidden [..., d_model]``
    (0 where it is not chosen), the shared expert's part last; they sum to the block's output."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    found = slots(row, block, flat)
    dense = flat.new_zeros(flat.shape[0], n_experts(row, block), flat.shape[-1])  # [N, E, d_model]
    dense.scatter_add_(1, found.indices[..., None].expand_as(found.outputs), found.parts)
    shared = shared_part(row, block, flat)
    if shared is not None:
        dense = torch.cat([dense, shared[:, None].to(dense.dtype)], dim=1)
    return dense.reshape(*hidden.shape[:-1], *dense.shape[1:])


@dataclass(frozen=True)
class ExpertsView:
    """A MoE block's output ``[batch, token, d_model]`` seen as every expert's part of it ``[batch,
    token, E (+ 1), d_model]`` (`contributions` of the block's input): a replacement of the parts
    changes the output by Σ (new − old), so the parts as they were change nothing, bit for bit."""

    row: Experts

    def expand(self, module: nn.Module, _output: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        return contributions(self.row, module, first)

    def collapse(self, output: torch.Tensor, expanded: torch.Tensor, replacement: torch.Tensor) -> torch.Tensor:
        return output + (replacement - expanded).sum(dim=-2).to(output.dtype)


# -- inference ---------------------------------------------------------------------------------


def find_experts(block: str, module: nn.Module, hidden: torch.Tensor) -> Experts | None:
    """The `Experts` row of a MoE block, inferred from ``module`` (one layer's block, which
    ``block``, the regex with the layer group, names in every layer) and one call on ``hidden
    [batch, token, d_model]`` (its input in a traced forward pass); None when ``module`` is not a
    mixture of experts this can read.

    Found, then proved on that call: the experts module (two or more 3-D parameters sharing a
    leading axis E, called with the hidden states, an integer tensor of top-k indices < E and their
    weights); the router (a module called on the same hidden states whose output tuple holds those
    indices and weights); the layout (which parameter comes first, transposed or not, biases, the
    activation) as the one that recomputes the experts module's output; the shared expert and its
    gate as the modules that make up the rest of the block's output. The row returned reproduces
    the block's output on this call.
    """
    with torch.no_grad():
        named = [(name, part) for name, part in module.named_modules() if name]
        calls, returned = trace(named, lambda: module(hidden))
        block_output = output_tensor(returned)
        for name, experts in module.named_modules():
            found = _experts_row(block, module, name, experts, calls, block_output)
            if found is not None:
                return found
    return None


def _experts_row(
    block: str, module: nn.Module, name: str, experts: nn.Module, calls: dict[str, Call], block_output: torch.Tensor
) -> Experts | None:
    """The row whose experts module is ``experts`` (at ``name`` below the block), or None."""
    fused = [key for key, parameter in experts.named_parameters(recurse=False) if parameter.dim() == 3]
    leading = {getattr(experts, key).shape[0] for key in fused}
    call = calls.get(name)
    if len(fused) < 2 or len(leading) != 1 or call is None or not torch.is_tensor(call.output):
        return None
    routed = _routed_arguments(call, leading.pop())
    if routed is None:
        return None
    flat, indices, weights = routed
    router = _router(calls, name, flat, indices, weights, module)
    if router is None:
        return None
    for layout in _layouts(experts, fused):
        row = Experts(block, router[0], name, router[1], router[2], **layout)
        try:
            computed = Slots(indices, weights, _outputs(row, experts, flat, indices)).parts.sum(dim=1)
        except (RuntimeError, IndexError, AttributeError, TypeError):
            continue
        if _close(computed, call.output):
            rest = block_output.reshape(flat.shape) - call.output
            shared = _shared(calls, name, router[0], flat, rest)
            if shared is not None:
                return replace(row, shared=shared[0], shared_gate=shared[1])
    return None


def _routed_arguments(call: Call, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(hidden [N, d], indices [N, k], weights [N, k])`` among an experts call's arguments."""
    tensors = [value for value in (*call.args, *call.kwargs.values()) if torch.is_tensor(value)]
    chosen = [
        t for t in tensors if not t.is_floating_point() and t.dim() == 2 and t.numel() and int(t.max()) < n_experts
    ]
    if len(chosen) != 1:
        return None
    indices = chosen[0]
    weights = [t for t in tensors if t.is_floating_point() and t.shape == indices.shape]
    hidden = [t for t in tensors if t.is_floating_point() and t.dim() == 2 and t.shape[0] == indices.shape[0]]
    hidden = [t for t in hidden if t.shape != indices.shape]
    if len(weights) != 1 or len(hidden) != 1:
        return None
    return hidden[0], indices, weights[0]


def _router(
    calls: dict[str, Call],
    experts: str,
    flat: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    module: nn.Module,
) -> tuple[str, int, int] | None:
    """``(path, weights_index, indices_index)`` of the module whose output, called on ``flat``,
    holds the experts call's ``indices`` and ``weights``."""
    for name in calls:
        if name == experts or name.startswith(experts + "."):
            continue
        try:
            routed = module.get_submodule(name)(flat)
        except (RuntimeError, TypeError, ValueError):
            continue
        if not isinstance(routed, (tuple, list)):
            continue
        places = {
            what: [i for i, item in enumerate(routed) if torch.is_tensor(item) and _same(item, wanted)]
            for what, wanted in (("weights", weights), ("indices", indices))
        }
        if places["weights"] and places["indices"]:
            return name, places["weights"][0], places["indices"][0]
    return None


def _same(found: torch.Tensor, wanted: torch.Tensor) -> bool:
    return found.shape == wanted.shape and found.dtype == wanted.dtype and torch.equal(found, wanted)


def _layouts(experts: nn.Module, fused: list[str]) -> list[dict[str, Any]]:
    """Every layout the fused parameters may have: which comes first, transposed, biased, activated how."""
    activations = [name for name in ("_apply_gate", "act_fn") if callable(getattr(experts, name, None))]
    found = []
    for (first, down), transposed, activation in itertools.product(
        itertools.permutations(fused, 2), (False, True), activations
    ):
        bias = all(hasattr(experts, f"{name}_bias") for name in (first, down))
        found.append(dict(first=first, down=down, transposed=transposed, bias=bias, activation=activation))
    return found


def _shared(
    calls: dict[str, Call], experts: str, router: str, flat: torch.Tensor, rest: torch.Tensor
) -> tuple[str | None, str | None] | None:
    """``(shared expert, its gate)`` whose part is ``rest [N, d]``, the block's output less the
    experts' (``(None, None)`` when nothing is left); None when no module explains what is."""
    if _close(rest, torch.zeros_like(rest)):
        return None, None
    outputs = {
        name: call.output.reshape(flat.shape[0], -1)
        for name, call in calls.items()
        if "." not in name and name not in (experts, router) and torch.is_tensor(call.output)
    }
    wide = [name for name, output in outputs.items() if output.shape == flat.shape]
    gates = [name for name, output in outputs.items() if output.shape[-1] == 1]
    for shared in wide:
        for gate in gates:
            if _close(torch.sigmoid(outputs[gate]) * outputs[shared], rest):
                return shared, gate
        if _close(outputs[shared], rest):
            return shared, None
    return None


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    if actual.shape != expected.shape:
        return False
    error = float((actual.double() - expected.double()).abs().max())
    return error <= TOLERANCE * max(float(expected.abs().max()), 1.0)
