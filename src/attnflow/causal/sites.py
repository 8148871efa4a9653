"""Where activation patching reads and writes, derived from the table of site kinds
(`attnflow.rows.site_kinds.SITE_TABLE`) and the family's adapter row.

Each kind's sweep fills an array ``[row, column]`` (``T`` tokens, ``L`` layers, ``H`` heads):
``residual [L + 1, T]`` (row 0: the stream entering the first layer, row l + 1: leaving layer l),
``attn`` and ``mlp [L, T]``, ``heads [L, H]`` (a head at every position, or at ``head_position``),
``knockout [L, T]`` (the edge from each key position to the ``target`` query blocked in a window
of layers centred on each layer), ``experts [L, E (+ 1)]`` (rows with a mixture of experts). `SITE_KINDS`
are the kinds that hold activations (patched to their value in another run) swept by default;
`ALL_KINDS` adds the experts and the interventions (knockout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.rows.site_kinds import SITE_KIND_ROWS, SITE_TABLE, SiteKind, window_layers
from attnflow.trace import CAPABILITIES

if TYPE_CHECKING:
    from attnflow.rows.hook_points import HookPoint

ALL_KINDS = tuple(row.name for row in SITE_TABLE)
SITE_KINDS = tuple(row.name for row in SITE_TABLE if row.is_activation and row.default)


def site_kind(name: str) -> SiteKind:
    """The table row of the kind ``name``."""
    return SITE_KIND_ROWS[name]


@dataclass(frozen=True)
class Site:
    """One patching site: ``kind`` (`ALL_KINDS`), ``layer`` (the row of the kind's sweep array: for
    ``residual`` 0 = entering the first layer, l + 1 = leaving layer l), ``index``: the column (a
    position, a head, a knockout's key position); ``head_position``: the one position the site is
    written at, for the kinds that have one (heads: None = every position; knockout: the query);
    ``layers``: the layers a windowed site spans (knockout; empty: ``layer`` alone)."""

    kind: str
    layer: int
    index: int
    head_position: int | None = None
    layers: tuple[int, ...] = ()

    def hook_layers(self) -> tuple[int, ...]:
        """The rows of the kind's hook points this site writes at."""
        return self.layers or (self.layer,)


@dataclass(frozen=True)
class SweepOptions:
    """What a sweep's kinds read besides their rows and columns: ``head_position`` (heads: the one
    position patched; None: every position), ``target`` (knockout: the query position whose edges
    are blocked), ``window`` (knockout: layers blocked around each layer), ``sources`` (knockout:
    the key positions swept; None: every position), ``expert_position`` (experts: the one position
    patched; None: every position)."""

    head_position: int | None = None
    target: int | None = None
    window: int = 1
    sources: tuple[int, ...] | None = None
    expert_position: int | None = None

    def position_of(self, row: SiteKind) -> int | None:
        """The one position every site of ``row`` is written at (None where the kind has none)."""
        return None if row.position_option is None else getattr(self, row.position_option)


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
    unknown = [name for name in names if name not in ALL_KINDS]
    if unknown or not names:
        raise InputError(f"unknown site kind(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(ALL_KINDS)}")
    return tuple(dict.fromkeys(names))


def sweep_shape(kind: str, n_layers: int, n_tokens: int, n_heads: int, n_experts: int = 0) -> tuple[int, int]:
    """The shape of a sweep's array for one site kind (see the module docstring)."""
    return site_kind(kind).shape(n_layers, n_tokens, n_heads, n_experts)


def all_sites(
    kind: str,
    n_layers: int,
    n_tokens: int,
    n_heads: int,
    head_position: int | None = None,
    *,
    options: SweepOptions | None = None,
    n_experts: int = 0,
    layers: Sequence[int] | None = None,
) -> list[Site]:
    """Every site of one kind, in the row-major order of its sweep array (heads patched at
    ``head_position`` only, or at every position when it is None; ``options`` for the other kinds'
    options; knockout columns outside ``options.sources`` are left out; ``n_experts``: the
    experts' columns). ``layers``: the rows the kind has (a hybrid stack's attention blocks,
    `SiteModules.layers`; a knockout's window then spans those of its blocks); None: every row."""
    row = site_kind(kind)
    options = options or SweepOptions(head_position=head_position)
    rows, columns = row.shape(n_layers, n_tokens, n_heads, n_experts)
    position = options.position_of(row)
    if row.window and position is None:
        raise InputError(f"{kind} sites need a target position")
    chosen = range(columns) if not row.window or options.sources is None else sorted(set(options.sources))
    present = range(rows) if layers is None else layers

    def window(layer: int) -> tuple[int, ...]:
        return tuple(block for block in window_layers(layer, options.window, n_layers) if block in present)

    return [
        Site(kind, layer, index, position, window(layer) if row.window else ()) for layer in present for index in chosen
    ]


class SiteModules:
    """The modules of one model that hold its sites, per kind (found with the adapter row's
    patterns; one per layer; a kind the row has no pattern for, such as ``experts`` without a
    mixture of experts, is left out), and the hook point of each row of each kind's sweep array.
    ``n_experts``: the experts' columns (a shared expert's included; 0 without experts).
    A hybrid stack's row (`attnflow.rows.adapters.Mixers`) has heads and knockout (and maybe
    experts) in some blocks only: ``layers[kind]`` are those blocks, the rows of the kind's sweep
    array that hold sites (the others stay NaN), and ``partial[kind]`` says so in one line (for what
    needs the kind in every layer, `check_in_every_layer`); its residual, attn (each layer's token
    mixer) and mlp sites cover every layer."""

    def __init__(self, model: ModelLike) -> None:
        from attnflow.rows.adapters import find_layers, layer_index
        from attnflow.rows.experts import n_columns

        check_sites_supported(model)
        self.row = model.adapter
        self.by_kind: dict[str, list[Any]] = {}
        self.layers: dict[str, tuple[int, ...]] = {}  # the block of each module of by_kind[kind]
        self.partial: dict[str, str] = {}  # a hybrid's kinds in some layers only: where they are
        mixers = model.adapter.mixers
        for row in SITE_TABLE:
            pattern = row.pattern(model.adapter)
            if pattern is None:
                continue
            located = find_layers(model.hf_model, pattern, gaps=mixers is not None)
            blocks = tuple(layer_index(pattern, name) for name, _ in located)
            if mixers is not None and len(located) != model.n_layers:
                self.partial[row.name] = (
                    f"the {model.adapter.family} stack is hybrid ({mixers.where}): its {row.name} sites are in "
                    f"layer{'s' if len(located) > 1 else ''} {', '.join(map(str, blocks))} only"
                )
            self.by_kind[row.name] = [module for _, module in located]
            self.layers[row.name] = blocks if row.name in self.partial else tuple(range(len(located)))
        experts = model.adapter.experts
        self.n_experts = n_columns(experts, self.by_kind["experts"][0]) if "experts" in self.by_kind else 0
        self.embeddings = model.hf_model.get_input_embeddings()
        self.n_heads = model.n_heads
        counts = {name: len(modules) for name, modules in self.by_kind.items() if name not in self.partial}
        if set(counts.values()) != {model.n_layers}:
            found = ", ".join(f"{count} for {name} ({site_kind(name).where})" for name, count in counts.items())
            raise InputError(f"{model.name}: the adapter row's site patterns found {found} for {model.n_layers} layers")
        # By role (edge attribution reads them so, `check_in_every_layer`): each layer's block (its
        # input and output: the residual stream), attention block and MLP (their outputs: what they
        # add to the stream) and attention output projection (its input: the heads' outputs).
        self.blocks, self.attention, self.mlp, self.projections = (
            self.by_kind.get(kind, []) for kind in ("residual", "attn", "mlp", "heads")
        )

    def points(self, kind: str) -> list[HookPoint]:
        """The hook point of each of ``kind``'s modules, in order (the sweep rows `rows` gives)."""
        return site_kind(kind).hook_points(self.by_kind[kind], self.row, self.rows(kind))

    def rows(self, kind: str) -> tuple[int, ...]:
        """The row of ``kind``'s sweep array at each of its hook points (a stream: one more, row 0
        its first module's input; a hybrid's partial kind: the blocks that hold its modules)."""
        if kind in self.partial:
            return self.layers[kind]
        return tuple(range(len(self.by_kind[kind]) + int(site_kind(kind).stream)))

    def recorded_row(self, kind: str, layer: int) -> int:
        """Where row ``layer`` of ``kind``'s sweep array is in a run's recorded activations of the
        kind (which hold its hook points in order: a hybrid's heads, its attention blocks only)."""
        return self.rows(kind).index(layer)

    def spread(self, kind: str, values: Any) -> Any:
        """``values [..., hook point, column]`` (one per recorded row) as ``[..., row, column]`` over
        the kind's whole sweep array, NaN in the rows without sites (a hybrid's other blocks)."""
        import numpy as np

        if kind not in self.partial:
            return values
        full = np.full((*values.shape[:-2], len(self.blocks), values.shape[-1]), np.nan)
        full[..., list(self.layers[kind]), :] = values
        return full

    def check_kinds(self, kinds: Sequence[str]) -> None:
        """One clear line when a kind asked for has no modules in this model's row."""
        missing = [kind for kind in kinds if kind not in self.by_kind]
        if missing:
            raise InputError(
                f"the {self.row.family} family's adapter row has no {', '.join(missing)} sites "
                f"({', '.join(site_kind(kind).where for kind in missing)})"
            )

    def check_in_every_layer(self, kinds: Sequence[str]) -> None:
        """`check_kinds`, and one line when a kind is in some layers only (a hybrid stack's heads)."""
        self.check_kinds(kinds)
        partial = [self.partial[kind] for kind in kinds if kind in self.partial]
        if partial:
            raise InputError(f"{partial[0]}: this needs them in every layer")
