"""Edges between components and the circuits they make: EAP and EAP-IG scores, and the top-k
circuit's faithfulness by exact edge patching.

Nodes. Upstream (what writes into the residual stream): ``emb`` (the stream entering the first
layer), each head ``a{l}.h{h}`` (its share of the attention output: the output projection applied to
its slice alone, bias left out) and each MLP ``m{l}``. Downstream (what reads from it): each
layer's attention block ``a{l}`` (all its heads together), each MLP ``m{l}`` and ``logits``. An edge
u → v joins an upstream node to every downstream node after it (a head of layer l feeds ``m{l}``).

Scores (normalised like patching effects, by m_clean − m_corrupted):

- ``eap`` (Syed et al. 2023): (a_u,clean − a_u,corrupted) · ∂m/∂(v's input), the gradient on the
  corrupted run, summed over positions;
- ``eap-ig`` (Hanna et al. 2024): the same with the gradient averaged over ``steps`` runs whose
  word embeddings go from the corrupted input's towards the clean one's (α = k / steps, k = 0 …
  steps − 1; ``steps=1`` is EAP).

∂m/∂(v's input) is the gradient through v's branch only: in a pre-norm block, resid_mid = resid_pre +
attn_out and resid_post = resid_mid + mlp_out, so the attention branch's is ∂m/∂resid_pre −
∂m/∂attn_out and the MLP branch's ∂m/∂attn_out − ∂m/∂mlp_out; the logits read the last stream.
Families whose blocks do not add up this way (post-norm BERT, sandwich-norm Gemma) are refused: the
decomposition is checked on every run.

Faithfulness of a circuit C (a set of edges): the clean run in which every downstream node v reads
its input with each edge u → v outside C given u's corrupted value (input_v − Σ (a_u − a_u,corrupted)),
as (m_C − m_corrupted) / (m_clean − m_corrupted): 1 = the circuit alone carries the answer. Done
with hooks only: the block's input is lowered by the attention branch's correction, which the
attention output adds back (minus the MLP branch's correction, added back by the MLP output); the
last block's output carries the logits' correction.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.rows.adapters import as_tokens
from attnflow.rows.hook_points import HookPoint, hooks
from attnflow.targets import Target, legacy_target

EDGE_METHODS = ("eap", "eap-ig")
TOLERANCE = 1e-3  # relative error allowed in the residual decomposition check


@dataclass
class EdgeScores:
    """``scores [upstream, downstream]`` (NaN where no edge joins them) and the node names."""

    upstream: list[str]
    downstream: list[str]
    scores: np.ndarray
    method: str
    clean_metric: float
    corrupt_metric: float
    faithfulness: dict[int, float] = field(default_factory=dict)

    def top_edges(self, k: int) -> list[tuple[int, int]]:
        """The ``k`` edges (upstream index, downstream index) with the largest |score|."""
        flat = np.where(np.isfinite(self.scores), np.abs(self.scores), -np.inf).ravel()
        order = np.argsort(-flat, kind="stable")[: min(k, int(np.isfinite(self.scores).sum()))]
        return [divmod(int(index), self.scores.shape[1]) for index in order]

    def to_dict(self) -> dict[str, Any]:
        """Every number, JSON-ready (NaN for missing edges)."""
        return {
            "method": self.method,
            "upstream": self.upstream,
            "downstream": self.downstream,
            "scores": self.scores.tolist(),
            "clean_metric": self.clean_metric,
            "corrupt_metric": self.corrupt_metric,
            "faithfulness": {str(k): value for k, value in self.faithfulness.items()},
        }


class EdgeGraph:
    """The component graph of one model and one clean/corrupted pair: activations of both runs,
    edge scores and circuit runs."""

    def __init__(
        self,
        model: ModelLike,
        clean: str,
        corrupt: str,
        target: Target | int | str | None = None,
        contrast: int | str | None = None,
    ) -> None:
        from attnflow.causal.api import _token_ids, resolve_metric, warn_if_unreadable
        from attnflow.causal.patching import PatchRunner

        self.model = model
        self.clean_ids = _token_ids(model, clean, "clean")
        self.corrupt_ids = _token_ids(model, corrupt, "corrupt")
        if self.clean_ids.shape != self.corrupt_ids.shape:
            raise InputError(
                f"the clean text is {self.clean_ids.shape[1]} tokens and the corrupt text "
                f"{self.corrupt_ids.shape[1]}: edges need the same token length"
            )
        wanted = legacy_target(target, None, contrast, "EdgeGraph")  # contrast=: deprecated, inside the Target
        self.runner = PatchRunner(model, resolve_metric(model, self.clean_ids, wanted))
        self.runner.modules.check_in_every_layer(("heads",))  # edges start at every layer's heads
        self.n_layers, self.n_heads = model.n_layers, model.n_heads
        self.upstream = ["emb"] + [
            name
            for layer in range(self.n_layers)
            for name in [*(f"a{layer}.h{head}" for head in range(self.n_heads)), f"m{layer}"]
        ]
        self.downstream = [name for layer in range(self.n_layers) for name in (f"a{layer}", f"m{layer}")] + ["logits"]
        self.valid = self._valid_edges()  # [upstream, downstream] bool
        with torch.no_grad():
            self.clean_metric, clean_run = self.runner.forward(self.clean_ids, 1, record=True)
            self.corrupt_metric, corrupt_run = self.runner.forward(self.corrupt_ids, 1, record=True)
            self.clean_nodes = self._node_outputs(clean_run)  # [upstream, token, d_model]
            self.corrupt_nodes = self._node_outputs(corrupt_run)
        self.difference = float(self.clean_metric) - float(self.corrupt_metric)
        if abs(self.difference) < 1e-6:
            raise InputError("the corruption does not change the metric: nothing to attribute to edges")
        warn_if_unreadable(self.runner.metric, float(self.clean_metric), float(self.corrupt_metric))

    def _valid_edges(self) -> np.ndarray:
        """``[upstream, downstream]``: whether u is computed before v reads the stream."""

        def writes(name: str) -> float:  # the stage after which the node has written
            if name == "emb":
                return -1.0
            layer = int(name[1:].split(".")[0])
            return layer + (0.5 if name.startswith("m") else 0.0)

        def reads(name: str) -> float:  # the stage at which the node reads
            if name == "logits":
                return float(self.n_layers)
            layer = int(name[1:])
            return layer + (0.25 if name.startswith("m") else -0.25)

        return np.array([[writes(u) < reads(v) for v in self.downstream] for u in self.upstream])

    def _head_shares(self, layer: int, heads_input: torch.Tensor) -> torch.Tensor:
        """``[head, token, d_model]`` each head's share of the output projection (bias left out)
        from ``heads_input [token, head * d_head]``."""
        projection = self.runner.modules.projections[layer]
        tokens, width = heads_input.shape
        mask = torch.zeros(self.n_heads, 1, width, dtype=heads_input.dtype, device=heads_input.device)
        for head in range(self.n_heads):
            mask[head, :, head * (width // self.n_heads) : (head + 1) * (width // self.n_heads)] = 1
        # forward(), not __call__: no hook of the projection runs again (the circuit run hooks it)
        bias = projection.forward(torch.zeros(1, tokens, width, dtype=heads_input.dtype, device=heads_input.device))
        return projection.forward(heads_input[None] * mask) - bias  # [head, token, d_model]

    def _node_outputs(self, recorded: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        """``[upstream, token, d_model]`` what each upstream node writes (sample 0), after checking
        that the stream is their sum (pre-norm blocks)."""
        rows = [recorded["residual"][0][0].detach()]
        for layer in range(self.n_layers):
            shares = self._head_shares(layer, recorded["heads"][layer][0].detach())
            rows.extend(shares)
            rows.append(recorded["mlp"][layer][0].detach())
            attention = recorded["attn"][layer][0].detach()
            before, after = recorded["residual"][layer][0], recorded["residual"][layer + 1][0]
            bias = attention - shares.sum(dim=0)  # the output projection's bias (constant over heads)
            self._check_sum(after, before + attention + recorded["mlp"][layer][0], layer, "the residual stream")
            self._check_sum(
                attention, shares.sum(dim=0) + bias.mean(dim=0, keepdim=True), layer, "the attention output"
            )
        return torch.stack(rows)

    def _check_sum(self, actual: torch.Tensor, expected: torch.Tensor, layer: int, what: str) -> None:
        error = float((actual - expected).abs().max()) / max(float(actual.abs().max()), 1e-12)
        if error > TOLERANCE:
            raise InputError(
                f"edge attribution needs pre-norm blocks whose parts add up to the stream: at layer {layer} "
                f"{what} of {self.model.name} ({self.model.adapter.family}) is not their sum "
                f"(relative error {error:.1e})"
            )

    def scores(self, method: str = "eap", steps: int = 5) -> EdgeScores:
        """EAP or EAP-IG scores of every edge (module docstring)."""
        from attnflow.causal.approximations import _gradients

        if method not in EDGE_METHODS:
            raise InputError(f"unknown edge method {method!r}; choose from {', '.join(EDGE_METHODS)}")
        rows = 1 if method == "eap" else steps
        if rows < 1:
            raise InputError("{steps} must be at least 1", parameter="steps")
        embeddings = self.runner.modules.embeddings
        with torch.no_grad():
            towards_clean = embeddings(self.clean_ids.to(self.model.device)) - embeddings(
                self.corrupt_ids.to(self.model.device)
            )  # [1, token, d_model]
        alphas = torch.arange(rows, dtype=towards_clean.dtype, device=towards_clean.device) / rows
        noise = alphas[:, None, None] * towards_clean  # [rows, token, d_model]
        gradients, _ = _gradients(self.runner, self.corrupt_ids, noise, rows)
        residual = gradients["residual"].mean(dim=0)  # [L + 1, token, d_model]
        attention, mlp = gradients["attn"].mean(dim=0), gradients["mlp"].mean(dim=0)  # [L, token, d_model]
        reads = []
        for layer in range(self.n_layers):
            reads.append(residual[layer] - attention[layer])  # the attention branch's input
            reads.append(attention[layer] - mlp[layer])  # the MLP branch's input
        reads.append(residual[self.n_layers])  # the logits read the last stream
        change = (self.clean_nodes - self.corrupt_nodes).double()  # [upstream, token, d_model]
        scores = torch.einsum("utd,vtd->uv", change, torch.stack(reads).double()).cpu().numpy()
        return EdgeScores(
            self.upstream,
            self.downstream,
            np.where(self.valid, scores / self.difference, np.nan),
            method,
            float(self.clean_metric),
            float(self.corrupt_metric),
        )

    def circuit_metric(self, edges: Sequence[tuple[int, int]]) -> float:
        """m on the clean input with every edge outside ``edges`` (upstream, downstream indices)
        given its upstream node's corrupted value."""
        outside = self.valid.copy()
        for up, down in edges:
            outside[up, down] = False
        with torch.no_grad(), self._edge_patching(torch.as_tensor(outside)):
            metric, _ = self.runner.forward(self.clean_ids, 1)
        return float(metric)

    def faithfulness(self, edges: Sequence[tuple[int, int]]) -> float:
        """(m_C − m_corrupted) / (m_clean − m_corrupted) of the circuit ``edges``."""
        return (self.circuit_metric(edges) - float(self.corrupt_metric)) / self.difference

    @contextmanager
    def _edge_patching(self, outside: torch.Tensor) -> Iterator[None]:
        """Hooks that give each downstream node its input with the edges ``outside [upstream,
        downstream]`` corrupted (module docstring), in a batch of one clean row."""
        modules = self.runner.modules
        current: list[torch.Tensor] = []  # what each upstream node writes in this run, in order
        corrupted = self.corrupt_nodes

        def correction(down: int) -> torch.Tensor:
            """Σ over the edges u → down outside the circuit of (a_u − a_u,corrupted): [token, d_model]."""
            count = len(current)
            chosen = outside[:count, down].to(corrupted.device)
            return ((torch.stack(current) - corrupted[:count]) * chosen[:, None, None]).sum(dim=0)

        corrections: dict[str, torch.Tensor] = {}

        def block_input(layer: int) -> Any:
            def hook(hidden: torch.Tensor) -> torch.Tensor:
                if layer == 0:
                    current.append(hidden[0])
                corrections["attn"] = correction(2 * layer)
                return hidden - corrections["attn"]

            return hook

        def heads_input(layer: int) -> Any:
            def hook(hidden: torch.Tensor) -> None:
                current.extend(self._head_shares(layer, hidden[0]))

            return hook

        def attention_output(layer: int) -> Any:
            def hook(hidden: torch.Tensor) -> torch.Tensor:
                corrections["mlp"] = correction(2 * layer + 1)
                return hidden + corrections["attn"] - corrections["mlp"]

            return hook

        def mlp_output(hidden: torch.Tensor) -> torch.Tensor:
            shaped = as_tokens(hidden, 1)  # [1, token, d_model] (a flattened feed-forward block's too)
            current.append(shaped[0])
            return (shaped + corrections["mlp"]).reshape(hidden.shape)

        def last_block_output(hidden: torch.Tensor) -> torch.Tensor:
            return hidden - correction(2 * self.n_layers)

        hooked: list[tuple[HookPoint, Any]] = []
        for layer in range(self.n_layers):
            hooked += [
                (HookPoint(modules.blocks[layer], "input"), block_input(layer)),
                (HookPoint(modules.projections[layer], "input"), heads_input(layer)),
                (HookPoint(modules.attention[layer], "output"), attention_output(layer)),
                (HookPoint(modules.mlp[layer], "output"), mlp_output),
            ]
        hooked.append((HookPoint(modules.blocks[-1], "output"), last_block_output))
        with hooks(hooked):
            yield


def edge_scores(
    model: ModelLike,
    clean: str,
    corrupt: str,
    *,
    target: Target | int | str | None = None,
    contrast: int | str | None = None,
    method: str = "eap-ig",
    steps: int = 5,
    circuit_sizes: Sequence[int] = (10, 50, 200, 1000),
) -> EdgeScores:
    """EAP or EAP-IG scores of every edge of ``model`` on one pair, with the faithfulness of the
    top-k circuit for each k in ``circuit_sizes`` (module docstring). ``target``: what the metric
    reads, as in `attnflow.patch` (a `attnflow.targets.Target`, its contrast included; or a class or
    token for short); ``contrast``: deprecated, the contrast inside the ``target``."""
    graph = EdgeGraph(model, clean, corrupt, legacy_target(target, None, contrast, "edge_scores"))
    result = graph.scores(method, steps)
    for k in circuit_sizes:
        result.faithfulness[int(k)] = graph.faithfulness(result.top_edges(int(k)))
    return result
