"""What a request will cost, estimated before it runs: the cost model that `attnflow serve` holds
its requests to (`attnflow.serve.costs`: 413 for what cannot finish within its time limit) and that
`attnflow why` plans its evidence with (`attnflow.question.plan`).

A request's work is counted per step (`Work`: forward passes of the model, the tokens they hold,
max-flow steps) from the text's tokens (n, of which m are content tokens) and each method's
declared cost (`attnflow.methods.registry.MethodSpec.cost`):

- the trace: one forward pass of the n tokens (and a backward pass when a method reads gradients);
  the methods computed from it (rollout, raw, norm, the gradient maps) add nothing;
- ``backward`` methods that re-run the model (attnlrp, cp_lrp, gim): a forward and a backward pass;
- ``expensive`` ones, what they run: leave-one-out m + 1 variants of the text, SHAP its coalitions
  (all 2^m up to ``max_evals``, else about ``max_evals``; removing its absent tokens, a coalition
  holds about half of the text), integrated gradients ``n_steps`` forward
  and backward passes, value zeroing n variants of each layer (about n passes of the text),
  attention flow L·n³ max-flow steps; another package's expensive method counts as leave-one-out;
- per-input faithfulness, what `attnflow.evaluate.per_input.BUDGET` lets it score: the bounds'
  search and the deletion curves of each map and of the random rankings;
- information flow routes (`routes_parts`): one forward pass, then the contribution graph, whose
  work grows as n² (about n / `ROUTES_GRAPH_PER` passes' worth of tokens), with the route and the lens;
- ALTI (`alti_ops`): for each layer, every query's [key, d_model] vectors of contributions, an
  einsum of H multiply-adds per element and `ALTI_PASSES` elementwise passes over them:
  L·n²·d·(H + `ALTI_PASSES`) operations, whether explained or explored;
- the explorer (`explore_parts`): the two traces (plain, and with the target and a backward pass),
  each method's own work, attention flow per head too (a head's own graph costs about
  n / `FLOW_HEAD_N` times a fused one: its sparser attention takes longer augmenting paths), every
  view's layers and heads summarised (about the L·H·n² elements of the attention), its per-input
  faithfulness, and the page that holds every matrix.

Seconds are ``passes · a + tokens · b`` (`Rates`, a backward pass counted as two forward ones)
plus ``flow · f``, ``elements · e`` and ``alti · c``: ``a`` and ``b`` are measured on the model itself when it
first serves (two timed forward passes, `calibrate`) and scaled by what finished heavy requests took
against their estimate (`Costs.observe`); ``f`` and ``e`` (max-flow steps and the explorer's array
work, which depend on the machine and not on the model) from a timed integer loop in the same
calibration (`cpu_seconds`), so that a busy machine's slower flows are foreseen like its slower passes;
``c`` by timing ALTI itself (`alti_op_seconds`: the method on a synthetic one-layer trace of
`ALTI_BLOCK` tokens with the model's heads and width, divided by its `alti_ops`), in the same
calibration and the same way (the fastest of three).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from attnflow.model_like import ModelLike

FLOW_S = 1e-7  # seconds per max-flow step (L·n³ units): over 60 s for the 512-token matrix of a 6-layer model here
# Measured against `cpu_seconds` (minilm-sentiment's attention, one thread, load average 11-14,
# cpu_seconds 0.080-0.095): a fused graph's max-flow step 7.9e-6-8.4e-6 times it (n = 64 and 128;
# 1.4e-5 at n = 32, where fixed costs weigh), a head's own graph n / 29-33 times a fused one's
# (n = 32, 64, 96); the explorer's views 2.5e-7-4.6e-7 s per attention element (raw, rollout,
# norm, norm rollout at 256 tokens: 3.5e-6 cpu_seconds), the page 4.6e-7 s per
# element of the matrices it holds (5.4e-6 cpu_seconds; 9.1 MB at 256 tokens).
FLOW_PER_CPU = 8e-6
FLOW_HEAD_N = 30
ELEMENT_PER_CPU = 3.5e-6
# ALTI (`alti_ops`): relevance.alti_matrices's elementwise passes over each [query, key, d_model]
# block besides the einsum that forms it (the key sum for y, the mean, the centring, the gain, the
# division by σ, the difference from x̃, its absolute value and its sum over d_model).
ALTI_PASSES = 8
ALTI_BLOCK = 64  # tokens of the synthetic trace `alti_op_seconds` times (at least two query chunks)
# Seconds per ALTI operation without a calibration: measured here (one thread, process CPU time,
# 12 heads, width 384): 8.5e-10 at 64 tokens, 6.3e-10-9.3e-10 from 128 to 512 tokens.
ALTI_S = 9e-10
PAGE_ELEMENTS = 1.55  # the page's work per element of a matrix it holds, in view elements (5.4e-6 / 3.5e-6)
REFERENCE_CPU_S = FLOW_S / FLOW_PER_CPU  # the machine `FLOW_S` describes: the rates given without calibration
ELEMENT_S = ELEMENT_PER_CPU * REFERENCE_CPU_S
PAGE = "page"
TRACE = "tracing"
FAITHFULNESS = "faithfulness"
SCALED_ABOVE_S = 0.3  # requests estimated at least this long teach `Rates.scale`
# The routes' graph, route and lens take about n / ROUTES_GRAPH_PER times the forward pass of n
# tokens (docs/routes.md, smollm2 at 512 tokens: forward pass 3.4 s, the rest 20.3 s).
ROUTES_GRAPH_PER = 85
ROUTES = "routes"


@dataclass(frozen=True)
class Work:
    """Work of one step: ``passes`` forward passes holding ``tokens`` tokens in all, ``flow`` max-flow
    steps, ``elements`` array elements the explorer summarises (`explore_parts`), ``alti`` ALTI's
    operations (`alti_ops`)."""

    passes: float = 0.0
    tokens: float = 0.0
    flow: float = 0.0
    elements: float = 0.0
    alti: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(
            self.passes + other.passes,
            self.tokens + other.tokens,
            self.flow + other.flow,
            self.elements + other.elements,
            self.alti + other.alti,
        )

    def times(self, factor: float) -> Work:
        return Work(
            self.passes * factor, self.tokens * factor, self.flow * factor, self.elements * factor, self.alti * factor
        )


@dataclass(frozen=True)
class Rates:
    """A model's measured speed: ``pass_s`` seconds per forward pass plus ``token_s`` per token it
    holds, ``flow_s`` per max-flow step, ``element_s`` per array element the explorer summarises,
    ``alti_s`` per ALTI operation; ``scale``: finished requests' time over their estimate; ``cpu_s``:
    the machine's `cpu_seconds` when it was measured (``flow_s`` moves within [1/4, 8] times what
    that gives)."""

    pass_s: float
    token_s: float
    flow_s: float = FLOW_S
    scale: float = 1.0
    element_s: float = ELEMENT_S
    cpu_s: float = REFERENCE_CPU_S
    alti_s: float = ALTI_S

    def seconds(self, work: Work) -> float:
        passes = self.scale * (work.passes * self.pass_s + work.tokens * self.token_s)
        return passes + work.flow * self.flow_s + work.elements * self.element_s + work.alti * self.alti_s


@dataclass(frozen=True)
class Shape:
    """What the work of a model depends on besides the text: its layers, heads and ``width``
    (d_model; 0: 64 per head)."""

    layers: int
    heads: int
    width: int = 0

    @property
    def d_model(self) -> int:
        return self.width or 64 * self.heads

    @classmethod
    def of(cls, model: ModelLike) -> Shape:
        return cls(model.n_layers, model.n_heads, int(model.d_model))


Parts = dict[str, Work]  # step name -> its work
Estimator = Callable[[int], Parts]  # tokens n -> the work of each step, for a text of n tokens


def method_work(name: str, options: Mapping[str, Any], n: int, shape: Shape) -> Work:
    """The work method ``name`` adds to the trace of ``n`` tokens (module docstring)."""
    from attnflow.methods.registry import get_method

    spec = get_method(name)
    m = max(1, n - 2)
    batch = max(1, int(options.get("batch_size", 32)))
    if name == "flow":
        return Work(flow=shape.layers * n**3)
    if name == "alti":
        return Work(alti=alti_ops(n, shape))
    if spec.takes != "model":
        return Work()  # computed from the trace
    if name == "shap":  # removing a coalition's absent tokens (the default) leaves about half of them
        evals = max(int(options.get("max_evals", 512)), m + 1)
        length = n if options.get("replace", "remove") != "remove" else n - m // 2
        return _variants(2**m if m < 40 and 2**m <= evals else evals, length, batch)
    if name == "integrated_gradients":  # captum's layer attribution: the layer's inputs, then forward and backward
        steps = int(options.get("n_steps", 32))
        return Work(4 * math.ceil(steps / 16) + 2, 4 * steps * n + 2 * n)
    if name == "value_zeroing":
        return Work(math.ceil(n / batch) + 1, n * n + n)  # n variants of each layer: about n whole passes
    if spec.cost == "expensive":  # leave-one-out, and any other expensive method: a variant per content token
        return _variants(m + 1, n, batch)
    return Work(3, 3 * n) if spec.cost == "backward" else Work(1, n)


def trace_work(names: Sequence[str], n: int) -> Work:
    """The trace's forward pass of ``n`` tokens, and its backward pass when a method reads gradients."""
    from attnflow.methods.registry import get_method

    backward = any(get_method(name).cost == "backward" and get_method(name).takes != "model" for name in names)
    return Work(3, 3 * n) if backward else Work(1, n)


def faithfulness_work(maps: int, n: int) -> Work:
    """Per-input faithfulness of ``maps`` maps on ``n`` tokens, within `per_input.BUDGET`."""
    from attnflow.evaluate.bounds import search_cost
    from attnflow.evaluate.metrics import top_count
    from attnflow.evaluate.per_input import BINS, BUDGET, RANDOM_RANKINGS

    m = max(1, n - 2)
    if maps == 0 or BUDGET.skipped(m):
        return Work()
    search = BUDGET.bounds_search(m, n)
    bounds = search_cost(m, [top_count(k, m) for k in BINS], search, beam_width=1)
    return _variants((RANDOM_RANKINGS + maps) * 2 * len(BINS) + bounds, n, 32)


def explain_parts(
    per_method: Mapping[str, Mapping[str, Any]],
    n: int,
    shape: Shape,
    faithfulness: bool,
    per_head: bool = False,
    steps: int = 1,
) -> Parts:
    """The work of the methods ``per_method`` (name -> options) on ``n`` tokens, with faithfulness
    (`attnflow.evaluate.per_input.explain_planned`); ``per_head``: each per-head method again per
    head (the explorer); ``steps``: per generated token (methods that explain a target run per step)."""
    from attnflow.methods.registry import get_method

    names = list(per_method)
    parts: Parts = {TRACE: trace_work(names, n)}
    for name in names:
        spec = get_method(name)
        work = method_work(name, per_method[name], n, shape)
        if per_head and spec.per_head:
            work = work.times(1 + shape.heads)
        parts[name] = work.times(steps if spec.uses_target else 1)
    if faithfulness:
        parts[FAITHFULNESS] = faithfulness_work(len(names), n).times(steps)
    return parts


def explore_parts(names: Sequence[str], n: int, shape: Shape, faithfulness: bool) -> Parts:
    """The work of `attnflow.explore` with the methods ``names`` on ``n`` tokens, with per-input
    faithfulness (a model with a class or next-token target), and its page (module docstring)."""
    from attnflow.methods.registry import get_method

    specs = [get_method(name) for name in names]
    targeted = Work(3, 3 * n) if any(spec.uses_target for spec in specs) else Work()
    parts: Parts = {TRACE: Work(1, n) + targeted}
    attention = shape.layers * shape.heads * n * n
    held = 0  # elements of the matrices the page holds
    for spec in specs:
        work = method_work(spec.name, {}, n, shape)
        if spec.name == "flow":  # the fused graph, then each head's own
            work = work + Work(flow=shape.heads * shape.layers * n**3 * max(1.0, n / FLOW_HEAD_N))
        elif spec.per_head:
            work = work.times(1 + shape.heads)
        if not spec.scores_only:
            work = work + Work(elements=attention)
            layers = shape.layers if spec.layerwise else 1
            held += layers * (1 + shape.heads if spec.per_head else 1) * n * n
        parts[spec.name] = work
    if faithfulness:
        parts[FAITHFULNESS] = Work(1, n) + faithfulness_work(len(specs), n)
    parts[PAGE] = Work(elements=PAGE_ELEMENTS * held)
    return parts


def alti_ops(n: int, shape: Shape) -> float:
    """ALTI's operations on ``n`` tokens: per layer, the [query, key, d_model] contributions formed
    by an einsum over the heads (H multiply-adds an element), then `ALTI_PASSES` elementwise passes."""
    return shape.layers * n * n * shape.d_model * (shape.heads + ALTI_PASSES)


def routes_parts(n: int) -> Parts:
    """The work of `attnflow.routes` on ``n`` tokens: the recorded forward pass, then the graph, the
    route and the lens (`ROUTES_GRAPH_PER`)."""
    return {TRACE: Work(1, n), ROUTES: Work(1, n * n / ROUTES_GRAPH_PER)}


def _variants(count: float, n: int, batch: int) -> Work:
    """``count`` altered copies of an ``n``-token text, scored in batches of ``batch``."""
    return Work(math.ceil(count / batch), count * n)


def count_tokens(tokenizer: Any, text: str, max_length: int | None = None, limit: int | None = None) -> int:
    """The tokens of ``text`` with its special tokens, at most ``max_length`` (and the model's ``limit``)."""
    n = len(tokenizer(text, verbose=False)["input_ids"])
    for cap in (max_length, limit):
        if cap is not None:
            n = min(n, cap)
    return max(1, n)


def position_limit(model: ModelLike) -> int:
    """The most tokens the model reads (``max_length``: a longer text is truncated)."""
    return int(model.max_length)


@functools.lru_cache(maxsize=2)
def cpu_seconds(clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of a fixed integer loop over 2^20 numbers (the fastest of three): the machine's speed
    at the array work of max-flow and the explorer, which a busy machine stretches; measured once
    per process and ``clock`` (by the first model's calibration: about 0.05 s on an idle machine;
    ``time.process_time``: the CPU seconds, which a busy machine does not stretch)."""
    import numpy as np

    fastest = math.inf
    for _ in range(3):
        numbers = np.arange(1 << 20, dtype=np.int64)
        began = clock()
        for _ in range(4):
            numbers = (numbers * 7 + 3) % 1000003
        int(numbers.sum())
        fastest = min(fastest, clock() - began)
    return fastest


def alti_op_seconds(heads: int, width: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per ALTI operation (`alti_ops`): ALTI itself (`relevance.alti_matrices`) on a
    synthetic one-layer trace of `ALTI_BLOCK` tokens with ``heads`` heads and ``width`` (random
    attention, values, weights and stream; the arithmetic does not depend on the numbers), the
    fastest of three runs (timed by ``clock``) over its operations."""
    import numpy as np

    from attnflow.methods.relevance import alti_matrices
    from attnflow.trace import Trace

    n, d_head = ALTI_BLOCK, max(1, width // heads)
    rng = np.random.default_rng(0)
    trace = Trace(
        tokens=["x"] * n,
        token_ids=np.arange(n),
        offsets=np.zeros((n, 2), dtype=np.int64),
        special_mask=np.zeros(n, dtype=bool),
        attentions=rng.dirichlet(np.ones(n), size=(1, heads, n)).astype(np.float32),  # [1, head, q, k]
        values=rng.normal(size=(1, n, heads, d_head)).astype(np.float32),  # [1, token, head, d_head]
        output_weights=rng.normal(size=(1, heads, d_head, heads * d_head)).astype(np.float32),
        layer_inputs=rng.normal(size=(1, n, heads * d_head)).astype(np.float32),  # [1, token, d_model]
        output_bias=np.zeros((1, heads * d_head), dtype=np.float32),
        layer_norms={
            "weight": np.ones((1, heads * d_head), dtype=np.float32),
            "bias": np.zeros((1, heads * d_head), dtype=np.float32),
            "eps": 1e-12,
        },
    )
    fastest = math.inf
    for _ in range(3):
        began = clock()
        alti_matrices(trace)
        fastest = min(fastest, clock() - began)
    return fastest / alti_ops(n, Shape(1, heads, heads * d_head))


def calibrate(model: ModelLike, clock: Callable[[], float] = time.perf_counter) -> Rates | None:
    """``a`` and ``b`` of `Rates` from two timed forward passes (1 × 8 and 8 × 32 tokens, the
    faster of two runs each), the max-flow and array rates from `cpu_seconds`, and ALTI's from
    `alti_op_seconds` (for a family that runs ALTI), all timed by ``clock`` (the wall clock: the
    seconds a request will wait on this machine as busy as it is now; ``time.process_time``: CPU
    seconds, to compare with a run's CPU time on a machine whose load moves); or None for a model
    the passes cannot run on (it answers without estimates)."""
    import torch

    network = model.hf_model
    vocabulary = getattr(getattr(network, "config", None), "vocab_size", None)
    if not isinstance(network, torch.nn.Module) or not vocabulary:
        return None
    timed = []
    try:
        for batch, length in ((1, 8), (8, 32)):
            ids = torch.full((batch, length), min(100, int(vocabulary) - 1), dtype=torch.long, device=model.device)
            fastest = math.inf
            for _ in range(2):
                began = clock()
                with torch.no_grad():
                    network(input_ids=ids, attention_mask=torch.ones_like(ids))
                fastest = min(fastest, clock() - began)
            timed.append(fastest)
    except Exception:  # a model these passes do not fit (encoder-decoder, images): no estimates
        return None
    token_s = max((timed[1] - timed[0]) / (256 - 8), 1e-9)
    cpu = cpu_seconds(clock)
    return Rates(
        pass_s=max(timed[0] - 8 * token_s, 1e-6),
        token_s=token_s,
        flow_s=FLOW_PER_CPU * cpu,
        element_s=ELEMENT_PER_CPU * cpu,
        cpu_s=cpu,
        alti_s=alti_op_seconds(model.n_heads, int(model.d_model), clock) if _runs_alti(model) else ALTI_S,
    )


def _runs_alti(model: ModelLike) -> bool:
    """Whether the model's family runs ALTI (a post-LN family: `methods_for` offers it)."""
    from attnflow.methods.registry import methods_for

    try:
        return "alti" in methods_for(model.adapter)
    except Exception:  # a model without an adapter row: no ALTI to time
        return False
