"""`attnflow models list` tells apart a model that is ready, one whose packages are installed but
whose first load still prepares it (unpacking, converting: minutes), and one not installed; and
`models --help` says which classifier heads ship."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnflow.capture import loading
from attnflow.cli import build_parser, main

PREPARED_ON_FIRST_LOAD = ("mpnet", "smollm2", "gemma3-270m", "qwen2.5-0.5b", "dinov2-s")


@pytest.fixture
def every_package(tmp_path, monkeypatch):
    """Every package of every embedded model installed (a folder each), the cache empty."""
    packages = tmp_path / "packages"
    packages.mkdir()
    monkeypatch.setattr(loading, "_package_dir", lambda _name: packages)
    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def listed(capsys) -> dict[str, dict]:
    assert main(["models", "list", "--json"]) == 0
    return {row["alias"]: row for row in json.loads(capsys.readouterr().out)}


def test_installed_packages_with_a_first_load_still_to_come_are_said_so(every_package, capsys):
    rows = listed(capsys)
    for alias in PREPARED_ON_FIRST_LOAD:
        assert rows[alias]["installed"] is True and rows[alias]["prepared"] is False, alias
        assert rows[alias]["state"] == "not prepared", alias
    assert rows["minilm"]["state"] == "installed" and rows["minilm"]["prepared"] is True
    assert rows["mpnet-sentiment"]["state"] == "not prepared"  # its head ships, its encoder is not unpacked
    assert "4 min" in rows["qwen2.5-0.5b"]["preparation"] and "2.9 GB" in rows["qwen2.5-0.5b"]["preparation"]
    assert main(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    mpnet = lines.index(next(line for line in lines if line.startswith("mpnet ")))
    assert "not prepared" in lines[mpnet] and "not installed" not in lines[mpnet]
    assert "attnflow models install mpnet" in lines[mpnet + 1]
    (every_package / "qwen2.5-0.5b-dequantised").mkdir(parents=True)
    (every_package / "qwen2.5-0.5b-dequantised" / "model.safetensors").write_bytes(b"")
    assert listed(capsys)["qwen2.5-0.5b"]["state"] == "installed"


def test_a_missing_package_is_not_installed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loading, "_package_dir", lambda _name: None)
    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path))
    rows = listed(capsys)
    assert all(rows[alias]["state"] == "not installed" for alias in loading.EMBEDDED)


def test_models_help_says_every_shipped_head_ships():
    parser = build_parser()
    (models,) = [a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "models"]
    text = models[1].format_help()
    shipped = sorted(path.stem for path in (Path(loading.__file__).parent / "heads").glob("*.npz"))
    assert shipped == ["minilm-sentiment", "minilm-topics", "mpnet-sentiment"]
    words = " ".join(text.split())
    assert "not yet" not in text and "heads ship trained in the package" in words
    assert all(alias in words for alias in shipped)
