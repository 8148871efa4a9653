"""Routes through a mixture of experts: the feed-forward whole is split into one part per chosen
expert (and the shared expert's part); the parts add up to each MoE block's own output, recorded
by a hand-written hook, and each expert's share is its proximity recomputed here from the model's
own experts module run on that expert alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnflow
from attnflow.flow_routes.forward import record

from tiny_models import MOE_FAMILIES

TEXT = "the cat sat on the mat"


def hooked(model, attention: list | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Each MoE block's input and output and each decoder layer's output ``[T, d]``, by plain torch
    hooks (and each attention module's output into ``attention``, when given)."""
    inputs, outputs, layers = [], [], []

    def keep_block(_module, args, output) -> None:
        inputs.append(args[0][0])
        outputs.append(output[0])

    def keep_layer(_module, _args, output) -> None:
        layers.append(output[0])

    handles = []
    for layer in model.hf_model.model.layers:
        handles += [layer.mlp.register_forward_hook(keep_block), layer.register_forward_hook(keep_layer)]
        if attention is not None:
            handles.append(layer.self_attn.register_forward_hook(lambda _m, _a, output: attention.append(output[0][0])))
    try:
        ids = model.tokenizer(TEXT, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            model.hf_model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return inputs, outputs, layers


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_parts_add_up_to_each_moe_block(tiny_moe, family):
    model = tiny_moe(family)
    ids = model.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    recording = record(model, ids)
    _, outputs, layers = hooked(model)
    assert recording.experts is not None and len(recording.experts) == model.n_layers
    for layer, moe in enumerate(recording.experts):
        total = moe.parts.sum(dim=1) + (0 if moe.shared is None else moe.shared)  # [T, d]
        assert (moe.shared is not None) == (family == "qwen2_moe")
        assert float((total - outputs[layer]).abs().max()) <= 1e-5
        assert float((recording.mids[layer] + total - layers[layer]).abs().max()) <= 1e-5


def proximity(whole: np.ndarray, part: np.ndarray) -> float:
    return max(np.abs(whole).sum() - np.abs(whole - part).sum(), 0.0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_experts_share_is_its_proximity_to_the_stream(tiny_moe, family):
    """Oracle: the parts from the model's own modules (the experts module on one slot with weight
    1, times the router's weight; the shared expert and its gate), one position at a time."""
    model = tiny_moe(family)
    routes = attnflow.routes(model, TEXT, threshold=0.0)
    inputs, outputs, layers = hooked(model)
    graph = routes.graph
    assert graph.experts is not None and graph.shared_expert == (family == "qwen2_moe")
    np.testing.assert_allclose(graph.experts.sum(axis=1), graph.ffn, atol=1e-6)
    for layer, block in enumerate(model.hf_model.model.layers):
        moe, x = block.mlp, inputs[layer]
        with torch.no_grad():
            _, weights, indices = moe.gate(x)
            parts = {int(e): torch.zeros_like(x) for e in indices.unique()}
            for slot in range(indices.shape[1]):
                alone = moe.experts(x, indices[:, slot : slot + 1], torch.ones_like(weights[:, :1]))
                for i, e in enumerate(indices[:, slot].tolist()):
                    parts[e][i] = weights[i, slot] * alone[i]
            if family == "qwen2_moe":
                parts[graph.experts.shape[1] - 1] = torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
        whole = layers[layer].double().numpy()
        residual = (layers[layer] - outputs[layer]).double().numpy()
        for i in range(len(routes.tokens)):
            found = {e: proximity(whole[i], part[i].double().numpy()) for e, part in parts.items() if part[i].any()}
            total = sum(found.values()) + proximity(whole[i], residual[i])
            expected = np.zeros(graph.experts.shape[1])
            expected[list(found)] = np.array(list(found.values())) / total
            np.testing.assert_allclose(graph.experts[layer, :, i], expected, atol=1e-6)


def test_the_route_names_the_experts_it_goes_through(tiny_moe):
    routes = attnflow.routes(tiny_moe("qwen2_moe"), TEXT, threshold=0.0)
    composition = routes.importance
    assert composition.experts is not None and composition.experts.shape == (2, 5)
    np.testing.assert_allclose(composition.experts.sum(axis=1), composition.ffn.sum(axis=1), rtol=1e-6)
    edges = [edge for edge in routes.edges if edge.kind == "ffn"]
    assert edges and all(edge.experts for edge in edges)
    names = {name for edge in edges for name in edge.experts}
    assert any(name.endswith(".S") for name in names) and all(name.startswith(("L0.", "L1.")) for name in names)
    for edge in edges:
        assert sum(edge.experts.values()) == pytest.approx(edge.weight, rel=1e-5)
        assert "experts" in edge.to_dict()


def test_a_parallel_blocks_expert_parts_and_the_rest_add_up_to_its_output(inferred_loaded):
    """Cohere 2 MoE's block output is x + attention(norm(x)) + MoE(norm(x)): the parts of the MoE
    add up to its own output, and with the stream entering and the attention block's output (plain
    torch hooks) to the layer's; routes give each chosen expert a share beside the heads."""
    model = inferred_loaded("cohere2_moe")  # parallel attention and a mixture of experts
    ids = model.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    recording = record(model, ids)
    attention: list[torch.Tensor] = []
    _, outputs, layers = hooked(model, attention)
    assert model.adapter.streams is not None and model.adapter.streams.parallel
    assert recording.experts is not None and len(recording.experts) == model.n_layers
    for layer, moe in enumerate(recording.experts):
        total = moe.parts.sum(dim=1) + (0 if moe.shared is None else moe.shared)  # [T, d]
        assert float((total - outputs[layer]).abs().max()) <= 1e-5
        entering = recording.inputs[layer]  # the stream entering the block (both updates read it)
        assert float((entering + attention[layer] + total - layers[layer]).abs().max()) <= 1e-5
    routes = attnflow.routes(model, TEXT, threshold=0.0)
    experts = routes.graph.experts  # [L, E (+ 1), T]
    assert experts is not None and routes.graph.parallel
    for layer, moe in enumerate(recording.experts):
        chosen = np.zeros(experts.shape[1:], dtype=bool)
        chosen[moe.indices.T.numpy(), np.arange(moe.indices.shape[0])] = True
        assert (experts[layer][~chosen] == 0).all() and (experts[layer][chosen] > 0).any()
        np.testing.assert_allclose(experts[layer].sum(axis=0), routes.graph.ffn[layer], rtol=1e-5, atol=1e-7)
