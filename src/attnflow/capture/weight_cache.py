"""A cache of dequantised weights: a model loaded from a slow source (a 4-bit GGUF file that
transformers dequantises on every load) is saved once as a plain safetensors model folder.

The folder holds what ``save_pretrained`` writes (``model.safetensors``, ``config.json``, the
tokenizer files) plus ``attnflow-cache.json``: the identity of the source file (name, size,
modification time) and the sha256 of every file. A cache is used only when the source is
unchanged and every checksum matches; otherwise it is rebuilt. It is written into a temporary
folder beside its place and renamed into place, so a crash or a full disk never leaves a
half-written cache (a failed write is a warning: the model just loaded is used as it is).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from attnflow.staging import building

log = logging.getLogger(__name__)

MANIFEST = "attnflow-cache.json"
FORMAT = 1


def cache_dir() -> Path:
    """attnflow's cache folder: ``$ATTNFLOW_CACHE`` or ``~/.cache/attnflow``."""
    return Path(os.environ.get("ATTNFLOW_CACHE", Path.home() / ".cache" / "attnflow"))


def source_identity(source_file: Path) -> dict[str, Any]:
    """What must not change for the cache to stay valid: the source file's name, size and mtime."""
    stat = Path(source_file).stat()
    return {"format": FORMAT, "name": Path(source_file).name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def is_valid(folder: Path, source_file: Path) -> bool:
    """Whether ``folder`` is a complete cache of ``source_file`` with every checksum intact."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if manifest.get("source") != source_identity(source_file):
        log.info("the cache in %s was made from another version of %s; rebuilding it", folder, Path(source_file).name)
        return False
    files = manifest.get("files") or {}
    for name, digest in files.items():
        if not (folder / name).is_file() or sha256(folder / name) != digest:
            log.warning("the cached weights in %s are damaged (%s fails its sha256); rebuilding them", folder, name)
            return False
    return "model.safetensors" in files


def write(model: Any, tokenizer: Any, folder: Path, source_file: Path) -> bool:
    """Save ``model`` (safetensors) and ``tokenizer`` as the cache of ``source_file`` in ``folder``.

    Returns True when the cache is in place; on an OS error (full disk, read-only cache) logs a
    warning, leaves no partial folder and returns False.
    """
    folder = Path(folder)
    try:
        with building(folder) as scratch:
            scratch.mkdir()
            save_weights(model, scratch)
            if tokenizer is not None:
                tokenizer.save_pretrained(scratch)
            files = {entry.name: sha256(entry) for entry in sorted(scratch.iterdir()) if entry.is_file()}
            manifest = {"source": source_identity(source_file), "files": files}
            (scratch / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    except (OSError, ValueError, RuntimeError) as error:  # a failed cache never fails the load
        log.warning(
            "could not cache the dequantised weights in %s (%s); the next load dequantises again", folder, error
        )
        return False
    log.info("cached the dequantised weights in %s", folder)
    return True


def save_weights(model: Any, folder: Path) -> None:
    """``config.json`` and ``model.safetensors`` that ``from_pretrained(folder)`` loads back.

    ``save_pretrained`` refuses models loaded from GGUF ("quantized with gguf and is not
    serializable") although their weights are plain dequantised tensors, so the state dict is
    written directly. Tied weights (embeddings shared with the output layer) are stored once,
    under the first name the state dict lists (the input embedding); loading ties them again.
    The quantisation settings are dropped from the config: the cached weights are not quantised.
    """
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    stored: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in stored:
            continue  # a tied copy of a tensor already stored
        stored.add(tensor.data_ptr())
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (Path(folder) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


def sha256(path: Path) -> str:
    """The hex sha256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
