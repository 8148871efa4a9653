"""Encoder-decoder rollout: how much each decoder position draws on each encoder token.

The rule (docs/methods.md), exactly as implemented:

* ``R_enc = rollout(encoder self-attention)`` — ``[enc, enc]``;
* ``R_dec⁽ˡ⁾ = Ã_dec⁽ˡ⁾ ⋯ Ã_dec⁽⁰⁾`` — decoder self-attention rollout through layer l
  (layerwise, same head fusion and residual), ``[dec, dec]``;
* ``C⁽ˡ⁾`` — layer l's cross-attention fused over heads (no residual: a decoder query has no
  encoder position of its own), ``[dec, enc]``;
* ``R_dec→enc = normalise_rows(Σₗ R_dec⁽ˡ⁾ C⁽ˡ⁾ R_enc)`` — ``[dec, enc]``, rows sum to 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from attnflow.errors import InputError
from attnflow.methods.rollout import rollout
from attnflow.methods.transforms import HeadFusion, Residual, fuse_heads, normalise_rows, validate_attentions


@dataclass
class EncoderDecoderRollout:
    """Rollout of an encoder-decoder: within the encoder, within the decoder, and from each decoder
    position to the encoder tokens."""

    encoder: np.ndarray  # [enc, enc]
    decoder: np.ndarray  # [dec, dec]
    decoder_to_encoder: np.ndarray  # [dec, enc]


def encoder_decoder_rollout(
    encoder_attentions: Any,
    decoder_attentions: Any,
    cross_attentions: Any,
    head_fusion: HeadFusion = "mean",
    residual: Residual = "half",
) -> EncoderDecoderRollout:
    """Rollout over an encoder-decoder model (rule in the module docstring).

    Args:
        encoder_attentions: ``[layer, head, enc, enc]``.
        decoder_attentions: ``[layer, head, dec, dec]`` (causal).
        cross_attentions: ``[layer, head, dec, enc]``; same layer count as the decoder.
    """
    encoder = rollout(encoder_attentions, head_fusion=head_fusion, residual=residual)
    decoder_layers = rollout(decoder_attentions, head_fusion=head_fusion, residual=residual, layerwise=True)
    cross = np.asarray(cross_attentions, dtype=np.float64)
    if cross.ndim != 4 or cross.shape[0] != decoder_layers.shape[0]:
        raise InputError(
            f"cross_attentions must be [layer, head, dec, enc] with {decoder_layers.shape[0]} layers, got {cross.shape}"
        )
    if cross.shape[2:] != (decoder_layers.shape[-1], encoder.shape[-1]):
        raise InputError(
            f"cross_attentions maps are {cross.shape[2:]}, expected (dec, enc) = "
            f"({decoder_layers.shape[-1]}, {encoder.shape[-1]})"
        )
    validate_attentions(cross, square=False)  # softmax rows over encoder keys
    fused_cross = fuse_heads(cross, head_fusion)  # [layer, dec, enc]
    mixed = np.einsum("lij,ljk->ik", decoder_layers, fused_cross) @ encoder  # Σₗ R_dec⁽ˡ⁾ C⁽ˡ⁾ R_enc
    return EncoderDecoderRollout(encoder, decoder_layers[-1], normalise_rows(mixed))
