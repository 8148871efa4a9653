"""The benchmark loop on the synthetic key-token classifier (tests/evaluate/conftest.py)."""

from __future__ import annotations

import json
import re
import zlib
from functools import partial

import numpy as np
import pytest

from attnflow.errors import InputError
from attnflow.evaluate.benchmark import BenchmarkOptions, run_benchmark
from attnflow.evaluate.deletion import without_top
from attnflow.evaluate.report import write_report
from attnflow.evaluate.sanity import FLAG_RHO, randomisation_stages
from attnflow.evaluate.scorer import ClassifierScorer

from conftest import KEY_TEXTS, KEY_WORD


def token_ids(model, text):
    return model.tokenizer(text, truncation=True, max_length=model.max_length)["input_ids"]


def key_first(model, texts, method, targets):
    """Ranks the known decisive token first: 1 on it, 0 elsewhere."""
    return [
        (np.asarray(token_ids(model, text)) == model.tokenizer.convert_tokens_to_ids(KEY_WORD)).astype(float)
        for text in texts
    ]


def random_scores(model, texts, method, targets):
    rng = np.random.default_rng(zlib.crc32("|".join(texts).encode()))  # deterministic, unlike hash()
    return [rng.normal(size=len(token_ids(model, text))) for text in texts]


def constant(model, texts, method, targets):
    return [np.ones(len(token_ids(model, text))) for text in texts]


def occlusion(model, texts, method, targets):
    """p_c(x) - p_c(x without token i): depends on every weight of ``model``."""
    scorer = ClassifierScorer(model)
    result = []
    for text, target in zip(texts, targets):
        ids = token_ids(model, text)
        variants = [ids] + [list(without_top(ids, np.array([i]), 1, "remove", None)) for i in range(len(ids))]
        p = scorer.probabilities(variants)[:, target]
        result.append(p[0] - p[1:])
    return result


FAKE_METHODS = {"key_first": key_first, "random": random_scores, "constant": constant, "occlusion": occlusion}


def dispatch(model, texts, method, targets):
    return FAKE_METHODS[method](model, texts, method, targets)


def counted_dispatch(calls, model, texts, method, targets):
    """`dispatch`, each method's name appended to ``calls``."""
    calls.append(method)
    return dispatch(model, texts, method, targets)


def run_fake_methods(model, out, resume=False, attribute_fn=dispatch, methods=tuple(FAKE_METHODS)):
    """The benchmark of fake ``methods`` on the key-token texts (occlusion the agreement reference),
    written to ``out``."""
    return run_benchmark(
        model,
        KEY_TEXTS,
        [1] * len(KEY_TEXTS),
        list(methods),
        BenchmarkOptions(sanity_samples=4, chunk_size=3, bounds="beam"),
        out,
        {"model": "key-token"},
        resume=resume,
        progress=False,
        attribute_fn=attribute_fn,
        reference_method="occlusion",
    )


@pytest.fixture(scope="module")
def results(key_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    return run_fake_methods(key_model, out), out


def test_the_synthetic_model_hinges_on_the_key_token(key_model):
    scorer = ClassifierScorer(key_model)
    with_key = scorer.probabilities([token_ids(key_model, text) for text in KEY_TEXTS])[:, 1]
    without = scorer.probabilities([token_ids(key_model, text.replace("great", "good")) for text in KEY_TEXTS])[:, 1]
    assert with_key.min() > 0.9 and without.max() < 0.1


def test_ranking_the_decisive_token_first_wins_comprehensiveness(results):
    methods = results[0]["methods"]
    comprehensiveness = {name: summary["comprehensiveness"]["mean"] for name, summary in methods.items()}
    assert max(comprehensiveness, key=comprehensiveness.get) in ("key_first", "occlusion")
    # removing "great" first flips every prediction: all bins drop p_c by > 0.8
    assert all(b["mean"] > 0.8 for b in methods["key_first"]["comprehensiveness"]["bins"].values())
    assert (
        comprehensiveness["key_first"] > comprehensiveness["random"] + 3 * methods["random"]["comprehensiveness"]["se"]
    )
    assert methods["key_first"]["sufficiency"]["mean"] < methods["random"]["sufficiency"]["mean"]
    assert methods["key_first"]["deletion_auc"]["mean"] < methods["random"]["deletion_auc"]["mean"]


def test_every_figure_has_a_standard_error(results):
    methods = results[0]["methods"]
    assert methods["occlusion"]["agreement_loo"] is None  # the reference is not compared with itself
    for name, summary in methods.items():
        metrics = ("comprehensiveness", "sufficiency", "deletion_auc", "seconds_per_sample")
        for metric in metrics + (("agreement_loo",) if name != "occlusion" else ()):
            assert set(summary[metric]) >= {"mean", "se"} and summary[metric]["se"] >= 0
        assert len(summary["comprehensiveness"]["bins"]) == 5
        assert summary["n"] == len(KEY_TEXTS)


def test_sanity_check_flags_a_constant_attribution_and_passes_occlusion(results, key_model):
    methods = results[0]["methods"]
    assert [s["stage"] for s in methods["constant"]["sanity"]["stages"]] == [
        label for label, _ in randomisation_stages(key_model)
    ]
    assert methods["constant"]["sanity"]["final_rho"] == 1.0 and methods["constant"]["sanity"]["flagged"]
    assert methods["key_first"]["sanity"]["flagged"]  # it ignores the weights too
    assert methods["occlusion"]["sanity"]["final_rho"] < FLAG_RHO and not methods["occlusion"]["sanity"]["flagged"]


def test_randomisation_leaves_the_original_model_untouched(results, key_model):
    scorer = ClassifierScorer(key_model)
    assert scorer.probabilities([token_ids(key_model, KEY_TEXTS[0])])[0, 1] > 0.9


def test_resume_reads_finished_methods_instead_of_recomputing(results, key_model):
    run, out = results
    calls = []
    counting = partial(counted_dispatch, calls)
    again = run_fake_methods(key_model, out, resume=True, attribute_fn=counting)
    assert calls == []
    assert again["methods"]["random"] == json.loads(json.dumps(run["methods"]["random"]))
    with pytest.raises(
        InputError, match=r"different configuration \(method_order: .*; run.options.replace: \"remove\""
    ):
        run_benchmark(
            key_model,
            KEY_TEXTS,
            [1] * len(KEY_TEXTS),
            ["random"],
            BenchmarkOptions(replace="mask"),
            out,
            {"model": "key-token"},
            resume=True,
            progress=False,
            attribute_fn=counting,
        )


def test_a_finished_run_resumed_explains_nothing_not_even_the_reference(key_model, tmp_path):
    calls = []
    counting = partial(counted_dispatch, calls)
    first = run_fake_methods(key_model, tmp_path, attribute_fn=counting, methods=("random", "key_first"))
    assert calls[0] == "occlusion" and first["methods"]["random"]["agreement_loo"] is not None
    calls.clear()
    again = run_fake_methods(key_model, tmp_path, resume=True, attribute_fn=counting, methods=("random", "key_first"))
    assert calls == []
    assert again["methods"] == json.loads(json.dumps(first["methods"]))


def test_an_interrupted_bounds_search_resumes_from_the_next_chunk(results, key_model, tmp_path, monkeypatch):
    """Ctrl-C during the second chunk's bounds search: the run stops after that chunk, its
    checkpoint kept; resumed, it searches only the chunks after it and ends with the bounds of the
    uninterrupted run."""
    import os
    import signal

    from attnflow.evaluate import benchmark

    whole = json.loads((results[1] / benchmark.BOUNDS_FILE).read_text())
    assert len(whole) == len(KEY_TEXTS)
    searched = []
    search = benchmark.search_bounds

    def counting(scorer, examples, *args):
        searched.append([example.text for example in examples])
        if len(searched) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C during the second chunk
        return search(scorer, examples, *args)

    monkeypatch.setattr(benchmark, "search_bounds", counting)
    with pytest.raises(KeyboardInterrupt):
        run_fake_methods(key_model, tmp_path)
    assert not (tmp_path / benchmark.BOUNDS_FILE).exists() and (tmp_path / benchmark.CHECKPOINT).exists()
    searched.clear()
    again = run_fake_methods(key_model, tmp_path, resume=True)
    assert searched == [list(KEY_TEXTS[6:])]  # chunks of 3: the third and last one
    resumed = json.loads((tmp_path / benchmark.BOUNDS_FILE).read_text())
    assert [b["search"] for b in resumed] == [b["search"] for b in whole]
    for metric in ("comprehensiveness", "sufficiency"):  # the same search, up to float32 noise of other batches
        np.testing.assert_allclose([b[metric] for b in resumed], [b[metric] for b in whole], atol=1e-6)
    naopc = again["methods"]["key_first"]["naopc_comprehensiveness"]["mean"]
    assert naopc == pytest.approx(results[0]["methods"]["key_first"]["naopc_comprehensiveness"]["mean"], abs=1e-6)


def test_cascade_randomises_head_then_layers_top_down_cumulatively(key_model):
    from attnflow.evaluate.sanity import cascade

    assert randomisation_stages(key_model) == [
        ("head", "head"),
        ("layer 1", "encoder.encoder.layer.1"),
        ("layer 0", "encoder.encoder.layer.0"),
    ]
    original = {name: p.detach().clone() for name, p in key_model.model.named_parameters()}

    def changed(model, prefix):
        return any(
            not np.allclose(p.detach(), original[n]) for n, p in model.model.named_parameters() if n.startswith(prefix)
        )

    seen = []
    for label, randomised in cascade(key_model, seed=1):
        seen.append(label)
        assert changed(randomised, "head.")
        assert changed(randomised, "encoder.encoder.layer.1.") == (label != "head")
        assert changed(randomised, "encoder.encoder.layer.0.") == (label == "layer 0")
        assert not changed(randomised, "encoder.embeddings.")
    assert seen == ["head", "layer 1", "layer 0"]
    assert not changed(key_model, "")  # the original is untouched


# ----- the results folder: replaced only with overwrite, whole -------------------------------


def test_an_earlier_run_is_replaced_only_with_overwrite_and_leaves_nothing_stale(key_model, tmp_path, monkeypatch):
    from attnflow.evaluate import api
    from attnflow.evaluate.api import evaluate

    # Scores from the fake methods, and no leave-one-out reference: the folder rules are under test.
    monkeypatch.setattr(api, "run_benchmark", partial(run_benchmark, attribute_fn=random_scores, reference_method=None))
    task = tmp_path / "task.csv"
    task.write_text("text,label\n" + "".join(f"{text},positive\n" for text in KEY_TEXTS[:2]))
    out = tmp_path / "out"

    def run(methods, **flags):
        options = BenchmarkOptions(sanity_samples=0)
        return evaluate(key_model, str(task), methods, 2, out, options, progress=False, figures=False, **flags)

    run(["random", "raw"])
    assert {p.name for p in (out / "methods").iterdir()} == {"random.json", "raw.json"}
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(InputError, match="holds an earlier run .*or overwrite to start again"):
        run(["random"])
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    with pytest.raises(InputError, match="not both"):
        run(["random"], overwrite=True, resume=True)
    results = run(["random"], overwrite=True)
    assert set(results["methods"]) == {"random"}
    assert {p.name for p in (out / "methods").iterdir()} == {"random.json"}  # raw.json of the old run is gone
    assert set(json.loads((out / "results.json").read_text())["methods"]) == {"random"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    run(["random"], resume=True)  # the same run, continued in place


def test_the_report_states_the_sanity_samples_run_and_what_each_mark_means(key_model, tmp_path):
    # Three samples, the default --sanity-samples 32: only three can be re-explained.
    texts = KEY_TEXTS[:3]
    run_info = {"model": "key-token", "task": "key", "split": "all", "samples": len(texts), "majority_accuracy": 1.0}
    results = run_benchmark(
        key_model,
        texts,
        [1] * len(texts),
        ["occlusion", "key_first", "random"],
        BenchmarkOptions(),
        tmp_path,
        run_info,
        progress=False,
        attribute_fn=dispatch,
        reference_method="occlusion",
    )
    assert results["run"]["options"]["sanity_samples"] == 8
    assert {stage["n"] for stage in results["methods"]["random"]["sanity"]["stages"]} == {3}
    paths = write_report(results, tmp_path, figures=False)
    table = paths["markdown"].read_text(encoding="utf-8")
    assert "Sanity check: 3 samples" in table and "Sanity check: 8" not in table
    main_table = table.split("\n\n")[2].splitlines()  # title, description, table
    assert main_table[0].startswith("| method |")
    column = main_table[0].split(" | ").index("sanity ρ (all random)")
    sanity = {row.split(" | ")[0][2:]: row.split(" | ")[column] for row in main_table[2:]}
    assert sanity == {
        "occlusion": f"{results['methods']['occlusion']['sanity']['final_rho']:.2f}",  # below FLAG_RHO: no flag
        "key_first": "1.00 **flagged**",
        "random": "1.00 **flagged** (expected: the control)",
    }
    legend = next(line for line in table.splitlines() if line.startswith("`reference`"))
    assert "**flagged**: with the head and every layer re-initialised" in legend
    assert "`random` is the control" in legend
    page = paths["html"].read_text(encoding="utf-8")
    assert "flagged: with the head and every layer re-initialised" in page and "random is the control" in page
    assert "Sanity check: 3 samples" in page


def test_report_figures_are_embedded_as_written_and_leave_matplotlib_alone(key_model, tmp_path):
    import base64

    import matplotlib

    texts = KEY_TEXTS[:3]
    run_info = {"model": "key-token", "task": "key", "split": "all", "samples": len(texts), "majority_accuracy": 1.0}
    options = BenchmarkOptions(sanity_samples=0)
    results = run_benchmark(
        key_model, texts, [1] * len(texts), ["key_first", "random"], options, tmp_path, run_info,
        progress=False, attribute_fn=dispatch, reference_method=None,
    )  # fmt: skip
    backend = matplotlib.get_backend()
    matplotlib.use("svg")  # a backend the report must not switch away from
    try:
        paths = write_report(results, tmp_path, figures=True)
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(backend)
    page = paths["html"].read_text(encoding="utf-8")
    for key in ("curves", "bars"):
        png = paths[key].read_bytes()
        assert png.startswith(b"\x89PNG") and base64.b64encode(png).decode("ascii") in page


def test_the_plan_is_printed_first_and_names_the_method_that_dominates(key_model, tmp_path, capsys):
    """Sizes against a count by hand (the head plus one stage per layer), the slow method named."""
    import time

    def slow(model, texts, method, targets):
        time.sleep(0.2 * len(texts))
        return random_scores(model, texts, method, targets)

    methods = {"random": random_scores, "slow": slow}
    options = BenchmarkOptions(sanity_samples=2, chunk_size=3)
    texts = KEY_TEXTS[:5]
    run_benchmark(
        key_model, texts, [1] * len(texts), list(methods), options, tmp_path, {"model": "key-token"},
        progress=True, attribute_fn=lambda m, t, name, g: methods[name](m, t, name, g), reference_method=None,
    )  # fmt: skip
    err = capsys.readouterr().err
    stages = 1 + key_model.n_layers
    explanations = 2 * (len(texts) + 2 * stages)
    assert (
        f"attnflow: plan: {len(texts)} examples × 2 methods, and 2 examples × {stages} sanity stages for each method: "
        f"{explanations:,} explanations"
    ) in err
    assert "attnflow: estimate: ~" in err
    dominant = next(line for line in err.splitlines() if "most of the time goes to" in line)
    share = re.match(r"attnflow: most of the time goes to slow (\d+) % ", dominant)
    assert share and int(share.group(1)) >= 50, dominant  # 200 ms an example against a few
    assert f"/{explanations} [" in err  # the bar counts the plan's explanations


def test_the_plan_counts_the_agreement_reference_and_the_methods_the_sanity_check_leaves_out(key_model):
    """The explanations still to run, counted from the run's units: leave_one_out (expensive) once
    per example, attnlrp also at every sanity stage, the agreement reference once per example."""
    from attnflow.evaluate.benchmark import benchmark_units, explanations_left
    from attnflow.evaluate.plan import plan_run

    options = BenchmarkOptions(sanity_samples=2, chunk_size=3)
    examples = KEY_TEXTS[:5]  # the units only slice them
    units = benchmark_units(key_model, examples, ["attnlrp", "leave_one_out"], options, "occlusion")
    stages = 1 + key_model.n_layers
    left = explanations_left(units, 0)
    assert left == {"occlusion (agreement reference)": 5, "attnlrp": 5 + 2 * stages, "leave_one_out": 5}
    assert explanations_left(units, 5) == {"attnlrp": 5 + 2 * stages, "leave_one_out": 5}  # the reference done
    plan = plan_run(key_model, None, examples, ["attnlrp", "leave_one_out"], left, options, timed=False)
    assert plan.describe() == [
        "plan: 5 examples × 2 methods, occlusion (agreement reference), and 2 examples × "
        f"{stages} sanity stages for 1 of them: {sum(left.values()):,} explanations"
    ]


def test_the_plan_advises_dropping_only_methods_the_run_was_asked_for():
    """The agreement reference is no entry of ``--methods``: its share is named, no advice to drop it."""
    from attnflow.evaluate.plan import Plan

    reference = "leave_one_out (agreement reference)"
    explanations = {"attnlrp": 5, "shap": 5, reference: 5}
    plan = Plan(5, ["attnlrp", "shap"], explanations, 0, 0, seconds={"attnlrp": 1.0, "shap": 30.0, reference: 60.0})
    dominant = next(line for line in plan.describe() if line.startswith("most of the time"))
    assert dominant.startswith(f"most of the time goes to {reference} 66 % (~60 s), shap 33 % (~30 s)")
    assert dominant.endswith("; --methods without shap runs faster")
    plan.seconds = {"attnlrp": 1.0, "shap": 1.0, reference: 60.0}
    dominant = next(line for line in plan.describe() if line.startswith("most of the time"))
    assert "--methods" not in dominant


def test_samples_not_given_take_a_smaller_set_whole_without_a_warning(caplog):
    from attnflow.evaluate.api import select_samples

    with caplog.at_level("WARNING"):
        assert select_samples(300, None, seed=0).tolist() == list(range(300))
    assert caplog.records == []
    with caplog.at_level("WARNING"):
        assert len(select_samples(300, 500, seed=0)) == 300
    assert "--samples 500 is more than the 300 held-out examples" in caplog.text
    assert len(select_samples(1000, None, seed=0)) == 500


def test_the_sanity_check_leaves_expensive_methods_out_unless_asked(key_model):
    from attnflow.evaluate.benchmark import method_units, sanity_checked
    from attnflow.methods.registry import get_method

    assert get_method("leave_one_out").cost == "expensive" and get_method("attnlrp").cost != "expensive"
    default, every = BenchmarkOptions(sanity_samples=2), BenchmarkOptions(sanity_samples=2, sanity_all=True)
    assert not sanity_checked("leave_one_out", default) and sanity_checked("leave_one_out", every)
    assert sanity_checked("attnlrp", default) and sanity_checked("key_first", default)  # not registered: checked
    examples = KEY_TEXTS[:3]  # the units only slice them
    kinds = {
        name: {unit.kind for unit in method_units(key_model, examples, name, default)}
        for name in ("leave_one_out", "attnlrp")
    }
    assert kinds == {"leave_one_out": {"method"}, "attnlrp": {"method", "sanity"}}
    assert {unit.kind for unit in method_units(key_model, examples, "leave_one_out", every)} == {"method", "sanity"}
