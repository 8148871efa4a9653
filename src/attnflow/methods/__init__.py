"""Attention methods: pure functions on arrays, registered by name (see `registry`)."""

from attnflow.methods.encoder_decoder import encoder_decoder_rollout
from attnflow.methods.flow import attention_flow
from attnflow.methods.registry import MethodSpec, Option, available_methods, get_method, register
from attnflow.methods.relevance import alti, grad_rollout, grad_x_input, gradient, norm, norm_rollout, random
from attnflow.methods.rollout import raw_attention, rollout
from attnflow.methods.saliency import saliency_row, to_patch_grid
from attnflow.methods.similarity import context_similarity

__all__ = [
    "MethodSpec",
    "Option",
    "alti",
    "attention_flow",
    "available_methods",
    "context_similarity",
    "encoder_decoder_rollout",
    "get_method",
    "grad_rollout",
    "grad_x_input",
    "gradient",
    "norm",
    "norm_rollout",
    "random",
    "raw_attention",
    "register",
    "rollout",
    "saliency_row",
    "to_patch_grid",
]
