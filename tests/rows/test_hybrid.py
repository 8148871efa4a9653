"""Hybrid stacks (attention in some layers; state-space, recurrent or linear-attention layers in the
others: Qwen3-Next, Bamba, Jamba): the inferred row names every block, attention in the attention
layers only and the other layers' token mixers (`attnflow.rows.adapters.Mixers`); what does not
assume attention is the only token mixer runs (exact patching, the gradient and perturbation
methods), what does (rollout, the value-aware maps, the LRP rules, routes) is refused in one line
naming the layers and their mixer."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import attnflow
from attnflow.errors import InputError
from attnflow.rows import check_adapter

CLEAN, CORRUPT = "the cat sat on the mat", "the dog sat on the mat"  # equal lengths on the tiny tokenizer


@pytest.fixture(scope="module")
def hybrid_path(tiny_architecture_path):
    """``hybrid_path(model_type) -> Path`` of a tiny hybrid causal LM (the session's build)."""
    return tiny_architecture_path


@pytest.fixture(scope="module")
def qwen3_next(hybrid_path):
    """Qwen3-Next tiny: layer 0 a Gated DeltaNet (linear attention), layer 1 full attention."""
    return attnflow.load(str(hybrid_path("qwen3_next")), device="cpu", progress=False)


HYBRIDS = [
    ("qwen3_next", "linear_attn", "Qwen3NextGatedDeltaNet"),
    ("bamba", "mamba", "BambaMixer"),
    ("jamba", "mamba", "JambaMambaMixer"),
]


@pytest.mark.parametrize(("model_type", "mixer", "mixer_class"), HYBRIDS)
def test_a_hybrid_loads_with_its_layers_and_mixers(hybrid_path, model_type, mixer, mixer_class):
    """Every block is a layer (Jamba's are of two classes), attention is read in layer 1 only, layer
    0's token mixer is named, and the row passes the conformance suite (the sites add up in every
    layer, the mixer's output being layer 0's token-mixing site)."""
    model = attnflow.load(str(hybrid_path(model_type)), device="cpu", progress=False)
    row = model.adapter
    assert model.n_layers == 2 and model.layer_names == ["model.layers.1.self_attn"]
    assert row.mixers is not None and row.mixers.layers == (0,) and row.mixers.kinds == (mixer_class,)
    assert row.stack.gaps and "attention_mixing" not in row.provides and "sites" in row.provides
    sites = {name for name, _ in model.hf_model.named_modules() if name and re.search(row.sites.attention, name)}
    assert sites == {f"model.layers.0.{mixer}", "model.layers.1.self_attn"}
    report = check_adapter(row, model)
    assert {"attention_weights", "residual_sum", "own_value", "knockout"} <= report.passed


def _metric(logits: torch.Tensor, target: int) -> float:
    return float(torch.log_softmax(logits[0, -1].double(), dim=-1)[target])


def test_exact_patching_of_a_hybrid_equals_a_hand_written_hook(qwen3_next):
    """Denoising the residual stream leaving layer 0 (a linear-attention layer) and the mixer's own
    output at one position: the exact sweep's effect is what a hook written here gives,
    (m_patched − m_corrupt) / (m_clean − m_corrupt) with m = log p(the clean prediction)."""
    import warnings

    model, hf = qwen3_next, qwen3_next.hf_model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on random weights the corruption may not lower the metric
        result = attnflow.patch(model, CLEAN, CORRUPT, sites="residual,attn", methods="exact", progress=False)
    clean = model.tokenizer(CLEAN, return_tensors="pt")["input_ids"]
    corrupt = model.tokenizer(CORRUPT, return_tensors="pt")["input_ids"]
    layer0, mixer = hf.model.layers[0], hf.model.layers[0].linear_attn
    kept: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(_module, _args, output):
            kept[name] = (output[0] if isinstance(output, tuple) else output).detach().clone()

        return hook

    handles = [layer0.register_forward_hook(keep("residual")), mixer.register_forward_hook(keep("attn"))]
    with torch.no_grad():
        clean_logits = hf(input_ids=clean).logits
        for handle in handles:
            handle.remove()
        corrupt_logits = hf(input_ids=corrupt).logits
    target = int(clean_logits[0, -1].argmax())
    m_clean, m_corrupt = _metric(clean_logits, target), _metric(corrupt_logits, target)
    position = int((clean != corrupt)[0].nonzero()[0, 0])  # "cat" / "dog"
    for kind, module in (("residual", layer0), ("attn", mixer)):

        def write(_module, _args, output, kind=kind):
            tensor = output[0] if isinstance(output, tuple) else output
            tensor = tensor.clone()
            tensor[:, position] = kept[kind][:, position]
            return (tensor, *output[1:]) if isinstance(output, tuple) else tensor

        handle = module.register_forward_hook(write)
        try:
            with torch.no_grad():
                patched = _metric(hf(input_ids=corrupt).logits, target)
        finally:
            handle.remove()
        expected = (patched - m_corrupt) / (m_clean - m_corrupt)
        row = 1 if kind == "residual" else 0  # residual row 1: the stream leaving layer 0
        found = result.effects["exact"][kind][row, position]
        # compared on the metric's scale (float32 forward passes, batched or not, differ by ~1e-7)
        assert abs(found - expected) * abs(m_clean - m_corrupt) < 1e-5, (kind, found, expected)
    assert abs(result.effects["exact"]["residual"][1, position]) > 1e-3  # the patch changes something


@pytest.mark.parametrize("method", ["rollout", "norm", "attnlrp", "grad_rollout"])
def test_a_method_that_reads_attention_as_the_only_mixer_is_refused_in_one_line(qwen3_next, method):
    """The refusal names the layer, its mixer and why: one line, no traceback."""
    with pytest.raises(InputError) as caught:
        qwen3_next.explain(CLEAN, method=method)
    message = str(caught.value)
    assert "\n" not in message
    assert f"method '{method}' does not support the qwen3_next family" in message
    assert "layer 0 mixes tokens through Qwen3NextGatedDeltaNet, which returns no attention weights" in message
    assert f"{method} reads attention as the only token mixer and would miss that flow" in message


def test_routes_of_a_hybrid_are_refused_naming_the_layers(qwen3_next):
    with pytest.raises(InputError, match=r"layer 0 mixes tokens through Qwen3NextGatedDeltaNet.*routes reads"):
        attnflow.routes(qwen3_next, CLEAN, lens="none")


def _hand_metrics(model, hook_at, make_hook, *, kwargs=False):
    """(m_clean, m_corrupt, m with ``make_hook(clean_kept)`` at ``hook_at`` on the corrupt run, on
    the clean run), m = log p(the clean prediction); ``clean_kept``: the first positional input of
    ``hook_at`` on the clean run (None when it takes its inputs by keyword, ``kwargs``)."""
    hf = model.hf_model
    clean = model.tokenizer(CLEAN, return_tensors="pt")["input_ids"]
    corrupt = model.tokenizer(CORRUPT, return_tensors="pt")["input_ids"]
    kept = []
    handle = hook_at.register_forward_pre_hook(lambda _m, args: kept.append(args[0].detach().clone() if args else None))
    with torch.no_grad():
        clean_logits = hf(input_ids=clean).logits
    handle.remove()
    corrupt_logits = hf(input_ids=corrupt).logits.detach()
    target = int(clean_logits[0, -1].argmax())
    handle = hook_at.register_forward_pre_hook(make_hook(kept[0]), with_kwargs=kwargs)
    try:
        with torch.no_grad():
            on_corrupt, on_clean = (_metric(hf(input_ids=ids).logits, target) for ids in (corrupt, clean))
    finally:
        handle.remove()
    return _metric(clean_logits, target), _metric(corrupt_logits, target), on_corrupt, on_clean


@pytest.mark.parametrize("model_type", [model_type for model_type, _, _ in HYBRIDS])
def test_head_sites_of_a_hybrid_are_its_attention_blocks_each_equal_to_a_hand_written_hook(hybrid_path, model_type):
    """``heads`` on a hybrid: row 1 (block 1, its attention layer) holds each head's effect, by
    denoising the head's slice of the output projection's input ``[batch, token, head * d_head]``
    with its clean value in a hook written here; row 0 (a Mamba / DeltaNet block) has no heads: NaN.
    The approximations fill the same rows, and AtP's sampled check reads block 1 only."""
    import warnings

    model = attnflow.load(str(hybrid_path(model_type)), device="cpu", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on random weights the corruption may not lower the metric
        result = attnflow.patch(model, CLEAN, CORRUPT, sites="heads", methods="exact,atp", progress=False)
    exact, atp = result.effects["exact"]["heads"], result.effects["atp"]["heads"]
    assert exact.shape == atp.shape == (2, model.n_heads)
    assert np.isnan(exact[0]).all() and np.isnan(atp[0]).all() and np.isfinite(exact[1]).all()
    assert {row for row, _ in result.check["sites"]["heads"]} == {1}
    projection = model.hf_model.model.layers[1].self_attn.o_proj
    width = projection.in_features // model.n_heads
    for head in range(model.n_heads):

        def make_hook(clean_input, head=head):
            def hook(_module, args):
                new = args[0].clone()
                new[..., head * width : (head + 1) * width] = clean_input[..., head * width : (head + 1) * width]
                return (new, *args[1:])

            return hook

        m_clean, m_corrupt, patched, _ = _hand_metrics(model, projection, make_hook)
        expected = (patched - m_corrupt) / (m_clean - m_corrupt)
        assert abs(exact[1, head] - expected) * abs(m_clean - m_corrupt) < 1e-5, (head, exact[1, head], expected)
    assert np.abs(exact[1]).max() > 1e-4  # some head changes the metric


@pytest.mark.parametrize("model_type", [model_type for model_type, _, _ in HYBRIDS])
def test_knockout_sites_of_a_hybrid_are_its_attention_blocks_each_equal_to_a_hand_written_hook(hybrid_path, model_type):
    """``knockout`` on a hybrid: row 1 (block 1's attention) blocks the edge key j -> the last
    query by −∞ in the attention mask the block receives, by a hook written here on the clean run:
    (m_clean − m_blocked) / (m_clean − m_corrupt); row 0 (no attention) is NaN."""
    import warnings

    model = attnflow.load(str(hybrid_path(model_type)), device="cpu", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on random weights the corruption may not lower the metric
        result = attnflow.patch(model, CLEAN, CORRUPT, sites="knockout", methods="exact", progress=False)
    found = result.effects["exact"]["knockout"]
    n_tokens = len(result.tokens)
    assert found.shape == (2, n_tokens) and np.isnan(found[0]).all() and np.isfinite(found[1]).all()
    attention = model.hf_model.model.layers[1].self_attn
    for key in range(n_tokens - 1):

        def make_hook(_clean_input, key=key):
            def hook(_module, args, kwargs):
                mask = kwargs["attention_mask"]
                assert mask is not None and mask.dim() == 4 and mask.is_floating_point()
                mask = mask.clone()
                mask[:, :, -1, key] = float("-inf")
                return args, {**kwargs, "attention_mask": mask}

            return hook

        m_clean, m_corrupt, _, blocked = _hand_metrics(model, attention, make_hook, kwargs=True)
        expected = (m_clean - blocked) / (m_clean - m_corrupt)
        assert abs(found[1, key] - expected) * abs(m_clean - m_corrupt) < 1e-5, (key, found[1, key], expected)
    assert np.abs(found[1]).max() > 1e-4  # some edge matters


def test_leave_one_out_on_a_hybrid_reruns_every_variant_whole(qwen3_next):
    """A recurrent layer's state is of the whole input: no key/value prefix is reused, and each
    token's score is log p(target | input) − log p(target | input without the token), by hand."""
    model, hf = qwen3_next, qwen3_next.hf_model
    explanation = model.explain(CLEAN, method="leave_one_out")
    encoded = model.tokenizer(CLEAN, return_tensors="pt", return_special_tokens_mask=True)
    ids, special = encoded["input_ids"][0], encoded["special_tokens_mask"][0]
    with torch.no_grad():
        full = torch.log_softmax(hf(input_ids=ids[None]).logits[0, -1].double(), dim=-1)
        target = int(full.argmax())
        expected = []
        for j in range(len(ids)):
            kept = torch.cat([ids[:j], ids[j + 1 :]])
            without = torch.log_softmax(hf(input_ids=kept[None]).logits[0, -1].double(), dim=-1)[target]
            expected.append(0.0 if special[j] else float(full[target] - without))
    np.testing.assert_allclose(np.asarray(explanation.scores, dtype=np.float64), expected, rtol=1e-4, atol=1e-6)


def test_the_cli_explains_a_hybrid_folder_by_gradient_and_refuses_rollout(hybrid_path, tmp_path, capsys):
    """``attnflow explain PATH --method gradient`` on a tiny hybrid writes its scores; ``--method
    rollout`` exits 2 with the one line and writes nothing."""
    from attnflow.cli import main

    folder = str(hybrid_path("qwen3_next"))
    out = tmp_path / "gradient"
    assert (
        main(["explain", CLEAN, "--model", folder, "--method", "gradient", "--out", str(out), "--device", "cpu", "-q"])
        == 0
    )
    data = json.loads((out / "explanation.json").read_text())
    assert data["method"] == "gradient" and len(data["scores"]) == len(data["tokens"]) > 2
    refused = tmp_path / "rollout"
    assert (
        main(
            ["explain", CLEAN, "--model", folder, "--method", "rollout", "--out", str(refused), "--device", "cpu", "-q"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "layer 0 mixes tokens through Qwen3NextGatedDeltaNet" in err and "Traceback" not in err
    assert not refused.exists() or not any(refused.iterdir())


def test_a_mixer_beside_attention_in_every_layer_is_named_and_refuses_rollout(hybrid_path):
    """Falcon-H1: attention and a Mamba mixer side by side in every layer (block output = input +
    attention + mixer + MLP, proven on the traced rows): rollout would see the attention half of
    the token mixing only, so it is refused naming the mixer; the gradient methods run."""
    model = attnflow.load(str(hybrid_path("falcon_h1")), device="cpu", progress=False)
    mixers = model.adapter.mixers
    assert mixers is not None and mixers.layers == (0, 1) and mixers.kinds == ("FalconH1Mixer",)
    assert not model.adapter.stack.gaps and model.n_layers == 2
    with pytest.raises(InputError, match=r"layers 0, 1 mix tokens through FalconH1Mixer, which returns no attention"):
        model.explain(CLEAN, method="rollout")
    assert np.isfinite(model.explain(CLEAN, method="gradient").scores).all()


def test_the_logit_lens_reads_a_hybrids_stream_layer_by_layer(qwen3_next):
    """`stream_lens` down the last position: row 1 (the stream leaving the linear-attention layer)
    is the final norm and the unembedding applied by hand to that layer's output; the last row is
    the model's own prediction and probability."""
    from attnflow.flow_routes.api import stream_lens

    hf = qwen3_next.hf_model
    readings = stream_lens(qwen3_next, CLEAN, top_k=3)
    ids = qwen3_next.tokenizer(CLEAN, return_tensors="pt")["input_ids"]
    kept = []
    handle = hf.model.layers[0].register_forward_hook(
        lambda _m, _a, output: kept.append(output[0] if isinstance(output, tuple) else output)
    )
    try:
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[0, -1]
            by_hand = torch.softmax(hf.lm_head(hf.model.norm(kept[0][0, -1])).double(), dim=-1)
    finally:
        handle.remove()
    assert len(readings) == 3  # entering layer 0, leaving layers 0 and 1
    top = by_hand.topk(3)
    assert [entry["id"] for entry in readings[1]["top"]] == top.indices.tolist()
    np.testing.assert_allclose([entry["probability"] for entry in readings[1]["top"]], top.values, rtol=1e-5)
    own = torch.softmax(logits.double(), dim=-1)
    assert readings[-1]["target"]["rank"] == 0
    assert readings[-1]["target"]["probability"] == pytest.approx(float(own.max()), rel=1e-5)


def test_the_explorer_of_a_hybrid_shows_the_methods_it_supports(qwen3_next):
    """The explorer's page data: the methods the hybrid supports (no rollout among them); its
    capture reads the attention layers' output projections only (one here, in layer 1)."""
    from attnflow.exploration import explore
    from attnflow.methods.registry import methods_for

    found = explore(qwen3_next, CLEAN, faithfulness=False)
    names = {view.name for view in found.methods}
    assert names and names <= set(methods_for(qwen3_next.adapter)) and "rollout" not in names
    assert found.n_layers == 1  # the attention layers' maps: layer 1's
    from attnflow.viz.explorer import explorer_payload

    assert found.layer_labels == [1]  # its one attention layer is block 1: labelled so, not "layer 0"
    assert explorer_payload(found)[0]["layer_labels"] == [1]


def test_why_on_a_hybrid_plans_no_routes_and_patches_the_stream(qwen3_next):
    """``attnflow.why`` leaves routes and knockout out of a hybrid's plan (they read attention as the
    only token mixer) and answers from the attribution and the residual stream's patching."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on random weights the corruption may not lower the metric
        found = attnflow.why(qwen3_next, CLEAN, samples=2)
    assert found.routes is None and found.patching is not None and found.attribution is not None
    assert not found.plan.runs("routes") and not found.plan.runs("knockout")


def test_the_default_sweep_of_a_hybrid_holds_its_heads_in_the_attention_blocks(qwen3_next):
    """Patching with the default kinds: the residual stream, token mixer and MLP sites of every
    block, and the heads of block 1 (its attention layer; block 0's row is NaN), with no warning
    about leaving any out."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = attnflow.patch(qwen3_next, CLEAN, CORRUPT, methods="exact", progress=False)
    assert not [w for w in caught if "leaves them out" in str(w.message)]
    assert set(result.effects["exact"]) == {"residual", "attn", "mlp", "heads"}
    assert result.effects["exact"]["residual"].shape[0] == 3  # entering layer 0, leaving layers 0 and 1
    heads = result.effects["exact"]["heads"]
    assert np.isnan(heads[0]).all() and np.isfinite(heads[1]).all()
    from attnflow.causal.report import report_html

    page = report_html(result)  # the attn sites are each block's token mixer, attention or not
    assert result.token_mixers and "token mixer outputs" in page and "attention block outputs" not in page


def test_edges_of_a_hybrid_are_refused_in_one_line(qwen3_next):
    """Edge attribution starts at every layer's heads: a hybrid's are in block 1 only."""
    from attnflow.causal.edges import EdgeGraph

    with pytest.raises(InputError, match=r"its heads sites are in layer 1 only: this needs them in every layer"):
        EdgeGraph(qwen3_next, CLEAN, CORRUPT)


def _patched_output_effect(model, module, position: int) -> tuple[float, float]:
    """Denoising ``module``'s output at ``position`` with its clean value, by a hook written here:
    (m_patched − m_corrupt) / (m_clean − m_corrupt), m = log p(the clean prediction), and
    m_clean − m_corrupt (to compare on the metric's scale)."""
    hf = model.hf_model
    clean = model.tokenizer(CLEAN, return_tensors="pt")["input_ids"]
    corrupt = model.tokenizer(CORRUPT, return_tensors="pt")["input_ids"]
    kept = []

    def first(output):
        return output[0] if isinstance(output, tuple) else output  # an attention module's (output, weights)

    handle = module.register_forward_hook(lambda _m, _a, output: kept.append(first(output).detach().clone()))
    with torch.no_grad():
        clean_logits = hf(input_ids=clean).logits
    handle.remove()

    def write(_module, _args, output):
        new = first(output).clone()
        new[:, position] = kept[0][:, position]
        return (new, *output[1:]) if isinstance(output, tuple) else new

    with torch.no_grad():
        corrupt_logits = hf(input_ids=corrupt).logits
        handle = module.register_forward_hook(write)
        try:
            patched_logits = hf(input_ids=corrupt).logits
        finally:
            handle.remove()
    target = int(clean_logits[0, -1].argmax())
    m_clean, m_corrupt = _metric(clean_logits, target), _metric(corrupt_logits, target)
    return (_metric(patched_logits, target) - m_corrupt) / (m_clean - m_corrupt), m_clean - m_corrupt


def test_a_hybrid_whose_layers_place_their_mlp_site_differently_gets_its_sites(hybrid_path):
    """OLMo-Hybrid: post-norm attention layers (the MLP site is ``post_feedforward_layernorm``) and
    pre-norm linear-attention layers (the MLP site is ``mlp`` itself): the row names each layer's
    own MLP site, the conformance suite's residual sum holds in every layer, and the exact sweep of
    the mlp kind equals a hook written here on each layer's module."""
    import warnings

    model = attnflow.load(str(hybrid_path("olmo_hybrid")), device="cpu", progress=False)
    row = model.adapter
    assert row.sites is not None and "sites" in row.provides
    named = {name for name, _ in model.hf_model.named_modules() if name and re.search(row.sites.mlp, name)}
    assert named == {"model.layers.0.mlp", "model.layers.1.post_feedforward_layernorm"}
    assert "residual_sum" in check_adapter(row, model).passed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on random weights the corruption may not lower the metric
        result = attnflow.patch(model, CLEAN, CORRUPT, sites="mlp", methods="exact", progress=False)
    layers = model.hf_model.model.layers
    position = len(result.tokens) - 1
    for layer, module in ((0, layers[0].mlp), (1, layers[1].post_feedforward_layernorm)):
        expected, scale = _patched_output_effect(model, module, position)
        found = result.effects["exact"]["mlp"][layer, position]
        # on the metric's scale (float32 forward passes, batched or not, differ by ~1e-7)
        assert abs(found - expected) * abs(scale) < 1e-5, (layer, found, expected)


def test_a_hybrid_whose_blocks_each_hold_one_part_gets_its_sites_by_block(hybrid_path):
    """Nemotron-H: each block is its input + one mixer (block 0 Mamba, 1 a mixture of experts, 2
    attention, 3 an MLP). The row names the token mixers (blocks 0 and 2) as the attn sites and the
    MLP parts (blocks 1 and 3) as the mlp sites, proven by the conformance suite's residual sum
    (every block: input + its one site); only block 0 is named as a non-attention mixer (its
    output at later positions changes with position 0, an MLP's does not). The exact sweep equals
    a hook written here on each block's mixer; the other blocks' rows of each kind are NaN."""
    import warnings

    model = attnflow.load(str(hybrid_path("nemotron_h")), device="cpu", progress=False)
    row = model.adapter
    assert row.sites is not None and "sites" in row.provides and not row.unverified
    modules = dict(model.hf_model.named_modules())
    assert {name for name in modules if name and re.search(row.sites.attention, name)} == {
        "model.layers.0.mixer",
        "model.layers.2.mixer",
    }
    assert {name for name in modules if name and re.search(row.sites.mlp, name)} == {
        "model.layers.1.mixer",
        "model.layers.3.mixer",
    }
    assert row.mixers is not None and row.mixers.layers == (0,) and row.mixers.kinds == ("NemotronHMamba2Mixer",)
    assert "residual_sum" in check_adapter(row, model).passed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on random weights the corruption may not lower the metric
        result = attnflow.patch(model, CLEAN, CORRUPT, sites="attn,mlp", methods="exact", progress=False)
    attn, mlp = result.effects["exact"]["attn"], result.effects["exact"]["mlp"]
    assert np.isnan(attn[[1, 3]]).all() and np.isnan(mlp[[0, 2]]).all()
    position = len(result.tokens) - 1
    for kind, layer in (("attn", 0), ("attn", 2), ("mlp", 1), ("mlp", 3)):
        expected, scale = _patched_output_effect(model, modules[f"model.layers.{layer}.mixer"], position)
        found = result.effects["exact"][kind][layer, position]
        # on the metric's scale (a Mamba scan in float32, batched or not, differs by ~1e-6)
        assert abs(found - expected) * abs(scale) < 1e-5, (kind, layer, found, expected, scale)


def test_a_stack_of_several_residual_streams_loads_without_sites(hybrid_path):
    """Qwen4-Exp's hyper-connections carry four residual streams side by side ([batch, token, 4 ×
    d_model]): its attention's output projection maps onto d_model, a quarter of the stream, and
    loads so; no split of the streams into sites exists, so patching is refused in one line."""
    model = attnflow.load(str(hybrid_path("qwen4_exp")), device="cpu", progress=False)
    assert model.layer_names == ["model.layers.1.self_attn"]
    assert model.adapter.stack.output_projection == r"^model\.layers\.(1)\.self_attn\.o_proj$"
    with pytest.raises(InputError, match=r"activation patching does not support the qwen4_exp_text family") as caught:
        attnflow.patch(model, CLEAN, CORRUPT, methods="exact", progress=False)
    assert "\n" not in str(caught.value)
