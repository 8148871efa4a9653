"""Value zeroing's independent oracle: full forward passes of the model, one per (layer, token), each
with that token's value features zeroed at that layer's value projection (plain torch hooks)."""

from __future__ import annotations

import numpy as np
import torch


def value_zeroing_matrices(hf_model, ids, blocks, values, columns: slice = slice(None)) -> list[np.ndarray]:
    """Per layer ``[n, n]``: 1 − cos(block output at i, the same with token j's value features
    ``columns`` of ``values[layer]``'s output zeroed), rows normalised. ``blocks`` and ``values``:
    the layers' modules in order; ``ids [1, n]``."""

    def block_output(layer: int, zeroed: int | None = None) -> torch.Tensor:
        recorded = {}

        def keep(_module, _inputs, output):
            recorded["out"] = output[0] if isinstance(output, tuple) else output

        def zero(_module, _inputs, output):
            output = output.clone()
            output[:, zeroed, columns] = 0.0  # [batch, token, features]
            return output

        handles = [blocks[layer].register_forward_hook(keep)]
        if zeroed is not None:
            handles.append(values[layer].register_forward_hook(zero))
        try:
            with torch.no_grad():
                hf_model(input_ids=ids)
        finally:
            for handle in handles:
                handle.remove()
        return recorded["out"][0].double()

    n = ids.shape[1]
    matrices = []
    for layer in range(len(blocks)):
        original = block_output(layer)
        matrix = np.zeros((n, n))
        for j in range(n):
            cosine = torch.nn.functional.cosine_similarity(original, block_output(layer, j), dim=-1)
            matrix[:, j] = (1 - cosine).clamp(min=0).numpy()
        matrices.append(matrix / matrix.sum(axis=1, keepdims=True))
    return matrices
