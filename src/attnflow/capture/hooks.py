"""Recording what a forward pass computes, through `attnflow.rows.hook_points.hooks` (registered
inside a `with` block, removed in `finally`): attention weights and head outputs of a stack, any
module's output or input, a layer's call arguments; and finding the modules of a layer pattern."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from attnflow.errors import CaptureError
from attnflow.rows.adapters import Stack, find_layers, layer_index
from attnflow.rows.hook_points import HookPoint, Side, hooks


class StopForward(Exception):
    """Raised by the last hook of a recording that needs nothing after the last attention layer:
    the rest of the forward pass (last output projection, feed-forward, pooler, head) is skipped."""


class MissingWeights(CaptureError):
    """An attention module returned no weights (some families compute them only when the forward
    pass is called with ``output_attentions=True``)."""


# Head fusions a recording can apply inside its hook, layer by layer (`record_stack`'s ``fuse_heads``).
HOOK_FUSIONS = ("mean",)


@dataclass
class StackRecording:
    """What one forward pass left in the hooks of one stack (one entry per layer, by name)."""

    layer_names: list[str]
    # name -> [batch, head, query, key] ([batch, 1, query, key] float32 when the heads are fused in the hook)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    head_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [batch, token, head * d_head]

    def layer_weights(self) -> list[torch.Tensor]:
        """One ``[batch, head, query, key]`` per layer, in order; raises if a layer reported none."""
        missing = [name for name in self.layer_names if name not in self.weights]
        if missing:
            raise CaptureError(
                f"no attention weights were captured for {len(missing)} of {len(self.layer_names)} layers "
                f"(first: {missing[0]}); the model must run eager attention and return its weights"
            )
        return [self.weights[name] for name in self.layer_names]

    def stacked_weights(self) -> torch.Tensor:
        """``[batch, layer, head, query, key]``."""
        return torch.stack(self.layer_weights(), dim=1)

    def stacked_head_outputs(self, n_heads: int) -> torch.Tensor:
        """``[batch, layer, token, head, d_head]`` from the output projections' inputs."""
        missing = [name for name in self.layer_names if name not in self.head_inputs]
        if missing:
            raise CaptureError(f"no head outputs were captured for layer {missing[0]}")
        per_layer = [self.head_inputs[name] for name in self.layer_names]  # [batch, token, head * d_head]
        batch, tokens, width = per_layer[0].shape
        if width % n_heads:
            raise CaptureError(f"output projection input width {width} is not divisible by {n_heads} heads")
        return torch.stack(per_layer, dim=1).reshape(batch, len(per_layer), tokens, n_heads, width // n_heads)


@contextmanager
def record_stack(
    model: nn.Module,
    stack: Stack,
    *,
    head_outputs: bool = True,
    stop_after_last_layer: bool = False,
    fuse_heads: str | None = None,
) -> Iterator[StackRecording]:
    """Record attention weights (the attention modules' outputs) and head outputs (the output
    projections' inputs) of every layer of ``stack`` during the forward passes run inside the block.
    Hooks are removed when the block exits, also when the forward pass raises.

    ``stop_after_last_layer``: once the last layer is recorded, raise `StopForward` so that the
    caller skips the rest of the forward pass (it must catch it; the model's outputs are lost).
    ``fuse_heads`` (``"mean"``, `HOOK_FUSIONS`): keep, per layer, only the heads' mean ``[batch, 1,
    query, key]`` in float32, computed inside the hook: the layer's ``[batch, head, query, key]``
    weights are then free once the layer is done (unless the forward pass keeps them itself: call
    it without ``output_attentions`` where the family returns its weights anyway).
    """
    if fuse_heads is not None and fuse_heads not in HOOK_FUSIONS:
        raise CaptureError(f"heads can be fused in the hook by {', '.join(HOOK_FUSIONS)}, not {fuse_heads!r}")
    attention_layers = find_layers(model, stack.attention, gaps=stack.gaps)
    if not attention_layers:
        raise CaptureError(
            f"{type(model).__name__} has no module matching {stack.attention!r}; "
            "its architecture differs from the adapter table row"
        )
    # Recorded tensors are keyed by module name and ordered by the layer index in that name, never
    # by the order in which hooks were registered or fired.
    names = sorted((name for name, _ in attention_layers), key=lambda name: layer_index(stack.attention, name))
    recording = StackRecording(layer_names=names)
    # The last layer's two hooks can fire in either order (DistilBERT calls its output
    # projection inside the attention module): whichever completes the layer stops.
    stop = _stop_when_complete(recording, names[-1], head_outputs) if stop_after_last_layer else _never
    hooked: list[tuple[HookPoint, Callable]] = [
        (
            HookPoint(module, "output", index=stack.weights_index, name=name),
            _weights_hook(recording, name, stop, type(module).__name__, fuse_heads),
        )
        for name, module in attention_layers
    ]
    if head_outputs:
        projections = find_layers(model, stack.output_projection, gaps=stack.gaps)
        if len(projections) != len(attention_layers):
            raise CaptureError(
                f"found {len(projections)} output projections for {len(attention_layers)} attention layers "
                f"({stack.output_projection!r})"
            )
        by_index = {layer_index(stack.output_projection, name): module for name, module in projections}
        for name in names:
            projection = by_index[layer_index(stack.attention, name)]
            hooked.append((HookPoint(projection, "input", name=name), _input_hook(recording, name, stop)))
    with hooks(hooked):
        yield recording


def _never() -> None:
    pass


def _stop_when_complete(recording: StackRecording, last: str, head_outputs: bool) -> Callable[[], None]:
    def stop() -> None:
        if last in recording.weights and (not head_outputs or last in recording.head_inputs):
            raise StopForward

    return stop


def _weights_hook(
    recording: StackRecording, name: str, stop: Callable[[], None], module_type: str, fuse_heads: str | None = None
) -> Callable:
    def hook(weights: Any) -> None:
        if weights is None or not torch.is_tensor(weights) or weights.dim() != 4:
            raise MissingWeights(
                f"{module_type} at {name} returned no attention weights; attnflow needs "
                "eager attention (attn_implementation='eager') and a model that returns its weights"
            )
        recording.weights[name] = weights if fuse_heads is None else head_mean(weights.detach())
        stop()

    return hook


def _input_hook(recording: StackRecording, name: str, stop: Callable[[], None]) -> Callable:
    def hook(heads: torch.Tensor) -> None:
        recording.head_inputs[name] = heads
        stop()

    return hook


def head_mean(weights: torch.Tensor) -> torch.Tensor:
    """``[batch, head, query, key]`` softmax weights -> the heads' mean ``[batch, 1, query, key]``,
    accumulated in float32 without a float32 copy of every head; a 16-bit model's rows are divided
    by their sums (`float_weights`), so that they sum to 1."""
    fused = weights.mean(dim=1, keepdim=True, dtype=torch.float32)
    if weights.dtype == torch.float32:
        return fused
    return fused / fused.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def float_weights(weights: torch.Tensor) -> torch.Tensor:
    """Softmax weights ``[..., query, key]`` in float32. A 16-bit model's rows (each weight rounded
    to 8 or 11 significant bits) sum to 1 only within a few 0.1 % (bfloat16): they are divided by
    their float32 sums, so every captured row sums to 1 as the methods expect; float32 weights are
    returned as they are."""
    if weights.dtype == torch.float32:
        return weights
    wide = weights.detach().float()
    return wide / wide.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


@contextmanager
def record_tensors(
    modules: list[tuple[str, nn.Module]], *, inputs: bool = False, copies: bool = False
) -> Iterator[dict[str, torch.Tensor]]:
    """Record each module's output (or, with ``inputs``, its hidden-states input: the forward's
    first argument) by module name, during the forward passes run inside the block. The tensors stay
    in the autograd graph; with ``copies`` (readers that take no gradient) they are copies instead,
    for a model may change an output in place after its hook (Falcon adds the attention output into
    the MLP's with ``+=``). Hooks are removed on exit."""
    recorded: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable:
        def hook(tensor: Any) -> None:
            if not torch.is_tensor(tensor):
                raise CaptureError(f"{name}: found no hidden-states tensor to record")
            recorded[name] = tensor.clone() if copies else tensor

        return hook

    side: Side = "input" if inputs else "output"
    with hooks((HookPoint(module, side, name=name), keep(name)) for name, module in modules):
        yield recorded


def stack_recorded(recorded: dict[str, torch.Tensor], modules: list[tuple[str, nn.Module]]) -> torch.Tensor:
    """``[batch, layer, ...]``: the recorded tensors in layer order; raises if a layer is missing."""
    missing = [name for name, _ in modules if name not in recorded]
    if missing:
        raise CaptureError(f"nothing was recorded at {missing[0]} during the forward pass")
    return torch.stack([recorded[name] for name, _ in modules], dim=1)


@contextmanager
def record_calls(modules: list[tuple[str, nn.Module]]) -> Iterator[dict[str, tuple[tuple, dict]]]:
    """Record each module's call arguments ``(args, kwargs)`` by module name, so that a method
    can call the module again on altered inputs (value zeroing reruns single layers)."""
    recorded: dict[str, tuple[tuple, dict]] = {}

    def keep(name: str) -> Callable:
        def hook(args: tuple, kwargs: dict) -> None:
            recorded[name] = (args, dict(kwargs))

        return hook

    with hooks((HookPoint(module, "call", name=name), keep(name)) for name, module in modules):
        yield recorded
