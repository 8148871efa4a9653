"""The package's modules import each other without circles (lazy and type-only imports included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx

import attnflow

SOURCE = Path(attnflow.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """An edge a -> b when module a names module b (or a name from it) in any import statement."""
    modules = {module_name(path): path for path in SOURCE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                # `from attnflow.viz import html` names the module attnflow.viz.html; `from
                # attnflow.viz.html import explanation_html` names attnflow.viz.html.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # A module's own packages are imported with it; those edges are not circles of design.
                if target and target != name and not name.startswith(target + "."):
                    graph.add_edge(name, target)
    return graph


def test_the_oracle_sees_edges():
    graph = import_graph()
    assert graph.has_edge("attnflow.corpus.engine", "attnflow.corpus.stats")
    assert graph.has_edge("attnflow.corpus.report", "attnflow.viz.page")


def test_no_import_circles():
    graph = import_graph()
    # Package __init__ modules re-export their children (lazily); only module-to-module circles matter.
    modules = graph.subgraph(name for name in graph if not (SOURCE.parent / name.replace(".", "/")).is_dir())
    assert list(nx.simple_cycles(modules)) == []


MODEL_METHODS = "attnflow.methods.model"


def subpackage(name: str) -> str:
    """The unit of layering a module belongs to: ``attnflow.capture.model`` -> ``attnflow.capture``;
    top-level modules (``attnflow.explanation``) are their own unit. The methods that re-run the
    model (``attnflow.methods.model``) are a layer of their own: above the capture, which uses the
    registry of the pure methods below it."""
    if name == MODEL_METHODS or name.startswith(MODEL_METHODS + "."):
        return MODEL_METHODS
    return ".".join(name.split(".")[:2])


def test_no_import_circles_between_subpackages():
    # Lazy imports inside functions count (ast.walk sees every import statement); the package root,
    # which re-exports the public API, is left out.
    units = nx.DiGraph()
    for a, b in import_graph().edges():
        if subpackage(a) != subpackage(b) and "attnflow" not in (a, b):
            units.add_edge(subpackage(a), subpackage(b))
    assert units.has_edge("attnflow.exploration", "attnflow.model")  # the oracle sees lazy imports
    assert list(nx.simple_cycles(units)) == []


# What capture/ may import from the rest of attnflow: modules that import nothing above themselves.
FOUNDATION = ("attnflow.errors", "attnflow.staging", "attnflow.trace", "attnflow.tokens", "attnflow.notebook")


def test_the_foundation_modules_import_only_each_other():
    graph = import_graph()
    assert graph.has_edge("attnflow.staging", "attnflow.errors")  # the oracle sees this edge
    outside = {(name, target) for name in FOUNDATION for target in graph.successors(name) if target not in FOUNDATION}
    assert outside == set()


def test_capture_does_not_reach_up():
    """capture/ (models, hooks, Traces) imports nothing above it: not the methods, the targets or
    the Explanation, not even lazily or for type checking; `attnflow.model` builds on it. It reads
    the rows (`attnflow.rows`: where each part of a model lives), which hook through capture in turn."""
    graph = import_graph()
    assert graph.has_edge("attnflow.model", "attnflow.capture.model")  # the oracle sees edges into capture
    assert graph.has_edge("attnflow.capture.loading", "attnflow.staging")  # ... and out of it
    up = sorted(
        f"{name} -> {target}"
        for name, target in graph.edges()
        if name.startswith("attnflow.capture")
        and not target.startswith(("attnflow.capture", "attnflow.rows"))
        and target not in FOUNDATION
    )
    assert up == []


def test_the_method_functions_do_not_depend_on_capture():
    """The pure methods (every module of attnflow.methods outside methods/model/) reach neither the
    capture nor the targets nor the model-running methods; the registry finds those through its
    catalogue of module names, not an import. methods/model/ may use the capture and the targets."""
    graph = import_graph()
    pure = [name for name in graph if subpackage(name) == "attnflow.methods"]
    assert "attnflow.methods.rollout" in pure and "attnflow.methods.registry" in pure
    assert graph.has_edge("attnflow.methods.model.lrp", "attnflow.rows.adapters")  # the oracle sees the layer above
    forbidden = ("attnflow.capture", "attnflow.rows", "attnflow.targets", MODEL_METHODS)
    reached = {name: sorted(n for n in nx.descendants(graph, name) if n.startswith(forbidden)) for name in pure}
    assert not {name: found for name, found in reached.items() if found}


def test_explanation_does_not_import_its_views():
    assert not any(target.startswith("attnflow.viz") for target in import_graph().successors("attnflow.explanation"))


DATASET_COMMANDS = {
    "attnflow.corpus.engine": "corpus",
    "attnflow.dataset_audit.engine": "audit",
    "attnflow.evaluate.benchmark": "evaluate",
    "attnflow.causal.dataset": "patch --file",
    "attnflow.cli.explain_file": "explain --file",
}


def test_every_dataset_command_runs_on_the_one_run_engine():
    """Each dataset command reaches the run engine and its checkpoint; none keeps a loop of its own
    (the signal handling and the actors are reached only through the engine)."""
    graph = import_graph()
    for module in DATASET_COMMANDS:
        assert graph.has_edge(module, "attnflow.runs.engine"), module
        assert graph.has_edge(module, "attnflow.runs.checkpoint"), module
        assert not graph.has_edge(module, "attnflow.runs.signals"), module
        assert not graph.has_edge(module, "attnflow.runs.actors"), module


def test_the_commands_share_runs_without_importing_each_other():
    """The audit and the corpus study stream with the machinery of attnflow.runs; neither reaches
    the other, and attnflow.runs reaches no command."""
    graph = import_graph()

    def reached(package: str) -> set[str]:
        modules = [name for name in graph if name == package or name.startswith(package + ".")]
        return {target for name in modules for target in nx.descendants(graph, name)}

    assert "attnflow.runs.engine" in reached("attnflow.dataset_audit") & reached("attnflow.corpus")
    assert not {name for name in reached("attnflow.dataset_audit") if name.startswith("attnflow.corpus")}
    assert not {name for name in reached("attnflow.corpus") if name.startswith("attnflow.dataset_audit")}
    commands = ("attnflow.corpus", "attnflow.dataset_audit", "attnflow.evaluate", "attnflow.causal", "attnflow.cli")
    assert not {name for name in reached("attnflow.runs") if name.startswith(commands)}


def test_no_family_branches_outside_capture():
    """Family knowledge lives in the adapter rows (rows/) and the loading (capture/): elsewhere code asks what a model
    provides or what its target is, never which family or kind of architecture it is."""
    branch = re.compile(
        r"""(model|adapter)\.(kind|family)\s*(==|!=|\bin\b|\bnot in\b)"""
        r"""|["'](bert|roberta|electra|distilbert|mpnet|gpt2|llama|qwen2|gemma3?|vit|deit|dinov2|t5|bart)["']"""
    )
    found = [
        f"{path.relative_to(SOURCE)}:{number}: {line.strip()}"
        for path in sorted(SOURCE.rglob("*.py"))
        if not {"capture", "rows"} & set(path.relative_to(SOURCE).parts)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if branch.search(line)
    ]
    assert not found, "family branches outside rows/ and capture/:\n" + "\n".join(found)


def registering_modules() -> set[str]:
    """Modules that register a method when imported: a top-level function decorated with
    ``@register(...)``, or a top-level statement that calls ``register`` or ``register_rules``."""

    def calls_register(node: ast.AST) -> bool:
        return any(
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id in ("register", "register_rules")
            for call in ast.walk(node)
        )

    found = set()
    for path in SOURCE.rglob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            decorated = isinstance(node, ast.FunctionDef) and any(map(calls_register, node.decorator_list))
            if decorated or (isinstance(node, (ast.Expr, ast.For)) and calls_register(node)):
                found.add(module_name(path))
    return found


def test_the_registry_catalogue_names_every_module_that_registers_a_method():
    """The package root imports no method module for its side effect: the registry imports its
    CATALOGUE on the first look-up, so a module left out of it would register nothing."""
    from attnflow.methods.registry import CATALOGUE

    assert {
        "attnflow.methods.rollout",
        "attnflow.methods.model.lrp",
    } <= registering_modules()  # the oracle sees both forms
    assert registering_modules() == set(CATALOGUE)
    root = ast.parse((SOURCE / "__init__.py").read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(root) if isinstance(node, ast.Import) for alias in node.names}
    assert not {name for name in imported if name.startswith("attnflow.methods")}


def test_the_model_protocol_imports_nothing_above_the_trace():
    graph = import_graph()
    assert graph.has_edge("attnflow.model_like", "attnflow.trace")  # the oracle sees its type-only import
    assert set(graph.successors("attnflow.model_like")) == {"attnflow.trace"}


def test_models_are_typed_not_any():
    """A parameter that takes a loaded model is a `ModelLike` (or a Hugging Face module named
    ``hf_model``), not ``Any``: mypy then checks what the code reads of it."""
    untyped = re.compile(r"\bmodel: Any\b")
    typed = re.compile(r"\bmodel: ModelLike\b")
    found, seen_typed = [], 0
    for path in sorted(SOURCE.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            seen_typed += bool(typed.search(line))
            if untyped.search(line):
                found.append(f"{path.relative_to(SOURCE)}:{number}: {line.strip()}")
    assert seen_typed > 50  # the oracle reads the sources: the annotations are there to be seen
    assert len(found) <= 5, "model: Any in:\n" + "\n".join(found)


def test_dir_lists_the_lazy_attributes_and_each_resolves():
    listed = set(dir(attnflow))
    assert {"load", "explain", "patch", "audit", "AttentionModel", "PatchResult", "explain_generation"} <= listed
    assert set(attnflow.__all__) <= listed
    assert all(getattr(attnflow, name) is not None for name in attnflow.__all__)


def test_the_routes_math_reads_no_model():
    """Information-flow routes: only ``forward`` (its hooks and the weights it reads) and the front
    door ``api`` reach the capture and the targets; the contributions, the graph, the lens and the
    result are functions of arrays. Nothing below the routes imports them."""
    graph = import_graph()
    assert graph.has_edge("attnflow.flow_routes.forward", "attnflow.capture.hooks")  # the oracle sees the layer below
    pure = tuple(f"attnflow.flow_routes.{name}" for name in ("contributions", "graph", "lens", "result"))
    forbidden = (
        "attnflow.capture",
        "attnflow.rows",
        "attnflow.model",
        "attnflow.targets",
        "attnflow.flow_routes.forward",
        "attnflow.flow_routes.api",
    )
    reached = {name: sorted(n for n in nx.descendants(graph, name) if n.startswith(forbidden)) for name in pure}
    assert not {name: found for name, found in reached.items() if found}
    below = [
        name
        for name in graph
        if subpackage(name) in ("attnflow.capture", "attnflow.rows", "attnflow.methods", MODEL_METHODS)
    ]
    reaching = [
        name for name in below if any(n.startswith("attnflow.flow_routes") for n in nx.descendants(graph, name))
    ]
    assert not reaching


def test_the_methods_do_not_reach_up_to_evaluate():
    """evaluate sits above the methods (it runs them all); no method, pure or model-running, imports
    it, even lazily: what both need (inputs rebuilt from ids with tokens removed or masked) lives in
    attnflow.methods.deletion, below both."""
    graph = import_graph()
    assert graph.has_edge("attnflow.evaluate.deletion", "attnflow.methods.deletion")  # the oracle sees the arrow down
    assert graph.has_edge("attnflow.methods.model.perturbation", "attnflow.methods.deletion")
    methods = [name for name in graph if subpackage(name) in ("attnflow.methods", MODEL_METHODS)]
    up = {name: sorted(n for n in nx.descendants(graph, name) if n.startswith("attnflow.evaluate")) for name in methods}
    assert not {name: found for name, found in up.items() if found}


def _classes_deriving(tree: ast.Module, base: str) -> set[str]:
    """Top-level classes of ``tree`` that derive (directly or through one another) from ``base``."""
    found = {base}
    changed = True
    while changed:
        changed = False
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name not in found:
                if any(isinstance(b, ast.Name) and b.id in found for b in node.bases):
                    found.add(node.name)
                    changed = True
    return found - {base}


def test_every_rule_objective_and_module_kind_is_reachable():
    """AST checks that nothing is declared and then left out: every `Rule` class of the rule module is
    exported by attnflow.methods.model (users compose rule sets from it) and used by a rule set of the
    table or exported; every module kind has a finder in `rule_modules` (or is the softmax or the head
    factor's sigmoid, applied inside the attention modules, or the router's weights, `_routers`); every objective class is registered
    under a kind of `TARGET_KINDS`."""
    import attnflow.methods.model as model_methods
    from attnflow.methods.model.lrp import MODULE_KINDS
    from attnflow.targets import OBJECTIVES, TARGET_KINDS

    lrp_path = SOURCE / "methods" / "model" / "lrp.py"
    lrp_tree = ast.parse(lrp_path.read_text(encoding="utf-8"))
    rules = _classes_deriving(lrp_tree, "Rule")
    assert {"ConstantNorm", "Scale", "Identity", "TemperedSoftmax"} <= rules  # the oracle sees the classes
    assert rules <= set(model_methods.__all__)
    finder = next(n for n in lrp_tree.body if isinstance(n, ast.FunctionDef) and n.name == "rule_modules")
    named = {n.value for n in ast.walk(finder) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert set(MODULE_KINDS) - {"softmax", "head_factor", "router"} <= named
    targets_tree = ast.parse((SOURCE / "targets.py").read_text(encoding="utf-8"))
    registered = {
        node.name: decorator.args[0].value
        for node in targets_tree.body
        if isinstance(node, ast.ClassDef)
        for decorator in node.decorator_list
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", "") == "register_objective"
    }
    assert set(registered.values()) == set(TARGET_KINDS) == set(OBJECTIVES)
    concrete = {name for name in _classes_deriving(targets_tree, "Objective") if not name.startswith("_")}
    assert concrete == set(registered)  # every public objective class is reachable through its kind
