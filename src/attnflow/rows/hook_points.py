"""Every hook attnflow puts on a model, registered in one place: `hooks` registers them for the
forward (and backward) passes run inside a ``with`` block and removes every one in ``finally``.

A `HookPoint` names one tensor of one module call:

- ``side="output"``: what the module returns: the tensor itself, or element ``index`` of a tuple
  or list output (``[batch, token, d_model]`` for a block, the softmax weights ``[batch, head,
  query, key]`` at an attention module's ``weights_index``);
- ``side="input"``: an argument the module receives: ``argument`` by name, found among the
  keyword arguments or at its place among the positional ones (the forward's signature says
  where), or, with no ``argument``, the forward's first parameter (``hidden_states``, ``x``,
  ``input``); None when the call leaves an optional argument out;
- ``side="gradient"``: the gradient reaching the module's output (its first element) in the
  backward pass;
- ``side="call"``: the whole call ``(args, kwargs)`` before the forward runs, read only.

A hook function receives the tensor (and, with ``with_input``, the module's first argument as well;
an output through a ``view``: the tensor the `View` expands it to)
and returns a replacement, or None to leave it as it is; `hooks` rewraps the replacement where the
tensor came from (the same tuple position, positional argument or keyword). No other module of
attnflow registers a hook or unwraps a hook's arguments (a source test checks it).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Literal, Protocol

from attnflow.errors import CaptureError

if TYPE_CHECKING:
    from torch import nn

Side = Literal["output", "input", "gradient", "call"]
HookFunction = Callable[..., Any]  # (tensor[, first input]) -> tensor | None; "call": (args, kwargs) -> None


class View(Protocol):
    """An output seen as another tensor (a MoE block's output as each expert's part of it): the
    hook function receives ``expand(module, output, first input)`` and what it returns in its
    place goes back through ``collapse(output, expanded, replacement)``."""

    def expand(self, module: nn.Module, output: Any, first: Any) -> Any: ...

    def collapse(self, output: Any, expanded: Any, replacement: Any) -> Any: ...


@dataclass(frozen=True, eq=False)
class HookPoint:
    """One tensor of one module's calls (module docstring): ``side``, ``argument`` (inputs: its
    name; None: the forward's first parameter), ``index`` (outputs: the element of a tuple output),
    ``with_input`` (the function also receives the module's first argument), ``name`` (messages),
    ``view`` (outputs: the function sees the output through a `View`)."""

    module: nn.Module
    side: Side = "output"
    argument: str | None = None
    index: int = 0
    with_input: bool = False
    name: str = ""
    view: View | None = None

    def describe(self) -> str:
        return self.name or type(self.module).__name__


def output_tensor(output: Any, index: int = 0) -> Any:
    """Element ``index`` of a tuple or list output, or the output itself when it is a tensor (index
    0); None when there is no such element. Also for code that calls a module directly."""
    if isinstance(output, (tuple, list)):
        return output[index] if -len(output) <= index < len(output) else None
    return output if index == 0 else None


def _replace_output(output: Any, index: int, new: Any) -> Any:
    if not isinstance(output, (tuple, list)):
        return new
    items = list(output)
    items[index] = new
    return type(output)(items) if isinstance(output, list) else tuple(items)


def _argument_place(point: HookPoint) -> tuple[str, int | None]:
    """(name, position among the positional arguments or None) of the input ``point`` reads; a
    CaptureError naming the module when its forward takes no such argument."""
    parameters = [
        parameter
        for parameter in inspect.signature(point.module.forward).parameters.values()
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    ]
    if point.argument is None:
        if not parameters:
            raise CaptureError(f"{point.describe()} ({type(point.module).__name__}) takes no input to hook")
        return parameters[0].name, 0
    for position, parameter in enumerate(parameters):
        if parameter.name == point.argument:
            keyword_only = parameter.kind == parameter.KEYWORD_ONLY
            return parameter.name, None if keyword_only else position
    raise CaptureError(
        f"{point.describe()} ({type(point.module).__name__}) takes no {point.argument!r} argument: "
        "attnflow cannot hook it there"
    )


def takes_input(module: nn.Module) -> bool:
    """Whether ``module``'s forward has a first parameter for an ``"input"`` hook point to read."""
    try:
        _argument_place(HookPoint(module, "input"))
    except CaptureError:
        return False
    return True


def _read_argument(args: tuple, kwargs: dict, name: str, position: int | None) -> Any:
    if name in kwargs:
        return kwargs[name]
    if position is not None and position < len(args):
        return args[position]
    return None


def _write_argument(args: tuple, kwargs: dict, name: str, position: int | None, new: Any) -> tuple[tuple, dict]:
    if name not in kwargs and position is not None and position < len(args):
        return (*args[:position], new, *args[position + 1 :]), kwargs
    return args, {**kwargs, name: new}


def _first_input(args: tuple, kwargs: dict, first: str) -> Any:
    return args[0] if args else kwargs.get(first)


def _input_hook(point: HookPoint, function: HookFunction) -> Callable:
    name, position = _argument_place(point)
    first = _argument_place(HookPoint(point.module, "input"))[0] if point.with_input else name

    def hook(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        tensor = _read_argument(args, kwargs, name, position)
        new = function(tensor, _first_input(args, kwargs, first)) if point.with_input else function(tensor)
        if new is None or new is tensor:
            return None
        return _write_argument(args, kwargs, name, position, new)

    return hook


def _output_hook(point: HookPoint, function: HookFunction) -> Callable:
    reads_first = point.with_input or point.view is not None
    first = _argument_place(HookPoint(point.module, "input"))[0] if reads_first else ""

    def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        tensor = output_tensor(output, point.index)
        first_input = _first_input(args, kwargs, first) if reads_first else None
        seen = tensor if point.view is None else point.view.expand(module, tensor, first_input)
        new = function(seen, first_input) if point.with_input else function(seen)
        if new is None or new is seen:
            return None
        if point.view is not None:
            new = point.view.collapse(tensor, seen, new)
        return _replace_output(output, point.index, new)

    return hook


def _gradient_hook(function: HookFunction) -> Callable:
    def hook(_module: Any, grad_output: tuple) -> tuple | None:
        new = function(grad_output[0])
        return None if new is None else (new, *grad_output[1:])

    return hook


def _call_hook(function: HookFunction) -> Callable:
    def hook(_module: Any, args: tuple, kwargs: dict) -> None:
        function(args, kwargs)

    return hook


def _register(point: HookPoint, function: HookFunction) -> Any:
    module = point.module
    if point.side == "output":
        return module.register_forward_hook(_output_hook(point, function), with_kwargs=True)
    if point.side == "input":
        return module.register_forward_pre_hook(_input_hook(point, function), with_kwargs=True)
    if point.side == "gradient":
        return module.register_full_backward_pre_hook(_gradient_hook(function))
    if point.side == "call":
        return module.register_forward_pre_hook(_call_hook(function), with_kwargs=True)
    raise ValueError(f"unknown hook side {point.side!r}; choose output, input, gradient or call")


@contextmanager
def hooks(hooked: Iterable[tuple[HookPoint, HookFunction]]) -> Iterator[None]:
    """Register each ``(point, function)`` for the passes run inside the block; every hook is
    removed when the block exits, also when registering, the forward or the backward pass raises.
    Hooks on one module and side run in the order given."""
    handles = []
    try:
        for point, function in hooked:
            handles.append(_register(point, function))
        yield
    finally:
        for handle in reversed(handles):
            handle.remove()


def hooks_on(module: nn.Module) -> int:
    """How many of attnflow's forward, forward-pre and backward hooks ``module`` and its submodules
    hold (transformers keeps hooks of its own, not counted); the leak tests count them."""
    return sum(
        getattr(hook, "__module__", "").startswith("attnflow")
        for part in module.modules()
        for table in (part._forward_hooks, part._forward_pre_hooks, part._backward_hooks, part._backward_pre_hooks)
        for hook in table.values()
    )
