"""A page in real headless Chromium (Playwright), offline, recording what must never happen: a
console error, a page error, a dialog (a token run as markup), a request beyond the page's file."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (run `make browser`)")
ARTIFACTS = Path(os.environ.get("ATTNFLOW_ARTIFACTS", Path(__file__).resolve().parents[1] / "out" / "test-artifacts"))


@contextmanager
def offline_page(path: Path, playwright_api: Any, width: int = 1400, height: int = 1000) -> Iterator[tuple[Any, dict]]:
    """``(tab, seen)`` with the page at ``path`` loaded offline; on leaving, no error, no dialog and
    only the file's own request may have been seen."""
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        tab = browser.new_page(viewport={"width": width, "height": height}, offline=True)
        seen: dict[str, list] = {"errors": [], "requests": [], "dialogs": []}
        tab.on("console", lambda message: seen["errors"].append(message.text) if message.type == "error" else None)
        tab.on("pageerror", lambda error: seen["errors"].append(str(error)))
        tab.on("request", lambda request: seen["requests"].append(request.url))
        tab.on("dialog", lambda dialog: (seen["dialogs"].append(dialog.message), dialog.dismiss()))
        tab.goto(path.resolve().as_uri())
        yield tab, seen
        browser.close()
        assert seen["errors"] == [] and seen["dialogs"] == [], seen
        assert len(seen["requests"]) == 1 and seen["requests"][0].startswith("file:"), seen["requests"]
