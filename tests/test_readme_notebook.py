"""The README's Python section as a notebook (`readme_notebook`: its cells are the README's
paragraphs, so it cannot drift), executed by nbclient in a fresh kernel: the executed notebook
stays small, every result a cell ends on shows itself as HTML (and a one-line repr), no warning is
said twice in a cell, and the HTML outputs render in Chromium."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from readme_notebook import readme_cells, readme_notebook

pytestmark = pytest.mark.slow  # a fresh kernel loads minilm, minilm-sentiment, smollm2 and dinov2-s (~2 min)

MAX_NOTEBOOK_BYTES = 2_000_000
MAX_REPR_CHARS = 1_000
# What a cell's value is when it is one of attnflow's result objects (its text/plain repr).
RESULT = re.compile(r"^(Trace|Explanation|Routes|Results|PatchResult|Exploration|Comparison)\(")
WARNING_LINE = re.compile(r"(?:Warning: |attnflow: WARNING: )(.+)")


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The README notebook run in a fresh kernel in an empty folder where its "photo.jpg" is Grace
    Hopper's portrait (matplotlib's sample photo), and the folder."""
    nbclient = pytest.importorskip("nbclient")
    import matplotlib
    import nbformat

    folder = tmp_path_factory.mktemp("readme-notebook")
    shutil.copy(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg", folder / "photo.jpg")
    notebook = readme_notebook()
    source = str(Path(__file__).resolve().parents[1] / "src")
    with pytest.MonkeyPatch.context() as patch:  # the kernel is a child process: it imports attnflow from here
        patch.setenv("PYTHONPATH", os.pathsep.join([source, *sys.path]))
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        client = nbclient.NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(folder)}})
        client.execute()
    path = folder / "readme.ipynb"
    nbformat.write(notebook, path)
    return notebook, path


def results_of(notebook):
    """``(cell source, output)`` of each cell whose value is an attnflow result object."""
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output["output_type"] == "execute_result" and RESULT.match(output["data"].get("text/plain", "")):
                yield cell.source, output


def test_the_notebook_is_the_readme():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    python = readme.split("### Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    lines = [line for cell in readme_cells() for line in cell.splitlines()]
    assert lines == [line for line in python.splitlines() if line.strip()]  # every line, in order, once
    assert readme_cells()[-2].splitlines()[-1].startswith("routes ")


def test_the_executed_notebook_is_small_and_every_result_shows_itself(executed):
    notebook, path = executed
    assert path.stat().st_size <= MAX_NOTEBOOK_BYTES, f"{path.stat().st_size} bytes"
    shown = {}
    for source, output in results_of(notebook):
        plain, html = output["data"]["text/plain"], output["data"].get("text/html", "")
        assert html.strip(), f"no HTML for the cell ending {source.splitlines()[-1]!r}"
        assert len(plain) <= MAX_REPR_CHARS and "\n" not in plain.strip(), plain[:200]
        shown[RESULT.match(plain).group(1)] = html
    assert {"Trace", "Explanation", "Routes"} <= set(shown), sorted(shown)  # the README's result cells
    assert "France" in shown["Routes"] and "attentions" in shown["Trace"]


def test_no_warning_is_said_twice_in_a_cell(executed):
    notebook, _ = executed
    for cell in notebook.cells:
        said = []
        for output in cell.get("outputs", []):
            if output["output_type"] == "stream":
                said += [line.strip() for line in output["text"].splitlines() if "Warning" in line or "WARNING" in line]
            elif output["output_type"] in ("execute_result", "display_data"):
                html = output["data"].get("text/html", "")
                said += [match.group(1)[:80] for match in WARNING_LINE.finditer(re.sub(r"<[^>]+>", "\n", html))]
        repeated = {line for line in said if said.count(line) > 1}
        assert not repeated, (cell.source.splitlines()[-1], repeated)


@pytest.mark.browser
def test_the_html_outputs_render_in_chromium(executed, tmp_path):
    from viz.test_browser import CHROMIUM, assert_not_blank, render, script_elements

    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (run `make browser`)")
    notebook, _ = executed
    fragments = [output["data"]["text/html"] for _, output in results_of(notebook)]
    page = tmp_path / "outputs.html"
    page.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>README notebook</title></head><body>'
        + "<hr>".join(fragment for fragment in fragments if "<iframe" not in fragment)
        + "</body></html>",
        encoding="utf-8",
    )
    image, dom = render(page, tmp_path)
    assert_not_blank(image)
    assert "France" in dom and "attentions" in dom
    assert script_elements(dom) == 0
