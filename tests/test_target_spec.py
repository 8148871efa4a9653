"""One target spec (`attnflow.targets.Target`) taken as one ``target=`` argument everywhere, the
registry of objectives, methods that re-run the model resolving the target in their own passes (no
pass before them), and errors that name parameters (the command line spells them as flags)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import attnflow
from attnflow.errors import InputError
from attnflow.targets import OBJECTIVES, TARGET_KINDS, Target, as_target

TEXT = "the movie was great but the acting was bad"


@pytest.fixture(scope="module")
def classifier(tiny_classifier_path):
    return attnflow.load(str(tiny_classifier_path("bert")), device="cpu")


def test_as_target_is_the_one_conversion():
    assert as_target(None) == Target() and not Target().given
    assert as_target(1) == Target(label=1) and as_target("pos", contrast="neg") == Target("pos", contrast="neg")
    assert as_target(None, text="a kitten") == Target(text="a kitten")
    spec = Target(" Paris", contrast=" Rome")
    assert as_target(spec) is spec and spec.given
    with pytest.raises(InputError, match="inside the Target") as error:
        as_target(spec, contrast=" Berlin")
    assert error.value.parameter == "target"
    with pytest.raises(InputError, match="must be a Target"):
        as_target(1.5)  # type: ignore[arg-type]
    assert set(OBJECTIVES) == set(TARGET_KINDS)  # every kind of target has its objective


def forward_passes(model, call):
    calls = []
    handle = model.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        result = call()
    finally:
        handle.remove()
    return len(calls), result


@pytest.mark.parametrize("method", ["leave_one_out", "attnlrp"])
def test_a_model_running_method_resolves_the_target_in_its_own_pass(classifier, method):
    passes, explanation = forward_passes(classifier, lambda: classifier.explain(TEXT, method=method))
    assert passes == 1  # no pass before the method: it resolved the prediction itself
    traced = classifier.trace(TEXT, needs=("target",))[0].target
    assert explanation.target["index"] == traced.index and explanation.prediction == explanation.target
    assert explanation.target["value"] == pytest.approx(traced.value, rel=1e-5)
    assert explanation.target["probability"] == pytest.approx(traced.probability, rel=1e-5)
    (trace,) = classifier.trace_for([method], [TEXT])
    assert trace.target is None and trace.request == Target() and trace.attentions.shape[:2] == (0, 0)


def test_a_contrast_target_through_a_method_that_reruns_the_model(classifier):
    """leave-one-out is linear in y: explaining pos rather than neg is loo(pos) − loo(neg)."""
    contrast = classifier.explain(TEXT, method="leave_one_out", target=Target("pos", contrast="neg"))
    pos, neg = (classifier.explain(TEXT, method="leave_one_out", target=label).scores for label in ("pos", "neg"))
    np.testing.assert_allclose(contrast.scores, pos - neg, atol=1e-5)
    assert contrast.target["label"] == "pos" and contrast.target["contrast_label"] == "neg"


def test_the_loose_arguments_are_deprecated_spellings_of_the_target(classifier):
    with pytest.warns(DeprecationWarning, match="target=Target"):
        loose = classifier.explain(TEXT, method="grad_x_input", signed=True, target="pos", contrast="neg")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        spec = classifier.explain(TEXT, method="grad_x_input", signed=True, target=Target("pos", contrast="neg"))
    np.testing.assert_array_equal(loose.scores, spec.scores)


def test_the_explorer_compare_and_patching_take_the_target(classifier, tiny_model_path):
    from attnflow.comparison import compare
    from attnflow.exploration import explore

    target = Target("pos", contrast="neg")
    view = explore(classifier, TEXT, methods=["grad_x_input"], target=target, faithfulness=False).methods[0]
    expected = classifier.explain(TEXT, method="grad_x_input", target=target)
    np.testing.assert_allclose(np.asarray(view.scores), expected.scores, rtol=1e-5, atol=1e-7)
    compared = compare(classifier, classifier, TEXT, method="grad_x_input", target=target, k=2)
    np.testing.assert_allclose(compared.scores_a, expected.scores, rtol=1e-5, atol=1e-7)
    llama = attnflow.load(str(tiny_model_path("llama")), device="cpu")
    spec = attnflow.patch(
        llama, "the cat sat on the", "the dog sat on the", target=Target(40, contrast=41), sites="residual",
        methods="exact", progress=False,
    )  # fmt: skip
    assert spec.metric.startswith("logit(") and " - logit(" in spec.metric
    with pytest.warns(DeprecationWarning):
        loose = attnflow.patch(
            llama, "the cat sat on the", "the dog sat on the", target=40, contrast=41, sites="residual",
            methods="exact", progress=False,
        )  # fmt: skip
    np.testing.assert_array_equal(spec.effects["exact"]["residual"], loose.effects["exact"]["residual"])


def test_errors_name_parameters_and_the_command_line_spells_them_as_flags(classifier, tiny_classifier_path, capsys):
    from attnflow.cli import main

    with pytest.raises(InputError) as error:
        classifier.explain(TEXT, method="gradient", max_length=1)
    assert str(error.value).startswith("max_length must be") and error.value.parameter == "max_length"
    with pytest.raises(InputError) as error:
        classifier.explain(TEXT, method="gradient", target="neutral")
    assert "(target)" in str(error.value) and error.value.parameter == "target"
    path = str(tiny_classifier_path("bert"))
    code = main(
        ["explain", TEXT, "--model", path, "--method", "gradient", "--max-length", "1", "-q", "--device", "cpu"]
    )
    assert (
        code == 2 and capsys.readouterr().err.strip() == "attnflow: error: --max-length must be an integer >= 2, got 1"
    )


def test_the_steps_objective_is_a_registered_kind(tiny_model_path):
    llama = attnflow.load(str(tiny_model_path("llama")), device="cpu")
    ids = torch.as_tensor([llama.tokenizer("the cat sat on the mat")["input_ids"]])
    objective = Target.steps([2, 3], [ids[0, 3].item(), ids[0, 4].item()]).objective(llama)
    y, index, probability = objective(torch.ones_like(ids), input_ids=ids)
    with torch.no_grad():
        log_probs = torch.log_softmax(llama.model(input_ids=ids).logits[0], dim=-1)
    expected = torch.stack([log_probs[2, ids[0, 3]], log_probs[3, ids[0, 4]]])
    torch.testing.assert_close(y.detach(), expected, rtol=1e-5, atol=1e-6)
    assert objective.describe(float(y[0].detach()), int(index[0]), float(probability[0].detach())).kind == "next_token"


def test_routes_edges_and_versus_take_the_target_and_their_contrast_is_a_deprecated_spelling(tiny_model_path):
    """`attnflow.routes`, `edge_scores`, `EdgeGraph` and `compare_with_patching` read one ``target=``
    (its contrast inside); their loose ``contrast=`` still works, with a DeprecationWarning."""
    from attnflow.causal import compare_with_patching, edge_scores
    from attnflow.causal.edges import EdgeGraph

    llama = attnflow.load(str(tiny_model_path("llama")), device="cpu")
    clean, corrupt, spec = "the cat sat on the", "the dog sat on the", Target(40, contrast=41)
    calls = {
        "routes": lambda **target: attnflow.routes(llama, clean, **target).direct.total,
        "edge_scores": lambda **target: (
            edge_scores(llama, clean, corrupt, method="eap", circuit_sizes=(), **target).scores
        ),
        "EdgeGraph": lambda **target: EdgeGraph(llama, clean, corrupt, **target).difference,
        "compare_with_patching": lambda **target: (
            compare_with_patching(llama, clean, corrupt, methods=("rollout",), **target).effects
        ),
    }
    for name, call in calls.items():
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "(?s).*contrast= are deprecated", DeprecationWarning)
            one = call(target=spec)
        with pytest.warns(DeprecationWarning, match=f"{name}: target_text= and contrast= are deprecated"):
            loose = call(target=40, contrast=41)
        np.testing.assert_array_equal(np.asarray(one), np.asarray(loose), err_msg=name)


def test_whether_auto_has_a_target_reads_the_target_spec():
    from types import SimpleNamespace

    from attnflow.evaluate.per_input import has_target

    encoder = SimpleNamespace(target_kind="similarity", default_row="mean")
    assert (
        has_target(encoder, Target(text="a kitten")) and not has_target(encoder, Target()) and not has_target(encoder)
    )
    assert has_target(SimpleNamespace(target_kind="class", default_row="cls"))
