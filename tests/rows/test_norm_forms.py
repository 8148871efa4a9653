"""Norm forms inference had to refuse: OLMo's weightless layer norms (the epsilon is written in
their forward, not stored: inference measures it), Nemotron's layer norms that multiply by 1 + w,
and ModernBERT's decoder, whose first layer has an identity where the others have an attention
norm. Oracles: ``torch.nn.functional.layer_norm`` written out with the constants of each model's
own source, and the module tree."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnflow
from attnflow.rows import check_adapter
from attnflow.rows.adapters import find_layers
from attnflow.rows.infer import verified_row
from attnflow.rows.tiny import model_class, randomise_constants, tiny_config, tiny_tokenizer

TEXT = "the movie was great but the acting"


def _tiny(model_type: str) -> attnflow.AttentionModel:
    torch.manual_seed(0)
    model = model_class(model_type, "causal-lm")._from_config(tiny_config(model_type), attn_implementation="eager")
    randomise_constants(model)
    model.eval()
    row = verified_row(model, "decoder")
    return attnflow.AttentionModel(model, tiny_tokenizer(), name=f"tiny {model_type}", adapter=row)


def _norm_input_and_output(model, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    module = dict(model.hf_model.named_modules())[name]
    seen = {}
    handle = module.register_forward_hook(lambda _m, args, out: seen.update(x=args[0], y=out))
    try:
        with torch.no_grad():
            model.hf_model(**model.tokenizer(TEXT, return_tensors="pt"))
    finally:
        handle.remove()
    return seen["x"], seen["y"]


@pytest.mark.parametrize(
    ("model_type", "form", "offset", "eps"),
    [("olmo", "layer", 0.0, 1e-5), ("nemotron", "layer", 1.0, None)],
)
def test_the_form_offset_and_epsilon_are_inferred(model_type, form, offset, eps):
    model = _tiny(model_type)
    norms = model.adapter.norms
    assert not model.adapter.unverified and norms is not None
    assert (norms.form, norms.rms_offset, norms.eps) == (form, offset, eps)
    assert {"norms", "query_key", "streams"} <= model.adapter.provides
    x, y = _norm_input_and_output(model, "model.layers.0.input_layernorm")
    module = model.hf_model.model.layers[0].input_layernorm
    if model_type == "olmo":  # OlmoLayerNorm: F.layer_norm(x, shape, None, None, eps=1e-5)
        oracle = F.layer_norm(x, x.shape[-1:], None, None, eps=1e-5)
        assert not torch.allclose(norms.recompute(module, x), F.layer_norm(x, x.shape[-1:], eps=1e-6), atol=1e-6)
    else:  # NemotronLayerNorm1P: F.layer_norm(x, shape, w + 1, b, eps)
        oracle = F.layer_norm(x, x.shape[-1:], module.weight + 1.0, module.bias, module.eps)
    torch.testing.assert_close(y, oracle)
    torch.testing.assert_close(norms.recompute(module, x), oracle, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", ["olmo", "nemotron", "modernbert-decoder"])
def test_the_backward_rules_and_routes_run(model_type):
    model = _tiny(model_type)
    relevance = model.explain(TEXT, method="attnlrp")
    assert np.isfinite(relevance.scores).all() and np.abs(relevance.scores).max() > 0
    routes = attnflow.routes(model, TEXT)  # routes check that the parts add up to every stream
    assert routes.edges and routes.graph.n_layers == model.n_layers


def test_a_layer_without_a_norm_is_left_out_of_the_pattern():
    model = _tiny("modernbert-decoder")
    hf_model, norms = model.hf_model, model.adapter.norms
    assert isinstance(hf_model.model.layers[0].attn_norm, nn.Identity)  # the oracle: the module tree
    matched = [module for name, module in hf_model.named_modules() if name and re.search(norms.modules, name)]
    assert matched and all(isinstance(module, nn.LayerNorm) for module in matched)
    assert hf_model.model.layers[1].attn_norm in matched
    assert check_adapter(model.adapter, hf_model, strict=False).outcome("norm_form") == "pass"
    assert len(find_layers(hf_model, r"layers\.(\d+)\.mlp_norm$")) == model.n_layers


def test_a_norm_read_only_through_a_top_k_is_not_the_rows():
    """DeepSeek-V3.2's lightning indexer layer-norms its keys (a LayerNorm among RMS norms) only to
    pick which keys each query attends to, by top-k: no gradient of the output reaches it, so it is
    not one of the norms the rules and routes linearise. The row declares the RMS norms, the check
    passes, and the backward rules and routes run. Oracle: changing the indexer norm's output
    changes no logit on this input (a discrete choice), while changing an RMS norm's output does."""
    from attnflow.rows.hook_points import HookPoint, hooks

    model = _tiny("deepseek_v32")
    row = model.adapter
    assert row.norms is not None and row.norms.form == "rms" and not row.unverified
    indexer = [name for name, _ in model.hf_model.named_modules() if name.endswith("indexer.k_norm")]
    assert indexer and not any(re.search(row.norms.modules, name) for name in indexer)
    assert check_adapter(row, model.hf_model, strict=False).outcome("norm_form") == "pass"
    ids = model.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    modules = dict(model.hf_model.named_modules())

    def logits_with(name: str | None) -> torch.Tensor:
        changed = [] if name is None else [(HookPoint(modules[name]), lambda tensor: tensor * 1.01 + 0.01)]
        with hooks(changed), torch.no_grad():
            return model.hf_model(input_ids=ids).logits

    clean = logits_with(None)
    assert all(torch.equal(logits_with(name), clean) for name in indexer)
    assert not torch.equal(logits_with("model.layers.0.input_layernorm"), clean)
    assert {"query_key", "norms", "streams"} <= row.provides
    assert np.isfinite(model.explain(TEXT, method="attnlrp").scores).all()
    assert attnflow.routes(model, TEXT).edges
