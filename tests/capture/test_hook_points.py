"""The one hook helper (`attnflow.rows.hook_points.hooks`): a hook function sees a tensor and
returns one, whatever the module's call looks like; no hook survives an exception raised in the
block, in a hook or while registering, through any of attnflow's hooking contexts (captum's
hook-removal test); and no other module of attnflow registers a hook or unwraps hook arguments."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import attnflow
from attnflow.errors import CaptureError
from attnflow.rows.hook_points import HookPoint, hooks, hooks_on, output_tensor

SOURCE = Path(attnflow.__file__).parent
HELPER = SOURCE / "rows" / "hook_points.py"
TEXT = "the cat sat on the mat"


class Toy(nn.Module):
    """forward(hidden_states, mask=None, *, scale=1.0) -> (hidden * scale + mask, hidden)."""

    def forward(self, hidden_states, mask=None, *, scale=1.0):
        shifted = hidden_states * scale + (0 if mask is None else mask)
        return shifted, hidden_states


def test_a_hook_function_receives_and_returns_the_tensor_wherever_it_travels():
    toy, x = Toy(), torch.ones(2, 3)
    doubled = []
    with hooks([(HookPoint(toy, "input"), lambda hidden: hidden * 2)]):
        doubled.append(toy(x)[0])  # positional
        doubled.append(toy(hidden_states=x)[0])  # keyword
    assert all(torch.equal(result, x * 2) for result in doubled)
    seen = []
    with hooks([(HookPoint(toy, "input", "mask", with_input=True), lambda mask, first: seen.append(mask) or first)]):
        assert torch.equal(toy(x)[0], x * 2)  # a mask the call left out: None in, the first input written
        assert torch.equal(toy(x, torch.ones(2, 3))[0], x * 2)  # positional mask replaced
        assert torch.equal(toy(x, mask=torch.zeros(2, 3))[0], x * 2)  # keyword mask replaced
    assert seen[0] is None and torch.equal(seen[1], torch.ones(2, 3))
    with hooks([(HookPoint(toy, "input", "scale"), lambda _scale: 3.0)]):
        assert torch.equal(toy(x, scale=1.0)[0], x * 3)  # keyword-only
    with hooks([(HookPoint(toy, "output", index=1), lambda second: second - 1)]):
        first, second = toy(x)
    assert torch.equal(first, x) and torch.equal(second, x - 1)  # the other element kept, a tuple still
    calls = []
    with hooks([(HookPoint(toy, "call"), lambda args, kwargs: calls.append((len(args), sorted(kwargs))))]):
        toy(x, scale=2.0)
    assert calls == [(1, ["scale"])]
    assert output_tensor((x, None), 1) is None and output_tensor(x) is x and output_tensor(x, 1) is None


def test_a_gradient_hook_sees_and_replaces_the_gradient_at_the_output():
    linear = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    seen = []
    with hooks([(HookPoint(linear, "gradient"), lambda gradient: seen.append(gradient) or gradient * 0)]):
        linear(x).sum().backward()
    assert torch.equal(seen[0], torch.ones(2, 3)) and torch.equal(x.grad, torch.zeros(2, 3))
    x.grad = None
    linear(x).sum().backward()  # removed: the plain gradient again
    assert torch.allclose(x.grad, linear.weight.sum(dim=0).expand(2, -1))


def test_a_module_without_the_argument_is_refused_and_nothing_stays():
    toy, linear = Toy(), nn.Linear(2, 2)
    with pytest.raises(CaptureError, match=r"takes no 'attention_mask' argument") as error:
        with hooks([(HookPoint(toy, "output"), lambda out: out), (HookPoint(linear, "input", "attention_mask"), id)]):
            pass
    assert "\n" not in str(error.value)
    assert hooks_on(toy) == hooks_on(linear) == 0  # the first hook, registered before, is gone too


@pytest.fixture
def llama(tiny_loaded):
    return tiny_loaded("llama")


def _contexts(model):
    """Every hooking context attnflow has: ``name -> callable returning a context manager``."""
    from attnflow.capture.hooks import record_calls, record_stack, record_tensors
    from attnflow.causal.patching import Metric, Patches, PatchRunner
    from attnflow.causal.sites import SITE_KINDS, Site
    from attnflow.methods.model.lrp import RULES, backward_rules
    from attnflow.rows.adapters import find_layers

    blocks = find_layers(model.model, model.adapter.sites.block)
    runner = PatchRunner(model, Metric("next_token", 1))
    knockout = Patches()
    knockout.add(0, Site("knockout", 0, 1, 3, (0, 1)), None)
    return {
        "record_stack": lambda: record_stack(model.model, model.adapter.stack),
        "record_tensors": lambda: record_tensors(blocks, inputs=True),
        "record_calls": lambda: record_calls(blocks),
        "backward_rules": lambda: backward_rules(model, RULES["gim"]),
        "patch_runner": lambda: runner._hooks(
            knockout, {kind: [] for kind in SITE_KINDS}, None, True, {0: torch.tensor([True])}
        ),
    }


@pytest.mark.parametrize(
    "context", ["record_stack", "record_tensors", "record_calls", "backward_rules", "patch_runner"]
)
@pytest.mark.parametrize("where", ["in the block", "in the forward pass"])
def test_no_hook_survives_an_exception(llama, context, where):
    ids = llama.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    enter = _contexts(llama)[context]
    softmax = torch.nn.functional.softmax
    assert hooks_on(llama.model) == 0

    def explode(_hidden):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with enter():
            assert hooks_on(llama.model) > 0  # the context's hooks are live here
            if where == "in the block":
                raise RuntimeError("boom")
            mlp = llama.model.model.layers[1].mlp  # a hook of our own, placed last, raises mid-forward
            with hooks([(HookPoint(mlp, "input"), explode)]):
                llama.model(input_ids=ids)
    assert hooks_on(llama.model) == 0
    assert torch.nn.functional.softmax is softmax  # GIM's softmax patch is undone as well


def hook_offences(source: str) -> list[tuple[int, str]]:
    """(line, what) of every place in ``source`` that registers a torch hook or unwraps a hook's
    arguments by hand: ``X[i] if isinstance(X, tuple…)``, ``args[0] if args`` (or ``inputs``),
    ``kwargs["hidden_states"]``."""
    registering = {
        "register_forward_hook",
        "register_forward_pre_hook",
        "register_full_backward_hook",
        "register_full_backward_pre_hook",
        "register_backward_hook",
        "register_hook",
    }
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in registering:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.IfExp) and isinstance(node.body, ast.Subscript):
            test, subject = node.test, ast.unparse(node.body.value)
            if isinstance(test, ast.Call) and ast.unparse(test.func) == "isinstance" and len(test.args) == 2:
                if ast.unparse(test.args[0]) == subject and "tuple" in ast.unparse(test.args[1]):
                    found.append((node.lineno, "tuple output unwrapped"))
            elif ast.unparse(test) == subject in ("args", "inputs"):
                found.append((node.lineno, "first positional argument unwrapped"))
        elif isinstance(node, (ast.Subscript, ast.Call)) and "hidden_states" in ast.unparse(node):
            text = ast.unparse(node)
            if text.startswith(("kwargs[", "kwargs.get(")):
                found.append((node.lineno, "keyword argument unwrapped"))
    return found


def test_the_oracle_finds_each_kind_of_offence():
    old_style = """
def install(module, hook):
    return module.register_forward_pre_hook(hook, with_kwargs=True)

def hook(_module, args, kwargs, output):
    hidden = args[0] if args else kwargs["hidden_states"]
    new = output[0] if isinstance(output, (tuple, list)) else output
    return kwargs.get("hidden_states")
"""
    assert sorted(hook_offences(old_style)) == [
        (3, "register_forward_pre_hook"),
        (6, "first positional argument unwrapped"),
        (6, "keyword argument unwrapped"),
        (7, "tuple output unwrapped"),
        (8, "keyword argument unwrapped"),
    ]
    assert "register_forward_hook" in {what for _, what in hook_offences(HELPER.read_text())}


def test_no_hook_is_registered_or_unwrapped_outside_the_helper():
    found = [
        f"{path.relative_to(SOURCE)}:{line}: {what}"
        for path in sorted(SOURCE.rglob("*.py"))
        if path != HELPER
        for line, what in hook_offences(path.read_text(encoding="utf-8"))
    ]
    assert not found, "hooks outside attnflow.rows.hook_points:\n" + "\n".join(found)
