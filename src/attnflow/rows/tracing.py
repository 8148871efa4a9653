"""One traced call of a model or a block, for finding its parts (`attnflow.rows.infer`,
`attnflow.rows.experts`): which modules run, in what order, with what arguments and outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from attnflow.rows.hook_points import HookPoint, hooks, takes_input

OUTPUT_INDICES = (0, 1, 2)  # tuple elements recorded per call (attention modules return their weights at 1 or 2)


@dataclass
class Call:
    """One module's first call in the traced run: when it started and ended (one counter for both),
    its arguments, its first input (the forward's first parameter, however it was passed) and the
    first elements of its output. Tensors are copies: a model may change one in place after the
    hook saw it (Falcon adds the attention output into the MLP's with ``+=``)."""

    name: str
    module: nn.Module
    start: int = -1
    end: int = -1
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    input: Any = None
    outputs: dict[int, Any] = field(default_factory=dict)
    count: int = 0  # how many times the module ran (one module shared by several layers runs more than once)

    @property
    def output(self) -> Any:
        return self.outputs.get(0)

    def inside(self, scope: str) -> bool:
        return self.name == scope or self.name.startswith(scope + ".")


def _kept(tensor: Any) -> Any:
    return tensor.detach().clone() if torch.is_tensor(tensor) else tensor


def trace(watched: Iterable[tuple[str, nn.Module]], run: Callable[[], Any]) -> tuple[dict[str, Call], Any]:
    """``run()`` once without gradients, recording the first call of every watched module; returns
    the calls of the modules that ran, by name, and what ``run`` returned."""
    calls: dict[str, Call] = {}
    counter = [0]

    def started(call: Call) -> Callable:
        def hook(args: tuple, kwargs: dict) -> None:
            call.count += 1
            if call.start < 0:
                call.start, counter[0] = counter[0], counter[0] + 1
                call.args, call.kwargs = args, kwargs

        return hook

    def first_input(call: Call) -> Callable:
        def hook(tensor: Any) -> None:
            if call.input is None:
                call.input = _kept(tensor)

        return hook

    def ended(call: Call, index: int) -> Callable:
        def hook(tensor: Any) -> None:
            if index not in call.outputs:
                call.outputs[index] = _kept(tensor)
                if index == 0:
                    call.end, counter[0] = counter[0], counter[0] + 1

        return hook

    hooked: list[tuple[HookPoint, Callable]] = []
    for name, module in watched:
        call = calls.setdefault(name, Call(name, module))
        hooked.append((HookPoint(module, "call", name=name), started(call)))
        if takes_input(module):
            hooked.append((HookPoint(module, "input", name=name), first_input(call)))
        hooked += [
            (HookPoint(module, "output", index=index, name=name), ended(call, index)) for index in OUTPUT_INDICES
        ]
    with hooks(hooked), torch.no_grad():
        returned = run()
    return {name: call for name, call in calls.items() if call.start >= 0}, returned


def affine_misfit(out: torch.Tensor, terms: tuple[torch.Tensor, ...], tolerance: float = 1e-4) -> tuple[float, bool]:
    """How far ``out [..., d]`` is from c_0 + Σ_k c_k ⊙ terms[k] with per-channel constants c (one
    least-squares fit per channel over every row): (the largest residual relative to ``out``'s
    largest magnitude, whether the fit is determined: at least twice as many rows as constants per
    channel, and every term carrying its own information (with ``tolerance``, no term is itself
    such a combination of the others))."""
    width = out.shape[-1]
    rows = [term.reshape(-1, width).double() for term in terms]
    design = torch.stack([torch.ones_like(rows[0]), *rows], dim=-1).transpose(0, 1)  # [d, row, 1 + terms]
    target = out.reshape(-1, width).double().transpose(0, 1).unsqueeze(-1)  # [d, row, 1]
    solution = torch.linalg.lstsq(design, target).solution  # [d, 1 + terms, 1]
    residual = float((design @ solution - target).abs().max())
    scale = max(float(target.abs().max()), 1.0)
    singular = torch.linalg.svdvals(design)  # [d, 1 + terms]
    determined = bool((singular[:, -1] > tolerance * singular[:, 0]).all()) and design.shape[1] >= 2 * design.shape[2]
    return residual / scale, determined


def affine_failure(out: torch.Tensor, terms: tuple[torch.Tensor, ...], tolerance: float) -> str | None:
    """Why ``out`` is not a per-channel affine combination of every one of ``terms`` (`affine_misfit`
    above ``tolerance``, an undetermined fit, or a term the fit does without: a site that is the
    whole stream would need neither the input nor the other site); None when it is."""
    misfit, determined = affine_misfit(out, terms)
    if not determined:
        return "not determined (a term is a combination of the others)"
    if misfit > tolerance:
        return f"largest difference {misfit:.2e} (allowed {tolerance:.1e})"
    for k in range(len(terms)):
        if affine_misfit(out, terms[:k] + terms[k + 1 :])[0] <= tolerance:
            return f"term {k} is not needed: the rest already give the output"
    return None
