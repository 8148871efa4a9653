"""The repository's documentation stands alone: no pointers to files or names that do not exist."""

from __future__ import annotations

import ast
import builtins
import re
import shutil
from dataclasses import dataclass
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
REPO_PATH = re.compile(
    r"(?<![\w./])((?:src|tests|docs|benchmarks)/[\w/.-]*\w\.(?:py|md|json|csv)\b|attnflow/[\w/]+\.py)"
)
ERROR_NAME = re.compile(r"`(?:attnflow\.errors\.)?([A-Z]\w*Error)`")
MARKDOWN_FILES = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*(\S*)")  # CommonMark: an opening fence may name a language
SECTION = re.compile(r"^#{1,6} \S")


@dataclass
class CodeBlock:
    language: str
    first_line: int  # 1-based, the line after the opening fence
    lines: list[str]


def split_markdown(path: Path) -> tuple[list[CodeBlock], list[str]]:
    """The fenced code blocks of a Markdown file and its prose lines (everything outside them).

    A block closes at a fence of the same character, at least as long, with nothing after it
    (CommonMark); a file that ends inside a block fails here, naming where the block opened.
    """
    blocks: list[CodeBlock] = []
    prose: list[str] = []
    opening = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fence = FENCE.match(line)
        if opening is None:
            if fence:
                opening = fence.group(1)
                blocks.append(CodeBlock(fence.group(2), number + 1, []))
            else:
                prose.append(line)
        elif fence and fence.group(1)[0] == opening[0] and len(fence.group(1)) >= len(opening) and not fence.group(2):
            opening = None
        else:
            blocks[-1].lines.append(line)
    assert opening is None, f"{path.name}: the code block opened at line {blocks[-1].first_line - 1} never closes"
    return blocks, prose


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


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_code_blocks_close_and_hide_no_heading(path):
    blocks, _ = split_markdown(path)
    for block in blocks:
        # a comment line starts with one "#"; "## Title" inside a block is a section swallowed by it
        swallowed = [line for line in block.lines if SECTION.match(line) and not line.startswith("# ")]
        assert not swallowed, f"{path.name}: block at line {block.first_line} holds the heading(s) {swallowed}"


TABLE_SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+$")


def table_cells(line: str) -> int:
    """The number of cells of a table row (``|`` inside backticks or escaped does not split)."""
    return len(re.split(r"(?<!\\)\|", re.sub(r"`[^`]*`", "code", line.strip()))) - 2


@pytest.mark.parametrize(
    "path",
    [*MARKDOWN_FILES, ROOT / "BENCHMARKS.md", *sorted(ROOT.glob("benchmarks/*.md"))],
    ids=lambda path: path.relative_to(ROOT).as_posix(),
)
def test_tables_render(path):
    """Every pipe table has its separator row under the header and no row with other columns."""
    _, prose = split_markdown(path)
    tables: list[list[str]] = []
    previous = ""
    for line in prose:
        if line.startswith("|"):
            if not previous.startswith("|"):
                tables.append([])
            tables[-1].append(line)
        previous = line
    for table in tables:
        assert len(table) >= 2 and TABLE_SEPARATOR.match(table[1]), f"{path.name}: no separator under {table[0]!r}"
        width = table_cells(table[0])
        wrong = [row for row in table if table_cells(row) != width]
        assert not wrong, f"{path.name}: rows with other than {width} columns under {table[0]!r}: {wrong}"


def test_readme_sections_render_as_headings_and_diagrams_as_code():
    blocks, prose = split_markdown(ROOT / "README.md")
    headings = {line.lstrip("#").strip() for line in prose if SECTION.match(line)}
    assert {
        "A 30-second tour",
        "Python",
        "Architecture",
        "Models and data (offline)",
        "Relevance beyond attention weights",
        "The corpus study",
        "The faithfulness benchmark",
        "Development",
    } <= headings
    assert not [line for line in prose if "──" in line], "the architecture diagram renders as prose"
    assert not [line for line in prose if re.match(r"[a-z_]\w* = \S", line)], "Python outside a code block"
    assert all(block.language in ("bash", "python", "text") for block in blocks)


def test_readme_python_names_are_defined_in_the_tour():
    """Every name the Python tour reads is imported or assigned in it (or a builtin)."""
    for block in split_markdown(ROOT / "README.md")[0]:
        if block.language != "python":
            continue
        tree = ast.parse("\n".join(block.lines))
        defined = set(dir(builtins))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
        assert read <= defined, f"README block at line {block.first_line} uses undefined {sorted(read - defined)}"


@pytest.mark.slow
def test_readme_python_tour_runs(tmp_path, monkeypatch):
    """The Python tour runs as written, in an empty folder where its "photo.jpg" is Grace Hopper's
    portrait (matplotlib's sample photo), and the shapes its comments state are the real ones."""
    import matplotlib

    shutil.copy(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg", tmp_path / "photo.jpg")
    monkeypatch.chdir(tmp_path)
    stated_shape = re.compile(r"^(\S.*?)\s+# .*= (\(\d+(?:, \d+)*\))$")
    python_blocks = [block for block in split_markdown(ROOT / "README.md")[0] if block.language == "python"]
    assert python_blocks
    for block in python_blocks:
        namespace: dict = {}
        exec(compile("\n".join(block.lines), f"README.md, block at line {block.first_line}", "exec"), namespace)
        for line in block.lines:
            claim = stated_shape.match(line)
            if claim:
                assert str(tuple(eval(claim.group(1), namespace))) == claim.group(2), line
    assert (tmp_path / "out" / "movie" / "explanation.html").exists()


def test_every_public_function_and_class_has_a_docstring_and_the_api_reference_builds(tmp_path):
    """The API reference (`make docs`, pdoc) documents each module from its docstrings: none may be
    missing, and the reference of a module renders."""
    import importlib
    import sys

    import pdoc

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from api_reference import library_modules
    finally:
        sys.path.pop(0)
    missing = []
    for name in library_modules():
        module = pdoc.doc.Module(importlib.import_module(name))
        missing += [] if module.docstring else [name]
        for member in module.flattened_own_members:
            public = not member.name.startswith("_") and member.taken_from[0] == name
            if public and isinstance(member, (pdoc.doc.Function, pdoc.doc.Class)) and not member.docstring:
                missing.append(member.fullname)
    assert not missing, f"public names without a docstring: {', '.join(missing)}"
    pdoc.pdoc("attnflow.methods.model.lrp", output_directory=tmp_path)
    assert "BackwardRules" in (tmp_path / "attnflow" / "methods" / "model" / "lrp.html").read_text(encoding="utf-8")


def test_the_readme_models_table_says_what_each_first_load_costs():
    """A model whose first load still prepares it (`attnflow models list`: "not prepared") costs
    minutes and gigabytes then: the README's row gives the same numbers."""
    from attnflow.capture.loading import EMBEDDED

    rows = {line.split("|")[1].strip(" `"): line for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| `")}  # fmt: skip
    costs = re.compile(r"\d+(?:\.\d+)? (?:min|GB|MB)\b")
    stated = {alias: costs.findall(model.preparation) for alias, model in EMBEDDED.items()}
    assert stated["qwen2.5-0.5b"]  # the oracle sees the numbers
    for alias, numbers in stated.items():
        assert all(number in rows[alias] for number in numbers), (alias, numbers)
