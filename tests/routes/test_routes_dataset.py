"""Routes over a dataset (`attnflow routes --file / --data`, `attnflow.flow_routes.dataset`) on a
tiny Llama: the means and standard errors equal a loop over `attnflow.routes` on each prompt (per
domain and pooled); the attention scores equal explicit loops over the model's own attention
weights; the role names, the word boundaries and the cut of a long text by hand; the report
escapes every prompt; the python-stdlib reader; every bad input one line, exit status 2.

The run killed with SIGKILL and resumed, and a resume under a changed option:
tests/runs/test_acceptance.py; local against Ray: tests/runs/test_ray_commands.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import attnflow
from attnflow.cli import main
from attnflow.flow_routes import head_roles
from attnflow.flow_routes.dataset import Moments, before_last_word, cut, routes_over_data
from attnflow.runs.engine import EngineOptions
from attnflow.runs.readers import open_corpus, python_functions

# zebra, quokka: out of the tiny vocabulary, spelled in pieces (z ##e ##b ...): words continued
WIKI_LIKE = ["the cat sat on the mat", "the zebra ran to the cat", "hello world this is a story", "we ran"]
CODE_LIKE = ["def quokka ( a ) : return a", "the dog is a good dog", "it was very bad"]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def loop_over_routes(model, texts: list[str]) -> dict[str, np.ndarray]:
    """Each prompt's `attnflow.routes`: heads' and feed-forward blocks' importance, stacked."""
    found: dict[str, list[np.ndarray]] = {"heads": [], "heads_full": [], "ffn": [], "ffn_full": []}
    for text in texts:
        routes = attnflow.routes(model, text, lens="none")
        found["heads"].append(routes.importance.heads)
        found["heads_full"].append(routes.importance_full.heads)
        found["ffn"].append(routes.importance.ffn.sum(axis=1))
        found["ffn_full"].append(routes.importance_full.ffn.sum(axis=1))
    return {name: np.stack(values) for name, values in found.items()}


def assert_mean_and_se(statistic: dict, values: np.ndarray) -> None:
    np.testing.assert_allclose(statistic["mean"], values.mean(axis=0), rtol=1e-9, atol=1e-12)
    se = values.std(axis=0, ddof=1) / np.sqrt(len(values))
    np.testing.assert_allclose(statistic["se"], se, rtol=1e-6, atol=1e-9)
    assert statistic["count"] == len(values)


def test_the_means_equal_a_loop_over_single_prompt_routes(tiny_loaded, tmp_path):
    model = tiny_loaded("llama")
    sources = [str(write_lines(tmp_path / "wiki.txt", WIKI_LIKE)), str(write_lines(tmp_path / "code.txt", CODE_LIKE))]
    summary = routes_over_data(model, sources, tmp_path / "out", batch_size=2, engine=EngineOptions(quiet=True))
    names = {"heads": "importance", "heads_full": "importance_full"}
    loops = [loop_over_routes(model, texts) for texts in (WIKI_LIKE, CODE_LIKE)]
    for domain, looped in zip(summary["domains"], loops, strict=True):
        for key, name in names.items():
            assert_mean_and_se(domain["heads"][name], looped[key])
        assert_mean_and_se(domain["ffn"]["importance"], looped["ffn"])
        assert_mean_and_se(domain["ffn"]["importance_full"], looped["ffn_full"])
        top = domain["top_heads"][0]
        assert (top["layer"], top["head"]) == np.unravel_index(
            looped["heads"].mean(0).argmax(), looped["heads"].shape[1:]
        )
    pooled = {key: np.concatenate([looped[key] for looped in loops]) for key in loops[0]}
    assert_mean_and_se(summary["all"]["heads"]["importance"], pooled["heads"])
    assert summary["prompts"] == 7 and summary["all"]["prompts"] == 7
    difference = summary["differences"][0]
    assert difference["domain"] == sources[1] and difference["against"] == sources[0]
    first = difference["heads"][0]
    expected = pooled["heads"][4:].mean(0) - pooled["heads"][:4].mean(0)
    assert first["difference"] == pytest.approx(expected[first["layer"], first["head"]], abs=1e-12)
    assert abs(first["difference"]) == pytest.approx(np.abs(expected).max(), abs=1e-12)
    written = sorted(path.name for path in (tmp_path / "out").iterdir())
    assert written == ["checkpoint.npz", "prompts.jsonl", "report.html", "summary.json"]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["domains"][1]["examples"] == CODE_LIKE


def oracle_scores(model, text: str) -> dict[str, np.ndarray]:
    """The attention scores by explicit loops over the model's own attention weights and its tokens."""
    encoded = model.tokenizer(text, return_tensors="pt", return_offsets_mapping=True)
    with torch.no_grad():
        attentions = model.model(input_ids=encoded["input_ids"], output_attentions=True).attentions
    weights = torch.stack([layer[0] for layer in attentions]).double().numpy()  # [L, H, T, T]
    offsets = encoded["offset_mapping"][0].tolist()
    n_layers, n_heads, n_tokens, _ = weights.shape
    pieces = [
        i
        for i in range(2, n_tokens)
        if offsets[i][0] == offsets[i - 1][1]
        and offsets[i][1] > offsets[i][0]
        and offsets[i - 1][1] > offsets[i - 1][0]
    ]  # the tiny WordPiece vocabulary: pieces of a word touch, words are separated by spaces
    found = {name: np.zeros((n_layers, n_heads)) for name in head_roles.SCORES}
    for layer in range(n_layers):
        for head in range(n_heads):
            queries = range(2, n_tokens)
            found["first_token"][layer, head] = np.mean([weights[layer, head, i, 0] for i in queries])
            found["previous_token"][layer, head] = np.mean([weights[layer, head, i, i - 1] for i in queries])
            found["self"][layer, head] = np.mean([weights[layer, head, i, i] for i in queries])
            found["subword"][layer, head] = np.mean([weights[layer, head, i, i - 1] for i in pieces])
    found["elsewhere"] = 1 - found["first_token"] - found["previous_token"] - found["self"]
    return found


def test_the_attention_scores_equal_loops_over_the_models_attention(tiny_loaded, tmp_path):
    model = tiny_loaded("llama")
    texts = ["the zebra sat on the quokka", "a quokka ran"]
    summary = routes_over_data(model, [str(write_lines(tmp_path / "t.txt", texts))], tmp_path / "out")
    oracle = [oracle_scores(model, text) for text in texts]
    for score in head_roles.SCORES:
        expected = np.stack([found[score] for found in oracle])
        assert_mean_and_se(summary["domains"][0]["heads"][score], expected)
    domain = summary["domains"][0]
    mean = np.asarray(domain["heads"]["importance"]["mean"])
    roles: dict[str, list[tuple[int, int]]] = {}
    for layer, head in np.ndindex(mean.shape):
        scores = {score: domain["heads"][score]["mean"][layer][head] for score in head_roles.SCORES}
        roles.setdefault(head_roles.role_of(scores), []).append((layer, head))
    for role, listed in domain["by_role"].items():
        assert len(listed) == min(5, len(roles[role])) and not role.startswith("mixed")
        for entry in listed:
            assert (entry["layer"], entry["head"]) in roles[role]
            assert entry["rank"] == 1 + int((mean > mean[entry["layer"], entry["head"]]).sum())
    assert set(domain["by_role"]) == {role for role in roles if not role.startswith("mixed")}
    chance = summary["domains"][0]["chance"]
    n_tokens = [len(model.tokenizer(text)["input_ids"]) for text in texts]
    even = np.mean([np.mean([1 / (i + 1) for i in range(2, n)]) for n in n_tokens])  # causal: i + 1 keys
    assert chance["first_token"] == pytest.approx(even) and chance["self"] == pytest.approx(even)
    assert chance["elsewhere"] == pytest.approx(1 - 3 * even)


def test_scores_and_roles_by_hand():
    attention = np.zeros((1, 3, 4, 4))
    attention[0, 0, :, 0] = 1  # a sink
    attention[0, 1, 1:, :] = np.eye(4)[np.arange(1, 4) - 1]  # the previous token
    attention[0, 1, 0, 0] = 1
    attention[0, 2] = np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None]  # even
    continues = np.array([False, False, False, True])
    scores = head_roles.attention_scores(attention, continues)
    np.testing.assert_allclose(scores["first_token"][0], [1, 0, (1 / 3 + 1 / 4) / 2])
    np.testing.assert_allclose(scores["previous_token"][0], [0, 1, (1 / 3 + 1 / 4) / 2])
    np.testing.assert_allclose(scores["subword"][0], [0, 1, 1 / 4])
    np.testing.assert_allclose(scores["elsewhere"][0], [0, 0, 1 / 8], atol=1e-12)  # query 3 to key 1
    assert head_roles.chance(attention, continues)["previous_token"] == pytest.approx((1 / 3 + 1 / 4) / 2)
    assert head_roles.attention_scores(attention[..., :2, :2], continues[:2])["self"] is None  # no query i >= 2
    assert head_roles.role_of({"first_token": 0.8, "previous_token": 0.1, "self": 0.05, "elsewhere": 0.05}) == (
        "first token (sink)"
    )
    subword = {"first_token": 0.2, "previous_token": 0.4, "self": 0.1, "elsewhere": 0.3, "subword": 0.9}
    assert head_roles.role_of(subword) == "subword merging"
    assert head_roles.role_of(subword | {"previous_token": 0.75}) == "previous token"
    assert head_roles.role_of(subword | {"subword": None}) == "mixed: previous token 0.40, other tokens 0.30"


def test_word_boundaries_and_the_cut_of_a_long_text(tiny_loaded):
    text = "he said: zebra_2 ok café"
    offsets = [(0, 2), (2, 7), (7, 8), (8, 10), (10, 13), (13, 14), (14, 16), (16, 19), (19, 23), (23, 24), (23, 24)]
    # he | " said" | ":" | " z" ebr a _2 | " ok" | " caf" é (two byte-level pieces of one character)
    continued = [False, False, False, False, True, True, True, False, False, True, True]
    assert head_roles.continues_word(text, offsets).tolist() == continued
    tokenizer = tiny_loaded("llama").tokenizer  # WordPiece: zebra -> z ##e ##b ##r ##a
    assert cut(tokenizer, "the zebra sat on the mat", 3) == "the"  # never half a word
    assert cut(tokenizer, "the zebra sat on the mat", 7) == "the zebra sat"
    assert cut(tokenizer, "zebra", 2) == "ze"  # the first word alone is longer: cut inside it
    assert cut(tokenizer, "the cat", 5) == "the cat" and cut(tokenizer, "the cat", None) == "the cat"


def test_a_document_is_cut_before_its_last_word():
    assert before_last_word("Paris is the capital of France.") == "Paris is the capital of"
    assert before_last_word("It ends here.  \n") == "It ends"
    assert before_last_word("def f(a):\n    return a") == "def f(a):\n    return"
    assert before_last_word("one") == "one" and before_last_word("  one ") == "  one "  # one word: kept whole


def test_predictions_survive_the_checkpoint_and_merge_across_workers():
    """What a resumed or a Ray run keeps of each prompt's prediction: ``state_dict`` (checkpoint.npz,
    Ray's transfer) and ``merge`` (the workers' results)."""
    first, second = Moments(), Moments()
    first.add("0/tokens", 3.0)
    first.predictions[0] = (1234, 0.25)
    second.predictions[7] = (5, 0.5)
    again = Moments.from_state_dict(first.state_dict())
    assert again.predictions == {0: (1234, 0.25)} and again.counts == {"0/tokens": 1.0}
    assert again.merge(second).predictions == {0: (1234, 0.25), 7: (5, 0.5)}
    assert again.pooled([0]).counts == {"tokens": 1.0}  # the per-prompt entries are not a domain's quantity


def read_prompts(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "prompts.jsonl").read_text(encoding="utf-8").splitlines()]


def test_data_cuts_documents_before_their_last_word_and_writes_each_prediction(tiny_model_path, tmp_path):
    """``routes --data`` without --max-tokens explains each text's last word, not what follows its
    final period; with --max-tokens a long text is cut there as before (and one it leaves whole
    before its last word); ``--file`` keeps each prompt as written. Every prompt's prediction and
    probability in prompts.jsonl (and the report) is the model's own at the prompt's last position."""
    source = write_lines(
        tmp_path / "docs.txt", ["the cat sat on the mat.", "the dog ran to the cat and it was very bad."]
    )
    model_path = str(tiny_model_path("llama"))
    runs = {
        "data": ["--data", str(source)],
        "tokens": ["--data", str(source), "--max-tokens", "8"],
        "file": ["--file", str(source)],
    }
    for name, arguments in runs.items():
        assert main(["routes", *arguments, "--model", model_path, "--out", str(tmp_path / name), "-q"]) == 0
    texts = {name: [row["text"] for row in read_prompts(tmp_path / name)] for name in runs}
    assert texts["data"] == ["the cat sat on the", "the dog ran to the cat and it was very"]
    assert texts["tokens"] == ["the cat sat on the", "the dog ran to the cat and it"]
    assert texts["file"] == ["the cat sat on the mat.", "the dog ran to the cat and it was very bad."]
    model = attnflow.load(model_path, device="cpu", progress=False)
    for name in runs:
        for row in read_prompts(tmp_path / name):
            input_ids = model.tokenizer(row["text"], return_tensors="pt")["input_ids"]
            with torch.no_grad():
                probabilities = model.model(input_ids=input_ids).logits[0, -1].softmax(-1)
            assert row["prediction_id"] == int(probabilities.argmax())
            assert row["prediction"] == model.tokenizer.decode([row["prediction_id"]])
            assert row["probability"] == pytest.approx(float(probabilities.max()), abs=1e-5)
    summary = json.loads((tmp_path / "data" / "summary.json").read_text())
    assert summary["last_word"] and summary["domains"][0]["predictions"] == [
        {key: row[key] for key in ("prediction", "prediction_id", "probability")}
        for row in read_prompts(tmp_path / "data")
    ]
    page = (tmp_path / "data" / "report.html").read_text(encoding="utf-8")
    first = read_prompts(tmp_path / "data")[0]
    assert (
        f"predicts {first['prediction']!r}".replace("'", "&#x27;") in page
        and f"(p = {first['probability']:.3f})" in page
    )


def test_the_report_escapes_every_prompt(tiny_model_path, tmp_path):
    hostile = '<script>alert("x")</script> the cat & <b>dog</b>'
    source = write_lines(tmp_path / "<odd> & name.txt", [hostile, "the cat sat"])
    out = tmp_path / "out"
    assert (
        main(["routes", "--file", str(source), "--model", str(tiny_model_path("llama")), "--out", str(out), "-q"]) == 0
    )
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "<script>" not in page and "<b>dog" not in page and "<odd>" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page and "&lt;odd&gt; &amp; name.txt" in page
    assert 'class="heads"' in page and "even attention" in page


def test_python_functions_round_robin_without_docstrings(tmp_path):
    (tmp_path / "a.py").write_text(
        'def one(x):\n    """Doc."""\n    y = x\n    return y\n\n\ndef two():\n    return 2\n\n\n'
        "class C:\n    @property\n    def three(self):\n        a = 1\n        return a\n",
        encoding="utf-8",
    )
    (tmp_path / "b.py").write_text("async def four(\n    a,\n):\n    await a\n    return a\n", encoding="utf-8")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "c.py").write_text("def skipped():\n    a = 1\n    return a\n", encoding="utf-8")
    (tmp_path / "broken.py").write_text("def (:\n", encoding="utf-8")
    found = list(python_functions(tmp_path))
    assert found == [
        "def one(x):\n    y = x\n    return y",
        "async def four(\n    a,\n):\n    await a\n    return a",
        "def three(self):\n    a = 1\n    return a",
    ]  # two's body is one line; tests/ is left out
    stdlib = open_corpus("python-stdlib")
    assert stdlib.kind == "python-stdlib" and next(iter(stdlib)).startswith(("def ", "async def "))


@pytest.mark.parametrize(
    ("content", "arguments", "message"),
    [
        ("", [], "has no text"),
        ('{"text": "the cat"}\n{"text": "the dog"\n', [], "line 2: malformed JSON"),
        ('{"body": "the cat"}\n', [], "no field 'text'"),
        ("the cat\n", ["--position", "0"], "--position would be ignored by routes over a dataset"),
        ("the cat\n", ["--json"], "--json would be ignored"),
        ("the cat\n", ["--samples", "0"], "--samples: must be a positive integer, got 0"),
        ("the cat\n", ["--threshold", "1"], "--threshold must be a number in [0, 1)"),
        ("the cat\n", ["--text", "the cat"], "give either TEXT or a dataset"),
        ("the cat\n", ["--data", "wiki"], "give either --file PATH or --data SOURCES, not both"),
        ("the cat\n", ["--no-out"], "give --out DIR"),
        ("the cat " * 40 + "\n", [], "more than"),
    ],
)
def test_bad_input_is_one_line(tiny_model_path, tmp_path, capsys, content, arguments, message):
    source = tmp_path / ("prompts.jsonl" if content.startswith("{") or not content else "prompts.txt")
    source.write_text(content, encoding="utf-8")
    argv = ["routes", "--file", str(source), "--model", str(tiny_model_path("llama")), "--quiet"]
    if "--text" in arguments:
        argv.insert(1, arguments[1])
        arguments = []
    if "--no-out" not in arguments:
        argv += ["--out", str(tmp_path / "out")]
    arguments = [word for word in arguments if word != "--no-out"]
    try:
        code = main([*argv, *arguments])
    except SystemExit as exit_:  # argparse's own check of a value
        code = exit_.code
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and message in error[-1], error
    assert not (tmp_path / "out" / "summary.json").exists()


def test_dataset_flags_are_refused_for_one_prompt(capsys, tmp_path):
    assert main(["routes", "the cat", "--samples", "3", "--resume", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        "attnflow: error: --samples, --resume would be ignored by routes over a dataset (--file or --data): drop them"
    )
