"""One traced call of a model or a block, for finding its parts (`attnflow.rows.infer`,
`attnflow.rows.experts`): which modules run, in what order, with what arguments and outputs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
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


_INSIDE = threading.local()  # .depth: how many of the watched modules are running in this thread

# What a softmax handler is given: the softmax's input x, its output, its dim and dtype (None: x's),
# and a function that computes the same softmax call of another first argument.
SoftmaxHandler = Callable[[torch.Tensor, torch.Tensor, int, Any, Callable[[torch.Tensor], torch.Tensor]], Any]


SOFTMAX = frozenset({torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax})
# The element-wise functions a per-position head factor is made with (a sigmoid gate, Laguna's softplus gate).
GATES = frozenset(
    {
        torch.sigmoid,
        torch.Tensor.sigmoid,
        torch.nn.functional.sigmoid,
        torch.special.expit,
        torch.nn.functional.softplus,
    }
)

# What a call handler is given: the torch function called, its positional and keyword arguments,
# and what it returned; it returns what the call returns instead.
CallHandler = Callable[[Any, tuple, dict, Any], Any]


@contextmanager
def softmax_inside(modules: list[nn.Module], handle: SoftmaxHandler) -> Iterator[None]:
    """While the block runs, in this thread: every softmax called inside the forward of one of
    ``modules`` — ``torch.nn.functional.softmax``, ``torch.softmax``, ``Tensor.softmax`` or
    ``torch.special.softmax``, however it is spelled — returns what ``handle`` returns for it (the
    attention weights' softmax, wherever a family computes it: the backward rules change its
    gradient there, the conformance suite reads it); every other call runs as it is."""
    with calls_inside(modules, softmax_handler(handle)):
        yield


def softmax_handler(handle: SoftmaxHandler) -> CallHandler:
    """A `CallHandler` that passes each softmax call (`SOFTMAX`) with a tensor argument to
    ``handle`` as `softmax_inside` describes, and returns every other call's output as it is."""

    def on_call(func: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        if func not in SOFTMAX or not isinstance(args[0], torch.Tensor):
            return output
        dim, dtype = _softmax_arguments(func, args, kwargs, args[0])
        return handle(args[0], output, dim, dtype, lambda x: func(x, *args[1:], **kwargs))

    return on_call


@contextmanager
def calls_inside(modules: list[nn.Module], handle: CallHandler) -> Iterator[None]:
    """While the block runs, in this thread: every torch function called inside the forward of one
    of ``modules`` (a softmax, a sigmoid, however it is spelled) returns ``handle(func, args, kwargs,
    output)``; calls outside them run as they are."""
    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            output = func(*args, **kwargs)
            if not getattr(_INSIDE, "depth", 0) or not args:
                return output
            return handle(func, args, kwargs, output)

    def enter(_args: tuple, _kwargs: dict) -> None:
        _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1

    def leave(_output: Any) -> None:
        _INSIDE.depth = max(0, getattr(_INSIDE, "depth", 0) - 1)

    counted: list[tuple[HookPoint, Callable]] = [(HookPoint(module, "call"), enter) for module in modules]
    counted += [(HookPoint(module, "output"), leave) for module in modules]
    _INSIDE.depth = 0
    try:
        with hooks(counted), Mode():
            yield
    finally:
        _INSIDE.depth = 0


def _softmax_arguments(func: Any, args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[int, Any]:
    """``(dim, dtype)`` of a softmax call, however it was spelled (F.softmax(x, dim, _stacklevel,
    dtype), torch.softmax(x, dim, dtype), x.softmax(dim, dtype)); F.softmax's legacy implicit dim as
    torch picks it."""
    dtype_at = 3 if func is torch.nn.functional.softmax else 2
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    dtype = kwargs.get("dtype", args[dtype_at] if len(args) > dtype_at else None)
    if dim is None:
        dim = 0 if x.dim() in (0, 1, 3) else 1
    return int(dim), dtype


def off_the_gradient_path(
    model: nn.Module, inputs: dict[str, torch.Tensor], watched: list[tuple[str, nn.Module]]
) -> set[str]:
    """The names of the ``watched`` modules whose output no gradient of the model's first output
    reaches, in one forward and one backward pass of ``inputs``: modules read only through a
    discrete choice (a sparse-attention indexer's norm, whose scores pick the keys by top-k), so
    nothing the methods linearise passes through them."""
    outputs: dict[str, torch.Tensor] = {}
    hooked: list[tuple[HookPoint, Callable]] = [
        (HookPoint(module, name=name), lambda tensor, name=name: outputs.__setitem__(name, tensor))
        for name, module in watched
    ]
    with hooks(hooked), torch.enable_grad():
        total = model(**inputs)[0].sum()  # the first output [batch, token, ...], summed
    reached = [name for name, tensor in outputs.items() if torch.is_tensor(tensor) and tensor.requires_grad]
    if not reached:  # computed without gradients (an indexer run under no_grad)
        return {name for name, _ in watched}
    gradients = torch.autograd.grad(total, [outputs[name] for name in reached], allow_unused=True)
    on_path = {
        name for name, gradient in zip(reached, gradients, strict=True) if gradient is not None and bool(gradient.any())
    }
    return {name for name, _ in watched} - on_path


def affine_misfit(out: torch.Tensor, terms: tuple[torch.Tensor, ...], tolerance: float = 1e-4) -> tuple[float, bool]:
    """How far ``out [..., d]`` is from c_0 + Σ_k c_k ⊙ terms[k] with per-channel constants c (one
    least-squares fit per channel over every row): (the largest residual relative to ``out``'s
    largest magnitude, whether the fit is determined: at least twice as many rows as constants per
    channel, and every term carrying its own information (with ``tolerance``, no term is itself
    such a combination of the others))."""
    design, target, solution = _affine_fit(out, terms)
    residual = float((design @ solution - target).abs().max())
    scale = max(float(target.abs().max()), 1.0)
    singular = torch.linalg.svdvals(design)  # [d, 1 + terms]
    determined = bool((singular[:, -1] > tolerance * singular[:, 0]).all()) and design.shape[1] >= 2 * design.shape[2]
    return residual / scale, determined


def affine_constants(out: torch.Tensor, terms: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``[1 + len(terms), d]`` float64: per channel, c_0 and each c_k of the least-squares fit of
    ``out [..., d]`` by c_0 + Σ_k c_k ⊙ terms[k] (`affine_misfit` says how well it fits)."""
    return _affine_fit(out, terms)[2][..., 0].T


def _affine_fit(out: torch.Tensor, terms: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(design ``[d, row, 1 + terms]``, target ``[d, row, 1]``, solution ``[d, 1 + terms, 1]``), float64."""
    width = out.shape[-1]
    rows = [term.reshape(-1, width).double() for term in terms]
    design = torch.stack([torch.ones_like(rows[0]), *rows], dim=-1).transpose(0, 1)  # [d, row, 1 + terms]
    target = out.reshape(-1, width).double().transpose(0, 1).unsqueeze(-1)  # [d, row, 1]
    return design, target, torch.linalg.lstsq(design, target).solution


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
