"""Embedded classifiers fine-tuned end to end: an embedded classifier (`attnflow.capture.probes`)
whose encoder *and* head are trained further on its task, built on the user's CPU on first install.

The recipe ships (`FINETUNED`: the classifier it starts from and a `Recipe`); the weights do not.
``attnflow models install minilm-sentiment-ft`` runs `attnflow.capture.loading.install_finetuned`:
the classifier it starts from (``minilm-sentiment``: minilm, mean pooling, the logistic-regression
head fitted on frozen features) is trained with AdamW on the same stratified 80 % training split (seed 0) and scored on
the same held-out 20 %, so both held-out accuracies are comparable. The build is reproducible to
the byte with the same seed on the same machine and library versions: ``torch.manual_seed``
(dropout), the order of the examples drawn from ``numpy.random.default_rng(seed)``,
``torch.use_deterministic_algorithms`` and a fixed number of torch threads during the build.

The folder it writes (``<cache>/ALIAS/``, atomically) holds ``model.safetensors`` (the whole
classifier: ``encoder.*`` and ``head.*``) and ``build.json`` (the recipe, the labels, the held-out
accuracy, the time and peak memory of the build, and the sha256 of ``model.safetensors``, checked
at every load). The loaded model is the same ``PooledClassifier`` as the classifier it starts from,
so every method runs on it and ``attnflow audit --versus`` compares the two head for head.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from attnflow.capture.weight_cache import cache_dir, sha256
from attnflow.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
RECORD = "build.json"


@dataclass(frozen=True)
class Recipe:
    """How a classifier is fine-tuned: AdamW over every parameter of the encoder's layers, its
    position embeddings, LayerNorms and the head (the word-embedding table is kept as it is: its
    30k rows would double the optimiser's work for words a sentiment task barely moves), a linear
    warm-up over ``warmup_fraction`` of the steps then a linear decay to zero, dropout as the
    encoder's config sets it. ``train_samples`` examples of the training split are drawn with
    ``seed`` (None: all of them) and seen ``epochs`` times, in batches of texts of similar length
    (`batches`); texts are truncated to ``max_length`` tokens; ``threads`` torch threads."""

    epochs: int = 1
    train_samples: int | None = 4096
    batch_size: int = 32
    learning_rate: float = 5e-5
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1
    max_length: int = 64
    seed: int = 0
    threads: int = 2
    frozen: tuple[str, ...] = ("word_embeddings",)  # parameters whose name holds one of these stay as they are


@dataclass(frozen=True)
class FineTunedSpec:
    """An embedded fine-tuned classifier: the embedded classifier it starts from (its encoder,
    head and task) and its `Recipe`."""

    alias: str
    base: str  # an alias of attnflow.capture.probes.PROBES
    description: str
    recipe: Recipe = field(default_factory=Recipe)
    # what the build cost here, said before a build starts (measured: README's model table)
    minutes: str = "about 1.5 min on an idle 2-core CPU, 2.5 CPU-minutes; longer beside other jobs"


FINETUNED: dict[str, FineTunedSpec] = {
    "minilm-sentiment-ft": FineTunedSpec(
        "minilm-sentiment-ft",
        "minilm-sentiment",
        "minilm-sentiment fine-tuned end to end (encoder layers + head; 1 epoch over 4,096 snippets of "
        "Rotten Tomatoes' training split)",
    ),
}


def finetuned_dir(alias: str) -> Path:
    """The cache folder of the fine-tuned classifier ``alias`` (built or not)."""
    return cache_dir() / _spec(alias).alias


def is_built(alias: str) -> bool:
    """Whether ``alias``'s weights have been built into the cache."""
    folder = finetuned_dir(alias)
    return (folder / WEIGHTS).exists() and (folder / RECORD).exists()


def build_record(alias: str) -> dict[str, Any]:
    """The ``build.json`` of ``alias``'s build (held-out accuracy, sha256, time, memory, ...)."""
    path = finetuned_dir(alias) / RECORD
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"{alias} is not built ({path}: {error}): build it once with `attnflow models install {alias}` "
            f"({_spec(alias).minutes})"
        ) from None


# -- training ------------------------------------------------------------------------------------


@contextmanager
def deterministic(threads: int) -> Iterator[None]:
    """Within the block: ``threads`` torch threads and deterministic algorithms (restored after)."""
    import torch

    previous_threads = torch.get_num_threads()
    previous_mode = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(previous_threads)
        torch.use_deterministic_algorithms(previous_mode)


def fine_tune(
    classifier: torch.nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    labels: np.ndarray,
    recipe: Recipe,
    progress: bool = True,
) -> dict[str, Any]:
    """Train every parameter of ``classifier`` (a ``PooledClassifier``: logits ``[batch, class]``)
    on ``texts`` with integer ``labels`` (``[text]``) as ``recipe`` says, in place; returns the
    training record (steps, last loss). Seeded and deterministic (see the module's docstring)."""
    import torch
    from tqdm.auto import tqdm

    torch.manual_seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    encoded = tokenizer(list(texts), truncation=True, max_length=recipe.max_length)["input_ids"]
    targets = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    epochs = [batches([len(ids) for ids in encoded], recipe.batch_size, rng) for _ in range(recipe.epochs)]
    total = sum(len(epoch) for epoch in epochs)
    warmup = max(1, round(recipe.warmup_fraction * total))
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, parameter in classifier.named_parameters():
        if any(part in name for part in recipe.frozen):
            parameter.requires_grad_(False)
        else:
            (no_decay if parameter.ndim == 1 or "LayerNorm" in name else decay).append(parameter)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.learning_rate,
        fused=True,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, max(0.0, (total - step) / max(1, total - warmup)))
    )
    pad = tokenizer.pad_token_id or 0
    classifier.train()
    losses: list[float] = []
    bar = tqdm(total=total, desc="fine-tuning", unit="step", disable=not progress)
    try:
        for index in (batch for epoch in epochs for batch in epoch):
            input_ids, mask = _padded([encoded[i] for i in index], pad)  # [batch, token] each
            logits = classifier(input_ids=input_ids, attention_mask=mask).logits  # [batch, class]
            loss = torch.nn.functional.cross_entropy(logits, targets[torch.as_tensor(index)])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([*decay, *no_decay], 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
    finally:
        bar.close()
        for parameter in classifier.parameters():
            parameter.requires_grad_(True)
    classifier.eval()
    return {"steps": total, "final_loss": round(float(np.mean(losses[-50:])), 4)}


def batches(lengths: Sequence[int], batch_size: int, rng: np.random.Generator, pool: int = 8) -> list[np.ndarray]:
    """One epoch's batches of indices into ``lengths`` (token counts): the examples in a random
    order, each run of ``pool`` batches' worth sorted by length and cut into batches (little
    padding), then the batches in a random order; all drawn from ``rng``."""
    order = rng.permutation(len(lengths))
    found = []
    for start in range(0, len(order), batch_size * pool):
        chunk = order[start : start + batch_size * pool]
        chunk = chunk[np.argsort([lengths[i] for i in chunk], kind="stable")]
        found += [chunk[first : first + batch_size] for first in range(0, len(chunk), batch_size)]
    return [found[i] for i in rng.permutation(len(found))]


def accuracy(
    classifier: torch.nn.Module, tokenizer: Any, texts: Sequence[str], labels: np.ndarray, max_length: int
) -> float:
    """The share of ``texts`` whose argmax logit is their label (no gradients, batches by length)."""
    import torch

    encoded = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    order = np.argsort([len(ids) for ids in encoded], kind="stable")
    predicted = np.zeros(len(encoded), dtype=np.int64)
    classifier.eval()
    with torch.no_grad():
        for start in range(0, len(order), 128):
            index = order[start : start + 128]
            input_ids, mask = _padded([encoded[i] for i in index], tokenizer.pad_token_id or 0)
            predicted[index] = classifier(input_ids=input_ids, attention_mask=mask).logits.argmax(-1).numpy()
    return float((predicted == np.asarray(labels)).mean())


def _padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, each ``[row, longest]`` long tensors, padded on the right."""
    import torch

    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def save_classifier(classifier: torch.nn.Module, folder: Path, record: dict[str, Any]) -> str:
    """Write ``classifier``'s weights (``model.safetensors``) and ``record`` plus their sha256
    (``build.json``) into ``folder`` (created); returns the sha256."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous() for name, tensor in classifier.state_dict().items()}
    save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})
    digest = sha256(folder / WEIGHTS)
    (folder / RECORD).write_text(json.dumps({**record, "sha256": digest}, indent=1) + "\n", encoding="utf-8")
    return digest


def build_into(
    folder: Path,
    classifier: torch.nn.Module,
    tokenizer: Any,
    data: Any,
    recipe: Recipe,
    record: dict[str, Any],
    progress: bool = True,
) -> dict[str, Any]:
    """Fine-tune ``classifier`` on ``data``'s training split (`attnflow.datasets.LabelledTexts.split`),
    score it on the held-out split and save it into ``folder``; returns the build record (``build.json``)."""
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    train, test = data.split()
    split_size = len(train)
    if recipe.train_samples is not None and recipe.train_samples < len(train):
        train = np.sort(np.random.default_rng(recipe.seed).permutation(train)[: recipe.train_samples])
    with deterministic(recipe.threads):
        trained = fine_tune(
            classifier, tokenizer, [data.texts[i] for i in train], data.labels[train], recipe, progress=progress
        )
        heldout = accuracy(classifier, tokenizer, [data.texts[i] for i in test], data.labels[test], recipe.max_length)
    seconds = time.perf_counter() - started
    full = {
        **record,
        "recipe": {**asdict(recipe), "frozen": list(recipe.frozen)},
        "labels": list(data.label_names),
        "task": data.name,
        "n_train": len(train),
        "n_train_split": split_size,
        "n_test": len(test),
        "split": "stratified 80/20, seed 0 (attnflow.datasets)",
        "heldout_accuracy": heldout,
        "majority_accuracy": float(np.bincount(data.labels[test]).max() / len(test)),
        **trained,
        "build_seconds": round(seconds, 1),
        "peak_memory_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "load_average_at_start": round(load_before, 2),
        "cpu_count": os.cpu_count(),
    }
    full["sha256"] = save_classifier(classifier, folder, full)
    return full


def load_finetuned_classifier(alias: str, encoder: Any) -> tuple[Any, dict[str, Any]]:
    """``(PooledClassifier, build record)`` of the built ``alias`` around ``encoder`` (a `CaptureModel`
    of its base's encoder), its weights' sha256 checked against ``build.json``; never builds."""
    import torch
    from safetensors.torch import load_file

    from attnflow.capture.probes import _make_classifier

    record = build_record(alias)
    path = finetuned_dir(alias) / WEIGHTS
    digest = sha256(path) if path.exists() else None
    if digest != record.get("sha256"):
        raise ModelLoadError(
            f"the {alias} weights {path} are {'damaged' if digest else 'missing'} (sha256 {digest}, "
            f"build.json records {record.get('sha256')}): build them again with "
            f"`attnflow models install {alias} --force`"
        )
    labels = list(record["labels"])
    head = torch.nn.Linear(encoder.d_model, len(labels))
    classifier = _make_classifier()(encoder.hf_model, head, labels)
    classifier.load_state_dict(load_file(str(path)), strict=True)
    classifier.eval()
    return classifier, record


def _spec(alias: str) -> FineTunedSpec:
    try:
        return FINETUNED[alias]
    except KeyError:
        raise ModelLoadError(f"unknown fine-tuned classifier {alias!r}; embedded: {', '.join(FINETUNED)}") from None


def versions() -> dict[str, str]:
    """The versions a build's bytes depend on (recorded in its ``build.json``)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("attnflow", "torch", "transformers", "numpy"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found
