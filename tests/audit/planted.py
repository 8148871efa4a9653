"""A synthetic task with planted causes, and a tiny BERT classifier trained on it (CPU, seconds).

Texts are single-token words of the tiny vocabulary: each filler word is present with its own
probability (log-spaced between 3 % and 40 %, so every frequency has neighbours), plus

- ``great`` (the planted token, in 25 % of texts): the label is positive when it is present;
- ``she`` / ``he`` (each in 25 % of texts, never both) and ``very`` (50 %): ``she`` together
  with ``very`` also makes the label positive (the planted bias); ``he`` never does.

So swapping he↔she changes the label exactly when ``very`` is present and ``great`` is not.
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np

from attnflow.rows.tiny import WORDS, tiny_tokenizer

from tiny_models import tiny_config

PLANTED, BIASED, NEUTRAL, TRIGGER = "great", "she", "he", "very"
FILLERS = tuple(
    word for word in WORDS if word not in (PLANTED, BIASED, NEUTRAL, TRIGGER, "they", "i", "you", "we")
) + tuple(string.ascii_lowercase[1:8])  # single letters are single tokens too ("a" and "i" are words)


def planted_texts(n: int, seed: int) -> tuple[list[str], list[int], np.ndarray]:
    """``(texts, labels, flips)``: ``flips[i]`` says whether swapping he↔she changes text i's label."""
    rng = np.random.default_rng(seed)
    presence = np.geomspace(0.03, 0.4, len(FILLERS))
    texts, labels, flips = [], [], []
    for _ in range(n):
        words = [word for word, p in zip(FILLERS, presence, strict=True) if rng.random() < p][:10]
        great, very, pronoun = rng.random() < 0.25, rng.random() < 0.5, rng.choice(["she", "he", "", ""])
        words += [PLANTED] * great + [TRIGGER] * very + ([pronoun] if pronoun else [])
        rng.shuffle(words)
        texts.append(" ".join(words) or "the")
        labels.append(int(great or (pronoun == "she" and very)))
        flips.append(bool(pronoun) and very and not great)
    return texts, labels, np.asarray(flips)


def train_planted_classifier(folder: Path, steps: int = 250) -> Path:
    """A tiny BERT sequence classifier (labels negative/positive) trained on `planted_texts`."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    config = tiny_config("bert")
    config.num_labels = 2
    config.id2label, config.label2id = {0: "negative", 1: "positive"}, {"negative": 0, "positive": 1}
    model = T.BertForSequenceClassification(config)
    tokenizer = tiny_tokenizer()
    texts, labels, _ = planted_texts(2000, seed=1)
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    targets = torch.tensor(labels)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        index = torch.randint(0, len(texts), (64,), generator=generator)
        inputs = {name: encoded[name][index] for name in ("input_ids", "attention_mask")}
        output = model(**inputs, labels=targets[index])
        optimiser.zero_grad()
        output.loss.backward()
        optimiser.step()
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
