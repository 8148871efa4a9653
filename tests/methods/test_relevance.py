"""Relevance beyond attention weights, against independent oracles.

- captured value vectors and output weights add back up to the real output projection's output
  (Σ_j Σ_h A f_h(x_j) + b_O), on tiny models of every value-aware family and on real minilm;
- ALTI's per-token parts, pushed through the layer norm, add up to the real layer-norm output;
- norm / norm_rollout / ALTI / grad_rollout against explicit Python loops over the definitions;
- attention gradients against the chain rule through the head outputs (dy/dA = dy/dZ · Vᵀ) and
  embedding gradients against central finite differences;
- value zeroing against full forward passes that zero one token's values at one layer;
- leave-one-out against one forward pass per shortened input; integrated gradients against
  completeness (attributions sum to y(x) − y(baseline)).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import attnflow
from attnflow.errors import ExplanationWarning
from attnflow.explanation import explain, explain_traces
from attnflow.methods.model.perturbation import integrated_gradient_attributions
from attnflow.methods.relevance import alti_layer_parts, alti_matrices, norm_matrices
from attnflow.rows.adapters import find_layers
from value_zeroing_oracle import value_zeroing_matrices

from tiny_models import CLASSIFIER_FAMILIES

TEXT = "the movie was terrible, but the acting was great."
VALUE_NEEDS = ("values", "output_weights", "layer_inputs")


@pytest.fixture(scope="module")
def tiny_bert(tiny_classifier_path):
    return attnflow.load(str(tiny_classifier_path("bert")), device="cpu")


def _module_outputs(model, pattern, text):
    """The real outputs ``[layer, token, d_model]`` of the modules matching ``pattern`` (one per
    layer), recorded by a plain forward hook during one forward pass over ``text``."""
    recorded = {}
    layers = find_layers(model.model, pattern)
    handles = [
        module.register_forward_hook(lambda m, i, o, name=name: recorded.__setitem__(name, o.detach()))
        for name, module in layers
    ]
    try:
        with torch.no_grad():
            model.model(**model.tokenizer(text, return_tensors="pt"))
    finally:
        for handle in handles:
            handle.remove()
    return np.stack([recorded[name][0].double().numpy() for name, _ in layers])


def _check_decomposition(model, text):
    trace = model.trace(text, needs=VALUE_NEEDS)[0]
    real = _module_outputs(model, model.adapter.stack.output_projection, text)  # [layer, token, d_model]
    for layer in range(trace.n_layers):
        parts = np.einsum("hij,jhd,hde->ie", trace.attentions[layer], trace.values[layer], trace.output_weights[layer])
        rebuilt = parts + trace.output_bias[layer]
        np.testing.assert_allclose(rebuilt, real[layer], atol=2e-4 * max(1.0, np.abs(real[layer]).max()))


@pytest.mark.parametrize("family", [*CLASSIFIER_FAMILIES])
def test_values_and_output_weights_add_up_to_the_projection_output(tiny_classifier_path, family):
    _check_decomposition(attnflow.load(str(tiny_classifier_path(family)), device="cpu"), TEXT)


def test_grouped_query_values_add_up_on_llama(tiny_model_path):
    model = attnflow.load(str(tiny_model_path("llama")), device="cpu")
    assert model.config.num_key_value_heads < model.n_heads
    _check_decomposition(model, TEXT)


def test_values_add_up_on_real_minilm(minilm_sentiment):
    _check_decomposition(minilm_sentiment, "The movie was terrible, but the acting was great.")


def test_layer_inputs_are_the_residual_stream(tiny_bert):
    trace = tiny_bert.trace(TEXT, needs=("layer_inputs",))[0]
    with torch.no_grad():
        hidden = tiny_bert.model(
            **tiny_bert.tokenizer(TEXT, return_tensors="pt"), output_hidden_states=True
        ).hidden_states
    for layer in range(trace.n_layers):  # hidden_states[l] is the input of layer l
        np.testing.assert_allclose(trace.layer_inputs[layer], hidden[layer][0].numpy(), atol=1e-6)


def _own_weights(model, trace, layer):
    """``values [token, head, d_head]`` and ``W_O [head, d_head, d_model]`` of one layer recomputed from
    the layer's own modules: its value projection applied to its input (after the pre-norm for
    pre-LN models), grouped-query value heads repeated; the output projection's weight."""
    block = find_layers(model.model, model.adapter.values.block)[layer][1]
    projection = find_layers(model.model, model.adapter.values.value)[layer][1]
    output = find_layers(model.model, model.adapter.stack.output_projection)[layer][1]
    hidden = torch.as_tensor(trace.layer_inputs[layer])[None]
    if hasattr(block, "input_layernorm"):  # pre-LN (Llama): values read the normalised stream
        hidden = block.input_layernorm(hidden)
    with torch.no_grad():
        values = projection(hidden)[0].double().numpy()  # [token, kv_heads * d_head]
    values = values.reshape(trace.n_tokens, -1, model.d_head).repeat(
        model.n_heads * model.d_head // values.shape[1], axis=1
    )
    w_o = output.weight.detach().double().numpy().T.reshape(model.n_heads, model.d_head, -1)
    return values, w_o


def _norm_loop(model, trace, layer, residual_vector=False):
    values, w_o = _own_weights(model, trace, layer)
    attentions = trace.attentions.astype(np.float64)
    n = trace.n_tokens
    result = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            vector = np.zeros(w_o.shape[-1])
            for h in range(trace.n_heads):
                vector += attentions[layer, h, i, j] * (values[j, h] @ w_o[h])
            if residual_vector and i == j:
                vector += trace.layer_inputs[layer, i]
            result[i, j] = np.linalg.norm(vector)
    return result


@pytest.mark.parametrize("model_name", ["tiny-bert", "tiny-llama", "minilm-sentiment"])
@pytest.mark.parametrize("residual_vector", [False, True])
def test_norm_matrices_equal_explicit_loops(model_name, residual_vector, tiny_bert, tiny_model_path, minilm_sentiment):
    model = {"tiny-bert": lambda: tiny_bert, "minilm-sentiment": lambda: minilm_sentiment}.get(
        model_name, lambda: attnflow.load(str(tiny_model_path("llama")), device="cpu")
    )()
    trace = model.trace("the cat sat on the mat.", needs=VALUE_NEEDS)[0]
    fast = norm_matrices(trace, residual_vector=residual_vector)
    for layer in range(trace.n_layers):
        expected = _norm_loop(model, trace, layer, residual_vector)
        np.testing.assert_allclose(fast[layer], expected, rtol=1e-4, atol=1e-6 * expected.max())


def test_norm_and_norm_rollout_compose_the_row_normalised_norms(tiny_bert):
    trace = tiny_bert.trace("the cat sat on the mat.", needs=VALUE_NEEDS)[0]
    norms = [_norm_loop(tiny_bert, trace, layer) for layer in range(trace.n_layers)]
    normalised = [m / m.sum(axis=1, keepdims=True) for m in norms]
    np.testing.assert_allclose(attnflow.norm(trace), normalised[-1], atol=1e-6)
    np.testing.assert_allclose(attnflow.norm(trace, layer=0), normalised[0], atol=1e-6)
    expected = np.eye(trace.n_tokens)
    for matrix in normalised:
        expected = (0.5 * matrix + 0.5 * np.eye(trace.n_tokens)) @ expected
    np.testing.assert_allclose(attnflow.norm_rollout(trace, residual="half"), expected, atol=1e-6)
    with_residual = [_norm_loop(tiny_bert, trace, layer, True) for layer in range(trace.n_layers)]
    residual = [m / m.sum(axis=1, keepdims=True) for m in with_residual]
    np.testing.assert_allclose(attnflow.norm_rollout(trace, residual="norm"), residual[1] @ residual[0], atol=1e-6)


@pytest.mark.parametrize("model_name", ["tiny-bert", "tiny-distilbert", "tiny-mpnet", "minilm-sentiment", "mpnet"])
def test_alti_parts_add_up_to_the_real_layer_norm_output(model_name, tiny_classifier_path, request):
    if model_name in ("minilm-sentiment", "mpnet"):
        model = request.getfixturevalue(model_name.replace("-", "_"))
    else:
        model = attnflow.load(str(tiny_classifier_path(model_name.split("-")[1])), device="cpu")
    text = "The movie was terrible, but the acting was great."
    trace = model.trace(text, needs=(*VALUE_NEEDS, "layer_norms"))[0]
    real = _module_outputs(model, model.adapter.values.norm, text)
    gain, shift = trace.layer_norms["weight"], trace.layer_norms["bias"]
    for layer in range(trace.n_layers):
        parts, y, sigma = alti_layer_parts(trace, layer, slice(None))
        z = gain[layer] * (parts - parts.mean(-1, keepdims=True)) / sigma[:, None, None]  # [q, k, d]
        bias = gain[layer] * (trace.output_bias[layer] - trace.output_bias[layer].mean()) / sigma[:, None]
        rebuilt = z.sum(axis=1) + bias + shift[layer]
        assert np.linalg.norm(rebuilt - real[layer]) <= 1e-4 * np.linalg.norm(real[layer])


def test_alti_equals_an_explicit_loop(tiny_bert):
    trace = tiny_bert.trace("the cat sat on the mat.", needs=(*VALUE_NEEDS, "layer_norms"))[0]
    for name in ("attentions", "values", "output_weights", "layer_inputs", "output_bias"):
        setattr(trace, name, getattr(trace, name).astype(np.float64))  # the loop in float64, as the method
    n, eps = trace.n_tokens, trace.layer_norms["eps"]
    expected = []
    for layer in range(trace.n_layers):
        g, b = (
            trace.layer_norms["weight"][layer].astype(np.float64),
            trace.layer_norms["bias"][layer].astype(np.float64),
        )
        contributions = np.zeros((n, n))
        for i in range(n):
            parts = []
            for j in range(n):
                t = sum(
                    trace.attentions[layer, h, i, j] * trace.values[layer, j, h] @ trace.output_weights[layer, h]
                    for h in range(trace.n_heads)
                )
                parts.append(t + (trace.layer_inputs[layer, i] if i == j else 0.0))
            y = np.sum(parts, axis=0) + trace.output_bias[layer]
            sigma = np.sqrt(y.var() + eps)
            normed = g * (y - y.mean()) / sigma + b
            for j in range(n):
                z = g * (parts[j] - parts[j].mean()) / sigma
                contributions[i, j] = max(0.0, np.abs(normed).sum() - np.abs(normed - z).sum())
        expected.append(contributions / contributions.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(alti_matrices(trace), np.stack(expected), atol=1e-8)
    np.testing.assert_allclose(attnflow.alti(trace), expected[1] @ expected[0], atol=1e-8)


def test_attention_grads_follow_the_chain_rule_through_head_outputs(tiny_bert):
    """dy/dA[h, i, j] = <dy/dZ[i, h], V[j, h]> with Z = A V the head outputs (recorded independently)."""
    encoded = tiny_bert.tokenizer(TEXT, return_tensors="pt")
    trace = tiny_bert.trace(TEXT, needs=("attention_grads", "values"))[0]
    heads_in = {}
    layers = find_layers(tiny_bert.model, tiny_bert.adapter.stack.output_projection)

    def keep(name):
        def hook(module, inputs):
            inputs[0].retain_grad()
            heads_in[name] = inputs[0]

        return hook

    handles = [module.register_forward_pre_hook(keep(name)) for name, module in layers]
    try:
        logits = tiny_bert.model(**encoded).logits
        logits[0, trace.target.index].backward()
    finally:
        for handle in handles:
            handle.remove()
    for layer, (name, _) in enumerate(layers):
        grad_z = heads_in[name].grad[0].reshape(trace.n_tokens, tiny_bert.n_heads, -1).double().numpy()  # [i, h, d]
        expected = np.einsum("ihd,jhd->hij", grad_z, trace.values[layer])
        np.testing.assert_allclose(trace.attention_grads[layer], expected, atol=1e-6)
    assert np.abs(trace.attention_grads).max() > 0


def test_embedding_grads_match_finite_differences(tiny_bert):
    trace = tiny_bert.trace(TEXT, needs=("embedding_grads",))[0]
    model = tiny_bert.model.double()
    try:
        ids = torch.as_tensor(trace.token_ids)[None]
        embeddings = model.get_input_embeddings()(ids)
        direction = torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        eps = 1e-5
        with torch.no_grad():
            plus = model(inputs_embeds=embeddings + eps * direction).logits[0, trace.target.index]
            minus = model(inputs_embeds=embeddings - eps * direction).logits[0, trace.target.index]
    finally:
        tiny_bert.model.float()
    numeric = float((plus - minus) / (2 * eps))
    analytic = float((torch.as_tensor(trace.embedding_grads, dtype=torch.float64) * direction[0]).sum())
    assert analytic == pytest.approx(numeric, rel=1e-3, abs=1e-6)
    np.testing.assert_allclose(trace.embeddings, embeddings[0].detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(attnflow.gradient(trace), np.linalg.norm(trace.embedding_grads, axis=-1))
    np.testing.assert_allclose(
        attnflow.grad_x_input(trace), np.linalg.norm(trace.embedding_grads * trace.embeddings, axis=-1)
    )


def test_signed_grad_x_input_is_the_derivative_of_scaling_each_token(tiny_bert):
    """Σ_d e_jd ∂y/∂e_jd = d/dt y(e_j scaled by 1 + t) at t = 0, by central differences per token."""
    trace = tiny_bert.trace(TEXT, needs=("embedding_grads",))[0]
    signed = explain(trace, method="grad_x_input", signed=True).scores
    model = tiny_bert.model.double()
    try:
        embeddings = model.get_input_embeddings()(torch.as_tensor(trace.token_ids)[None])
        eps = 1e-6
        numeric = []
        with torch.no_grad():
            for j in range(trace.n_tokens):
                scaled = [embeddings.clone(), embeddings.clone()]
                scaled[0][0, j] *= 1 + eps
                scaled[1][0, j] *= 1 - eps
                plus, minus = (float(model(inputs_embeds=e).logits[0, trace.target.index]) for e in scaled)
                numeric.append((plus - minus) / (2 * eps))
    finally:
        tiny_bert.model.float()
    np.testing.assert_allclose(signed, numeric, rtol=1e-3, atol=1e-8)
    assert np.any(signed < 0) and np.any(signed > 0)


def test_grad_rollout_equals_an_explicit_loop(tiny_bert):
    trace = tiny_bert.trace(TEXT, needs=("attention_grads",))[0]
    n = trace.n_tokens
    relevance = np.eye(n)
    for layer in range(trace.n_layers):
        weighted = np.zeros((n, n))
        for h in range(trace.n_heads):
            for i in range(n):
                for j in range(n):
                    weighted[i, j] += (
                        max(0.0, trace.attention_grads[layer, h, i, j] * trace.attentions[layer, h, i, j])
                        / trace.n_heads
                    )
        relevance = relevance + weighted @ relevance
    np.testing.assert_allclose(attnflow.grad_rollout(trace, keep_identity=True), relevance, atol=1e-10)
    np.testing.assert_allclose(attnflow.grad_rollout(trace), relevance - np.eye(n), atol=1e-10)
    assert np.abs(relevance - np.eye(n)).max() > 0  # the gradients really weigh something


@pytest.mark.parametrize("family", CLASSIFIER_FAMILIES)
def test_value_zeroing_equals_full_forward_passes_with_one_token_zeroed(tiny_classifier_path, family):
    tiny_bert = attnflow.load(str(tiny_classifier_path(family)), device="cpu")
    text = "the cat sat on the mat."
    trace = tiny_bert.trace(text, needs=("attentions",))[0]
    ids = torch.as_tensor(trace.token_ids)[None]
    blocks = [module for _, module in find_layers(tiny_bert.model, tiny_bert.adapter.values.block)]
    values = [module for _, module in find_layers(tiny_bert.model, tiny_bert.adapter.values.value)]
    expected = value_zeroing_matrices(tiny_bert.model, ids, blocks, values)
    result = explain(trace, method="value_zeroing", model=tiny_bert, batch_size=3).matrix  # 3: several batches
    np.testing.assert_allclose(result, expected[1] @ expected[0], atol=1e-6)


def test_leave_one_out_equals_one_forward_per_removed_token(tiny_bert):
    trace = tiny_bert.trace(TEXT, needs=("target",))[0]
    scores = explain(trace, method="leave_one_out", model=tiny_bert, batch_size=4).scores
    ids = list(trace.token_ids)
    with torch.no_grad():
        full = float(tiny_bert.model(input_ids=torch.tensor([ids])).logits[0, trace.target.index])
        for j in range(len(ids)):
            if trace.special_mask[j]:
                assert scores[j] == 0.0
                continue
            shorter = ids[:j] + ids[j + 1 :]
            value = float(tiny_bert.model(input_ids=torch.tensor([shorter])).logits[0, trace.target.index])
            assert scores[j] == pytest.approx(full - value, abs=1e-5)


def test_leave_one_out_of_several_texts_scores_all_their_variants_together(tiny_bert, monkeypatch):
    """The batch form (`model.explain(texts)`): one set of forward passes for every text's variants,
    each text explained for its own class, equal to explaining each text alone."""
    from attnflow.methods.model import perturbation

    texts = [TEXT, "the acting was great", "a cat sat on the mat and the dog ran"]
    traces = tiny_bert.trace(texts, needs=("target",))
    traces[1].target = dataclasses.replace(traces[1].target, index=1 - traces[1].target.index)  # classes differ
    calls = []
    original = perturbation.target_values
    monkeypatch.setattr(
        perturbation, "target_values", lambda *args, **kw: calls.append(len(args[2])) or original(*args, **kw)
    )
    together = explain_traces(traces, method="leave_one_out", model=tiny_bert, batch_size=4)
    assert calls == [sum(1 + int((~trace.special_mask).sum()) for trace in traces)]  # one call, every variant
    for trace, explanation in zip(traces, together, strict=True):
        alone = explain(trace, method="leave_one_out", model=tiny_bert, batch_size=4)
        np.testing.assert_allclose(explanation.scores, alone.scores, atol=1e-5)


def test_integrated_gradients_are_complete(tiny_bert):
    """Σ_j Σ_d IG_jd = y(x) − y(baseline), the baseline replacing content tokens by [PAD]."""
    trace = tiny_bert.trace(TEXT, needs=("target",))[0]
    attributions = integrated_gradient_attributions(tiny_bert, trace, n_steps=300)  # [token, d_model]
    baseline = np.where(trace.special_mask, trace.token_ids, tiny_bert.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = [
            tiny_bert.model(input_ids=torch.as_tensor(ids)[None]).logits[0, trace.target.index]
            for ids in (trace.token_ids, baseline)
        ]
    assert attributions.sum() == pytest.approx(float(logits[0] - logits[1]), rel=2e-2, abs=1e-4)
    scores = explain(trace, method="integrated_gradients", model=tiny_bert, n_steps=300).scores
    np.testing.assert_allclose(scores, np.linalg.norm(attributions, axis=-1), rtol=1e-6)
    assert np.all(scores[trace.special_mask] == 0)  # baseline == input there: no path, no attribution
    signed = explain(trace, method="integrated_gradients", model=tiny_bert, n_steps=300, signed=True).scores
    np.testing.assert_allclose(signed, attributions.sum(axis=-1), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("family", CLASSIFIER_FAMILIES)
def test_every_method_runs_on_every_bert_like_family(tiny_classifier_path, family):
    model = attnflow.load(str(tiny_classifier_path(family)), device="cpu")
    texts = [TEXT, "hi there."]
    for method in attnflow.available_methods():
        explanations = model.explain(texts, method=method, batch_size=2)
        for explanation in explanations:
            assert np.all(np.isfinite(explanation.scores)), method
            assert explanation.prediction["kind"] == "class"
            if explanation.matrix is not None and method != "grad_rollout":
                np.testing.assert_allclose(explanation.matrix.sum(axis=1), 1.0, atol=1e-6, err_msg=method)


def test_integrated_gradients_report_their_completeness_error(minilm_sentiment):
    trace = minilm_sentiment.trace("The movie was terrible, but the acting was great.", needs=("target",))[0]
    attributions, delta, difference = integrated_gradient_attributions(minilm_sentiment, trace, return_delta=True)
    assert delta == pytest.approx(attributions.sum() - difference, abs=1e-4)  # captum's convergence delta
    assert abs(delta) < 0.05 * abs(difference)  # 32 steps are enough on a real sentence
    assert explain(trace, method="integrated_gradients", model=minilm_sentiment).notes == []
    with pytest.warns(ExplanationWarning, match="completeness error"):
        coarse = explain(trace, method="integrated_gradients", model=minilm_sentiment, n_steps=1)
    assert "completeness error" in coarse.notes[0]


def test_random_is_seeded(tiny_bert):
    trace = tiny_bert.trace(TEXT, needs=("attentions",))[0]
    first, again, other = (attnflow.random(trace, seed=s) for s in (3, 3, 4))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert first.shape == (trace.n_tokens,)


def test_random_differs_between_inputs_of_the_same_length(tiny_bert):
    """Seeded by the input too: two texts of the same length get independent scores (a seed alone
    made `random` one fixed positional ranking, the same for every input of a length)."""
    one, two = tiny_bert.trace(["the movie was bad", "a film is very"], needs=("attentions",))
    assert one.n_tokens == two.n_tokens
    assert not np.array_equal(attnflow.random(one), attnflow.random(two))
    np.testing.assert_array_equal(attnflow.random(one), attnflow.random(tiny_bert.trace("the movie was bad")[0]))


def test_random_rankings_are_uniform_so_its_expected_aopc_is_the_mean_over_permutations(tiny_bert):
    """Over seeds, `random`'s ranking of 4 content tokens is each of the 24 orders equally often, and
    the mean AOPC of a drop that is not additive equals the exact mean over all 24 permutations."""
    from itertools import permutations

    from attnflow.evaluate.metrics import content_ranking, top_count

    trace = tiny_bert.trace("the cat sat on", needs=("attentions",))[0]
    special = np.asarray(trace.special_mask, dtype=bool)
    content = np.flatnonzero(~special)
    assert len(content) == 4
    weights = np.random.default_rng(1).normal(size=trace.n_tokens)
    counts = [top_count(k, 4) for k in (0.25, 0.5, 0.75)]

    def aopc(order):  # a drop with an interaction between the first two content tokens
        return np.mean([weights[order[:c]].sum() + 2.0 * (set(content[:2]) <= set(order[:c])) for c in counts])

    exact = np.mean([aopc(np.array(order)) for order in permutations(content)])
    seen: dict[tuple, int] = {}
    values = []
    for seed in range(2400):
        order = content_ranking(attnflow.random(trace, seed=seed), special)
        seen[tuple(order)] = seen.get(tuple(order), 0) + 1
        values.append(aopc(order))
    assert len(seen) == 24 and min(seen.values()) > 60  # 100 expected each
    assert np.mean(values) == pytest.approx(exact, abs=3 * np.std(values) / np.sqrt(len(values)))


def test_methods_refuse_a_trace_without_what_they_need(tiny_bert):
    trace = tiny_bert.trace(TEXT, needs=("attentions",))[0]
    for method in ("norm", "alti", "grad_rollout", "gradient"):
        with pytest.raises(ValueError, match="needs"):
            explain(trace, method=method)
    with pytest.raises(ValueError, match="re-runs the model"):
        explain(trace, method="value_zeroing")


def test_gradients_reach_the_right_layers_when_hooks_register_in_a_shuffled_order(tiny_bert, monkeypatch):
    """Hooks registered in a random layer order: attentions and their gradients still land on their
    own layers (they are keyed by module name, never by registration or firing order)."""
    from attnflow.capture import hooks

    expected = tiny_bert.trace(TEXT, needs=("attention_grads", "head_outputs"))[0]
    original = hooks.find_layers
    rng = np.random.default_rng(0)

    def shuffled(model, pattern, **options):  # options: find_layers' gaps
        layers = original(model, pattern, **options)
        return [layers[i] for i in rng.permutation(len(layers))]

    monkeypatch.setattr(hooks, "find_layers", shuffled)
    for _ in range(3):
        trace = tiny_bert.trace(TEXT, needs=("attention_grads", "head_outputs"))[0]
        np.testing.assert_array_equal(trace.attentions, expected.attentions)
        np.testing.assert_array_equal(trace.attention_grads, expected.attention_grads)
        np.testing.assert_array_equal(trace.head_outputs, expected.head_outputs)
    assert not np.allclose(expected.attention_grads[0], expected.attention_grads[1])  # layers differ


@pytest.mark.parametrize("method", sorted(set(attnflow.available_methods()) - {"random"}))
def test_batched_explanations_equal_one_by_one(tiny_bert, method):
    """Padding in a batch changes nothing: every method gives each text what it gives it alone."""
    texts = [TEXT, "hi there.", "the dog ran to the cat and the cat sat on the mat."]
    batched = tiny_bert.explain(texts, method=method, batch_size=3)
    for text, explanation in zip(texts, batched, strict=True):
        single = tiny_bert.explain(text, method=method)
        np.testing.assert_allclose(explanation.scores, single.scores, rtol=1e-4, atol=1e-6)
        if single.matrix is not None:
            np.testing.assert_allclose(explanation.matrix, single.matrix, rtol=1e-4, atol=1e-6)
