"""Where activation patching reads and writes, taken from the family's adapter row (`Sites`).

Site kinds and the arrays a sweep fills (``T`` tokens, ``L`` layers, ``H`` heads):

- ``residual`` ``[L + 1, T]``: row 0 is the residual stream entering the first layer (the input of
  block 0: the embeddings), row l + 1 the stream leaving layer l (block l's output);
- ``attn`` ``[L, T]``: what layer l's attention block adds to the residual stream at one position;
- ``mlp`` ``[L, T]``: what layer l's MLP adds at one position;
- ``heads`` ``[L, H]``: one head's output (its ``d_head`` slice of the input of the attention output
  projection) at every position, or at one position (``head_position``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.trace import CAPABILITIES

SITE_KINDS = ("residual", "attn", "mlp", "heads")


@dataclass(frozen=True)
class Site:
    """One patching site: ``kind`` (`SITE_KINDS`), ``layer`` (for ``residual``: 0 = entering the
    first layer, l + 1 = leaving layer l), ``index``: the position (``residual``, ``attn``, ``mlp``)
    or the head (``heads``); ``head_position``: heads only, the one position patched (None: every
    position)."""

    kind: str
    layer: int
    index: int
    head_position: int | None = None


def check_sites_supported(model: ModelLike) -> None:
    """One clear line when the model's family has no patching sites in its adapter row."""
    if "sites" not in model.adapter.provides:
        raise InputError(
            f"activation patching does not support the {model.adapter.family} family ({model.name}): "
            f"its adapter row has no sites ({CAPABILITIES['sites']})"
        )


def parse_site_kinds(kinds: str | Sequence[str]) -> tuple[str, ...]:
    """``"residual,heads"`` or a sequence -> known site kinds in order, without repeats."""
    names = [name.strip() for name in (kinds.split(",") if isinstance(kinds, str) else kinds) if name.strip()]
    unknown = [name for name in names if name not in SITE_KINDS]
    if unknown or not names:
        raise InputError(f"unknown site kind(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(SITE_KINDS)}")
    return tuple(dict.fromkeys(names))


def sweep_shape(kind: str, n_layers: int, n_tokens: int, n_heads: int) -> tuple[int, int]:
    """The shape of a sweep's array for one site kind (see the module docstring)."""
    return {
        "residual": (n_layers + 1, n_tokens),
        "attn": (n_layers, n_tokens),
        "mlp": (n_layers, n_tokens),
        "heads": (n_layers, n_heads),
    }[kind]


def all_sites(kind: str, n_layers: int, n_tokens: int, n_heads: int, head_position: int | None = None) -> list[Site]:
    """Every site of one kind, in the row-major order of its sweep array (heads patched at
    ``head_position`` only, or at every position when it is None)."""
    rows, columns = sweep_shape(kind, n_layers, n_tokens, n_heads)
    position = head_position if kind == "heads" else None
    return [Site(kind, layer, index, position) for layer in range(rows) for index in range(columns)]


class SiteModules:
    """The modules of one model that hold its sites: blocks, attention blocks, MLPs and output
    projections, one per layer (found with the adapter row's patterns)."""

    def __init__(self, model: ModelLike) -> None:
        from attnflow.capture.hooks import find_layers

        check_sites_supported(model)
        sites = model.adapter.sites
        self.blocks = [module for _, module in find_layers(model.model, sites.block)]
        self.attention = [module for _, module in find_layers(model.model, sites.attention)]
        self.mlp = [module for _, module in find_layers(model.model, sites.mlp)]
        self.projections = [module for _, module in find_layers(model.model, model.adapter.stack.output_projection)]
        self.embeddings = model.model.get_input_embeddings()
        self.n_heads = model.n_heads
        counts = {len(self.blocks), len(self.attention), len(self.mlp), len(self.projections)}
        if counts != {model.n_layers}:
            raise InputError(
                f"{model.name}: the adapter row's site patterns found {len(self.blocks)} blocks, "
                f"{len(self.attention)} attention blocks, {len(self.mlp)} MLPs and {len(self.projections)} "
                f"output projections for {model.n_layers} layers"
            )
