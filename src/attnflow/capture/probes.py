"""Embedded classifiers: an embedded sentence encoder, its mean pooling and a linear head trained
on a task that ships in a pip package (`attnflow.datasets`, which the caller loads).

The head is a logistic regression on the frozen encoder's mean-pooled features (L2-regularised,
fitted with L-BFGS on standardised features, the standardisation folded into the weights),
trained on the stratified 80 % split of the task with a fixed seed and scored on the held-out
20 %. The trained heads ship in the package (``capture/heads/ALIAS.npz``: ``weight [class,
d_model]``, ``bias [class]``, ``labels [class]`` and ``meta``, the training record as JSON), each
checked against the sha256 in `SHIPPED_HEADS`, so loading a classifier never trains (one whose
head does not ship yet is refused until it is retrained).
``attnflow models install ALIAS --retrain`` trains the head again with the same code and stores it
as ``<cache>/probes/ALIAS.npz``, which is then used instead of the shipped one.

The result is one differentiable torch module, encoder → pooling → linear
(`PooledClassifier`), so every gradient and perturbation method explains a real prediction.
Torch is imported on first use: listing the probes stays fast.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from attnflow.capture.weight_cache import cache_dir
from attnflow.errors import ModelLoadError
from attnflow.staging import atomic_file

if TYPE_CHECKING:
    from attnflow.capture.model import CaptureModel

log = logging.getLogger(__name__)

PROBE_MAX_LENGTH = 128  # tokens per text when the features are computed (special tokens included)
L2_PENALTY = 1e-3  # on standardised features, per example (scikit-learn's C = 1 / (penalty * n_train))
SHIPPED_HEADS_DIR = Path(__file__).with_name("heads")
# sha256 of each shipped head file, trained once with attnflow's training code (`train_probe`,
# OMP_NUM_THREADS=2); a file that does not match is refused. A classifier not listed here needs
# `attnflow models install ALIAS --retrain` once.
SHIPPED_HEADS = {
    "minilm-sentiment": "a9d8d16f3bd5aad8da492dace3a5a999d09ebb53d120d2d723944bbcea5701ec",
    "minilm-topics": "819c94ebf93bf7659f3f3100904d45e5fc5bcb411b8bbc0bf805c0768816dfb4",
    "mpnet-sentiment": "053ca44f7506413264edd24ed989fba921b3d8f1a4c144e27c897060b0b82fec",
}


@dataclass(frozen=True)
class ProbeSpec:
    """An embedded classifier: an encoder alias, the task its head is trained on and the head's file."""

    alias: str
    encoder: str  # an embedded encoder alias
    task: str  # a name in attnflow.datasets.TASKS
    description: str


# Embedded classifiers: an embedded encoder, its pooling and a head trained once on a shipped task
# (trained here; `attnflow.capture.loading.load` wraps an encoder with its head).
PROBES: dict[str, ProbeSpec] = {
    "minilm-sentiment": ProbeSpec(
        "minilm-sentiment",
        "minilm",
        "rotten-tomatoes",
        "minilm + mean pooling + logistic-regression head on Rotten Tomatoes (negative/positive)",
    ),
    "minilm-topics": ProbeSpec(
        "minilm-topics",
        "minilm",
        "wiki-topics",
        "minilm + mean pooling + logistic-regression head on Wikipedia topics (12 classes)",
    ),
    "mpnet-sentiment": ProbeSpec(
        "mpnet-sentiment",
        "mpnet",
        "rotten-tomatoes",
        "mpnet + mean pooling + logistic-regression head on Rotten Tomatoes (negative/positive)",
    ),
}


@dataclass(frozen=True)
class Head:
    """A trained linear head: ``logits = features @ weight.T + bias`` on raw mean-pooled features.

    weight: ``[class, d_model]`` float32; bias: ``[class]`` float32; meta: the training record
    (``labels``, ``task``, ``encoder``, ``n_train``, ``n_test``, ``heldout_accuracy``,
    ``majority_accuracy``, ...) plus ``source``: the file it was read from.
    """

    weight: np.ndarray
    bias: np.ndarray
    meta: dict[str, Any]


def shipped_head_path(alias: str) -> Path:
    """Where the head of ``alias`` ships in the package (whether or not it ships yet)."""
    return SHIPPED_HEADS_DIR / f"{_spec(alias).alias}.npz"


def retrained_head_path(alias: str) -> Path:
    """Where `attnflow models install ALIAS --retrain` stores its head (used instead of the shipped one)."""
    return cache_dir() / "probes" / f"{_spec(alias).alias}.npz"


def has_head(alias: str) -> bool:
    """Whether ``alias`` has a head to load: retrained in the cache, or shipped."""
    return retrained_head_path(alias).exists() or alias in SHIPPED_HEADS


def read_head(alias: str) -> Head:
    """The head ``alias`` uses: the retrained one in the cache if there is one, else the shipped one."""
    path = retrained_head_path(alias)
    if path.exists():
        return _read_head(alias, path)
    if alias not in SHIPPED_HEADS:
        raise ModelLoadError(
            f"{alias} has no trained head in this version of attnflow: train it once with "
            f"`attnflow models install {alias} --retrain` (minutes on a CPU)"
        )
    return read_shipped_head(alias)


def read_shipped_head(alias: str) -> Head:
    """The head that ships in the package, its sha256 checked against `SHIPPED_HEADS`."""
    path = shipped_head_path(alias)
    digest = _sha256(path) if path.exists() else None
    if digest != SHIPPED_HEADS[alias]:
        raise ModelLoadError(
            f"the shipped {alias} head {path} is {'damaged' if digest else 'missing'} "
            f"(sha256 {digest}, expected {SHIPPED_HEADS[alias]}): reinstall attnflow"
        )
    return _read_head(alias, path)


def _read_head(alias: str, path: Path) -> Head:
    try:
        with np.load(path, allow_pickle=False) as stored:
            meta = {**json.loads(str(stored["meta"])), "labels": stored["labels"].tolist(), "source": str(path)}
            return Head(stored["weight"], stored["bias"], meta)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        raise ModelLoadError(
            f"the {alias} head {path} is damaged ({error}); "
            f"delete it or run `attnflow models install {alias} --retrain`"
        ) from None


def probe_metadata(alias: str) -> dict[str, Any]:
    """The training record of the head ``alias`` uses (labels, held-out accuracy, ..., ``source``)."""
    return read_head(alias).meta


def write_head(head: Head, path: Path) -> None:
    """Store ``head`` as ``path`` (an ``.npz``), atomically: written beside it and renamed."""
    with atomic_file(path) as out:
        np.savez(
            out,
            weight=head.weight.astype(np.float32),
            bias=head.bias.astype(np.float32),
            labels=np.array(head.meta["labels"], dtype=str),
            meta=np.array(json.dumps({k: v for k, v in head.meta.items() if k not in ("labels", "source")})),
        )


def _make_classifier():
    import torch
    from torch import nn
    from transformers.modeling_outputs import SequenceClassifierOutput

    class PooledClassifier(nn.Module):
        """``encoder`` → mean over the real tokens → ``head``: logits ``[batch, class]``.

        Takes the encoder's own keyword arguments (``input_ids`` or ``inputs_embeds``,
        ``attention_mask``, ``output_attentions``); its ``config`` is the encoder's, with the
        class names in ``id2label``.
        """

        def __init__(self, encoder: nn.Module, head: nn.Linear, label_names: list[str]) -> None:
            super().__init__()
            self.encoder = encoder
            self.head = head
            self.config = encoder.config
            self.config.id2label = dict(enumerate(label_names))
            self.config.label2id = {name: index for index, name in enumerate(label_names)}

        def get_input_embeddings(self) -> nn.Module:
            return self.encoder.get_input_embeddings()

        def forward(
            self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs
        ) -> SequenceClassifierOutput:
            outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs
            )
            hidden = outputs.last_hidden_state  # [batch, token, d_model]
            if attention_mask is None:
                attention_mask = torch.ones(hidden.shape[:2], device=hidden.device)
            weights = attention_mask.to(hidden.dtype).unsqueeze(-1)  # [batch, token, 1]
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)  # [batch, d_model]
            return SequenceClassifierOutput(logits=self.head(pooled), attentions=outputs.attentions)

    return PooledClassifier


def mean_pooled_features(model: CaptureModel, texts: list[str], batch_size: int = 64, progress: bool = True) -> Any:
    """``[text, d_model]`` float32 mean-pooled last hidden states of a `CaptureModel`'s encoder,
    texts truncated to `PROBE_MAX_LENGTH` tokens (sorted by length into batches for speed)."""
    import torch
    from tqdm.auto import tqdm

    order = np.argsort([len(text) for text in texts], kind="stable")
    features = np.zeros((len(texts), model.d_model), dtype=np.float32)
    with torch.no_grad():
        for start in tqdm(range(0, len(texts), batch_size), desc="features", unit="batch", disable=not progress):
            index = order[start : start + batch_size]
            encoded = model.tokenizer(
                [texts[i] for i in index],
                padding=True,
                truncation=True,
                max_length=PROBE_MAX_LENGTH,
                return_tensors="pt",
            ).to(model.device)
            hidden = model.hf_model(**encoded).last_hidden_state  # [batch, token, d_model]
            mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            features[index] = ((hidden * mask).sum(1) / mask.sum(1)).cpu().numpy()
    return features


def fit_logistic_regression(features: Any, labels: Any, n_classes: int, seed: int = 0) -> tuple[Any, Any]:
    """Multinomial logistic regression ``[class, d]`` weights and ``[class]`` bias that act on raw
    features (standardised internally; L2 penalty `L2_PENALTY` on the standardised weights)."""
    import torch

    torch.manual_seed(seed)
    x = torch.as_tensor(features, dtype=torch.float64)
    y = torch.as_tensor(labels, dtype=torch.long)
    mean, scale = x.mean(0), x.std(0).clamp(min=1e-6)
    z = (x - mean) / scale
    weight = torch.zeros(n_classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=500, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        value = torch.nn.functional.cross_entropy(z @ weight.T + bias, y) + 0.5 * L2_PENALTY * weight.pow(2).sum()
        value.backward()
        return value

    optimizer.step(loss)
    with torch.no_grad():
        raw_weight = weight / scale  # fold the standardisation into the head
        raw_bias = bias - raw_weight @ mean
    return raw_weight.float().numpy(), raw_bias.float().numpy()


def train_probe(alias: str, encoder: CaptureModel, data: Any, progress: bool = True) -> Head:
    """Train the head of ``alias`` on ``encoder`` (the `CaptureModel` of its encoder alias) and
    ``data``, its task (``attnflow.datasets.load_task(PROBES[alias].task)``): the features of every
    text, the fit on the training split, the held-out accuracy."""
    spec = _spec(alias)
    train, test = data.split()
    log.info("training %s on %d %s examples (held out: %d)", alias, len(train), spec.task, len(test))
    features = mean_pooled_features(encoder, list(data.texts), progress=progress)
    weight, bias = fit_logistic_regression(features[train], data.labels[train], len(data.label_names))
    predictions = (features[test] @ weight.T + bias).argmax(1)
    accuracy = float((predictions == data.labels[test]).mean())
    majority = float(np.bincount(data.labels[test]).max() / len(test))
    log.info("%s: held-out accuracy %.3f (majority class %.3f)", alias, accuracy, majority)
    meta = {
        "alias": alias,
        "encoder": spec.encoder,
        "task": spec.task,
        "labels": list(data.label_names),
        "n_train": len(train),
        "n_test": len(test),
        "split": "stratified 80/20, seed 0 (attnflow.datasets)",
        "max_length": PROBE_MAX_LENGTH,
        "l2_penalty": L2_PENALTY,
        "heldout_accuracy": accuracy,
        "majority_accuracy": majority,
    }
    return Head(weight, bias, meta)


def probe_classifier(alias: str, encoder: CaptureModel) -> tuple[Any, dict[str, Any]]:
    """``(PooledClassifier, metadata)`` of the probe ``alias`` around ``encoder``'s torch module
    (`CaptureModel` wrapping is the caller's); never trains (see `read_head`)."""
    import torch

    head = read_head(alias)
    linear = torch.nn.Linear(head.weight.shape[1], head.weight.shape[0])
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(head.weight))
        linear.bias.copy_(torch.from_numpy(head.bias))
    return _make_classifier()(encoder.model, linear, list(head.meta["labels"])), head.meta


def _spec(alias: str) -> ProbeSpec:
    try:
        return PROBES[alias]
    except KeyError:
        raise ModelLoadError(f"unknown classifier {alias!r}; embedded classifiers: {', '.join(PROBES)}") from None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
