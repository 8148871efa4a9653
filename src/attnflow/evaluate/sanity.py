"""Cascading model-parameter randomisation (Adebayo et al. 2018, "Sanity checks for saliency maps").

The classifier's head is re-initialised first, then its transformer blocks one by one from the top
down, cumulatively; after each stage the same inputs are explained again (same target class) and
compared with the original explanation by Spearman's rho on the content tokens. A method whose
maps barely change when the weights they claim to explain are destroyed does not explain the model:
it is flagged when the mean rho after the last stage (everything above the embeddings random)
stays at or above `FLAG_RHO`.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from attnflow.errors import InputError
from attnflow.model_like import ModelLike

FLAG_RHO = 0.5
HEAD_NAMES = ("head", "classifier", "score", "lm_head")  # PooledClassifier, *ForSequenceClassification, LMs


def randomisation_stages(model: ModelLike) -> list[tuple[str, str]]:
    """``(stage label, module name)`` in cascade order: the head, then the blocks top-down.

    A block is the numbered ancestor of each attention layer the model's adapter names
    (``encoder.layer.3.attention.self`` -> ``encoder.layer.3``: attention and feed-forward).
    """
    names = dict(model.hf_model.named_modules())
    head = next((name for name in HEAD_NAMES if name in names), None)
    if head is None:
        raise InputError(f"model {model.name!r}: no classifier head module ({', '.join(HEAD_NAMES)}) to randomise")
    blocks = [_block_of(layer) for layer in model.layer_names]
    stages = [("head", head)]
    stages += [(f"layer {index}", block) for index, block in reversed(list(enumerate(blocks)))]
    return stages


def _block_of(layer_name: str) -> str:
    parts = layer_name.split(".")
    numbered = [index for index, part in enumerate(parts) if part.isdigit()]
    if not numbered:
        raise InputError(f"cannot tell which transformer block holds the attention layer {layer_name!r}")
    return ".".join(parts[: numbered[-1] + 1])


def reinitialise(module: nn.Module, generator: torch.Generator, std: float) -> None:
    """Fresh weights: linear and embedding weights ~ N(0, std), biases 0, LayerNorm 1/0."""
    with torch.no_grad():
        for part in module.modules():
            if isinstance(part, (nn.Linear, nn.Embedding)):
                part.weight.copy_(torch.randn(part.weight.shape, generator=generator) * std)
                if getattr(part, "bias", None) is not None:
                    part.bias.zero_()
            elif isinstance(part, nn.LayerNorm):
                part.weight.fill_(1.0)
                part.bias.zero_()


def shown_stages(n_stages: int, layers: int | None) -> list[int]:
    """Indices of the stages re-explained: the head (0) and ``layers`` of the ``n_stages − 1`` layer
    stages, evenly spaced from the top layer to the last stage (everything random); all for None."""
    if layers is None or layers >= n_stages - 1:
        return list(range(n_stages))
    return [0, *sorted({round(float(i)) for i in np.linspace(n_stages - 1, 1, layers)})]


def cascade(model: ModelLike, seed: int = 0, layers: int | None = None) -> Iterator[tuple[str, Any]]:
    """Yield ``(stage label, randomised AttentionModel)`` cumulatively; the original is untouched
    (one deep copy of the module is randomised step by step). Every stage is randomised; only those
    `shown_stages` picks (``layers``) are yielded. A head that shares its weights with the input
    embeddings (tied language-model heads) is untied in the copy first, so the embeddings stay."""
    from attnflow.model import AttentionModel

    stages = randomisation_stages(model)
    module = copy.deepcopy(model.hf_model).cpu()
    parts = dict(module.named_modules())
    head = parts[stages[0][1]]
    embeddings = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    if embeddings is not None and getattr(head, "weight", None) is embeddings.weight:
        head.weight = nn.Parameter(head.weight.detach().clone())
    generator = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    shown = set(shown_stages(len(stages), layers))
    for number, (label, name) in enumerate(stages):
        reinitialise(parts[name], generator, std)
        if number not in shown:
            continue
        randomised = AttentionModel(
            module,
            model.tokenizer,
            name=f"{model.name} ({label} and above random)",
            adapter=model.adapter,
            device=model.device,
        )
        randomised.default_row = model.default_row
        yield label, randomised
