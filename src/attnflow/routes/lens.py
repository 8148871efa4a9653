"""The logit lens at the nodes of a route, and the direct effects of heads and feed-forward blocks.

- **Lens.** A residual vector x (any node) read as the model reads its last one: the final norm and
  the unembedding, ``logits = W_U final_norm(x)`` (and the model's final soft-capping, where it has
  one), then the softmax: the top tokens, the target's rank and probability. At the top node of
  the last layer this is the model's own output.
- **Direct effect.** A part q that a block writes into the stream at position i reaches the logits
  read at i through the final norm with its statistic fixed at its value on the final residual at
  i: DE(q) = W_U (s_i ⊙ q), s_i = gain / rms(x_i) (RMS norms) or gain / σ(x_i) after
  subtracting q's mean (layer norms). Along one position's stream the direct effects of every part
  (the embedding, every head's part from every source, every bias term, every feed-forward output)
  plus the final norm's shift add up to the logits, before soft-capping and without the
  unembedding's bias. For one token t the effect is a dot product with the *readout field*
  G_i = s_i ⊙ W_U[t] (centred for layer norms): DE_t(q) = G_i · q (`readout_field`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from attnflow.routes.contributions import Norm, centre

LENS_CHUNK = 256  # residual vectors per batch through the unembedding ([chunk, vocabulary] logits)


@dataclass
class Lens:
    """The final norm (its ``module`` and its parameters ``norm``), the ``unembedding`` module
    (its ``weight`` is W_U ``[vocabulary, d]``) and the final soft-capping c (or None)."""

    module: nn.Module
    norm: Norm
    unembedding: nn.Module
    softcap: float | None

    @property
    def vocabulary(self) -> torch.Tensor:
        """``[V, d]`` W_U."""
        return self.unembedding.weight.detach()

    def direction(self, token: int, contrast: int | None = None) -> torch.Tensor:
        """``[d]`` in float64: W_U[token], or W_U[token] − W_U[contrast]."""
        rows = self.vocabulary
        found = rows[token].double()
        return found if contrast is None else found - rows[contrast].double()

    @torch.no_grad()
    def logits(self, vectors: torch.Tensor) -> torch.Tensor:
        """``[N, V]`` the model's logits for residual vectors ``[N, d]`` read as its last one."""
        outputs = []
        for start in range(0, vectors.shape[0], LENS_CHUNK):
            chunk = vectors[start : start + LENS_CHUNK].to(self.vocabulary.dtype)
            logits = self.unembedding(self.module(chunk)).float()
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            outputs.append(logits)
        return torch.cat(outputs)

    def readout_field(self, final: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """``[T, d]`` G_i with DE(q at i) = G_i · q, for a logit direction ``[d]`` (W_U[t], or
        W_U[A] − W_U[B]) and the final residual ``final [T, d]`` that fixes the norm's statistic."""
        field = self.norm.scale(final) * direction
        return centre(field) if self.norm.centres else field

    def shift_effect(self, direction: torch.Tensor) -> float:
        """The final norm's shift β along ``direction``: the non-edge term of every position."""
        return float(self.norm.shift.to(direction.dtype) @ direction)

    @torch.no_grad()
    def token_effects(self, part: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` the direct effect of parts ``[..., d]`` written at positions whose final
        residuals are ``final [..., d]``, on every token's logit."""
        scaled = self.norm.linear(part, self.norm.scale(final))
        return scaled.to(self.vocabulary.dtype) @ self.vocabulary.T


def describe_tokens(tokenizer: Any, ids: Sequence[int], values: Sequence[float], key: str) -> list[dict[str, Any]]:
    """``[{"id", "token", key: value}]`` for token ids and their numbers."""
    return [
        {"id": int(index), "token": tokenizer.decode([int(index)]), key: float(value)}
        for index, value in zip(ids, values, strict=True)
    ]


@torch.no_grad()
def readouts(
    lens: Lens, tokenizer: Any, vectors: torch.Tensor, target: int, contrast: int | None, k: int
) -> list[dict[str, Any]]:
    """For each residual vector ``[N, d]``: its ``k`` top tokens with their probabilities, the
    target's (and the contrast's) rank (0 = the top token), probability and logit."""
    logits = lens.logits(vectors)
    probabilities = logits.softmax(dim=-1)
    top = probabilities.topk(k, dim=-1)
    found = []
    for row in range(vectors.shape[0]):
        entry: dict[str, Any] = {
            "top": describe_tokens(tokenizer, top.indices[row].tolist(), top.values[row].tolist(), "probability")
        }
        for name, index in (("target", target), ("contrast", contrast)):
            if index is not None:
                entry[name] = {
                    "rank": int((logits[row] > logits[row, index]).sum()),
                    "probability": float(probabilities[row, index]),
                    "logit": float(logits[row, index]),
                }
        found.append(entry)
    return found


def promotes(tokenizer: Any, effects: torch.Tensor, k: int) -> dict[str, list[dict[str, Any]]]:
    """The ``k`` tokens a direct effect ``[V]`` raises most and the ``k`` it lowers most (logits)."""
    up, down = effects.topk(k), (-effects).topk(k)
    return {
        "promotes": describe_tokens(tokenizer, up.indices.tolist(), up.values.tolist(), "effect"),
        "suppresses": describe_tokens(tokenizer, down.indices.tolist(), (-down.values).tolist(), "effect"),
    }
