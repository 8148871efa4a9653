"""Mergeable streaming statistics of the corpus study (the study of the paper "Self-attention
vector output similarities reveal how machines pay attention"; S is defined in docs/methods.md).

`StudyStats` eats batches of windows (token ids, sentence ids, attention maps and per-head
outputs, as torch tensors on any device) and keeps only sums and counts whose size does not
depend on the number of samples. Two accumulators over disjoint windows `merge` into the one
a single pass over all windows gives: every accumulator is a plain sum (float64 for real values,
int64 for counts), so ``a.merge(b)`` equals the whole up to float64 rounding of the additions.
Per-window quantities are computed in the input's dtype and summed across windows in float64,
so the results do not depend on how windows are batched, with one exception: the mean
similarity map is summed over the windows of a block in the input dtype first (float32: two
batchings of the same windows agree to ~1e-7 relative; merging is still exact).

Definitions (per layer l and head h; a "pair" is an unordered pair of positions i < j of one
window of n tokens, so a window has P = n(n−1)/2 pairs; S = `context_similarity`, symmetric):

* **Mean similarity**: ``mean_similarity`` = Σ_samples S / N, an ``[n, n]`` matrix per head.
  ``similarity_mean`` / ``similarity_std``: mean and (population) standard deviation of the
  off-diagonal entries S_ij, i < j, pooled over all pairs of all samples.
* **High-similarity set H** (one per matrix), ``StudyConfig.high``:
  ``top-percent:p``: the pairs whose S_ij reaches the k-th largest pair value, k = max(1,
  ⌊p/100 · P + ½⌋) (exactly k pairs unless values tie at the cutoff; tied pairs are all kept);
  ``top-k-per-row:K``: the pairs {i, j} with S_ij among the K largest entries of row i or of
  row j (j ≠ i; ties kept), so nK/2 ≤ |H| ≤ nK without ties; ``zscore:Z``: the pairs with
  (S_ij − μ)/σ > Z, μ and σ the mean and population std of that matrix's P pairs (possibly
  empty; a matrix with an empty H adds nothing to the shares below).
* Every *share* below is a ratio of sums over all samples (pooled), e.g. the distance
  histogram's short-range share is Σ_samples |{(i,j) ∈ H: j−i ≤ r}| / Σ_samples |H|.
  Its *chance* baseline is the same share over all P pairs of the same windows.
* **Distance**: histogram of j − i over H (``high_distance_hist``, index d = 0…n−1, entry 0 is
  0) next to the all-pairs histogram (n − d pairs at distance d per window); ``mean_distance_high``
  vs ``mean_distance_all`` = (n+1)/3; ``short_range_share``: share of H with j − i ≤
  ``short_range``; ``long_range_share`` = 1 − short; chances from the all-pairs histogram.
* **Same sentence**: only pairs whose two tokens both have a sentence id ≥ 0 (i.e. neither is a
  special token) are *eligible*; ``same_sentence_share`` = |{eligible pairs of H with equal
  sentence ids}| / |{eligible pairs of H}|; ``same_sentence_chance`` = the same ratio over all
  pairs = Σ_samples Σₛ nₛ(nₛ−1)/2 / Σ_samples m(m−1)/2, m = non-special tokens of the window
  (the familiar Σₛ nₛ(nₛ−1)/(n(n−1)) with n counting only the m non-special tokens).
* **Repeats**: ``repeat_share`` = share of H with token_ids equal at i and j; ``repeat_chance``
  = share of all pairs with equal token ids (special tokens included, like in H).
* **Anchor token**: per matrix with a non-empty H, cover(t) = number of pairs of H with token t
  at i or at j (a pair t–t counts once); the anchor is the t with the largest cover (ties: the
  token occurring first in the window) and its share is cover/|H|. ``anchor_share`` is the mean
  share over the matrices with a non-empty H; ``anchor_share_chance`` is the mean over windows
  of max_t cover(t) over *all* P pairs / P: the share a uniformly random H gives, in
  expectation, to the window's most pair-covering token (it does not include the extra maximum
  a small random set shows by luck). ``top_anchor_tokens``: how often each token was a head's
  anchor over the corpus, the ``n_anchor_tokens`` most frequent. The counts live in a dense
  int64 table ``[layer·head, vocab]`` (grown to the largest token id seen; 35 MB for
  mpnet's 30,527-token vocab × 144 heads), stored sparsely (non-zero entries) in `state_dict`.
* **Attention masking**: ``M`` = the pairs whose max(A_ij, A_ji) reaches the k_M-th largest such
  value of that head's map, k_M = max(1, ⌊p_A/100 · P + ½⌋) (p_A = ``attention_top_percent``;
  ties kept; pairs with zero attention both ways never count); ``signal_share`` =
  Σ|H ∩ M| / Σ|H|, ``noise_share`` = 1 − signal; ``signal_chance`` = k_M / P.
* **Attention statistics** (Clark et al. 2019), means over samples and query rows i of one head:
  ``attention_to[name]`` = Σ_j A_ij over the positions j holding that token id (the names and
  ids of ``special_token_ids`` and ``punctuation_ids``; chance: occurrences / n, uniform rows);
  ``attention_self`` = A_ii, ``attention_prev`` = A_{i,i−1} (rows i ≥ 1), ``attention_next`` =
  A_{i,i+1} (rows i ≤ n−2) (chance 1/n); ``attention_entropy`` = −Σ_j A_ij ln A_ij (nats,
  0 ln 0 = 0; uniform rows: ln n).

Layer summaries are plain means of the head values over heads (NaN heads skipped).

Cost: `update` works in blocks of layers × windows, each a handful of passes over that block's
attention maps and similarity matrices (one matmul, two order-statistic selections, a few
gathers, one log for the entropy) plus per-pair bookkeeping on the |H| selected pairs only;
no Python loop over windows or heads. On the CPU the order statistics use numpy's introselect
and the blocks are sized to stay in the cache.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Sequence

import numpy as np
import torch

from attnflow.methods.similarity import context_similarity

HIGH_RULES = ("top-percent", "top-k-per-row", "zscore")
ATTENTION_POSITIONS = ("self", "prev", "next", "entropy")
# Every scalar of a head (and, as means over heads, of a layer) in `summary` and `head_table`.
HEAD_SCALARS = (
    "similarity_mean",
    "similarity_std",
    "high_pairs_per_sample",
    "mean_distance_high",
    "mean_distance_all",
    "short_range_share",
    "short_range_chance",
    "long_range_share",
    "long_range_chance",
    "same_sentence_share",
    "same_sentence_chance",
    "repeat_share",
    "repeat_chance",
    "signal_share",
    "noise_share",
    "signal_chance",
    "anchor_share",
    "anchor_share_chance",
    "attention_self",
    "attention_prev",
    "attention_next",
    "attention_entropy",
)


@dataclass(frozen=True)
class HighRule:
    """A parsed ``StudyConfig.high``: ``kind`` in `HIGH_RULES` and its number."""

    kind: str
    value: float


def parse_high(spec: str) -> HighRule:
    """Parse ``"top-percent:P"`` (0 < P ≤ 100), ``"top-k-per-row:K"`` (integer K ≥ 1) or ``"zscore:Z"``.

    Raises:
        ValueError: naming the accepted forms when ``spec`` is none of them.
    """
    forms = '"top-percent:P" (0 < P <= 100), "top-k-per-row:K" (integer K >= 1) or "zscore:Z"'

    def bad(reason: str) -> ValueError:
        return ValueError(f"bad high-similarity rule {spec!r}: {reason}; expected {forms}")

    if not isinstance(spec, str) or spec.count(":") != 1:
        raise bad("not of the form RULE:NUMBER")
    kind, _, number = (part.strip() for part in spec.partition(":"))
    if kind not in HIGH_RULES:
        raise bad(f"unknown rule {kind!r}")
    try:
        value = float(number)
    except ValueError:
        raise bad(f"{number!r} is not a number") from None
    if not math.isfinite(value):
        raise bad("the number is not finite")
    if kind == "top-percent" and not 0 < value <= 100:
        raise bad("the percentage must lie in (0, 100]")
    if kind == "top-k-per-row" and (value < 1 or value != int(value)):
        raise bad("K must be an integer >= 1")
    return HighRule(kind, value)


def top_count(percent: float, n_pairs: int) -> int:
    """How many of ``n_pairs`` pairs the top ``percent`` % holds: max(1, ⌊percent/100 · n_pairs + ½⌋)."""
    return max(1, min(n_pairs, math.floor(percent / 100.0 * n_pairs + 0.5)))


@dataclass
class StudyConfig:
    """Options of the corpus study's statistics (see the module docstring for the definitions).

    Attributes:
        high: the high-similarity rule: ``"top-percent:P"``, ``"top-k-per-row:K"`` or ``"zscore:Z"``.
        attention_top_percent: M holds the pairs whose max(A_ij, A_ji) is in the top p % of
            that head's pairs.
        short_range: pairs with j − i ≤ short_range are short-range.
        n_anchor_tokens: per head, how many of the most frequent anchor tokens the summary lists.
    """

    high: str = "top-percent:2"
    attention_top_percent: float = 2.0
    short_range: int = 8
    n_anchor_tokens: int = 10

    def __post_init__(self) -> None:
        parse_high(self.high)
        percent = self.attention_top_percent
        if isinstance(percent, bool) or not (isinstance(percent, (int, float)) and 0 < percent <= 100):
            raise ValueError(f"attention_top_percent must lie in (0, 100]; got {self.attention_top_percent!r}")
        if (
            isinstance(self.short_range, bool)
            or not isinstance(self.short_range, (int, np.integer))
            or self.short_range < 1
        ):
            raise ValueError(f"short_range must be an integer >= 1; got {self.short_range!r}")
        if (
            isinstance(self.n_anchor_tokens, bool)
            or not isinstance(self.n_anchor_tokens, (int, np.integer))
            or self.n_anchor_tokens < 1
        ):
            raise ValueError(f"n_anchor_tokens must be an integer >= 1; got {self.n_anchor_tokens!r}")

    @property
    def high_rule(self) -> HighRule:
        return parse_high(self.high)


# Accumulators: name -> (shape kind, dtype). Shape kinds: "lh" [layer, head], "lhnn", "lhn",
# "lhk" [layer, head, named token], "k" [named token], "" scalar (one number over samples).
_F64, _I64 = torch.float64, torch.int64
_ACCUMULATORS: dict[str, tuple[str, torch.dtype]] = {
    "similarity_sum": ("lhnn", _F64),  # Σ_samples S
    "offdiag_mean_sum": ("lh", _F64),  # Σ_samples mean_{i<j} S_ij
    "offdiag_mean_sq_sum": ("lh", _F64),  # Σ_samples (mean_{i<j} S_ij)²
    "offdiag_m2_sum": ("lh", _F64),  # Σ_samples Σ_{i<j} (S_ij − mean)²
    "high_pairs": ("lh", _I64),  # Σ |H|
    "high_nonempty": ("lh", _I64),  # matrices with |H| > 0
    "high_distance_hist": ("lhn", _I64),  # Σ |{(i,j) ∈ H: j − i = d}|
    "high_same_sentence": ("lh", _I64),
    "high_sentence_eligible": ("lh", _I64),
    "high_repeat": ("lh", _I64),
    "high_in_attention": ("lh", _I64),  # Σ |H ∩ M|
    "anchor_share_sum": ("lh", _F64),  # Σ over non-empty matrices of cover(anchor)/|H|
    "attention_to_sum": ("lhk", _F64),  # Σ_samples mean_i Σ_{j: token j = id_k} A_ij
    "attention_self_sum": ("lh", _F64),
    "attention_prev_sum": ("lh", _F64),
    "attention_next_sum": ("lh", _F64),
    "attention_entropy_sum": ("lh", _F64),
    "pairs_same_sentence": ("", _I64),
    "pairs_sentence_eligible": ("", _I64),
    "pairs_repeat": ("", _I64),
    "anchor_chance_sum": ("", _F64),
    "token_occurrences": ("k", _I64),  # occurrences of each named token id
}


class StudyStats:
    """Streaming, mergeable per-(layer, head) statistics of context similarity and attention.

    Args:
        n_layers, n_heads, seq_len: the shape every batch must have (windows of exactly
            ``seq_len`` tokens, no padding).
        config: `StudyConfig` (default: ``StudyConfig()``).
        special_token_ids: names → ids whose received attention is reported, e.g.
            ``{"[CLS]": 101, "[SEP]": 102}``.
        punctuation_ids: the same for punctuation, e.g. ``{".": 1012, ",": 1010}``.
        vocab_size: optional; sizes the anchor count table up front (else it grows on demand).
        layer_chunk, sample_block: `update` works on blocks of ``layer_chunk`` layers ×
            ``sample_block`` windows (temporary memory: a few block-sized float arrays). Default
            on the CPU: one layer × as many windows as fit in about 6 MB of attention maps per
            torch thread, so a block's passes run from the cache, not from memory (1.5× faster
            than whole batches of 32 on one thread); elsewhere (GPU): all layers × the whole batch.
        threads: torch CPU threads while `update` runs (restored afterwards); None: the caller's
            setting. On a machine whose cores are oversubscribed, every multi-threaded torch op
            waits for a descheduled worker (a 0.5 ms reduction took 16 ms with 2 threads at load
            7 on 2 cores), and ``threads=1`` makes the statistics several times faster.

    The accumulators (float64 and int64) live on the device of the batches (Apple ``mps``
    has no float64: batches there are moved to the CPU).
    """

    def __init__(
        self,
        n_layers: int,
        n_heads: int,
        seq_len: int,
        config: StudyConfig | None = None,
        special_token_ids: dict[str, int] | None = None,
        punctuation_ids: dict[str, int] | None = None,
        vocab_size: int | None = None,
        layer_chunk: int | None = None,
        sample_block: int | None = None,
        threads: int | None = None,
    ) -> None:
        for name, value, least in (("n_layers", n_layers, 1), ("n_heads", n_heads, 1), ("seq_len", seq_len, 2)):
            if isinstance(value, bool) or int(value) != value or value < least:
                raise ValueError(f"{name} must be an integer >= {least}; got {value!r}")
        self.n_layers, self.n_heads, self.seq_len = int(n_layers), int(n_heads), int(seq_len)
        self.config = config if config is not None else StudyConfig()
        if not isinstance(self.config, StudyConfig):
            raise TypeError(f"config must be a StudyConfig, got {type(self.config).__name__}")
        self.rule = self.config.high_rule
        self.n_pairs = self.seq_len * (self.seq_len - 1) // 2
        if self.rule.kind == "top-k-per-row" and self.rule.value > self.seq_len - 1:
            raise ValueError(f"top-k-per-row K must be <= seq_len - 1 = {self.seq_len - 1}; got {self.config.high!r}")
        self.special_token_ids = {str(k): int(v) for k, v in (special_token_ids or {}).items()}
        self.punctuation_ids = {str(k): int(v) for k, v in (punctuation_ids or {}).items()}
        overlap = set(self.special_token_ids) & set(self.punctuation_ids)
        if overlap:
            raise ValueError(f"names given both as special tokens and punctuation: {sorted(overlap)}")
        self.token_names = list(self.special_token_ids) + list(self.punctuation_ids)
        self._named_ids = [*self.special_token_ids.values(), *self.punctuation_ids.values()]
        self.layer_chunk = None if layer_chunk is None else max(1, int(layer_chunk))
        self.sample_block = None if sample_block is None else max(1, int(sample_block))
        self.threads = None if threads is None else max(1, int(threads))
        self._n_samples = 0
        self.device = torch.device("cpu")
        shapes = {
            "lh": (self.n_layers, self.n_heads),
            "lhnn": (self.n_layers, self.n_heads, self.seq_len, self.seq_len),
            "lhn": (self.n_layers, self.n_heads, self.seq_len),
            "lhk": (self.n_layers, self.n_heads, len(self.token_names)),
            "k": (len(self.token_names),),
            "": (),
        }
        self._acc = {name: torch.zeros(shapes[kind], dtype=dtype) for name, (kind, dtype) in _ACCUMULATORS.items()}
        self._anchor_counts = torch.zeros((self.n_layers * self.n_heads, int(vocab_size or 0)), dtype=_I64)
        self._pair_cache: dict[torch.device, dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------ bookkeeping

    @property
    def n_samples(self) -> int:
        """Windows added so far (by `update` and `merge`)."""
        return self._n_samples

    def _to(self, device: torch.device) -> None:
        if device != self.device:
            self._acc = {name: value.to(device) for name, value in self._acc.items()}
            self._anchor_counts = self._anchor_counts.to(device)
            self.device = device

    def _pairs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Index tensors of the P pairs i < j, in row-major order (i, then j) (cached per device)."""
        if device not in self._pair_cache:
            n = self.seq_len
            rows = torch.arange(n)
            i, j = torch.triu_indices(n, n, offset=1)
            self._pair_cache[device] = {
                name: value.to(device)
                for name, value in {
                    "i": i,
                    "j": j,
                    "distance": j - i,
                    "flat_upper": i * n + j,  # S[i, j] in S.flatten(-2)
                    "flat_lower": j * n + i,  # S[j, i]
                    "rows": rows,
                }.items()
            }
        return self._pair_cache[device]

    # ------------------------------------------------------------------ update

    def update(
        self,
        *,
        token_ids: torch.Tensor,
        sentence_ids: torch.Tensor | None,
        attentions: torch.Tensor | Sequence[torch.Tensor],
        head_outputs: torch.Tensor,
    ) -> None:
        """Add one batch of windows.

        Args:
            token_ids: ``[batch, token]`` int vocabulary ids (>= 0).
            sentence_ids: ``[batch, token]`` int sentence index per token, -1 for special tokens
                (None: all -1, no same-sentence statistics).
            attentions: ``[batch, layer, head, query, key]`` softmax weights, or one ``[batch,
                head, query, key]`` tensor per layer (what capture returns; saves a stacked copy).
            head_outputs: ``[batch, layer, token, head, d_head]`` per-head outputs.
        """
        if self.threads is None or _maps_device(attentions).type != "cpu":
            self._update(token_ids, sentence_ids, attentions, head_outputs)
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            self._update(token_ids, sentence_ids, attentions, head_outputs)
        finally:
            torch.set_num_threads(threads)

    def _update(self, token_ids, sentence_ids, attentions, head_outputs) -> None:
        if _maps_device(attentions).type == "mps":  # no float64 accumulators there: work on the CPU
            attentions = attentions.cpu() if torch.is_tensor(attentions) else [a.cpu() for a in attentions]
            head_outputs = head_outputs.cpu()
        token_ids, sentence_ids = self._validate(token_ids, sentence_ids, attentions, head_outputs)
        device = head_outputs.device
        self._to(device)
        self._grow_anchor_table(int(token_ids.max()) + 1)  # one host sync per batch
        pairs = self._pairs(device)
        batch, n = token_ids.shape
        acc = self._acc

        # Per-window pair features [batch, pair].
        repeat = token_ids[:, pairs["i"]] == token_ids[:, pairs["j"]]
        sid_i, sid_j = sentence_ids[:, pairs["i"]], sentence_ids[:, pairs["j"]]
        eligible = (sid_i >= 0) & (sid_j >= 0)
        same_sentence = eligible & (sid_i == sid_j)
        # label[b, t]: position of the first occurrence of token t's id in window b (equal
        # labels <=> equal token ids), the unit anchors are counted in.
        equal = token_ids[:, :, None] == token_ids[:, None, :]  # [batch, token, token]
        label = torch.where(equal, pairs["rows"], n).amin(-1)  # [batch, token]
        label_i, label_j = label[:, pairs["i"]], label[:, pairs["j"]]
        acc["pairs_repeat"] += repeat.sum()
        acc["pairs_sentence_eligible"] += eligible.sum()
        acc["pairs_same_sentence"] += same_sentence.sum()
        # cover(t) over all pairs: pairs with label t at i, plus pairs with t at j only.
        cover_all = torch.zeros((batch, n), dtype=_I64, device=device)
        cover_all.scatter_add_(1, label_i, torch.ones_like(label_i))
        cover_all.scatter_add_(1, label_j, (~repeat).to(_I64))
        acc["anchor_chance_sum"] += (cover_all.amax(-1).to(_F64) / self.n_pairs).sum()
        named = torch.tensor(self._named_ids, dtype=_I64, device=device)
        is_named = (token_ids[:, :, None] == named).to(head_outputs.dtype)  # [batch, token, named]
        acc["token_occurrences"] += is_named.sum((0, 1)).to(_I64)

        window = _Window(token_ids, label_i, label_j, repeat, eligible, same_sentence)
        layer_chunk, sample_block = self._blocks(batch, device)
        for start in range(0, self.n_layers, layer_chunk):
            layers = slice(start, min(start + layer_chunk, self.n_layers))
            block = _attention_block(attentions, layers)  # [batch, layer, head, q, k], a view
            # [batch, layer·head·q·k]: every map's pairs are one index_select away.
            flat_block = block.reshape(batch, -1)
            for first in range(0, batch, sample_block):
                rows = slice(first, min(first + sample_block, batch))
                self._update_similarity(layers, head_outputs[rows, layers], flat_block[rows], window.rows(rows))
                self._update_attention(layers, block[rows], is_named[rows])
        self._n_samples += batch

    def _blocks(self, batch: int, device: torch.device) -> tuple[int, int]:
        """(layers, windows) per block of `update` (see the class docstring)."""
        if device.type == "cpu":
            map_bytes = self.n_heads * self.seq_len**2 * 4
            layer_chunk = self.layer_chunk or 1
            # About 6 MB of attention maps per thread: the block's passes run from the cache,
            # and each multi-threaded op still has enough work to share.
            budget = (6 << 20) * max(1, torch.get_num_threads())
            sample_block = self.sample_block or max(1, budget // (map_bytes * layer_chunk))
        else:
            layer_chunk, sample_block = self.layer_chunk or self.n_layers, self.sample_block or batch
        return layer_chunk, sample_block

    def _validate(self, token_ids, sentence_ids, attentions, head_outputs):
        n_layers, n_heads, n = self.n_layers, self.n_heads, self.seq_len
        if token_ids.ndim != 2 or token_ids.shape[1] != n:
            raise ValueError(f"token_ids must be [batch, {n}]; got {tuple(token_ids.shape)}")
        batch = token_ids.shape[0]
        if batch == 0:
            raise ValueError("empty batch")
        if sentence_ids is None:
            sentence_ids = torch.full_like(token_ids, -1)
        if tuple(sentence_ids.shape) != (batch, n):
            raise ValueError(f"sentence_ids must be [batch={batch}, {n}]; got {tuple(sentence_ids.shape)}")
        if isinstance(attentions, torch.Tensor):
            fits, got = tuple(attentions.shape) == (batch, n_layers, n_heads, n, n), str(tuple(attentions.shape))
        else:
            fits = len(attentions) == n_layers and all(tuple(a.shape) == (batch, n_heads, n, n) for a in attentions)
            got = f"{len(attentions)} tensors, the first {tuple(attentions[0].shape) if len(attentions) else ()}"
        if not fits:
            raise ValueError(
                f"attentions must be [batch={batch}, layer={n_layers}, head={n_heads}, {n}, {n}] "
                f"or {n_layers} tensors [batch={batch}, head={n_heads}, {n}, {n}]; got {got}"
            )
        if head_outputs.ndim != 5 or tuple(head_outputs.shape[:4]) != (batch, n_layers, n, n_heads):
            raise ValueError(
                f"head_outputs must be [batch={batch}, layer={n_layers}, token={n}, head={n_heads}, d_head]; "
                f"got {tuple(head_outputs.shape)}"
            )
        maps = [attentions] if torch.is_tensor(attentions) else list(attentions)
        if not all(a.is_floating_point() for a in maps) or not head_outputs.is_floating_point():
            raise ValueError("attentions and head_outputs must be floating-point tensors")
        device = head_outputs.device
        token_ids = token_ids.to(device).long()
        if int(token_ids.min()) < 0:
            raise ValueError("token_ids must be vocabulary ids >= 0")
        return token_ids, sentence_ids.to(device).long()

    def _grow_anchor_table(self, width: int) -> None:
        """Widen the anchor count table ``[layer·head, token id]`` to at least ``width`` columns."""
        old = self._anchor_counts
        if width > old.shape[1]:
            table = torch.zeros((old.shape[0], max(width, 2 * old.shape[1])), dtype=_I64, device=self.device)
            table[:, : old.shape[1]] = old.to(self.device)
            self._anchor_counts = table

    def _high_mask(self, sim: torch.Tensor, sim_upper: torch.Tensor) -> torch.Tensor:
        """The high-similarity set of each matrix as a bool mask over pairs ``[batch, layer, head, pair]``.

        ``sim`` is ``[batch, layer, head, n, n]``, ``sim_upper`` its pairs i < j.
        """
        rule = self.rule
        if rule.kind == "top-percent":
            cutoff = kth_largest(sim_upper, top_count(rule.value, self.n_pairs))
            return sim_upper >= cutoff[..., None]
        if rule.kind == "zscore":
            mean = sim_upper.mean(-1, keepdim=True)
            std = sim_upper.std(-1, correction=0, keepdim=True)
            return (sim_upper - mean > rule.value * std) & (std > 0)
        # top-k-per-row: pairs {i, j} with S_ij among the K largest of row i or of row j.
        masked = sim.clone()
        masked.diagonal(dim1=-2, dim2=-1).fill_(-math.inf)
        cutoff = kth_largest(masked, int(rule.value))  # [batch, layer, head, row]
        chosen = masked >= cutoff[..., None]
        chosen |= chosen.transpose(-1, -2).clone()
        return chosen.flatten(-2)[..., self._pairs(sim.device)["flat_upper"]]

    def _update_similarity(self, layers: slice, head_outputs, flat_attention, window: "_Window") -> None:
        """Similarity, high-set, anchor and masking statistics of a slice of layers.

        ``head_outputs`` ``[batch, layer, token, head, d_head]`` holds only the layers of
        ``layers``; ``flat_attention`` is those layers' maps ``[batch, layer·head·q·k]``.
        """
        device = flat_attention.device
        acc, pairs = self._acc, self._pairs(device)
        batch, n_chunk, n_heads = head_outputs.shape[0], head_outputs.shape[1], self.n_heads
        n = self.seq_len
        n_matrices = batch * n_chunk * n_heads
        sim = context_similarity(head_outputs)  # [batch, layer, head, n, n]
        # Sum over the block's windows in the input dtype, accumulated across blocks in float64.
        acc["similarity_sum"][layers] += sim.sum(0).to(_F64)
        sim_upper = sim.view(n_matrices, n * n).index_select(1, pairs["flat_upper"])  # [matrix, pair]
        sim_upper = sim_upper.view(batch, n_chunk, n_heads, self.n_pairs)
        mean = sim_upper.mean(-1, keepdim=True)  # per matrix, over its pairs
        m2 = torch.linalg.vector_norm(sim_upper - mean, dim=-1).to(_F64).square()  # Σ (S_ij − mean)²
        mean = mean[..., 0].to(_F64)
        acc["offdiag_mean_sum"][layers] += mean.sum(0)
        acc["offdiag_mean_sq_sum"][layers] += mean.square().sum(0)
        acc["offdiag_m2_sum"][layers] += m2.sum(0)
        high = self._high_mask(sim, sim_upper)
        del sim, sim_upper

        # H as a list of (matrix, pair) hits; matrix = (b · n_chunk + layer) · n_heads + head.
        matrix, pair = high.view(-1, self.n_pairs).nonzero(as_tuple=True)  # one host sync
        del high
        sample = matrix // (n_chunk * n_heads)
        head = matrix % (n_chunk * n_heads)  # layer · n_heads + head within the chunk
        ones = torch.ones_like(matrix)

        def per_head(values: torch.Tensor) -> torch.Tensor:  # hit values -> [layer, head] sums
            out = torch.zeros(n_chunk * n_heads, dtype=_I64, device=device)
            return out.index_add_(0, head, values.to(_I64)).view(n_chunk, n_heads)

        size = torch.zeros(n_matrices, dtype=_I64, device=device).index_add_(0, matrix, ones)  # |H|
        acc["high_pairs"][layers] += size.view(batch, n_chunk, n_heads).sum(0)
        nonempty = (size > 0).view(batch, n_chunk, n_heads)
        acc["high_nonempty"][layers] += nonempty.sum(0)
        repeat = window.repeat[sample, pair]
        acc["high_repeat"][layers] += per_head(repeat)
        acc["high_same_sentence"][layers] += per_head(window.same_sentence[sample, pair])
        acc["high_sentence_eligible"][layers] += per_head(window.eligible[sample, pair])
        hist = torch.zeros(n_chunk * n_heads * n, dtype=_I64, device=device)
        hist.index_add_(0, head * n + pairs["distance"][pair], ones)
        acc["high_distance_hist"][layers] += hist.view(n_chunk, n_heads, n)

        # Attention masking: M = pairs whose max(A_ij, A_ji) reaches the k_M-th largest over the
        # pairs of the map.
        first_map = torch.arange(n_chunk * n_heads, device=device)[:, None] * (n * n)
        symmetric = torch.maximum(
            flat_attention.index_select(1, (first_map + pairs["flat_upper"]).flatten()),
            flat_attention.index_select(1, (first_map + pairs["flat_lower"]).flatten()),
        ).view(n_matrices, self.n_pairs)  # max(A_ij, A_ji): [matrix, pair]
        hit_attention = symmetric[matrix, pair]  # before the partition reorders the rows
        k_attention = top_count(self.config.attention_top_percent, self.n_pairs)
        cutoff = kth_largest(symmetric, k_attention, overwrite=True)
        del symmetric
        acc["high_in_attention"][layers] += per_head((hit_attention >= cutoff[matrix]) & (hit_attention > 0))

        # Anchor token of each matrix: cover(label) counted over the hits, then the best label.
        cover = torch.zeros(n_matrices * n, dtype=_I64, device=device)
        cover.index_add_(0, matrix * n + window.label_i[sample, pair], ones)
        cover.index_add_(0, matrix * n + window.label_j[sample, pair], (~repeat).to(_I64))
        best, label = cover.view(batch, n_chunk, n_heads, n).max(-1)  # ties: the first label
        share = best.to(_F64) / size.view(batch, n_chunk, n_heads).clamp(min=1).to(_F64)
        acc["anchor_share_sum"][layers] += share.sum(0)  # empty H: best = 0, adds 0
        anchor = window.token_ids.gather(1, label.view(batch, -1)).view(label.shape)  # token ids
        rows = layers.start * n_heads + torch.arange(n_chunk * n_heads, device=device).view(1, n_chunk, n_heads)
        self._anchor_counts.index_put_(
            (rows.expand_as(anchor).flatten(), anchor.flatten()), nonempty.flatten().to(_I64), accumulate=True
        )

    def _update_attention(self, layers: slice, attentions: torch.Tensor, is_named: torch.Tensor) -> None:
        """Clark et al. (2019) attention statistics of a slice of layers ``[batch, layer, head, q, k]``."""
        acc = self._acc
        received = attentions.sum(-2)  # Σ_i A_ij: [batch, layer, head, key]
        # Per window: mean_i Σ_{j holds token k} A_ij; summed over windows in float64.
        to_named = torch.einsum("blhj,bjk->blhk", received, is_named) / self.seq_len
        acc["attention_to_sum"][layers] += to_named.to(_F64).sum(0)
        for name, offset in (("self", 0), ("prev", -1), ("next", 1)):
            diagonal = attentions.diagonal(offset=offset, dim1=-2, dim2=-1)  # prev: A[i, i-1]
            acc[f"attention_{name}_sum"][layers] += diagonal.mean(-1).to(_F64).sum(0)
        # Row entropy −Σ_j A_ij ln A_ij; clamping makes 0 · ln 0 = 0 (and moves entries below the
        # smallest normal float by less than their own size).
        log_attention = attentions.clamp_min(torch.finfo(attentions.dtype).tiny).log_()
        entropy = -log_attention.mul_(attentions).sum(-1).mean(-1)  # [batch, layer, head]
        acc["attention_entropy_sum"][layers] += entropy.to(_F64).sum(0)

    # ------------------------------------------------------------------ merge and state

    def _check_compatible(self, other: "StudyStats") -> None:
        mine = (
            self.n_layers,
            self.n_heads,
            self.seq_len,
            asdict(self.config),
            self.special_token_ids,
            self.punctuation_ids,
        )
        theirs = (
            other.n_layers,
            other.n_heads,
            other.seq_len,
            asdict(other.config),
            other.special_token_ids,
            other.punctuation_ids,
        )
        if mine != theirs:
            raise ValueError(
                "cannot merge statistics of different studies: (layers, heads, seq_len, config, special "
                f"tokens, punctuation) {mine} != {theirs}"
            )

    def merge(self, other: "StudyStats") -> "StudyStats":
        """Add ``other``'s windows to this accumulator; returns ``self``."""
        if not isinstance(other, StudyStats):
            raise TypeError(f"can only merge StudyStats, got {type(other).__name__}")
        self._check_compatible(other)
        for name, value in other._acc.items():
            self._acc[name] += value.to(self.device)
        theirs = other._anchor_counts.to(self.device)
        width = max(self._anchor_counts.shape[1], theirs.shape[1])
        if width > self._anchor_counts.shape[1]:
            table = torch.zeros((self._anchor_counts.shape[0], width), dtype=_I64, device=self.device)
            table[:, : self._anchor_counts.shape[1]] = self._anchor_counts
            self._anchor_counts = table
        self._anchor_counts[:, : theirs.shape[1]] += theirs
        self._n_samples += other._n_samples
        return self

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild this accumulator, as numpy arrays and scalars (for ``np.savez``)."""
        state: dict[str, Any] = {name: value.cpu().numpy().copy() for name, value in self._acc.items()}
        rows, tokens = torch.nonzero(self._anchor_counts, as_tuple=True)
        state["anchor_rows"] = rows.cpu().numpy()  # layer · n_heads + head
        state["anchor_tokens"] = tokens.cpu().numpy()
        state["anchor_counts"] = self._anchor_counts[rows, tokens].cpu().numpy()
        state["anchor_table_width"] = int(self._anchor_counts.shape[1])
        state.update(
            n_samples=self._n_samples,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            seq_len=self.seq_len,
            config_high=self.config.high,
            config_attention_top_percent=float(self.config.attention_top_percent),
            config_short_range=int(self.config.short_range),
            config_n_anchor_tokens=int(self.config.n_anchor_tokens),
            special_token_names=np.array(list(self.special_token_ids), dtype=str),
            special_token_values=np.array(list(self.special_token_ids.values()), dtype=np.int64),
            punctuation_names=np.array(list(self.punctuation_ids), dtype=str),
            punctuation_values=np.array(list(self.punctuation_ids.values()), dtype=np.int64),
        )
        return state

    @classmethod
    def from_state_dict(cls, state: Any) -> "StudyStats":
        """Rebuild from `state_dict` output (a dict, or an ``np.load`` of the saved ``.npz``)."""

        def scalar(name: str) -> Any:
            return np.asarray(state[name]).item()

        def names(prefix: str) -> dict[str, int]:
            keys = [str(k) for k in np.asarray(state[f"{prefix}_names"]).reshape(-1)]
            values = [int(v) for v in np.asarray(state[f"{prefix}_values"]).reshape(-1)]
            return dict(zip(keys, values, strict=True))

        config = StudyConfig(
            high=str(scalar("config_high")),
            attention_top_percent=float(scalar("config_attention_top_percent")),
            short_range=int(scalar("config_short_range")),
            n_anchor_tokens=int(scalar("config_n_anchor_tokens")),
        )
        stats = cls(
            int(scalar("n_layers")),
            int(scalar("n_heads")),
            int(scalar("seq_len")),
            config,
            special_token_ids=names("special_token"),
            punctuation_ids=names("punctuation"),
            vocab_size=int(scalar("anchor_table_width")),
        )
        for name, value in stats._acc.items():
            loaded = torch.as_tensor(np.asarray(state[name]), dtype=value.dtype)
            if tuple(loaded.shape) != tuple(value.shape):
                raise ValueError(f"state {name!r} has shape {tuple(loaded.shape)}, expected {tuple(value.shape)}")
            stats._acc[name] = loaded.clone()
        rows = torch.as_tensor(np.asarray(state["anchor_rows"]), dtype=_I64)
        tokens = torch.as_tensor(np.asarray(state["anchor_tokens"]), dtype=_I64)
        stats._anchor_counts[rows, tokens] = torch.as_tensor(np.asarray(state["anchor_counts"]), dtype=_I64)
        stats._n_samples = int(scalar("n_samples"))
        return stats

    # ------------------------------------------------------------------ results

    def _head_arrays(self) -> dict[str, np.ndarray]:
        """Every per-head scalar of `HEAD_SCALARS` as a float64 ``[layer, head]`` array (NaN: undefined)."""
        a = {name: value.cpu().numpy() for name, value in self._acc.items()}
        n, n_pairs, samples = self.seq_len, self.n_pairs, self._n_samples
        shape = (self.n_layers, self.n_heads)

        def ratio(top: Any, bottom: Any) -> np.ndarray:
            top, bottom = np.broadcast_arrays(np.asarray(top, dtype=np.float64), np.asarray(bottom, dtype=np.float64))
            out = np.full(top.shape, np.nan)
            np.divide(top, bottom, out=out, where=bottom > 0)
            return np.broadcast_to(out, shape).copy() if out.ndim == 0 else out

        distances = np.arange(n)
        all_hist = (n - distances) * (distances > 0)  # pairs per window at distance d
        short = (distances > 0) & (distances <= self.config.short_range)
        hist = a["high_distance_hist"].astype(np.float64)
        high = a["high_pairs"].astype(np.float64)
        mean_of_means = ratio(a["offdiag_mean_sum"], samples)
        # Pooled variance: within-matrix part + between-matrix part (all in float64).
        between = n_pairs * (a["offdiag_mean_sq_sum"] - samples * np.nan_to_num(mean_of_means) ** 2)
        variance = ratio(a["offdiag_m2_sum"] + between, samples * n_pairs)
        out = {
            "similarity_mean": mean_of_means,
            "similarity_std": np.sqrt(np.clip(variance, 0.0, None)),
            "high_pairs_per_sample": ratio(high, samples),
            "mean_distance_high": ratio((hist * distances).sum(-1), high),
            "mean_distance_all": ratio((all_hist * distances).sum(), all_hist.sum()),
            "short_range_share": ratio(hist[..., short].sum(-1), high),
            "short_range_chance": ratio(all_hist[short].sum(), all_hist.sum()),
            "same_sentence_share": ratio(a["high_same_sentence"], a["high_sentence_eligible"]),
            "same_sentence_chance": ratio(a["pairs_same_sentence"], a["pairs_sentence_eligible"]),
            "repeat_share": ratio(a["high_repeat"], high),
            "repeat_chance": ratio(a["pairs_repeat"], samples * n_pairs),
            "signal_share": ratio(a["high_in_attention"], high),
            "signal_chance": ratio(top_count(self.config.attention_top_percent, n_pairs), n_pairs),
            "anchor_share": ratio(a["anchor_share_sum"], a["high_nonempty"]),
            "anchor_share_chance": ratio(a["anchor_chance_sum"], samples),
        }
        out["long_range_share"] = 1.0 - out["short_range_share"]
        out["long_range_chance"] = 1.0 - out["short_range_chance"]
        out["noise_share"] = 1.0 - out["signal_share"]
        for name in ATTENTION_POSITIONS:
            out[f"attention_{name}"] = ratio(a[f"attention_{name}_sum"], samples)
        return {name: out[name] for name in HEAD_SCALARS}

    def _attention_to(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean attention received by each named token ``[layer, head, named]`` and its chance ``[named]``."""
        samples = max(self._n_samples, 1)
        received = self._acc["attention_to_sum"].cpu().numpy() / samples
        chance = self._acc["token_occurrences"].cpu().numpy() / (samples * self.seq_len)
        if self._n_samples == 0:
            received = np.full_like(received, np.nan)
            chance = np.full_like(chance, np.nan, dtype=np.float64)
        return received, chance

    def _top_anchors(self) -> tuple[np.ndarray, np.ndarray]:
        """The ``n_anchor_tokens`` most frequent anchors per head: ids and counts ``[layer, head, k]``.

        Unused slots hold id -1 and count 0; ties go to the smaller token id.
        """
        k = self.config.n_anchor_tokens
        table = self._anchor_counts.cpu()
        ids = torch.full((table.shape[0], k), -1, dtype=_I64)
        counts = torch.zeros((table.shape[0], k), dtype=_I64)
        if table.shape[1] > 0:
            width = min(k, table.shape[1])
            # Stable descending sort: equal counts keep token-id order.
            order = torch.sort(table, dim=1, descending=True, stable=True).indices[:, :width]
            top = table.gather(1, order)
            ids[:, :width] = torch.where(top > 0, order, -1)
            counts[:, :width] = top
        shape = (self.n_layers, self.n_heads, k)
        return ids.view(shape).numpy(), counts.view(shape).numpy()

    def arrays(self) -> dict[str, np.ndarray]:
        """Result arrays for ``stats.npz`` (means, histograms, per-head scalars ``[layer, head]``)."""
        samples = self._n_samples
        n = self.seq_len
        distances = np.arange(n)
        attention_to, attention_to_chance = self._attention_to()
        anchor_ids, anchor_counts = self._top_anchors()
        out: dict[str, np.ndarray] = {
            "mean_similarity": (
                self._acc["similarity_sum"].cpu().numpy() / samples
                if samples
                else np.full((self.n_layers, self.n_heads, n, n), np.nan)
            ),  # [layer, head, n, n]
            "high_distance_hist": self._acc["high_distance_hist"].cpu().numpy(),  # [layer, head, distance]
            "all_distance_hist": samples * (n - distances) * (distances > 0),  # [distance]
            "attention_to": attention_to,  # [layer, head, named token]
            "attention_to_chance": attention_to_chance,  # [named token]
            "attention_token_names": np.array(self.token_names, dtype=str),
            "top_anchor_ids": anchor_ids,  # [layer, head, n_anchor_tokens], -1 unused
            "top_anchor_counts": anchor_counts,
            "n_samples": np.array(samples),
        }
        out.update(self._head_arrays())
        return out

    def _head_rows(self, id_to_token: Callable[[int], str]) -> list[list[dict[str, Any]]]:
        scalars = self._head_arrays()
        attention_to, _ = self._attention_to()
        anchor_ids, anchor_counts = self._top_anchors()
        layers = []
        for layer in range(self.n_layers):
            heads = []
            for head in range(self.n_heads):
                row: dict[str, Any] = {"layer": layer, "head": head}
                row.update({name: _json_float(values[layer, head]) for name, values in scalars.items()})
                row["attention_to"] = {
                    name: _json_float(attention_to[layer, head, k]) for k, name in enumerate(self.token_names)
                }
                row["top_anchor_tokens"] = [
                    {"token": id_to_token(int(token)), "id": int(token), "count": int(count)}
                    for token, count in zip(anchor_ids[layer, head], anchor_counts[layer, head], strict=True)
                    if count > 0
                ]
                heads.append(row)
            layers.append(heads)
        return layers

    def summary(self, id_to_token: Callable[[int], str]) -> dict[str, Any]:
        """JSON-able results: ``samples``, ``config``, ``chance`` and ``layers`` (each with ``heads``).

        Each head object holds every name of `HEAD_SCALARS`, ``attention_to`` (name → mean
        attention received) and ``top_anchor_tokens`` (``[{"token", "id", "count"}]``, most
        frequent first). A layer object holds the mean over heads of the same scalars and of
        ``attention_to``, plus its ``heads``. Undefined values (no samples, an empty H) are null.
        """
        scalars = self._head_arrays()
        attention_to, attention_to_chance = self._attention_to()
        layers = []
        for layer, heads in enumerate(self._head_rows(id_to_token)):
            entry: dict[str, Any] = {"layer": layer}
            entry.update({name: _json_float(_nanmean(values[layer])) for name, values in scalars.items()})
            entry["attention_to"] = {
                name: _json_float(_nanmean(attention_to[layer, :, k])) for k, name in enumerate(self.token_names)
            }
            entry["heads"] = heads
            layers.append(entry)
        n = self.seq_len
        return {
            "samples": self._n_samples,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "seq_len": n,
            "config": asdict(self.config),
            "high_pairs_per_matrix": top_count(self.rule.value, self.n_pairs)
            if self.rule.kind == "top-percent"
            else None,
            "attention_pairs_per_matrix": top_count(self.config.attention_top_percent, self.n_pairs),
            "chance": {
                "attention_to": {name: _json_float(attention_to_chance[k]) for k, name in enumerate(self.token_names)},
                "attention_self": 1.0 / n,
                "attention_prev": 1.0 / n,
                "attention_next": 1.0 / n,
                "attention_entropy": math.log(n),
            },
            "layers": layers,
        }

    def head_table(self, id_to_token: Callable[[int], str]) -> list[dict[str, Any]]:
        """One flat row per (layer, head) for a CSV: the scalars, ``attention_to_<name>`` columns
        and ``top_anchor_tokens`` as ``"token:count|token:count|…"``."""
        rows = []
        for heads in self._head_rows(id_to_token):
            for head in heads:
                row = {key: value for key, value in head.items() if key not in ("attention_to", "top_anchor_tokens")}
                row.update({f"attention_to_{name}": value for name, value in head["attention_to"].items()})
                row["top_anchor_tokens"] = "|".join(f"{t['token']}:{t['count']}" for t in head["top_anchor_tokens"])
                rows.append(row)
        return rows


@dataclass
class _Window:
    """Per-window pair features of one batch, ``[batch, pair]`` (token ids ``[batch, token]``)."""

    token_ids: torch.Tensor
    label_i: torch.Tensor  # first position of token i's id
    label_j: torch.Tensor
    repeat: torch.Tensor  # token_i == token_j
    eligible: torch.Tensor  # both tokens have a sentence id >= 0
    same_sentence: torch.Tensor  # eligible and equal sentence ids

    def rows(self, rows: slice) -> "_Window":
        """The features of the windows ``rows`` of the batch."""
        return _Window(*(getattr(self, f.name)[rows] for f in fields(self)))


def _maps_device(attentions: torch.Tensor | Sequence[torch.Tensor]) -> torch.device:
    return attentions.device if isinstance(attentions, torch.Tensor) else attentions[0].device


def _attention_block(attentions: torch.Tensor | Sequence[torch.Tensor], layers: slice) -> torch.Tensor:
    """Layers ``layers`` of ``[batch, layer, head, q, k]`` or of per-layer maps, without a copy
    when possible (a single layer of a list, any slice of a tensor)."""
    if isinstance(attentions, torch.Tensor):
        return attentions[:, layers]
    if layers.stop - layers.start == 1:
        return attentions[layers.start].unsqueeze(1)
    return torch.stack(list(attentions[layers]), dim=1)


def kth_largest(values: torch.Tensor, k: int, overwrite: bool = False) -> torch.Tensor:
    """The k-th largest entry along the last axis: ``[..., m]`` -> ``[...]`` (k counts from 1).

    On the CPU numpy's introselect (several times faster than `torch.topk` there; with
    ``overwrite=True`` it reorders ``values`` in place instead of copying them); elsewhere
    `torch.kthvalue`. NaN counts as the largest value.
    """
    size = values.shape[-1]
    if not 1 <= k <= size:
        raise ValueError(f"k must lie in [1, {size}], got {k}")
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64) and not values.requires_grad:
        if overwrite and values.is_contiguous():
            array = values.numpy()
            array.partition(size - k, axis=-1)
            return torch.from_numpy(array[..., size - k].copy())
        array = values.contiguous().numpy()
        return torch.from_numpy(np.partition(array, size - k, axis=-1)[..., size - k].copy())
    return values.kthvalue(size - k + 1, dim=-1).values


def _nanmean(values: np.ndarray) -> float:
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if finite.size else math.nan


def _json_float(value: Any) -> float | None:
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value
