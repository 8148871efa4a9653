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
    assert graph.has_edge("attnflow.viz.report", "attnflow.viz.page")


def test_no_import_circles():
    graph = import_graph()
    # Package __init__ modules re-export their children (lazily); only module-to-module circles matter.
    modules = graph.subgraph(name for name in graph if not (SOURCE.parent / name.replace(".", "/")).is_dir())
    assert list(nx.simple_cycles(modules)) == []


def subpackage(name: str) -> str:
    """The unit of layering a module belongs to: ``attnflow.capture.model`` -> ``attnflow.capture``;
    top-level modules (``attnflow.explanation``) are their own unit."""
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
FOUNDATION = ("attnflow.errors", "attnflow.staging", "attnflow.trace", "attnflow.tokens")


def test_the_foundation_modules_import_only_each_other():
    graph = import_graph()
    assert graph.has_edge("attnflow.staging", "attnflow.errors")  # the oracle sees this edge
    outside = {(name, target) for name in FOUNDATION for target in graph.successors(name) if target not in FOUNDATION}
    assert outside == set()


def test_capture_does_not_reach_up():
    """capture/ (models, hooks, Traces) imports nothing above it: not the methods, the targets or
    the Explanation, not even lazily or for type checking; `attnflow.model` builds on it."""
    graph = import_graph()
    assert graph.has_edge("attnflow.model", "attnflow.capture.model")  # the oracle sees edges into capture
    assert graph.has_edge("attnflow.capture.loading", "attnflow.staging")  # ... and out of it
    up = sorted(
        f"{name} -> {target}"
        for name, target in graph.edges()
        if name.startswith("attnflow.capture")
        and not target.startswith("attnflow.capture")
        and target not in FOUNDATION
    )
    assert up == []


def test_the_method_functions_do_not_depend_on_capture():
    reachable = nx.descendants(import_graph(), "attnflow.methods")
    assert not any(name.startswith(("attnflow.capture", "attnflow.perturb", "attnflow.targets")) for name in reachable)


def test_explanation_does_not_import_its_views():
    assert not any(target.startswith("attnflow.viz") for target in import_graph().successors("attnflow.explanation"))


def test_the_engines_share_the_batch_step_without_importing_each_other():
    graph = import_graph()
    assert not graph.has_edge("attnflow.corpus.ray_engine", "attnflow.corpus.engine")
    assert graph.has_edge("attnflow.corpus.ray_engine", "attnflow.corpus.study")
    assert graph.has_edge("attnflow.corpus.engine", "attnflow.corpus.study")


def test_no_family_branches_outside_capture():
    """Family knowledge lives in the adapter rows (capture/): elsewhere code asks what a model
    provides or what its target is, never which family or kind of architecture it is."""
    branch = re.compile(
        r"""(model|adapter)\.(kind|family)\s*(==|!=|\bin\b|\bnot in\b)"""
        r"""|["'](bert|roberta|electra|distilbert|mpnet|gpt2|llama|qwen2|gemma3?|vit|deit|dinov2|t5|bart)["']"""
    )
    found = [
        f"{path.relative_to(SOURCE)}:{number}: {line.strip()}"
        for path in sorted(SOURCE.rglob("*.py"))
        if "capture" not in path.relative_to(SOURCE).parts
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if branch.search(line)
    ]
    assert not found, "family branches outside capture/:\n" + "\n".join(found)
