"""Gemma 3 (sandwich norms, q/k norms, x·(1 + w) RMS norms, local sliding-window layers beside
global ones, grouped-query attention): captured attentions and next-token scores equal the model's
own eager forward, loaded here by transformers alone; a local layer's window (written out from the
config) is where its attention lives; rollout and flow never reach past what the windows allow
(reachability composed here with boolean matrices); the embedded gemma3-270m (slow)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T

import attnflow
from attnflow.methods.flow import attention_flow
from attnflow.methods.rollout import rollout
from attnflow.model import AttentionModel
from attnflow.rows.adapters import find_layers
from attnflow.rows.tiny import tiny_tokenizer

from tiny_models import GEMMA3_WINDOW, tiny_config

TEXT = "the movie was terrible, but the acting was great."
PROMPT = "The capital of France is"


def allowed(n: int, window: int | None) -> np.ndarray:
    """``[query, key]`` where a causal layer may attend: j <= i, and i - j < window for a local one."""
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        for j in range(i + 1):
            mask[i, j] = window is None or i - j < window
    return mask


def layer_windows(config) -> list[int | None]:
    return [config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types]


def reachable(masks: list[np.ndarray]) -> list[np.ndarray]:
    """Per layer l, where output i of layer l can get information from input j: the boolean product
    of the masks of layers 0..l with the residual (each token keeps itself)."""
    n = masks[0].shape[0]
    reach, history = np.eye(n, dtype=bool), []
    for mask in masks:
        step = mask | np.eye(n, dtype=bool)
        reach = (step.astype(int) @ reach.astype(int)) > 0
        history.append(reach)
    return history


def test_capture_and_next_token_equal_the_models_own_forward(tiny_model_path):
    path = tiny_model_path("gemma3")
    model = attnflow.load(str(path), device="cpu")
    assert model.adapter.family == "gemma3" and model.kind == "decoder"
    trace = model.trace(TEXT, needs=("attentions", "head_outputs", "target"))[0]
    reference = T.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    with torch.no_grad():
        out = reference(input_ids=torch.tensor(trace.token_ids)[None], output_attentions=True)
    np.testing.assert_allclose(trace.attentions, torch.stack(out.attentions, 1)[0].numpy(), atol=1e-6)
    log_probabilities = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
    assert trace.target.index == int(log_probabilities.argmax())
    assert trace.target.value == pytest.approx(float(log_probabilities.max()), rel=1e-5)
    n = trace.n_tokens
    for layer, window in enumerate(layer_windows(model.config)):
        inside = allowed(n, window)
        assert np.all(trace.attentions[layer][:, ~inside] == 0.0), f"layer {layer} attends outside its window"
        assert np.all(trace.attentions[layer][:, inside] > 0.0)


def test_values_pass_through_the_sandwich_norm_and_the_projections_stay_for_the_rules(tiny_model_path):
    """The norm after the attention block is carried by the value-aware methods with its statistic
    fixed (tests/methods/test_output_norm.py checks the numbers); the backward rules still find
    the query/key/value projections."""
    model = attnflow.load(str(tiny_model_path("gemma3")), device="cpu")
    assert {"values", "query_key"} <= model.adapter.provides
    n = len(model.trace(TEXT)[0].tokens)
    assert model.explain(TEXT, method="norm").scores.shape == (n,)
    assert model.explain(TEXT, method="attnlrp").scores.shape == (n,)


def local_only_gemma3() -> AttentionModel:
    """The tiny Gemma 3 with every layer local (window `GEMMA3_WINDOW`): a token then receives from
    at most L·(window − 1) tokens back."""
    torch.manual_seed(0)
    config = tiny_config("gemma3")
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    tokenizer = tiny_tokenizer()
    return AttentionModel(model, tokenizer, name="tiny local gemma3", device="cpu")


@pytest.mark.parametrize("local_only", [True, False])
def test_rollout_and_flow_never_reach_past_the_windows(tiny_model_path, local_only):
    model = local_only_gemma3() if local_only else attnflow.load(str(tiny_model_path("gemma3")), device="cpu")
    trace = model.trace(TEXT)[0]
    n = trace.n_tokens
    masks = [allowed(n, window) for window in layer_windows(model.config)]
    reach = reachable(masks)
    causal = np.tril_indices(n)
    assert not reach[0][causal].all()  # the local first layer cuts the far past off
    assert reach[-1][causal].all() != local_only  # a global layer last reaches every earlier token
    per_layer = rollout(trace.attentions, layerwise=True)  # [layer, query, key]
    for layer, can in enumerate(reach):
        assert np.all(per_layer[layer][~can] == 0.0) and np.all(per_layer[layer][can] > 0.0)
        flows = attention_flow(trace.attentions, layer=layer + 1, normalize=False)
        assert np.all(flows[~can] == 0.0) and np.all(flows[can] > 0.0)
    if local_only:  # the bound by hand: 2 local layers of window 3 reach 2 · (3 − 1) = 4 tokens back
        farthest = n - 1 - 2 * (GEMMA3_WINDOW - 1)
        assert reach[-1][n - 1, farthest] and not reach[-1][n - 1, farthest - 1]


@pytest.mark.slow
def test_gemma3_270m_equals_its_own_forward():
    model = attnflow.load("gemma3-270m", device="cpu")
    assert (model.n_layers, model.n_heads, model.config.num_key_value_heads) == (18, 4, 1)
    assert model.config.sliding_window == 512 and "full_attention" in model.config.layer_types
    trace = model.trace(PROMPT, needs=("attentions", "target"))[0]
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor(trace.token_ids)[None], output_attentions=True)
    np.testing.assert_allclose(trace.attentions, torch.stack(out.attentions, 1)[0].numpy(), atol=1e-6)
    log_probabilities = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
    # float32 logits over a vocabulary of 150k-260k tokens: the log-probabilities agree to ~3e-5
    assert trace.target.value == pytest.approx(float(log_probabilities.max()), abs=2e-4)
    assert trace.tokens[0] == "<bos>" and trace.special_mask[0]


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_patching_sites_add_up_to_the_residual_stream(tiny_model_path, family):
    """Each layer's output = its input + the attention site's output + the MLP site's output: the
    sites are what the blocks add to the residual stream (Gemma: after the sandwich norms)."""
    model = attnflow.load(str(tiny_model_path(family)), device="cpu")
    sites = model.adapter.sites
    recorded: dict[str, list[torch.Tensor]] = {"in": [], "out": [], "attention": [], "mlp": []}

    def keep(name):
        def hook(_module, args, kwargs, output):
            if name == "out":
                recorded["in"].append(args[0] if args else kwargs["hidden_states"])
            recorded[name].append(output[0] if isinstance(output, tuple) else output)

        return hook

    ids = torch.tensor(model.trace(TEXT)[0].token_ids)[None]
    handles = []
    for name, pattern in (("out", sites.block), ("attention", sites.attention), ("mlp", sites.mlp)):
        layers = find_layers(model.model, pattern)
        assert len(layers) == model.n_layers
        handles += [module.register_forward_hook(keep(name), with_kwargs=True) for _, module in layers]
    try:
        with torch.no_grad():
            model.model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    assert all(len(tensors) == model.n_layers for tensors in recorded.values())
    for layer in range(model.n_layers):
        added = recorded["attention"][layer] + recorded["mlp"][layer]
        torch.testing.assert_close(recorded["out"][layer], recorded["in"][layer] + added, atol=1e-5, rtol=1e-5)
