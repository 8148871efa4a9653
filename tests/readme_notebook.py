"""A notebook built from the README's Python section (its python code blocks, one cell per
paragraph), so the notebook test runs what the README shows and cannot drift from it."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "### Python"
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def readme_python(readme: Path = README) -> list[str]:
    """The python code blocks of the README's Python section (up to the next heading)."""
    text = readme.read_text(encoding="utf-8")
    start = text.index(SECTION) + len(SECTION)
    end = re.search(r"^#{1,3} ", text[start:], re.MULTILINE)
    section = text[start : start + end.start()] if end else text[start:]
    return BLOCK.findall(section)


def readme_cells(readme: Path = README) -> list[str]:
    """The code cells: each python block cut at its blank lines (a paragraph is what a reader would
    run at once)."""
    return [cell.strip() for block in readme_python(readme) for cell in re.split(r"\n\s*\n", block) if cell.strip()]


def readme_notebook(readme: Path = README):
    """An nbformat v4 notebook of `readme_cells`."""
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(cell) for cell in readme_cells(readme)]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return notebook
