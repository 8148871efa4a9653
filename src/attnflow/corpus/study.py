"""The corpus study's options and its step (`StudyStep`: the model loaded, an empty accumulator,
one batch of windows into it), which the run engine (`attnflow.runs.engine`) runs in this process
or in model replicas as Ray actors; `attnflow.corpus.engine` builds the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnflow.corpus.stats import StudyConfig, StudyStats
from attnflow.corpus.windows import WindowBatch, marker_token_ids
from attnflow.model_like import ModelLike
from attnflow.runs.readers import ReadOptions


@dataclass
class StudyOptions:
    """Everything a study run is given (the `attnflow corpus` options, as a library object).

    ``samples=None`` takes every window the corpus gives; ``stride=None`` is ``seq_len`` minus the
    special tokens (disjoint windows). ``statistics``: what is counted (`StudyConfig`);
    ``reading``: how the corpus file is read (`ReadOptions`). ``workers``: torch threads for the
    local engine, model replicas (actors) for Ray. ``checkpoint_every``: batches between checkpoints.
    ``dtype``: the model's precision (``float32``, ``bfloat16``, ``float16``; `attnflow.load`).
    """

    model: str = "minilm"
    data: str = "wiki"
    samples: int | None = 20000
    seq_len: int = 128
    stride: int | None = None
    batch_size: int = 16
    statistics: StudyConfig = field(default_factory=StudyConfig)
    reading: ReadOptions = field(default_factory=ReadOptions)
    device: str = "auto"
    dtype: str = "float32"
    engine: str = "local"
    workers: int | None = None
    ray_address: str | None = None
    checkpoint_every: int = 20
    quiet: bool = False


def process_batch(model: ModelLike, stats: StudyStats, batch: WindowBatch) -> None:
    """One batch through ``model.capture_batch`` into ``stats`` (shared by every engine)."""
    import torch

    token_ids = torch.from_numpy(batch.token_ids)  # [batch, seq_len]
    capture = model.capture_batch(token_ids, head_outputs=True)
    device = capture.head_outputs.device
    stats.update(
        token_ids=token_ids.to(device),
        sentence_ids=torch.from_numpy(batch.sentence_ids).to(device),  # [batch, seq_len], -1 special
        attentions=capture.layer_attentions,  # layer x [batch, head, query, key], not copied
        head_outputs=capture.head_outputs,  # [batch, layer, token, head, d_head]
    )


def new_stats(model: ModelLike, options: StudyOptions) -> StudyStats:
    """An empty accumulator shaped for ``model`` and ``options``."""
    special, punctuation = marker_token_ids(model.tokenizer)
    return StudyStats(
        model.n_layers,
        model.n_heads,
        options.seq_len,
        options.statistics,
        special_token_ids=special,
        punctuation_ids=punctuation,
        vocab_size=len(model.tokenizer),
    )


@dataclass(frozen=True)
class StudyStep:
    """The study's `attnflow.runs.engine.Step`: a model replica, its `StudyStats`, a batch of windows."""

    options: StudyOptions

    def load(self, device: str) -> Any:
        from attnflow.model import load

        return load(self.options.model, device=device, dtype=self.options.dtype)

    def empty(self, model: ModelLike) -> StudyStats:
        return new_stats(model, self.options)

    def run(self, model: ModelLike, stats: StudyStats, batch: WindowBatch) -> StudyStats:
        process_batch(model, stats, batch)
        return stats
