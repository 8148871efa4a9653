"""Exact activation patching on the Hugging Face model itself, through hooks at the hook points of
the site table (`attnflow.rows.site_kinds`), registered by `attnflow.rows.hook_points.hooks`.

`PatchRunner.forward` runs the model on a batch of copies of one input; each batch row may have
its own embedding noise and its own patched sites (a site's activation replaced by a given value,
or an intervention such as an attention knockout written in), and the run can record every
activation site (in the autograd graph when gradients are wanted).
`exact_sweep` patches one site per row: a sweep over n sites costs n / batch_size forward passes.
No model class is converted: the logits are the model's own.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from attnflow.causal.sites import Site, SiteModules, site_kind
from attnflow.model_like import ModelLike
from attnflow.rows.hook_points import HookPoint, hooks
from attnflow.rows.site_kinds import SITE_TABLE, SiteKind, Write

# Recorded activations of one run, per activation kind (`PatchRunner.activation_kinds`), one tensor
# per row of the kind's sweep (row 0 of ``residual`` is the stream entering the first layer):
# residual/attn/mlp ``[batch, token, d_model]``, heads ``[batch, token, head * d_head]``, experts
# ``[batch, token, expert, d_model]``.
Recorded = dict[str, list[torch.Tensor]]


@dataclass(frozen=True)
class Metric:
    """The scalar a patch is judged by, computed from the logits of a batch: the patching view of a
    `attnflow.targets.Objective` (`Metric.of`), read from the logits the patched runs return.

    ``kind``: ``"class"`` (classifier logits ``[batch, class]``) or ``"next_token"`` (LM logits
    ``[batch, token, vocab]``, read at the last position); ``target``: class index or token id;
    ``contrast``: None (class logit, or log p(target) for LMs) or a second class / token (the
    logit difference target − contrast); ``label``/``contrast_label``: their names.
    """

    kind: str
    target: int
    contrast: int | None = None
    label: str = ""
    contrast_label: str | None = None

    @classmethod
    def of(cls, objective: Any, index: int) -> Metric:
        """The metric of a class or next-token `attnflow.targets.Objective` for class or token ``index``
        (the objective's contrast, if any, and the names of both)."""
        contrast = objective.contrast_index
        contrast_label = None if contrast is None else objective.label_of(contrast)
        return cls(objective.kind, index, contrast, objective.label_of(index), contrast_label)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``[batch]`` metric values."""
        scores = logits[:, -1] if self.kind == "next_token" else logits  # [batch, vocab or class]
        if self.contrast is not None:
            return scores[:, self.target] - scores[:, self.contrast]
        if self.kind == "next_token":
            return torch.log_softmax(scores, dim=-1)[:, self.target]
        return scores[:, self.target]

    def describe(self) -> str:
        """``log p(' Paris')``, ``logit(' Paris') - logit(' Rome')``, ``logit(positive)``."""
        if self.contrast is not None:
            return f"logit({self.label!r}) - logit({self.contrast_label!r})"
        return f"log p({self.label!r})" if self.kind == "next_token" else f"logit({self.label!r})"


@dataclass
class Patches:
    """Patched sites of one batch: per hook point ``(kind, row of the kind's sweep array, the one
    position)``, the batch rows, the indices (positions, heads, key positions) and the values
    (``[n, d_model]``; heads: ``[n, token, d_head]`` at every position, ``[n, d_head]`` at one;
    None for an intervention). A windowed site (knockout) is added at each layer it spans."""

    rows: dict[tuple[str, int, int | None], list[int]] = field(default_factory=dict)
    indices: dict[tuple[str, int, int | None], list[int]] = field(default_factory=dict)
    values: dict[tuple[str, int, int | None], list[torch.Tensor | None]] = field(default_factory=dict)

    def add(self, row: int, site: Site, value: torch.Tensor | None) -> None:
        """Row ``row`` gets ``value`` at ``site``."""
        for layer in site.hook_layers():
            key = (site.kind, layer, site.head_position)
            self.rows.setdefault(key, []).append(row)
            self.indices.setdefault(key, []).append(site.index)
            self.values.setdefault(key, []).append(value)

    def writes(self, kind: str, layer: int, like: torch.Tensor) -> list[Write]:
        """The `Write`s at one hook point, on ``like``'s device (values in its dtype)."""
        found = []
        for key in self.rows:
            if key[:2] != (kind, layer):
                continue
            values = [value for value in self.values[key] if value is not None]
            stacked = torch.stack(values).to(like.device, like.dtype) if values else None
            rows = torch.as_tensor(self.rows[key], device=like.device)
            found.append(Write(rows, torch.as_tensor(self.indices[key], device=like.device), stacked, key[2]))
        return found


@dataclass(frozen=True)
class BaseRun:
    """The run a sweep patches: ``input_ids [1, token]``, ``noise [samples, token, d_model]`` (None:
    no noise), the ``source`` activations patched in (`stacked`; 1 sample or a divisor of
    ``samples``) and the number of ``samples`` (rows) each site is averaged over;
    ``source_embeddings [1 or samples, token, d_model]``: the word embeddings (noise included) of
    the run the source activations come from, the far end of the path ``atp-ig`` integrates along
    (None: not known)."""

    input_ids: torch.Tensor
    noise: torch.Tensor | None
    source: dict[str, torch.Tensor]
    samples: int
    source_embeddings: torch.Tensor | None = None

    def embeddings(self, runner: "PatchRunner") -> torch.Tensor:
        """``[samples or 1, token, d_model]`` this run's word embeddings, its noise included."""
        with torch.no_grad():
            embedded = runner.modules.embeddings(self.input_ids.to(runner.model.device))  # [1, token, d_model]
        return embedded if self.noise is None else embedded + self.noise.to(embedded.device, embedded.dtype)


class PatchRunner:
    """Forward passes of one model with patched and recorded sites (`SiteModules`)."""

    def __init__(self, model: ModelLike, metric: Metric) -> None:
        self.model = model
        self.metric = metric
        self.modules = SiteModules(model)
        self.n_layers = model.n_layers
        self.n_heads = model.n_heads
        # The activation kinds this model has, each recorded (the default sweep's and the experts').
        self.activation_kinds = tuple(
            row.name for row in SITE_TABLE if row.is_activation and row.name in self.modules.by_kind
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: int,
        *,
        noise: torch.Tensor | None = None,
        patches: Patches | None = None,
        record: bool = False,
        leaf_embeddings: bool = False,
        drop_gradient_rows: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Recorded]:
        """One forward pass of ``input_ids [1, token]`` copied ``batch`` times.

        ``noise [batch, token, d_model]`` is added to the word embeddings; ``patches`` replace
        sites row by row; ``record`` keeps every site's activation (`Recorded`); ``leaf_embeddings``
        makes the word embeddings a leaf that requires grad (so that every site is in the autograd
        graph); ``drop_gradient_rows`` {layer: bool [batch]}: the rows in which no gradient flows
        back through that layer's attention and MLP outputs (GradDrop; forward values unchanged).
        Returns the metric ``[batch]`` and what was recorded.
        """
        ids = input_ids.to(self.model.device).expand(batch, -1)
        recorded: Recorded = {kind: [] for kind in self.activation_kinds} if record else {}
        with self._hooks(patches or Patches(), recorded, noise, leaf_embeddings, drop_gradient_rows or {}, batch):
            logits = self.model.hf_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        return self.metric(logits), recorded

    @contextmanager
    def _hooks(
        self,
        patches: Patches,
        recorded: Recorded,
        noise: torch.Tensor | None,
        leaf_embeddings: bool,
        drop_gradient_rows: dict[int, torch.Tensor],
        batch: int = 1,
    ) -> Iterator[None]:
        """A hook at every row of every activation kind (`SiteModules.points`), and at the rows of
        the interventions ``patches`` writes; removed when the block exits. ``batch``: the forward
        pass's rows (a flattened feed-forward block's tensors are seen ``[batch, token, d]``)."""
        hooked: list[tuple[HookPoint, Callable]] = []
        if noise is not None or leaf_embeddings:
            hooked.append((HookPoint(self.modules.embeddings, "output"), _embedding_hook(noise, leaf_embeddings)))
        written = {key[0] for key in patches.rows}
        for row in SITE_TABLE:
            if row.name not in self.activation_kinds and row.name not in written:
                continue
            for layer, point in zip(self.modules.rows(row.name), self.modules.points(row.name), strict=True):
                drop = drop_gradient_rows.get(layer) if row.adds_to_stream else None
                hooked.append((point, self._site_hook(row, layer, patches, recorded, drop, batch)))
        with hooks(hooked):
            yield

    def _site_hook(
        self, row: SiteKind, layer: int, patches: Patches, recorded: Recorded, drop: torch.Tensor | None, batch: int
    ) -> Callable:
        """The hook of row ``layer`` of ``row``'s sweep: write the patches, record, and (GradDrop)
        pass no gradient back through this output in the rows ``drop`` marks (values unchanged); a
        tensor a flattened feed-forward block holds ``[batch * token, d]`` is seen ``[batch, token,
        d]`` (`SiteKind.on_tokens`)."""

        def change(tensor: torch.Tensor | None, first: torch.Tensor | None) -> torch.Tensor | None:
            writes = patches.writes(row.name, layer, tensor if tensor is not None else first)
            new = row.write(tensor, writes, self.n_heads, first) if writes else tensor
            if recorded and row.is_activation:
                recorded[row.name].append(new)
            if drop is not None and new is not None:
                new = torch.where(drop.to(new.device)[:, None, None], new.detach(), new)
            return new

        def hook(tensor: torch.Tensor | None, first: torch.Tensor | None = None) -> torch.Tensor | None:
            return row.on_tokens(tensor, batch, lambda shaped: change(shaped, first))

        return hook


def _embedding_hook(noise: torch.Tensor | None, leaf: bool) -> Callable:
    def hook(output: torch.Tensor) -> torch.Tensor:
        embedded = output.detach() if leaf else output
        if noise is not None:
            embedded = embedded + noise.to(embedded.device, embedded.dtype)
        return embedded.requires_grad_(True) if leaf else embedded

    return hook


def stacked(recorded: Recorded) -> dict[str, torch.Tensor]:
    """Detached activations per kind: residual ``[batch, L + 1, token, d_model]``, attn and mlp
    ``[batch, L, token, d_model]``, heads ``[batch, L, token, head * d_head]``."""
    return {kind: torch.stack([tensor.detach() for tensor in tensors], dim=1) for kind, tensors in recorded.items()}


def site_value(
    activations: dict[str, torch.Tensor], sample: int, site: Site, n_heads: int, row: int | None = None
) -> torch.Tensor | None:
    """The value a site takes in sample ``sample`` of a recorded run: ``[d_model]`` at one
    position; for one head ``[token, d_head]``, or ``[d_head]`` at its one position; None for an
    intervention (knockout), which no run supplies. ``row``: where the site's layer is in the
    recorded activations (`SiteModules.recorded_row`; None: ``site.layer``)."""
    read = site_kind(site.kind).read
    if read is None:
        return None
    recorded = site.layer if row is None else row
    layer = activations[site.kind][sample % len(activations[site.kind]), recorded]
    return read(layer, site.index, site.head_position, n_heads)


def exact_sweep(
    runner: PatchRunner,
    input_ids: torch.Tensor,
    noise: torch.Tensor | None,
    source: dict[str, torch.Tensor],
    sites: Sequence[Site],
    samples: int,
    batch_size: int,
    progress: Callable[[int], None] | None = None,
) -> np.ndarray:
    """The metric with each site patched to its value in ``source`` (`stacked` activations),
    ``[n_sites]``, averaged over ``samples`` rows per site (row i: noise ``noise[i]`` when given,
    source sample ``i mod len(source)``). One forward pass per ``batch_size`` rows;
    ``progress(n)`` after each pass with the number of sites done in it."""
    per_pass = max(1, batch_size // samples)
    metrics = []
    with torch.no_grad():
        for start in range(0, len(sites), per_pass):
            chunk = sites[start : start + per_pass]
            patches = Patches()
            for number, site in enumerate(chunk):
                recorded = runner.modules.recorded_row(site.kind, site.layer) if site.kind in source else None
                for sample in range(samples):
                    value = site_value(source, sample, site, runner.n_heads, recorded)
                    patches.add(number * samples + sample, site, value)
            rows = len(chunk) * samples
            batch_noise = None if noise is None else noise.repeat(len(chunk), 1, 1)
            values, _ = runner.forward(input_ids, rows, noise=batch_noise, patches=patches)
            metrics.append(values.double().reshape(len(chunk), samples).mean(dim=1).cpu().numpy())
            if progress is not None:
                progress(len(chunk))
    return np.concatenate(metrics) if metrics else np.zeros(0)
