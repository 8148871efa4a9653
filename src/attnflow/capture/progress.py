"""What a slow step of loading says while it runs (no silent waits): a line on stderr when a step
of unknown length starts (unpacking, converting, dequantising, caching) and a progress bar where it
has a length (joining pieces, checking a checksum, installing packages). `attnflow.load`'s
``progress=False`` (the CLI's ``--quiet``) silences both for the load (`shown`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

_SHOWN: ContextVar[bool] = ContextVar("attnflow_loading_progress", default=True)
LARGE_FILE_BYTES = 1 << 30  # 1 GiB: a file whose checksum takes seconds (~3 s on a loaded 2-core machine) gets a bar


@contextmanager
def shown(enabled: bool) -> Iterator[None]:
    """Within the block, the steps below say what they do (``enabled``) or stay quiet."""
    token = _SHOWN.set(enabled)
    try:
        yield
    finally:
        _SHOWN.reset(token)


def say(message: str) -> None:
    """``attnflow: MESSAGE`` on stderr, as the CLI's progress lines (nothing when quiet)."""
    if _SHOWN.get():
        print(f"attnflow: {message}", file=sys.stderr, flush=True)


def bar(total: int, description: str, unit: str = "B", quiet_below: int = 0, leave: bool = True) -> Any:
    """A tqdm bar on stderr of ``total`` units (bytes are scaled: MB, GB), disabled when quiet or
    when ``total`` is below ``quiet_below`` (a step too short to need one); ``leave=False``: a
    routine step (a checksum on every load) whose bar a terminal clears when it is done."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=f"attnflow: {description}",
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        disable=not _SHOWN.get() or total < quiet_below,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=leave,
    )
