"""The audit's Ray engine (``--engine ray``): model replicas as actors, each with its own
`AuditStats`, merged on the driver (`attnflow.runs.actors.ActorPool`: least busy actor
first, a killed actor replaced and its batches since the last checkpoint recomputed)."""

from __future__ import annotations

from typing import Any

from attnflow.dataset_audit.stats import AuditStats
from attnflow.dataset_audit.step import AuditOptions, Batch, audit_batch
from attnflow.dataset_audit.words import SwapTable
from attnflow.runs.actors import ActorPool


class AuditWorker:
    """A Ray actor: one model replica and its own accumulator."""

    def __init__(self, options: AuditOptions, n_classes: int, swaps: SwapTable, threads: int, device: str):
        import torch

        from attnflow.evaluate.scorer import ClassifierScorer
        from attnflow.model import load

        torch.set_num_threads(max(1, threads))
        self.options, self.n_classes, self.swaps = options, n_classes, swaps
        self.model = load(options.model, device=device)
        self.scorer = ClassifierScorer(self.model)
        self.stats = AuditStats(n_classes)

    def process(self, first: int, texts: tuple[str, ...], labels: tuple[int, ...] | None) -> int:
        batch = Batch(first, texts, labels)
        for result in audit_batch(self.model, self.options.method, batch, self.swaps, self.scorer):
            self.stats.update(result)
        return len(texts)

    def take(self) -> dict[str, Any]:
        """The accumulated state since the last `take`; the actor starts a fresh accumulator."""
        state = self.stats.state_dict()
        self.stats = AuditStats(self.n_classes)
        return state


class AuditRayBackend(ActorPool):
    """`attnflow.dataset_audit.engine.Backend` over Ray actors."""

    def __init__(self, options: AuditOptions, stats: AuditStats, swaps: SwapTable) -> None:
        super().__init__(
            AuditWorker,
            (options, stats.n_classes, swaps),
            workers=options.workers,
            ray_address=options.ray_address,
            device=options.device,
        )
        self.stats = stats

    def process(self, batch: Batch) -> None:
        self.submit(batch.first, batch.texts, batch.labels)

    def collect(self) -> AuditStats:
        for state in self.take_all():
            self.stats = self.stats.merge(AuditStats.from_state_dict(state))
        return self.stats
