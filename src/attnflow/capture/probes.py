"""Embedded classifiers: an embedded sentence encoder, its mean pooling and a linear head trained
on a task that ships in a pip package (`attnflow.datasets`).

The head is a logistic regression on the frozen encoder's mean-pooled features (L2-regularised,
fitted with L-BFGS on standardised features, the standardisation folded into the weights),
trained on the stratified 80 % split of the task with a fixed seed and scored on the held-out
20 %. It is trained once, on first use or by ``attnflow models install ALIAS``, and cached as
``head.safetensors`` plus ``probe.json`` (labels, split sizes, held-out accuracy, sha256 of the
head) in ``<cache>/probes/ALIAS``.

The result is one differentiable torch module, encoder → pooling → linear
(`PooledClassifier`), so every gradient and perturbation method explains a real prediction.
Torch is imported on first use: listing the probes stays fast.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from attnflow.capture.loading import PROBES, ProbeSpec, cache_dir
from attnflow.errors import ModelLoadError
from attnflow.staging import building

log = logging.getLogger(__name__)

HEAD_FILE = "head.safetensors"
META_FILE = "probe.json"
PROBE_MAX_LENGTH = 128  # tokens per text when the features are computed (special tokens included)
L2_PENALTY = 1e-3  # on standardised features, per example (scikit-learn's C = 1 / (penalty * n_train))


def probe_dir(alias: str) -> Path:
    return cache_dir() / "probes" / alias


def probe_metadata(alias: str) -> dict[str, Any] | None:
    """``probe.json`` of a trained probe (labels, accuracy, ...), or None when not trained yet."""
    try:
        return json.loads((probe_dir(alias) / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


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


def mean_pooled_features(model: Any, texts: list[str], batch_size: int = 64, progress: bool = True) -> Any:
    """``[text, d_model]`` float32 mean-pooled last hidden states of an `AttentionModel`'s encoder,
    texts truncated to `PROBE_MAX_LENGTH` tokens (sorted by length into batches for speed)."""
    import numpy as np
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
            hidden = model.model(**encoded).last_hidden_state  # [batch, token, d_model]
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


def train_probe(alias: str, encoder: Any, progress: bool = True) -> Path:
    """Train the probe ``alias`` on ``encoder`` (the `AttentionModel` of its encoder alias) once and
    cache it (atomic: written into a temporary folder beside the target and renamed). Returns the
    probe's folder."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from attnflow.datasets import load_task

    spec = _spec(alias)
    data = load_task(spec.task)
    train, test = data.split()
    log.info("training %s on %d %s examples (held out: %d)", alias, len(train), spec.task, len(test))
    features = mean_pooled_features(encoder, list(data.texts), progress=progress)
    weight, bias = fit_logistic_regression(features[train], data.labels[train], len(data.label_names))
    predictions = (features[test] @ weight.T + bias).argmax(1)
    accuracy = float((predictions == data.labels[test]).mean())
    majority = float(np.bincount(data.labels[test]).max() / len(test))
    target = probe_dir(alias)
    with building(target) as scratch:
        scratch.mkdir()
        head_path = scratch / HEAD_FILE
        save_file({"weight": torch.from_numpy(weight), "bias": torch.from_numpy(bias)}, str(head_path))
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
            "head_sha256": _sha256(head_path),
        }
        (scratch / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    log.info("%s: held-out accuracy %.3f (majority class %.3f)", alias, accuracy, majority)
    return target


def probe_classifier(alias: str, encoder: Any, progress: bool = True) -> tuple[Any, dict[str, Any]]:
    """``(PooledClassifier, metadata)`` of the probe ``alias`` around ``encoder``'s torch module,
    training the head first if it is not cached (`AttentionModel` wrapping is the caller's)."""
    import torch
    from safetensors.torch import load_file

    meta = probe_metadata(alias)
    if meta is None:
        train_probe(alias, encoder, progress=progress)
        meta = probe_metadata(alias)
    head_path = probe_dir(alias) / HEAD_FILE
    if meta is None or not head_path.exists() or _sha256(head_path) != meta.get("head_sha256"):
        raise ModelLoadError(f"the cached {alias} head is damaged; run `attnflow models install {alias} --force`")
    tensors = load_file(str(head_path))
    head = torch.nn.Linear(tensors["weight"].shape[1], tensors["weight"].shape[0])
    head.load_state_dict(tensors)
    return _make_classifier()(encoder.model, head, list(meta["labels"])), meta


def _spec(alias: str) -> ProbeSpec:
    try:
        return PROBES[alias]
    except KeyError:
        raise ModelLoadError(f"unknown classifier {alias!r}; embedded classifiers: {', '.join(PROBES)}") from None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
