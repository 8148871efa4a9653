"""The `Trace`: everything one forward pass revealed about one input, as plain arrays.

A Trace is produced by `attnflow.capture` and consumed by `attnflow.methods`; it never holds a
model. Padding has already been removed, so every axis named ``token``/``query``/``key`` has
length ``n`` = the number of real tokens (special tokens included).

Optional fields are ``None`` when not captured. What a trace holds is chosen by *needs*: each
registered method declares the names it needs (`NEEDS`), and ``AttentionModel.trace(texts,
needs=..., target=...)`` captures exactly those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# What a method can need from a forward pass (`MethodSpec.needs`; `AttentionModel.trace(needs=)`):
NEEDS = {
    "attentions": "softmax weights [layer, head, query, key] (always captured)",
    "head_outputs": "per-head attention outputs [layer, token, head, d_head]",
    "output_weights": "each head's slice of the output projection [layer, head, d_head, d_model], its bias and "
    "any norm after it (output_norms)",
    "values": "per-head value vectors [layer, token, head, d_head]",
    "layer_inputs": "the residual stream entering each attention block [layer, token, d_model]",
    "layer_norms": "post-LN models: the layer norm after each attention block (weight, bias, eps)",
    "attention_grads": "d(target)/d(attention weights) [layer, head, query, key]",
    "embedding_grads": "the token embeddings [token, d_model] and d(target)/d(embeddings)",
    "target": "the scalar the explanation is about (class logit, next-token log-prob, similarity)",
    "model": "the method re-runs the model (perturbations, integrated gradients)",
}
# The array fields a trace may hold (what its repr and notebook view list by shape).
ARRAY_FIELDS = (
    "attentions", "head_outputs", "output_weights", "values", "layer_inputs", "attention_grads", "embeddings",
    "embedding_grads", "decoder_attentions", "cross_attentions", "head_factors",
)  # fmt: skip
# What a model family can provide (`Adapter.provides`); a method requires a subset (`MethodSpec.requires`).
CAPABILITIES = {
    "text_target": "a differentiable text model with a target: a class, a next token or a similarity",
    "values": "value projections and the layers around them",
    "post_norm": "a layer norm right after each attention block (post-LN)",
    "query_key": "query and key projections, or the attention scores they meet in",
    "gated_mlp": "a gated MLP",
    "sites": "patching sites: the residual stream, attention and MLP outputs per layer",
    "streams": "the residual stream after each attention block, value vectors and the norms information-flow "
    "routes linearise",
    "norms": "every norm module and its form (layer or RMS), declared",
    "experts": "a mixture of experts: its router, its fused expert parameters and any shared expert",
    "attention_mixing": "attention as every layer's only token mixer (not a hybrid stack with state-space, "
    "recurrent or linear-attention layers)",
}
# The needs that come from a backward pass, and those that need a target (y) at all.
GRADIENT_NEEDS = frozenset({"attention_grads", "embedding_grads"})
TARGET_NEEDS = GRADIENT_NEEDS | {"target"}


def crop_field(name: str, array: np.ndarray, n: int, copy: bool = True) -> np.ndarray:
    """One sample's captured array (field ``name``) cut to its first ``n`` tokens: ``[layer, head,
    n, n]`` maps, ``[layer, n, ...]`` per-layer token arrays, ``[n, d_model]`` embeddings. A copy,
    so a Trace never keeps the batch alive; ``copy=False`` (a batch of one sample, which the trace
    may keep): a view."""
    if name in ("attentions", "attention_grads"):
        cropped = array[:, :, :n, :n]
    elif name in ("embeddings", "embedding_grads"):
        cropped = array[:n]
    else:
        cropped = array[:, :n]
    return cropped.copy() if copy else cropped


@dataclass
class Trace:
    """Captured attention of one input.

    Attributes:
        tokens: ``n`` token strings as the tokenizer spells them (``["[CLS]", "the", ...]``).
        token_ids: ``[n]`` int64 vocabulary ids (``-1`` for image patches).
        offsets: ``[n, 2]`` character spans ``(start, end)`` into ``text``; ``(0, 0)`` for special
            tokens and image patches.
        special_mask: ``[n]`` bool, True for special tokens ([CLS], [SEP], <s>, BOS, ...).
        attentions: ``[layer, head, query, key]`` float32 softmax weights; rows sum to 1 (a model
            run in 16 bits: each row divided by its float32 sum). A head-fused capture
            (``fuse_heads="mean"``, ``meta["fused_heads"]``) holds the heads' mean, ``[layer, 1,
            query, key]``.
        head_outputs: ``[layer, token, head, d_head]`` float32 per-head attention outputs
            softmax(QK^T/sqrt(d))V, taken at the input of the output projection; or None.
        text: the raw input text ("" for images).
        model_name: what `attnflow.load` was given.
        layer_names: ``L`` module paths of the attention layers, in order (gradients and other
            per-layer data are keyed by these names, never by list position).
        grid: ``(rows, cols)`` of the patch grid for vision models, else None.
        n_prefix_tokens: tokens before the first patch for vision models (CLS, distillation,
            registers); 0 for text.
        output_weights: ``[layer, head, d_head, d_model]`` float32 slices of each layer's output
            projection W_O (shared between traces of one model, not copied), or None.
        decoder_tokens / decoder_attentions / cross_attentions: for encoder-decoder models, the
            decoder side: ``[layer, head, dec_query, dec_key]`` and
            ``[layer, head, dec_query, enc_key]``; None otherwise.
        attention_grads: ``[layer, head, query, key]`` d(target)/dA, or None.
        values: ``[layer, token, head, d_head]`` per-head value vectors x W_V + b_V (grouped-query
            models: each query head's shared value head), or None.
        head_factors: families whose heads are A·V times a per-position factor
            (`attnflow.rows.adapters.Values.head_factor`: a gate, a sink's rescaling), captured with
            ``values``: ``[layer, token, head, d_head]`` D, the output projection's input over A·V
            at each query position (`attnflow.rows.adapters.head_factor`); None for the others.
        layer_inputs: ``[layer, token, d_model]`` the residual stream entering each attention
            block (the layer's input), or None.
        output_bias: ``[layer, d_model]`` bias of each output projection (zeros when it has
            none), captured with ``output_weights``, or None.
        layer_norms: post-LN models, the layer norm after each attention block:
            ``{"weight": [layer, d_model], "bias": [layer, d_model], "eps": float}``, or None.
        output_norms: families with a norm between the output projection and the residual
            addition (Gemma 2/3's sandwich norm, OLMo-2's post-norm), captured with
            ``output_weights``: ``{"kind": "layer" | "rms", "gain": [layer, d_model], "shift":
            [layer, d_model], "eps": float}`` (the gain holds any offset, Gemma's 1 + w; the shift
            is zeros for an RMS norm), or None.
        embeddings / embedding_grads: ``[token, d_model]`` the word embeddings the model read
            and d(target)/d(embeddings), or None.
        target: the `attnflow.targets.ResolvedTarget` explained (kind, index, label, value), or None.
        request: the `attnflow.targets.Target` still to resolve, for a trace captured without a
            forward pass (``attentions`` then ``[0, 0, n, n]``: methods that re-run the model and
            explain a target need only the tokens, and resolve the target in their own passes,
            `resolved`); None otherwise.
        meta: free-form extras (e.g. the image path); ``meta["notes"]``: what capture warned
            about (truncation, mostly unknown tokens, RGB conversion), carried into Explanations;
            ``meta["dtype"]``: the precision of a model run in 16 bits (``"bfloat16"``); absent for
            float32.
    """

    tokens: list[str]
    token_ids: np.ndarray
    offsets: np.ndarray
    special_mask: np.ndarray
    attentions: np.ndarray
    head_outputs: np.ndarray | None = None
    text: str = ""
    model_name: str = ""
    layer_names: list[str] = field(default_factory=list)
    grid: tuple[int, int] | None = None
    n_prefix_tokens: int = 0
    output_weights: np.ndarray | None = None
    decoder_tokens: list[str] | None = None
    decoder_attentions: np.ndarray | None = None
    cross_attentions: np.ndarray | None = None
    attention_grads: np.ndarray | None = None
    values: np.ndarray | None = None
    head_factors: np.ndarray | None = None
    layer_inputs: np.ndarray | None = None
    output_bias: np.ndarray | None = None
    layer_norms: dict[str, Any] | None = None
    output_norms: dict[str, Any] | None = None
    embeddings: np.ndarray | None = None
    embedding_grads: np.ndarray | None = None
    target: Any = None
    request: Any = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if self.attentions.ndim != 4 or self.attentions.shape[2:] != (n, n):
            raise ValueError(
                f"attentions must be [layer, head, {n}, {n}] for {n} tokens, got {tuple(self.attentions.shape)}"
            )
        if self.head_outputs is not None and self.head_outputs.shape[:2] != (
            self.attentions.shape[0],
            n,
        ):
            raise ValueError(
                "head_outputs must be [layer, token, head, d_head] with "
                f"layer={self.attentions.shape[0]}, token={n}; got {tuple(self.head_outputs.shape)}"
            )

    def __repr__(self) -> str:
        """One line (the arrays are for the methods): the model, the text, the size, the captured
        fields by shape and the target."""
        from attnflow.notebook import compact_repr

        arrays = {name: getattr(self, name) for name in ARRAY_FIELDS if getattr(self, name) is not None}
        target = getattr(self.target, "label", None) if self.target is not None else None
        return compact_repr(
            "Trace",
            {"model": self.model_name, "text": self.text, "n_tokens": self.n_tokens, **arrays, "target": target},
        )

    def _repr_html_(self) -> str:
        """In a notebook: the tokens, the captured fields with their shapes and the target."""
        from attnflow.notebook import view

        return view("trace", self)

    def resolved(self, target: Any) -> None:
        """Record the target a method resolved in its own passes for a trace whose target was still
        to resolve (``request``); a trace that already has its target keeps it."""
        if self.target is None:
            self.target, self.request = target, None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_layers(self) -> int:
        return int(self.attentions.shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.attentions.shape[1])

    def require(self, *names: str, method: str = "this method") -> None:
        """Raise a clear ValueError if any of the named fields was not captured."""
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise ValueError(
                f"{method} needs {', '.join(missing)} in the trace; capture them with "
                f"model.trace(texts, needs=...) or use model.explain(text, method=...)"
            )

    def captured(self, name: str, method: str = "this method") -> Any:
        """The field ``name``, raising the clear ValueError of `require` when it was not captured."""
        self.require(name, method=method)
        return getattr(self, name)

    def save(self, path: str) -> None:
        """Write the arrays to an ``.npz`` (``attentions`` float32 ``[L,H,n,n]``, ``tokens``, and
        ``head_outputs`` / ``attention_grads`` float32 ``[L,H,n,n]`` when captured)."""
        arrays: dict[str, Any] = {
            "attentions": self.attentions.astype(np.float32),
            "tokens": np.array(self.tokens, dtype=object).astype(str),
            "token_ids": self.token_ids,
            "offsets": self.offsets,
            "special_mask": self.special_mask,
        }
        if self.head_outputs is not None:
            arrays["head_outputs"] = self.head_outputs.astype(np.float32)
        if self.attention_grads is not None:
            arrays["attention_grads"] = self.attention_grads.astype(np.float32)
        np.savez_compressed(path, **arrays)
