"""The repository's documentation stands alone: no pointers to files or names that do not exist."""

from __future__ import annotations

import builtins
import re
from pathlib import Path

import pytest

import attnflow.errors
from attnflow.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
TEXT_FILES = sorted(
    path
    for pattern in ("src/**/*.py", "tests/**/*.py", "benchmarks/*.py", "docs/*.md", "docs/*.py", "*.md", "Makefile")
    for path in ROOT.glob(pattern)
)
# A design file outside the repository (spelled in two parts so that this file does not cite it).
OUTSIDE_DESIGN = re.compile("DES" + r"IGN(\.md| §)")
REPO_PATH = re.compile(r"(?<![\w./])((?:src|tests|docs|benchmarks)/[\w/.-]*\w\.(?:py|md|json|csv)|attnflow/[\w/]+\.py)")
ERROR_NAME = re.compile(r"`(?:attnflow\.errors\.)?([A-Z]\w*Error)`")


def test_the_scan_sees_the_files():
    names = {path.relative_to(ROOT).as_posix() for path in TEXT_FILES}
    assert {"README.md", "docs/methods.md", "src/attnflow/explanation.py", "tests/test_docs.py"} <= names


@pytest.mark.parametrize("path", TEXT_FILES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_no_pointer_to_missing_things(path):
    text = path.read_text(encoding="utf-8")
    assert not OUTSIDE_DESIGN.search(text), "cite docs/methods.md, not a file outside the repository"
    for mention in REPO_PATH.findall(text):
        candidates = [ROOT / mention, ROOT / "src" / mention, path.parent / mention]
        assert any(candidate.exists() for candidate in candidates), f"{mention} does not exist"
    for name in ERROR_NAME.findall(text):
        assert hasattr(attnflow.errors, name) or hasattr(builtins, name), f"no error type {name}"


def test_methods_page_defines_every_method_and_option():
    page = (ROOT / "docs" / "methods.md").read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", page, flags=re.MULTILINE)
    for topic in (
        "Head fusion",
        "Residual correction",
        "Pruning",
        "Attention rollout",
        "Saliency row",
        "Attention flow",
        "Encoder–decoder rollout",
        "Context similarity",
        "Relevance beyond attention weights",
    ):
        assert any(heading.startswith(topic) for heading in headings), topic
    for option in (
        "prune_on",
        '"attention"',
        '"residual"',
        "discard_ratio",
        "top_k",
        "threshold",
        "start_layer",
        "normalize",
        "rows=",
        "layer=",
        'space="projected"',
    ):
        assert option in page, option


def test_explain_help_points_to_the_methods_page():
    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    assert "docs/methods.md" in subparsers.choices["explain"].format_help()


def test_methods_table_is_the_registry():
    from attnflow.methods.registry import markdown_table

    page = (ROOT / "docs" / "methods.md").read_text(encoding="utf-8")
    table = page.split("<!-- methods table -->\n", 1)[1].split("\n<!-- end of methods table -->", 1)[0]
    assert table == markdown_table(), "regenerate the table: attnflow.methods.registry.markdown_table()"
