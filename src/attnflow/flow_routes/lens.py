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
  plus the final norm's shift and the unembedding's bias (Phi's) add up to the logits before
  soft-capping. Gemma 2's final soft-capping c·tanh(z / c) is applied by the lens where it reads
  logits (`Lens.logits`: at the top node, the model's own logits) but not to direct effects, which
  are linear in the parts: they add up to z, the logits before the cap. For one token t the
  effect is a dot product with the *readout field* G_i = s_i ⊙ W_U[t] (centred for layer norms):
  DE_t(q) = G_i · q (`readout_field`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from attnflow.flow_routes.contributions import Norm, centre

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

    def shift_effect(self, token: int, contrast: int) -> float:
        """The non-edge term of logit(token) − logit(contrast) at every position: the final norm's
        shift β along W_U[token] − W_U[contrast], plus the unembedding's bias difference (Phi's
        language-model head has a bias)."""
        direction = self.direction(token, contrast)
        bias = getattr(self.unembedding, "bias", None)
        offset = 0.0 if bias is None else float(bias[token].detach() - bias[contrast].detach())
        return float(self.norm.shift.to(direction.dtype) @ direction) + offset

    @torch.no_grad()
    def token_effects(self, part: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` the direct effect of parts ``[..., d]`` written at positions whose final
        residuals are ``final [..., d]``, on every token's logit."""
        scaled = self.norm.linear(part, self.norm.scale(final))
        return scaled.to(self.vocabulary.dtype) @ self.vocabulary.T


def decoded(tokenizer: Any, id_lists: Sequence[Sequence[int]]) -> dict[int, str]:
    """Each distinct token id of ``id_lists`` -> its text, decoded once."""
    return {index: tokenizer.decode([index]) for index in {i for ids in id_lists for i in ids}}


@torch.no_grad()
def readouts(
    lens: Lens, tokenizer: Any, vectors: torch.Tensor, target: int, contrast: int | None, k: int
) -> list[dict[str, Any]]:
    """For each residual vector ``[N, d]``: its ``k`` top tokens with their probabilities, the
    target's (and the contrast's) rank (0 = the top token), probability and logit.

    Every node goes through the final norm and the unembedding in one matrix product per chunk of
    `LENS_CHUNK` vectors; the ranks, probabilities and top tokens are reduced over the vocabulary
    on the whole chunk at once, and each distinct token is decoded once."""
    tracked = [index for index in (target, contrast) if index is not None]
    rows: dict[str, list] = {"top_ids": [], "top_p": [], "rank": [], "p": [], "logit": []}
    for start in range(0, vectors.shape[0], LENS_CHUNK):
        logits = lens.logits(vectors[start : start + LENS_CHUNK])  # [n, V]
        probabilities = logits.softmax(dim=-1)
        top = probabilities.topk(k, dim=-1)
        picked = logits[:, tracked]  # [n, tracked]
        ranks = [(logits > picked[:, [n]]).sum(dim=-1, dtype=torch.int32) for n in range(len(tracked))]
        rows["top_ids"] += top.indices.tolist()
        rows["top_p"] += top.values.tolist()
        rows["rank"] += torch.stack(ranks, dim=1).tolist()
        rows["p"] += probabilities[:, tracked].tolist()
        rows["logit"] += picked.tolist()
    names = decoded(tokenizer, rows["top_ids"])
    found = []
    for row, ids in enumerate(rows["top_ids"]):
        top_tokens = [
            {"id": index, "token": names[index], "probability": p}
            for index, p in zip(ids, rows["top_p"][row], strict=True)
        ]
        entry: dict[str, Any] = {"top": top_tokens}
        for n, name in enumerate(("target", "contrast")[: len(tracked)]):
            entry[name] = {
                "rank": rows["rank"][row][n],
                "probability": rows["p"][row][n],
                "logit": rows["logit"][row][n],
            }
        found.append(entry)
    return found


@torch.no_grad()
def promotes(tokenizer: Any, effects: torch.Tensor, k: int) -> list[dict[str, list[dict[str, Any]]]]:
    """For each direct effect ``[N, V]`` (one row per part): the ``k`` tokens it raises most and
    the ``k`` it lowers most, with their effects (logits), from one top-k each way."""
    up, down = effects.topk(k, dim=-1), (-effects).topk(k, dim=-1)
    ids = {"promotes": up.indices.tolist(), "suppresses": down.indices.tolist()}
    values = {"promotes": up.values.tolist(), "suppresses": (-down.values).tolist()}
    names = decoded(tokenizer, ids["promotes"] + ids["suppresses"])
    return [
        {
            way: [
                {"id": index, "token": names[index], "effect": value}
                for index, value in zip(ids[way][row], values[way][row], strict=True)
            ]
            for way in ids
        }
        for row in range(effects.shape[0])
    ]
