"""A stack of dense and mixture-of-experts layers (ERNIE 4.5 MoE, GLM-4.5, DeepSeek's first dense
layers): the inferred gated MLP names the dense layers only, the conformance suite proves it there,
and the backward rules split the gated product in those layers (the MoE layers keep their plain
gradient, as every layer of an all-MoE stack does). The oracle is the module tree itself: which
layers' feed-forward block has an up projection."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnflow
from attnflow.methods.model.lrp import rule_modules, rules_named
from attnflow.rows import check_adapter
from attnflow.rows.adapters import find_layers
from attnflow.rows.infer import verified_row
from attnflow.rows.tiny import model_class, randomise_constants, tiny_config, tiny_tokenizer


@pytest.fixture(scope="module")
def mixed():
    """A tiny ERNIE 4.5 MoE of 4 layers, a mixture of experts in every second one (1 and 3)."""
    config = tiny_config("ernie4_5_moe")
    config.num_hidden_layers, config.moe_layer_interval = 4, 2
    config.moe_layer_start_index, config.moe_layer_end_index = 0, 3
    torch.manual_seed(0)
    model = model_class("ernie4_5_moe", "causal-lm")._from_config(config, attn_implementation="eager")
    randomise_constants(model)
    return model.eval()


def _dense_layers(model) -> list[int]:
    return [index for index, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "up_proj")]


def test_the_gated_mlp_names_the_dense_layers_and_passes_its_check(mixed):
    assert _dense_layers(mixed) == [0, 2]  # the oracle: two dense layers, two mixtures of experts
    row = verified_row(mixed, "decoder")
    assert not row.unverified and row.gated_mlp is not None
    names = [name for name, _ in find_layers(mixed, row.gated_mlp.module, gaps=True)]
    assert names == [f"model.layers.{index}.mlp" for index in _dense_layers(mixed)]
    assert {"gated_mlp", "query_key", "values", "sites", "streams"} <= row.provides
    assert check_adapter(row, mixed, strict=False).outcome("gated_product") == "pass"


def test_a_gated_mlp_pattern_that_names_a_moe_layer_fails_its_check(mixed):
    import dataclasses

    row = verified_row(mixed, "decoder")
    every_layer = dataclasses.replace(row.gated_mlp, module=r"^model\.layers\.(\d+)\.mlp$")
    report = check_adapter(dataclasses.replace(row, gated_mlp=every_layer), mixed, strict=False)
    assert report.outcome("gated_product") == "fail"
    assert "layer 1" in next(result.detail for result in report.failed if result.check == "gated_product")


def test_the_rules_split_the_dense_layers_products_and_attnlrp_runs(mixed):
    row = verified_row(mixed, "decoder")
    model = attnflow.AttentionModel(mixed, tiny_tokenizer(), name="tiny mixed MoE", adapter=row)
    applied = rule_modules(model, rules_named("attnlrp"))
    gated = {module for module, kinds in applied.items() if any(kind == "gated_product" for kind, _, _ in kinds)}
    layers = mixed.model.layers
    assert gated == {module for index in _dense_layers(mixed) for module in (layers[index].mlp.up_proj,
                                                                            layers[index].mlp.act_fn)}  # fmt: skip
    relevance = model.explain("the movie was great but the acting", method="attnlrp")
    assert np.isfinite(relevance.scores).all() and np.abs(relevance.scores).max() > 0
