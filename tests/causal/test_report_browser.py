"""The patching report in real headless Chromium: every heatmap is there and drawn, and the numbers
in the page's tables equal those of patch.json."""

from __future__ import annotations

import json
import shutil

import pytest

from attnflow.causal import patch

from conftest import CLEAN, CORRUPT

pytestmark = pytest.mark.browser
playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright is not installed (pip install -e .[test])"
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (run `make browser`)")
def test_report_page_shows_the_json_numbers(tiny_patch_models, tmp_path):
    result = patch(tiny_patch_models["llama"], CLEAN, CORRUPT, methods="exact,atp,relp", progress=False)
    page_path = result.save(tmp_path)
    saved = json.loads((tmp_path / "patch.json").read_text())
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(offline=True)
            errors: list[str] = []
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(page_path.resolve().as_uri())
            heatmaps = page.eval_on_selector_all(
                "figure.heatmap",
                "figures => figures.map(f => [f.dataset.method, f.dataset.kind, f.querySelector('img').complete,"
                " f.querySelector('img').naturalWidth])",
            )
            agreement = page.eval_on_selector_all(
                "table.agreement tbody tr",
                "rows => rows.map(r => [r.dataset.method, r.dataset.kind,"
                " ...Array.from(r.querySelectorAll('td[data-value]'), c => c.dataset.value)])",
            )
            strongest = page.eval_on_selector_all(
                "table.strongest tbody tr",
                "rows => rows.map(r => [r.dataset.method, r.dataset.kind, +r.dataset.layer, +r.dataset.index,"
                " r.querySelector('td[data-value]').dataset.value])",
            )
        finally:
            browser.close()
    assert errors == []
    expected = {(method, kind) for method, kinds in saved["effects"].items() for kind in kinds}
    assert {(method, kind) for method, kind, _, _ in heatmaps} == expected and len(heatmaps) == 12
    assert all(complete and width > 100 for _, _, complete, width in heatmaps)
    assert len(agreement) == 8
    for method, kind, pearson, spearman in agreement:
        assert float(pearson) == saved["correlations"][method][kind]["pearson"]
        assert float(spearman) == saved["correlations"][method][kind]["spearman"]
    assert len(strongest) == 12 * 5
    for method, kind, layer, index, value in strongest:
        assert float(value) == saved["effects"][method][kind][layer][index]
