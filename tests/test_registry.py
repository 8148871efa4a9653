"""A method is one declaration: a toy method registered here, in this file alone, reaches the CLI
(flags and --help), the explorer and the faithfulness benchmark's method list."""

from __future__ import annotations

import json

import numpy as np
import pytest

import attnflow
from attnflow.cli import main
from attnflow.evaluate.api import resolve_methods
from attnflow.methods.registry import Option, available_methods, get_method, method_options, register, unregister
from test_exploration import decode_page, hostile_trace


def last_layer_power(attentions, power: float = 1.0, layerwise: bool = False):
    """``[query, key]`` the last layer's head-mean attention raised to ``power``, rows normalised."""
    layers = np.asarray(attentions, dtype=np.float64).mean(axis=-3) ** power  # [layer, q, k]
    layers = layers / layers.sum(axis=-1, keepdims=True)
    return layers if layerwise else layers[-1]


@pytest.fixture
def toy_method():
    register(
        "toy_power",
        "toy: the last layer's attention raised to a power",
        takes="attentions",
        options=(Option("power", "exponent applied to the attention", parse=float, metavar="P", flag="--toy-power"),),
        layerwise=True,
    )(last_layer_power)
    try:
        yield get_method("toy_power")
    finally:
        unregister("toy_power")


def test_the_declaration_is_checked_against_the_function():
    with pytest.raises(ValueError, match="declares seed but its function has no such keyword"):
        register("bad", "x", takes="trace", options=(Option("seed", "s"),))(lambda _trace: None)
    with pytest.raises(ValueError, match="takes='model' and needs 'model' go together"):
        register("bad", "x", takes="model")(lambda _model, _trace: None)
    with pytest.raises(ValueError, match="per_head needs a head_fusion option"):
        register("bad", "x", takes="attentions", per_head=True)(lambda _attentions: None)
    with pytest.raises(ValueError, match="unknown method 'bad'"):
        get_method("bad")


@pytest.mark.usefixtures("toy_method")
def test_toy_method_reaches_the_cli_help(capsys):
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    help_text = capsys.readouterr().out
    assert "toy_power" in help_text and "the last layer's attention raised to a power" in help_text
    assert "--toy-power P" in help_text and "exponent applied to the attention [toy_power]" in help_text


@pytest.mark.usefixtures("toy_method")
def test_toy_method_runs_from_the_cli_with_its_flag(tiny_model_path, capsys):
    path = tiny_model_path("bert")
    assert (
        main(
            ["explain", "hello world again", "--model", str(path), "--method", "toy_power", "--toy-power", "3"]
            + ["--json", "--quiet"]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["method"] == "toy_power" and data["options"] == {"power": 3.0}
    attentions = attnflow.load(str(path)).trace("hello world again")[0].attentions
    cubed = np.asarray(attentions, dtype=np.float64)[-1].mean(axis=0) ** 3  # independent: [q, k]
    np.testing.assert_allclose(data["matrix"], cubed / cubed.sum(axis=-1, keepdims=True), atol=1e-6)


def test_an_option_of_another_method_is_one_line(toy_method, capsys):
    assert main(["explain", "hello", "--model", "tiny", "--method", "toy_power", "--steps", "4"]) == 2
    # the library names the parameters (n_steps, power); the command line spells them as its flags
    assert "method 'toy_power' does not take --steps; it takes: --toy-power" in capsys.readouterr().err
    assert method_options(toy_method, {"power": 2.0, "unused": None}) == {"power": 2.0}


@pytest.mark.usefixtures("toy_method")
def test_toy_method_reaches_the_explorer_with_its_layers():
    trace = hostile_trace(n_layers=3)
    exploration = attnflow.explore(trace)
    view = next(view for view in exploration.methods if view.name == "toy_power")
    assert view.matrices.shape == (3, trace.n_tokens, trace.n_tokens)  # declared layerwise: one view per layer
    np.testing.assert_allclose(view.matrices[1], last_layer_power(trace.attentions[:2]))
    meta, _ = decode_page(exploration.to_html())
    assert "toy_power" in json.dumps(meta)


@pytest.mark.usefixtures("toy_method")
def test_toy_method_reaches_the_benchmark():
    assert "toy_power" in resolve_methods("all")


def test_a_batch_form_is_declared_only_where_it_fits():
    def batch(model, traces, power: float = 2.0):
        return [np.zeros(trace.n_tokens) for trace in traces]

    with pytest.raises(ValueError, match="batch form is for takes='model' methods with scores_only"):
        register("bad_batch", "test", takes="trace", batch=batch)
    power = Option("power", "exponent", parse=float)
    with pytest.raises(ValueError, match="its batch form lacks the keyword"):
        register(
            "bad_batch",
            "test",
            takes="model",
            needs=("attentions", "model"),
            scores_only=True,
            options=(power,),
            batch=lambda model, traces: [],
        )(lambda model, trace, power=2.0: np.zeros(trace.n_tokens))
    assert "bad_batch" not in available_methods()


def test_an_installed_package_adds_its_methods_through_the_entry_point_group(tmp_path, monkeypatch, caplog):
    """A package declaring ``[project.entry-points."attnflow.methods"]`` (here: its installed
    metadata written by hand) gets its method registered; a broken plug-in is one warning."""
    from attnflow.methods.registry import load_plugins

    (tmp_path / "toy_plugin.py").write_text(
        "import numpy as np\n"
        "from attnflow.methods.registry import register\n\n"
        "@register('toy_plugin_last', 'toy plug-in: the last layer, heads averaged', takes='attentions')\n"
        "def last(attentions):\n"
        "    return np.asarray(attentions)[-1].mean(axis=0)\n",
        encoding="utf-8",
    )
    info = tmp_path / "toy_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(
        "[attnflow.methods]\ntoy = toy_plugin\nbroken = toy_plugin_missing\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert load_plugins() == ["toy"]
        trace = hostile_trace()
        result = attnflow.explain(trace, method="toy_plugin_last", row=0)
        np.testing.assert_allclose(result.scores, trace.attentions[-1].astype(np.float64).mean(axis=0)[0], rtol=1e-6)
        assert "toy_plugin_last" in available_methods()
        assert "skipped the method plug-in 'broken' (toy_plugin_missing)" in caplog.text
    finally:
        unregister("toy_plugin_last")
