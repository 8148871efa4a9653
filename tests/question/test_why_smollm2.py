"""`attnflow why` on the real models (slow): on 20 factual prompts written for this test (not tuned
on), the agreement on the page equals the one recomputed from `attnflow explain`, `routes` and
`patch`'s JSON files, and every number of the reading is in why.json as displayed; the embedded
classifier's demo sentence gets its evidence words."""

from __future__ import annotations

import json

import pytest
from test_why import check_against_separate_commands, check_reading

from attnflow.cli import explain as explain_command
from attnflow.cli import main
from attnflow.cli import patch as patch_command
from attnflow.cli import routes as routes_command
from attnflow.cli import why as why_command

pytestmark = pytest.mark.slow

# Written for this test; none of them was run before the test was (no tuning on them).
FACTUAL = [
    "The capital of Spain is",
    "The largest planet in the solar system is",
    "Water freezes at zero degrees",
    "The Great Wall is in",
    "Shakespeare wrote Romeo and",
    "The currency of Japan is the",
    "The Statue of Liberty is in New",
    "Cats are animals that say",
    "The opposite of hot is",
    "Monday comes before",
    "The chemical symbol for gold is",
    "Bees make",
    "The Amazon river flows through",
    "The first man on the moon was Neil",
    "A triangle has three",
    "The color of the sky on a clear day is",
    "Berlin is the capital of",
    "The Pacific is an",
    "Mozart was a famous",
    "Ice cream is usually served",
]


@pytest.fixture
def real_models(monkeypatch, smollm2):
    """``--model smollm2`` is the session's smollm2, in every command."""
    for command in (why_command, explain_command, routes_command, patch_command):
        monkeypatch.setattr(command, "load_model", lambda *_: smollm2)


@pytest.mark.usefixtures("real_models")
@pytest.mark.parametrize("text", FACTUAL)
def test_the_agreement_on_factual_prompts_is_what_the_separate_commands_give(tmp_path, text):
    why = check_against_separate_commands(text, "smollm2", tmp_path, why_only=("--samples", "1"))
    assert why["evidence"]["patching"]["method"] == "exact" and why["agreement"]["layers"] is not None
    check_reading(why)


def test_the_demo_sentence_gets_evidence_words(tmp_path, monkeypatch, minilm_sentiment):
    monkeypatch.setattr(why_command, "load_model", lambda *_: minilm_sentiment)
    text = "The movie was terrible, but the acting was great."
    assert main(["why", text, "--model", "minilm-sentiment", "--out", str(tmp_path), "--quiet"]) == 0
    why = json.loads((tmp_path / "why.json").read_text())
    assert why["answer"]["label"] == "negative"
    assert "'terrible'" in why["shown"]["for_words"]["text"] and "'great'" in why["shown"]["against_words"]["text"]
    check_reading(why)
