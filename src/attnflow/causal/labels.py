"""How every output of `attnflow patch` names a site's layer, and which sites it shows as the
strongest (the console summary, patch.html, summary.html, ``--versus``)."""

from __future__ import annotations

import numpy as np

FINAL_ROW_NOTE = "the stream leaving the last layer left out: 1 by definition at the position the output reads"


def strongest_sites(kind: str, values: np.ndarray, k: int) -> list[tuple[int, int]]:
    """The ``k`` sites ``(row, column)`` of one kind's effects with the largest |effect|, largest
    first. The residual stream leaving the last layer (the final row of a stream kind) is left out: restoring it at
    the position the output reads restores the whole answer (effect 1) by definition, elsewhere
    nothing, so it says nothing about where the answer lives."""
    shown = np.asarray(values, dtype=np.float64)
    if _is_stream(kind):
        shown = shown[:-1]
    order = np.argsort(-np.abs(np.nan_to_num(shown)), axis=None, kind="stable")[:k]
    return [(int(row), int(column)) for row, column in zip(*np.unravel_index(order, shown.shape), strict=True)]


def handover_row(residual: np.ndarray, position: int, share: float = 0.5) -> int | None:
    """The first row of a residual sweep ``[n_layers + 1, token]`` (row 0: the stream entering
    layer 0; row l + 1: leaving layer l) whose stream at ``position`` restores at least ``share`` of
    the answer on its own: where the answer has reached the position that reads it. None when no
    row before the last does (the last row restores it by definition: `FINAL_ROW_NOTE`)."""
    column = np.nan_to_num(np.asarray(residual, dtype=np.float64)[:-1, position], nan=-np.inf)
    reached = np.flatnonzero(column >= share)
    return int(reached[0]) if reached.size else None


def layer_label(kind: str, row: int) -> str:
    """How every output names the layer of a site (one convention for the console, the pages and
    ``--versus``): ``Ln`` is layer n (from 0); a row of the residual stream (a kind whose rows are
    the stream) is the stream entering layer 0 (``emb``, row 0) or leaving layer n (``Ln``, row n + 1)."""
    if _is_stream(kind):
        return "emb" if row == 0 else f"L{row - 1}"
    return f"L{row}"


def _is_stream(kind: str) -> bool:
    """Whether a site kind's rows are the residual stream (one more row than layers: the table's
    ``stream``)."""
    from attnflow.causal.sites import site_kind

    return site_kind(kind).stream
