"""The logit lens and the direct effects on the tiny decoders: equal to W_U · final_norm(x) computed
by hand from the modules' weights, the top node's lens equal to the model's own logits, and the
direct effects along the top position's stream adding up to the model's own logit difference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from routes_oracle import VARIANTS, layer_norm, numpy64, oracle, rms_norm

import attnflow
from attnflow.errors import InputError
from attnflow.targets import Target

DECODERS = ("llama", "qwen2", "gemma3", "gpt2")
TEXT = "the cat sat on the mat"


LAYER_NORMED = ("gpt2", "gptj", "phi")  # the final norm is a layer norm (the others: RMS)


def _final(family: str, model):
    """The final norm module of a tiny decoder."""
    if family in ("gpt2", "gptj"):
        return model.model.transformer.ln_f
    return model.model.model.final_layernorm if family == "phi" else model.model.model.norm


def final_norm(family: str, model, vectors: np.ndarray) -> np.ndarray:
    """The final norm by hand, from its weights."""
    norm = _final(family, model)
    if family in LAYER_NORMED:
        return layer_norm(vectors, numpy64(norm.weight), numpy64(norm.bias), norm.eps)
    return rms_norm(vectors, _final_gain(family, model), _eps(family, model))


def unembedded(model, vectors: np.ndarray) -> np.ndarray:
    """W_U · x + b (Phi's language-model head has a bias b; the others none), by hand."""
    head = model.model.get_output_embeddings()
    return vectors @ numpy64(head.weight).T + (0.0 if head.bias is None else numpy64(head.bias))


def capped(model, logits: np.ndarray) -> np.ndarray:
    """The model's final soft-capping c·tanh(z / c) (Gemma 2), by hand; the logits as they are without one."""
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else cap * np.tanh(logits / cap)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("family", DECODERS + VARIANTS)
def test_the_lens_is_the_unembedding_of_the_final_norm(family, any_loaded):
    """W_U · final_norm(x), soft-capped where the model caps its logits (Gemma 2), at every node
    (parallel blocks have no mid node)."""
    model = any_loaded(family)
    routes = attnflow.routes(model, TEXT, lens="all", top_k=3)
    layers, hidden = oracle(family, model, TEXT)
    unembedding = numpy64(model.model.get_output_embeddings().weight)  # [V, d]
    vectors = {("in", layer, i): hidden[layer][i] for layer in range(model.n_layers) for i in range(len(routes.tokens))}
    if not routes.graph.parallel:
        vectors |= {
            ("mid", layer, i): layers[layer].mid[i]
            for layer in range(model.n_layers)
            for i in range(len(routes.tokens))
        }
    assert set(routes.lens) == set(vectors) | {("in", model.n_layers, i) for i in range(len(routes.tokens))}
    target = routes.target["id"]
    for node, vector in vectors.items():
        logits = capped(model, unembedded(model, final_norm(family, model, vector)))
        readout = routes.lens[node]
        assert readout["target"]["logit"] == pytest.approx(logits[target], abs=1e-4)
        assert readout["target"]["probability"] == pytest.approx(softmax(logits)[target], abs=1e-5)
        assert readout["target"]["rank"] == int((logits > logits[target]).sum())
        assert [token["id"] for token in readout["top"]] == list(np.argsort(-logits)[:3])


@pytest.mark.parametrize("family", DECODERS + VARIANTS)
def test_the_top_node_reads_the_models_own_logits(family, any_loaded):
    model = any_loaded(family)
    routes = attnflow.routes(model, TEXT)
    input_ids = model.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model.model(input_ids=input_ids).logits[0, -1].double()
    probabilities = logits.softmax(dim=-1)
    readout = routes.lens[routes.top]
    assert routes.prediction["id"] == int(logits.argmax()) == readout["top"][0]["id"] == routes.target["id"]
    for token in readout["top"]:
        assert token["probability"] == pytest.approx(float(probabilities[token["id"]]), abs=1e-6)
    assert routes.target["logit"] == pytest.approx(float(logits[routes.target["id"]]), abs=1e-5)


@pytest.mark.parametrize("family", DECODERS)
def test_direct_effects_by_hand_and_their_sum_is_the_logit_difference(family, tiny_loaded):
    model = tiny_loaded(family)
    input_ids = model.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model.model(input_ids=input_ids).logits[0, -1].double()
    target, contrast = (int(i) for i in logits.argsort(descending=True)[:2])
    routes = attnflow.routes(model, TEXT, target=Target(target, contrast=contrast))
    assert routes.direct.total == pytest.approx(float(logits[target] - logits[contrast]), abs=1e-4)
    layers, _ = oracle(family, model, TEXT)
    final = layers[-1].out  # [T, d] the stream leaving the last layer, by the oracle
    direction = numpy64(model.model.get_output_embeddings().weight)[target]
    for index, layer in enumerate(layers):
        for i in range(len(routes.tokens)):
            # the final norm at i with its statistic (σ or rms of the final residual at i) fixed
            statistic = final[i] - final[i].mean() if family == "gpt2" else final[i]
            scale = 1.0 / np.sqrt((statistic**2).mean() + _eps(family, model))
            gain = _final_gain(family, model)
            for head in range(model.n_heads):
                part = layer.head_outputs[i, head]
                part = part - part.mean() if family == "gpt2" else part
                expected = direction @ (gain * scale * part)
                assert routes.head_effects[index, head, i] == pytest.approx(expected, abs=1e-4)
            ffn_part = layer.out[i] - layer.mid[i]
            ffn_part = ffn_part - ffn_part.mean() if family == "gpt2" else ffn_part
            assert routes.ffn_effects[index, i] == pytest.approx(direction @ (gain * scale * ffn_part), abs=1e-4)


@pytest.mark.parametrize("family", DECODERS)
def test_each_edge_through_a_block_by_hand(family, tiny_loaded):
    model = tiny_loaded(family)
    input_ids = model.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model.model(input_ids=input_ids).logits[0, -1]
    target, contrast = (int(i) for i in logits.argsort(descending=True)[:2])
    routes = attnflow.routes(model, TEXT, threshold=0.01, target=Target(target, contrast=contrast), top_k=3)
    layers, _ = oracle(family, model, TEXT)
    final = layers[-1].out
    unembedding = numpy64(model.model.get_output_embeddings().weight)  # [V, d]
    through = [edge for edge in routes.edges if edge.kind in ("attention", "ffn")]
    assert through and all("promotes" in edge.effects for edge in through)  # fewer than EDGE_TOKENS
    for edge in through:
        layer, i, j = layers[edge.layer], edge.target[2], edge.source[2]
        statistic = final[i] - final[i].mean() if family == "gpt2" else final[i]
        reading = _final_gain(family, model) / np.sqrt((statistic**2).mean() + _eps(family, model))
        if edge.kind == "attention":
            per_head = layer.edge_parts[i, j]  # [H, d]
            per_head = per_head - per_head.mean(axis=-1, keepdims=True) if family == "gpt2" else per_head
            np.testing.assert_allclose(
                edge.effects["head_effects"], per_head @ (reading * unembedding[target]), atol=1e-4
            )
            part = per_head.sum(axis=0)
        else:
            part = layer.out[i] - layer.mid[i]
            part = part - part.mean() if family == "gpt2" else part
        effects = unembedding @ (reading * part)  # every token's logit
        assert edge.effects["effect"] == pytest.approx(effects[target], abs=1e-4)
        assert [token["id"] for token in edge.effects["promotes"]] == list(np.argsort(-effects)[:3])
        assert [token["effect"] for token in edge.effects["suppresses"]] == pytest.approx(
            np.sort(effects)[:3], abs=1e-4
        )
        if i == routes.position:
            assert edge.effects["contrast_effect"] == pytest.approx(effects[target] - effects[contrast], abs=1e-4)
        else:
            assert "contrast_effect" not in edge.effects


def _eps(family: str, model) -> float:
    norm = _final(family, model)
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)))


def _final_gain(family: str, model) -> np.ndarray:
    return numpy64(_final(family, model).weight) + (1.0 if family in ("gemma3", "gemma2") else 0.0)


@pytest.mark.parametrize("family", VARIANTS)
def test_direct_effects_add_up_to_the_logit_difference_before_soft_capping(family, variant_loaded):
    """Along the top stream every part's direct effect (a parallel block's feed-forward output
    among them) sums to the difference of W_U · final_norm(x): the model's own logits, except
    where it soft-caps them (Gemma 2), which the direct effects, linear in the parts, leave out."""
    model = variant_loaded(family)
    layers, _ = oracle(family, model, TEXT)
    uncapped = unembedded(model, final_norm(family, model, layers[-1].out[-1]))
    input_ids = model.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model.model(input_ids=input_ids).logits[0, -1].double().numpy()
    np.testing.assert_allclose(capped(model, uncapped), logits, atol=1e-5)  # the model's logits by hand
    target, contrast = (int(i) for i in np.argsort(-logits)[:2])
    routes = attnflow.routes(model, TEXT, target=Target(target, contrast=contrast))
    assert routes.direct.total == pytest.approx(uncapped[target] - uncapped[contrast], abs=1e-5)
    if family == "gemma2":  # the tiny model's cap bites: its logits are not the uncapped ones
        assert np.abs(logits - uncapped).max() > 1e-2


def test_encoders_have_routes_without_a_lens(tiny_loaded):
    routes = attnflow.routes(tiny_loaded("bert"), TEXT, position=0, threshold=0.0)
    assert routes.prediction is None and routes.lens == {} and routes.head_effects is None
    assert routes.nodes[0] == (("in", 2, 0), 1.0) and routes.components and "promotes" not in routes.components[0]
    with pytest.raises(InputError, match="no language-model head"):
        attnflow.routes(tiny_loaded("bert"), TEXT, target="cat")


@pytest.mark.parametrize(
    ("first", "phrase"),
    [
        (0, "in every stream, from the embeddings on"),
        (1, "from the stream leaving layer 0 (L0) on"),
        (2, "only in the final stream (leaving layer 1, L1)"),
    ],
)
def test_the_summary_names_streams_as_versus_names_rows(first, phrase, tiny_loaded):
    routes = attnflow.routes(tiny_loaded("llama"), TEXT)  # 2 layers: streams entering layers 0, 1, 2
    for layer in range(routes.n_layers + 1):
        routes.lens[("in", layer, routes.position)]["target"]["rank"] = 0 if layer >= first else 3
    assert f"the target {routes.target['token']!r} is the lens's top token {phrase}" in routes.summary()
