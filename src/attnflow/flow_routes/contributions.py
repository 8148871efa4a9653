"""How much each part of a residual update contributes to the whole (definitions: docs/routes.md).

proximity(part, whole) = max(‖whole‖_p − ‖whole − part‖_p, 0), normalised over all the parts of
that whole (they sum to 1). Two wholes per layer l and position i:

- the stream after the attention block, whose parts are the stream before it (the residual), one
  part per (head h, source j): A_h[i, j] · v_h(j) W_O^h, and the non-edge bias term (the output
  projection's bias; post-LN families also the norm's shift β);
- the stream after the feed-forward block, whose parts are the stream before it, the block's
  output and (post-LN families) the norm's shift β; for a mixture of experts, the block's output
  is split further: one part per chosen expert, g_k · E_{i_k}(x), and the shared expert's part.

A row whose heads are A·V times a per-position factor D (`attnflow.rows.adapters.Values.head_factor`:
a sigmoid gate, a sink's rescaling) has the (head h, source j) part A_h[i, j] · (D_i^h ⊙ v_h(j)) W_O^h:
no longer one vector per source but one per (query, source) pair (`QueryVectors`), T² per head
(the kernel builds them a block of queries at a time, so memory stays O(T·H·d) per query).

A parallel block (`attnflow.rows.Streams.parallel`: attention and feed-forward both read the
stream x entering the layer) has one whole, the stream leaving it: its parts are x, every (head,
source) part, the bias term and the feed-forward output.

A norm that reads a sum of parts is linearised with its statistic fixed at its value on this input
(`Linearised`): each part p becomes c_i ⊙ p (RMS norms, c_i = gain / rms(y_i)) or c_i ⊙ (p −
mean(p)) (layer norms, c_i = gain / σ(y_i)), so the parts and the bias terms add up to the whole
exactly. Arrays are torch tensors, float64 in `attnflow.flow_routes.api` (a proximity is a difference of
two close norms); the proximities of the (head, source) parts, the bulk of the work, come from one
compiled kernel that never holds the ``[query, key, head, d_model]`` decomposition
(`head_proximities`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import torch

from attnflow.errors import CaptureError

NORMS = (1, 2)  # the p of the proximity's norm ‖·‖_p: 1 is Ferrando & Voita's
TOLERANCE = 1e-3  # the largest error, relative to the whole's largest entry, of the sum of the parts (float32)
# 16 bits: the model rounds every stream and part to its precision, so the parts recomputed from
# them miss its sum by up to about one rounding step of the stream's largest entry (measured, 4
# prompts each: smollm2 0.70 eps in bfloat16 and 0.64 in float16, qwen2.5-0.5b 0.45, gemma3-270m
# 1.00 in bfloat16; float32 2.3 eps of float32): allowed, ROUNDING_STEPS of them
ROUNDING_STEPS = 4


def tolerance(dtype: torch.dtype) -> float:
    """The largest error allowed, relative to the whole's largest entry (at least 1), when the model
    computed its streams in ``dtype``: `TOLERANCE`, or `ROUNDING_STEPS` rounding steps (machine
    epsilon) of ``dtype`` where that is larger (bfloat16: 0.031, float16: 0.0039)."""
    return max(TOLERANCE, ROUNDING_STEPS * torch.finfo(dtype).eps)


@dataclass
class Norm:
    """A norm's parameters: ``kind`` ``"layer"`` (g ⊙ (y − mean(y)) / σ(y) + β, σ(y) =
    sqrt(var(y) + eps)) or ``"rms"`` (g ⊙ y / sqrt(mean(y²) + eps); ``gain`` g already holds
    Gemma's 1 + w); ``gain``, ``shift`` β (zeros for RMS norms): ``[..., d]``."""

    kind: str
    gain: torch.Tensor
    shift: torch.Tensor
    eps: float

    @property
    def centres(self) -> bool:
        """Whether the norm subtracts the mean (a layer norm)."""
        return self.kind == "layer"

    def scale(self, y: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` c = gain / σ(y) (layer norm) or gain / rms(y): the norm's multiplier with its
        statistic fixed at its value on ``y [..., d]``."""
        if self.centres:
            statistic = (y.var(dim=-1, unbiased=False, keepdim=True) + self.eps).sqrt()
        else:
            statistic = (y.pow(2).mean(dim=-1, keepdim=True) + self.eps).sqrt()
        return self.gain / statistic

    def linear(self, part: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """A part through the norm linearised at ``scale``: c ⊙ (part − mean(part)) or c ⊙ part."""
        return scale * (centre(part) if self.centres else part)

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """The norm itself: ``linear(y, scale(y)) + shift``."""
        return self.linear(y, self.scale(y)) + self.shift

    def layer(self, index: int, dtype: torch.dtype) -> Norm:
        """One layer's norm, from parameters stacked ``[layer, d]``, in ``dtype``."""
        return Norm(self.kind, self.gain[index].to(dtype), self.shift[index].to(dtype), self.eps)


def centre(vectors: torch.Tensor) -> torch.Tensor:
    """Each vector minus its mean over the last axis."""
    return vectors - vectors.mean(dim=-1, keepdim=True)


@dataclass
class Linearised:
    """One block's whole at every position, as parts: whole_i = residual_i + Σ parts_i + bias_i.

    ``residual [T, d]``: the stream before the block, as it reaches the whole; ``scale [T, d]`` or
    None: c_i, what multiplies every other part (after centring when ``centres``); ``bias [T, d]``:
    the non-edge term (a bias and a norm's shift where they act; zeros where none)."""

    residual: torch.Tensor
    scale: torch.Tensor | None
    centres: bool
    bias: torch.Tensor

    def part(self, raw: torch.Tensor) -> torch.Tensor:
        """``[T, ..., d]`` a raw part (what the block computes at each position) as it reaches the whole."""
        part = centre(raw) if self.centres else raw
        if self.scale is None:
            return part
        return part * self.scale.reshape(self.scale.shape[0], *([1] * (part.dim() - 2)), self.scale.shape[-1])


def linearise_attention(
    inputs: torch.Tensor, output: torch.Tensor, bias: torch.Tensor, norm: Norm | None, norm_first: bool
) -> Linearised:
    """The attention block at one layer: ``inputs [T, d]`` the stream entering it, ``output [T, d]``
    the output projection's output (its ``bias [d]`` included). ``norm`` (this layer's ``[d]``
    parameters): post-LN, read by LN(inputs + output); ``norm_first`` (sandwich): inputs +
    norm(output); None: pre-LN, inputs + output."""
    if norm is None:
        return Linearised(inputs, None, False, bias.expand_as(inputs))
    if norm_first:
        scale = norm.scale(output)
        return Linearised(inputs, scale, norm.centres, norm.linear(bias.expand_as(inputs), scale) + norm.shift)
    scale = norm.scale(inputs + output)
    return Linearised(
        norm.linear(inputs, scale), scale, norm.centres, norm.linear(bias.expand_as(inputs), scale) + norm.shift
    )


def linearise_ffn(mid: torch.Tensor, output: torch.Tensor, norm: Norm | None) -> Linearised:
    """The feed-forward block at one layer: ``mid [T, d]`` the stream entering it, ``output [T, d]``
    what it adds (with any norm of its own, as Gemma's post-feed-forward norm, already applied);
    ``norm``: post-LN, the layer norm reading mid + output."""
    if norm is None:
        return Linearised(mid, None, False, torch.zeros_like(mid))
    scale = norm.scale(mid + output)
    return Linearised(norm.linear(mid, scale), scale, norm.centres, norm.shift.expand_as(mid))


def gated(block: Linearised, shift: torch.Tensor, residual: torch.Tensor, branch: torch.Tensor) -> Linearised:
    """``block`` in a gated block (`attnflow.rows.Streams.gated`), whose update joins the stream as
    shift + residual ⊙ stream + branch ⊙ update (each ``[d]``): the stream's part is scaled by
    ``residual``, every other part and the bias by ``branch``, and ``shift`` adds to the bias."""
    scale = branch.expand_as(block.residual) if block.scale is None else branch * block.scale
    return Linearised(residual * block.residual, scale, block.centres, branch * block.bias + shift)


@dataclass
class QueryVectors:
    """The head vectors of a row with a per-position factor: f_h(i, j) = (D_i^h ⊙ v_h(j)) W_O^h,
    one per (query i, source j), built on demand (`rows`). ``per_head [T, H, d_head]`` the values
    read by each query head, ``factors [T, H, d_head]`` D, ``output_weights [H, d_head, d]``."""

    per_head: torch.Tensor
    factors: torch.Tensor
    output_weights: torch.Tensor

    def rows(self, queries: slice) -> torch.Tensor:
        """``[q, T, H, d]`` f_h(i, j) for the queries i in ``queries`` and every source j."""
        return torch.einsum("jhk,ihk,hkd->ijhd", self.per_head, self.factors[queries], self.output_weights)


Vectors: TypeAlias = torch.Tensor | QueryVectors  # [T, H, d] f_h(j), or per query


def head_vectors(values: torch.Tensor, output_weights: torch.Tensor, factors: torch.Tensor | None = None) -> Vectors:
    """``[T, H, d]`` f_h(j) = v_h(j) W_O^h from ``values [T, KV, d_head]`` and ``output_weights
    [H, d_head, d]`` (grouped-query attention: head h reads KV head h // (H / KV)); with ``factors
    [T, H, d_head]`` D, the `QueryVectors` f_h(i, j) = (D_i^h ⊙ v_h(j)) W_O^h."""
    n_heads, n_kv = output_weights.shape[0], values.shape[1]
    per_head = values.repeat_interleave(n_heads // n_kv, dim=1)  # [T, H, d_head]
    if factors is not None:
        return QueryVectors(per_head, factors, output_weights)
    return torch.einsum("jhk,hkd->jhd", per_head, output_weights)


def at_query(vectors: Vectors, i: int) -> torch.Tensor:
    """``[T, H, d]`` the head vectors query ``i`` reads, f_h(j) or f_h(i, j)."""
    return vectors.rows(slice(i, i + 1))[0] if isinstance(vectors, QueryVectors) else vectors


def head_outputs(
    attention: torch.Tensor, values: torch.Tensor, output_weights: torch.Tensor, factors: torch.Tensor | None = None
) -> torch.Tensor:
    """``[T, H, d]`` each head's raw output at each query, Σ_j A_h[i, j] f_h(j), computed as
    (A_h V_h) W_O^h (no ``[T, T, d]`` product); with ``factors [T, H, d_head]`` D, (D_i ⊙ (A_h V_h)_i) W_O^h."""
    n_heads, n_kv = output_weights.shape[0], values.shape[1]
    per_head = values.repeat_interleave(n_heads // n_kv, dim=1)  # [T, H, d_head]
    mixed = torch.einsum("hij,jhk->ihk", attention, per_head)  # [T, H, d_head]
    if factors is not None:
        mixed = mixed * factors
    return torch.einsum("ihk,hkd->ihd", mixed, output_weights)


def check_whole(
    name: str, layer: int, whole: torch.Tensor, parts_sum: torch.Tensor, dtype: torch.dtype = torch.float32
) -> None:
    """Decompositions check themselves: the parts must add up to the model's own whole, within
    `tolerance` of ``dtype`` (the precision the model computed them in) times the whole's largest
    entry (at least 1). Over it in float32 the adapter row is wrong; in 16 bits it may be rounding
    that even this tolerance does not cover, and the message says to run in float32 first."""
    error = float((whole - parts_sum).abs().max())
    scale = max(1.0, float(whole.abs().max()))
    allowed = tolerance(dtype)
    if error <= allowed * scale:
        return
    found = f"(largest error {error:.3g} on entries up to {scale:.3g}, allowed {allowed * scale:.3g}"
    if torch.finfo(dtype).bits < 32:
        precision = str(dtype).removeprefix("torch.")
        raise CaptureError(
            f"layer {layer}: the parts of the {name} do not add up to the model's own stream {found} in "
            f"{precision}): more than {precision}'s rounding explains; load the model with {{dtype}} float32 and "
            "run again (if the parts do not add up there either, the adapter row does not match this model)",
            parameter="dtype",
        )
    raise CaptureError(
        f"layer {layer}: the parts of the {name} do not add up to the model's own stream {found}): "
        "the adapter row does not match this model"
    )


def proximity(whole: torch.Tensor, part: torch.Tensor, p: int) -> torch.Tensor:
    """``[...]`` max(‖whole‖_p − ‖whole − part‖_p, 0) over the last axis (broadcasting)."""
    return (torch.linalg.vector_norm(whole, p, dim=-1) - torch.linalg.vector_norm(whole - part, p, dim=-1)).clamp(
        min=0.0
    )


def normalise(*proximities: torch.Tensor) -> list[torch.Tensor]:
    """Each ``[T, ...]`` proximity divided by the sum over every part of the same whole (the
    position i, the first axis; 0 where that sum is 0, a whole no part comes near)."""
    total = sum(p.reshape(p.shape[0], -1).sum(dim=1, dtype=torch.float64) for p in proximities)
    divisor = torch.where(total > 0, total, torch.ones_like(total))
    return [p / divisor.reshape(-1, *([1] * (p.dim() - 1))).to(p.dtype) for p in proximities]


def attention_contributions(
    whole: torch.Tensor,
    block: Linearised,
    vectors: Vectors,
    attention: torch.Tensor,
    p: int,
    ffn: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's attention-block contributions, normalised: ``heads [H, T, T]`` ``[head, query,
    key]``, ``residual [T]``, ``bias [T]`` and ``ffn [T]``. ``whole [T, d]``: the stream after the
    block; ``vectors [T, H, d]``: f_h(j) (`head_vectors`; per query: `QueryVectors`); ``attention [H, T, T]``;
    ``ffn [T, d]``:
    a parallel block's feed-forward output, one more part of the same whole (None: a sequential
    block, whose ``ffn`` share is 0); ``[T, n, d]``: n parts of it (a mixture of experts' chosen
    experts and its shared expert), whose shares come back ``[T, n]``."""
    heads = head_proximities(whole, block, vectors, attention, p)  # [T, H, T]
    residual = proximity(whole, block.residual, p)
    bias = proximity(whole, block.bias, p)
    if ffn is None:
        through_ffn = torch.zeros_like(residual)
    else:
        through_ffn = proximity(whole if ffn.dim() == 2 else whole[:, None], ffn, p)  # [T] or [T, n]
    residual, heads, bias, through_ffn = normalise(residual, heads, bias, through_ffn)
    return heads.permute(1, 0, 2), residual, bias, through_ffn


def ffn_contributions(
    whole: torch.Tensor, block: Linearised, part: torch.Tensor, p: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's feed-forward contributions, normalised: ``ffn [T]``, ``residual [T]``, ``bias
    [T]``; ``part [T, d]`` what the block adds as it reaches the whole (``block.part(output)``)."""
    ffn = proximity(whole, part, p)
    residual = proximity(whole, block.residual, p)
    bias = proximity(whole, block.bias, p)
    ffn, residual, bias = normalise(ffn, residual, bias)
    return ffn, residual, bias


def expert_contributions(
    whole: torch.Tensor, block: Linearised, experts: torch.Tensor, p: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mixture of experts' contributions, normalised: ``experts [T, n]``, ``residual [T]``,
    ``bias [T]``; ``experts [T, n, d]``: each chosen expert's part (and the shared expert's) as it
    reaches the whole (``block.part``)."""
    shares = proximity(whole[:, None], experts, p)
    residual = proximity(whole, block.residual, p)
    bias = proximity(whole, block.bias, p)
    shares, residual, bias = normalise(shares, residual, bias)
    return shares, residual, bias


QUERY_BLOCK = 1 << 22  # QueryVectors: the most entries of f_h(i, j) built at once (32 MiB in float64)


def head_proximities(
    whole: torch.Tensor, block: Linearised, vectors: Vectors, attention: torch.Tensor, p: int
) -> torch.Tensor:
    """``[T, H, T]`` ``[query, head, key]`` proximity of A_h[i, j] c_i ⊙ f̃_h(j) to whole_i, from one
    compiled kernel that walks (i, j, h) and never forms the part vectors: memory O(T·H·d) for the
    inputs, O(H·T²) for the result. A zero attention weight gives a zero part, whose proximity is
    exactly 0, so the kernel skips it (causal models: j > i; local layers: outside the window).
    `QueryVectors` f_h(i, j) go through the same kernel a block of queries at a time (at most
    `QUERY_BLOCK` entries built at once): T² · H · d_head · d multiply-adds to build them."""
    if p not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {p!r}")
    scale = torch.ones_like(whole) if block.scale is None else block.scale
    result = np.empty((whole.shape[0], attention.shape[0], whole.shape[0]), dtype=np.float64)
    kernel = _compiled_kernel()

    def numpy(tensor: torch.Tensor) -> np.ndarray:
        return np.ascontiguousarray(tensor.detach().cpu().double().numpy())

    if not isinstance(vectors, QueryVectors):
        tilde = centre(vectors) if block.centres else vectors
        kernel(numpy(whole), numpy(scale), numpy(tilde[None]), numpy(attention), np.int64(p), np.int64(0), result)
        return torch.from_numpy(result).to(whole.device)
    n_tokens = whole.shape[0]
    step = max(1, QUERY_BLOCK // max(1, n_tokens * vectors.per_head.shape[1] * whole.shape[-1]))
    for start in range(0, n_tokens, step):
        rows = slice(start, min(start + step, n_tokens))
        tilde = vectors.rows(rows)
        tilde = centre(tilde) if block.centres else tilde
        found = np.empty((rows.stop - start, attention.shape[0], n_tokens), dtype=np.float64)
        arrays = (numpy(whole[rows]), numpy(scale[rows]), numpy(tilde), numpy(attention[:, rows]))
        kernel(*arrays, np.int64(p), np.int64(1), found)
        result[rows] = found
    return torch.from_numpy(result).to(whole.device)


_KERNEL: list[Any] = []
_KERNEL_LOCK = threading.Lock()


def _compiled_kernel() -> Any:
    """The numba kernel, compiled on first use (numba's on-disk cache keeps it between runs)."""
    with _KERNEL_LOCK:
        if not _KERNEL:
            from numba import njit

            _KERNEL.append(njit(cache=True, nogil=True, fastmath=True)(_proximity_kernel))
    return _KERNEL[0]


def _proximity_kernel(whole, scale, vectors, attention, p, per_query, out):  # pragma: no cover - numba
    """out[i, h, j] = max(‖w_i‖_p − ‖w_i − A[h, i, j] c_i ⊙ f[q, j, h]‖_p, 0), q = i where
    ``per_query`` (``vectors [queries, T, H, d]``), else 0 (``[1, T, H, d]``); the loops over k are
    kept apart per norm, so that each vectorises."""
    n_tokens, width = whole.shape
    n_keys, n_heads = vectors.shape[1], vectors.shape[2]
    for i in range(n_tokens):
        q = i if per_query else 0
        norm = 0.0
        if p == 1:
            for k in range(width):
                norm += abs(whole[i, k])
        else:
            for k in range(width):
                norm += whole[i, k] * whole[i, k]
            norm = np.sqrt(norm)
        for h in range(n_heads):
            for j in range(n_keys):
                weight = attention[h, i, j]
                if weight == 0.0:
                    out[i, h, j] = 0.0
                    continue
                distance = 0.0
                if p == 1:
                    for k in range(width):
                        distance += abs(whole[i, k] - weight * scale[i, k] * vectors[q, j, h, k])
                else:
                    for k in range(width):
                        gap = whole[i, k] - weight * scale[i, k] * vectors[q, j, h, k]
                        distance += gap * gap
                    distance = np.sqrt(distance)
                out[i, h, j] = max(norm - distance, 0.0)
