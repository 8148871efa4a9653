"""A cache of dequantised weights: a model loaded from a slow source (a 4-bit GGUF file that
transformers dequantises on every load) is saved once as a plain safetensors model folder.

The folder holds what ``save_pretrained`` writes (``model.safetensors``, ``config.json``, the
tokenizer files) plus ``attnflow-cache.json``: the content of the source file (its size and
sha256) and the sha256 of every file. A cache is used only when the source's content is the
same and every checksum matches; otherwise it is rebuilt. The key is the content, not the path
or the modification time, so a second clone or a reinstalled package with the same file uses
the same cache; the source's sha256 is remembered in ``source-digests.json`` (per path, size and
modification time) so that it is computed once per installed file, not on every load. Each
source has one cache folder, replaced when the source changes.

It is written into a temporary folder beside its place and renamed into place, so a crash or a
full disk never leaves a half-written cache (a failed write is a warning: the model just loaded
is used as it is). Two processes that load the same source at once convert it once:
`converting` holds a lock while one of them checks, converts and writes; the other waits, then
finds the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from attnflow.capture import progress
from attnflow.staging import atomic_file, building, checkpoint

if TYPE_CHECKING:
    from torch import nn

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: conversions are not serialised
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

MANIFEST = "attnflow-cache.json"
SOURCE_DIGESTS = "source-digests.json"
FORMAT = 2  # 2: keyed by the source's size and sha256 (1: by its name, size and mtime)


def cache_dir() -> Path:
    """attnflow's cache folder: ``$ATTNFLOW_CACHE`` or ``~/.cache/attnflow``."""
    return Path(os.environ.get("ATTNFLOW_CACHE", Path.home() / ".cache" / "attnflow"))


def source_identity(source_file: Path) -> dict[str, Any]:
    """What must not change for the cache to stay valid: the source file's content (size, sha256)."""
    return {"format": FORMAT, "size": Path(source_file).stat().st_size, "sha256": source_digest(source_file)}


def source_digest(source_file: Path) -> str:
    """The sha256 of ``source_file``, computed once per (path, size, modification time) and
    remembered in ``cache_dir()/source-digests.json``; a new path or mtime (a reinstall) hashes
    the file again, a few seconds for a large model, instead of converting it again."""
    path = Path(source_file).resolve()
    stat = path.stat()
    memo_file = cache_dir() / SOURCE_DIGESTS
    try:
        memo = json.loads(memo_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        memo = {}
    seen = memo.get(str(path)) if isinstance(memo, dict) else None
    if isinstance(seen, dict) and seen.get("size") == stat.st_size and seen.get("mtime_ns") == stat.st_mtime_ns:
        return str(seen["sha256"])
    digest = sha256(path)
    memo = memo if isinstance(memo, dict) else {}
    memo[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
    try:
        with atomic_file(memo_file) as handle:
            handle.write(json.dumps(memo, indent=1, sort_keys=True).encode("utf-8"))
    except OSError as error:  # a read-only cache: hash again next time
        log.info("could not remember the sha256 of %s in %s (%s)", path, memo_file, error)
    return digest


@contextmanager
def converting(folder: Path) -> Iterator[None]:
    """Hold the conversion lock of cache ``folder`` (``FOLDER.lock`` beside it) for the block:
    a second process converting the same source waits here (a message says so), then finds the
    cache the first one wrote. An unwritable cache folder is not locked (the write will warn)."""
    lock_file = Path(folder).with_name(Path(folder).name + ".lock")
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        if fcntl is not None:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.warning("another attnflow process is converting into %s; waiting for it", folder)
                fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock; the file stays (deleting it would race with a waiter)


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


def write(hf_model: nn.Module, tokenizer: Any, folder: Path, source_file: Path) -> bool:
    """Save ``hf_model`` (safetensors) and ``tokenizer`` as the cache of ``source_file`` in ``folder``.

    Returns True when the cache is in place; on an OS error (full disk, read-only cache) logs a
    warning, leaves no partial folder and returns False.
    """
    folder = Path(folder)
    try:
        with building(folder) as scratch:
            scratch.mkdir()
            save_weights(hf_model, scratch)
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


def save_weights(hf_model: nn.Module, folder: Path) -> None:
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
    for name, tensor in hf_model.state_dict().items():
        checkpoint()
        if tensor.data_ptr() in stored:
            continue  # a tied copy of a tensor already stored
        stored.add(tensor.data_ptr())
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (Path(folder) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


def sha256(path: Path) -> str:
    """The hex sha256 of a file, read in 4 MiB blocks (a progress bar for a large one)."""
    digest = hashlib.sha256()
    size = Path(path).stat().st_size
    name = Path(path).name
    checking = progress.bar(size, f"checking the sha256 of {name}", quiet_below=progress.LARGE_FILE_BYTES, leave=False)
    with open(path, "rb") as handle, checking as shown:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
            shown.update(len(block))
            checkpoint()
    return digest.hexdigest()
