"""Context similarity matrices (docs/methods.md, "Context similarity").

For layer l and head h let Zₗₕ ∈ ℝⁿˣᵈʰ be that head's attention output softmax(QKᵀ/√d)V
(taken before the output projection). The context similarity matrix is the plain dot product
Sₗₕ = Zₗₕ Zₗₕᵀ (not cosine) with its diagonal set to 0. ``space="projected"`` uses each head's
contribution to the residual stream, Zₗₕ W_Oʰ, instead: Sₗₕ = Zₗₕ W_Oʰ (W_Oʰ)ᵀ Zₗₕᵀ.

Works on numpy arrays and torch tensors, one sample or a batch, with no Python loop over layers
or heads.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from attnflow.errors import InputError

Space = Literal["head", "projected"]
SPACES = ("head", "projected")


def _is_torch(array: Any) -> bool:
    return hasattr(array, "detach") and hasattr(array, "device")


def context_similarity(
    head_outputs_or_trace: Any,
    space: Space = "head",
    output_weights: Any = None,
) -> Any:
    """Per-head context similarity S = Z Zᵀ with a zero diagonal.

    Args:
        head_outputs_or_trace: a `Trace` (its ``head_outputs`` and, for ``space="projected"``,
            its ``output_weights`` are used), or per-head outputs ``[layer, token, head, d_head]``,
            or a batch ``[batch, layer, token, head, d_head]`` (numpy or torch).
        space: ``"head"`` (default): Z is the head's output before the output projection;
            ``"projected"``: Z W_Oʰ, the head's slice of the output projection applied.
        output_weights: ``[layer, head, d_head, d_model]`` slices of W_O (row vectors: the
            head's output ``z`` maps to ``z @ W_Oʰ``); required for ``space="projected"`` unless
            a Trace carrying them is given (an explicit argument overrides the Trace's).

    Returns:
        ``[layer, head, token, token]`` (batched: ``[batch, layer, head, token, token]``),
        symmetric, diagonal 0. numpy in: float64 numpy out. torch in: a tensor of the input's
        floating dtype on the input's device (``output_weights`` are moved there).

    Raises:
        ValueError: unknown ``space``, missing head outputs or output weights, shapes that do
            not fit together.
    """
    if space not in SPACES:
        raise InputError(f"space must be one of {SPACES}, got {space!r}")
    head_outputs = head_outputs_or_trace
    if hasattr(head_outputs_or_trace, "attentions") and hasattr(head_outputs_or_trace, "tokens"):
        trace = head_outputs_or_trace
        if trace.head_outputs is None:
            raise InputError("the trace has no head_outputs; capture them to compute context similarity")
        head_outputs = trace.head_outputs
        if output_weights is None:
            output_weights = trace.output_weights
    if head_outputs is None or head_outputs.ndim not in (4, 5):
        shape = None if head_outputs is None else tuple(head_outputs.shape)
        raise InputError(
            "head_outputs must be [layer, token, head, d_head] or "
            f"[batch, layer, token, head, d_head]; got shape {shape}"
        )
    if _is_torch(head_outputs):
        return _similarity_torch(head_outputs, space, output_weights)
    return _similarity_numpy(np.asarray(head_outputs, dtype=np.float64), space, output_weights)


def _check_output_weights(head_shape: tuple[int, ...], weights_shape: tuple[int, ...] | None) -> None:
    """``head_shape`` is ``[..., layer, token, head, d_head]``; W_O must be ``[layer, head, d_head, d_model]``."""
    if weights_shape is None:
        raise InputError('space="projected" needs output_weights [layer, head, d_head, d_model]')
    n_layers, _, n_heads, d_head = head_shape[-4:]
    if len(weights_shape) != 4 or tuple(weights_shape[:3]) != (n_layers, n_heads, d_head):
        raise InputError(
            f"output_weights must be [layer={n_layers}, head={n_heads}, d_head={d_head}, d_model]; "
            f"got {tuple(weights_shape)}"
        )


def _similarity_numpy(head_outputs: np.ndarray, space: str, output_weights: Any) -> np.ndarray:
    z = np.moveaxis(head_outputs, -2, -3)  # [..., layer, head, token, d_head]
    z_t = np.swapaxes(z, -1, -2)  # [..., layer, head, d_head, token]
    if space == "projected":
        _check_output_weights(head_outputs.shape, None if output_weights is None else np.shape(output_weights))
        w_o = np.asarray(output_weights, dtype=np.float64)  # [layer, head, d_head, d_model]
        gram = w_o @ np.swapaxes(w_o, -1, -2)  # W_Oʰ W_Oʰᵀ: [layer, head, d_head, d_head]
        similarity = (z @ gram) @ z_t
    else:
        similarity = z @ z_t  # [..., layer, head, token, token]
    n = similarity.shape[-1]
    similarity[..., np.arange(n), np.arange(n)] = 0.0
    return similarity


def _similarity_torch(head_outputs: Any, space: str, output_weights: Any) -> Any:
    import torch

    if not head_outputs.is_floating_point():
        head_outputs = head_outputs.double()
    z = head_outputs.movedim(-2, -3)  # [..., layer, head, token, d_head]
    z_t = z.transpose(-1, -2)  # [..., layer, head, d_head, token]
    if space == "projected":
        _check_output_weights(
            tuple(head_outputs.shape), None if output_weights is None else tuple(output_weights.shape)
        )
        w_o = torch.as_tensor(output_weights).to(device=head_outputs.device, dtype=head_outputs.dtype)
        gram = w_o @ w_o.transpose(-1, -2)  # W_Oʰ W_Oʰᵀ: [layer, head, d_head, d_head]
        similarity = (z @ gram) @ z_t
    else:
        similarity = z @ z_t  # [..., layer, head, token, token]
    similarity.diagonal(dim1=-2, dim2=-1).zero_()
    return similarity
