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
) -> list[Site]:
    """Every site of one kind, in the row-major order of its sweep array (heads patched at
    ``head_position`` only, or at every position when it is None; ``options`` for the other kinds'
    options; knockout columns outside ``options.sources`` are left out; ``n_experts``: the
    experts' columns)."""
    row = site_kind(kind)
    options = options or SweepOptions(head_position=head_position)
    rows, columns = row.shape(n_layers, n_tokens, n_heads, n_experts)
    position = options.position_of(row)
    if row.window and position is None:
        raise InputError(f"{kind} sites need a target position")
    chosen = range(columns) if not row.window or options.sources is None else sorted(set(options.sources))
    return [
        Site(kind, layer, index, position, window_layers(layer, options.window, n_layers) if row.window else ())
        for layer in range(rows)
        for index in chosen
    ]


class SiteModules:
    """The modules of one model that hold its sites, per kind (found with the adapter row's
    patterns; one per layer; a kind the row has no pattern for, such as ``experts`` without a
    mixture of experts, is left out), and the hook point of each row of each kind's sweep array.
    ``n_experts``: the experts' columns (a shared expert's included; 0 without experts).
    A hybrid stack's row (`attnflow.rows.adapters.Mixers`) has heads (and knockout, and maybe
    experts) in some layers only: those kinds are left out too, with the reason ``check_kinds``
    gives (``partial``); its residual, attn (each layer's token mixer) and mlp sites cover every layer."""

    def __init__(self, model: ModelLike) -> None:
        from attnflow.rows.adapters import find_layers, layer_index
        from attnflow.rows.experts import n_columns

        check_sites_supported(model)
        self.row = model.adapter
        self.by_kind: dict[str, list[Any]] = {}
        self.partial: dict[str, str] = {}  # a hybrid's kinds in some layers only: why they are left out
        mixers = model.adapter.mixers
        for row in SITE_TABLE:
            pattern = row.pattern(model.adapter)
            if pattern is None:
                continue
            located = find_layers(model.hf_model, pattern, gaps=mixers is not None)
            if mixers is not None and len(located) != model.n_layers:
                where = ", ".join(str(layer_index(pattern, name)) for name, _ in located)
                self.partial[row.name] = (
                    f"the {model.adapter.family} stack is hybrid ({mixers.where}): its {row.name} sites are in "
                    f"layer{'s' if len(located) > 1 else ''} {where} only"
                )
                continue
            self.by_kind[row.name] = [module for _, module in located]
        experts = model.adapter.experts
        in_every_layer = experts is not None and "experts" in self.by_kind
        self.n_experts = n_columns(experts, self.by_kind["experts"][0]) if in_every_layer else 0
        self.embeddings = model.hf_model.get_input_embeddings()
        self.n_heads = model.n_heads
        counts = {name: len(modules) for name, modules in self.by_kind.items()}
        if set(counts.values()) != {model.n_layers}:
            found = ", ".join(f"{count} for {name} ({site_kind(name).where})" for name, count in counts.items())
            raise InputError(f"{model.name}: the adapter row's site patterns found {found} for {model.n_layers} layers")
        # By role (edge attribution reads them so): each layer's block (its input and output: the
        # residual stream), attention block and MLP (their outputs: what they add to the stream) and
        # attention output projection (its input: the heads' outputs).
        self.blocks, self.attention, self.mlp, self.projections = (
            self.by_kind.get(kind, []) for kind in ("residual", "attn", "mlp", "heads")
        )

    def points(self, kind: str) -> list[HookPoint]:
        """The hook point of each row of ``kind``'s sweep array, in order."""
        return site_kind(kind).hook_points(self.by_kind[kind], self.row)

    def check_kinds(self, kinds: Sequence[str]) -> None:
        """One clear line when a kind asked for has no modules in this model's row."""
        partial = [self.partial[kind] for kind in kinds if kind in self.partial]
        if partial:
            raise InputError(f"{partial[0]}; choose from {', '.join(self.by_kind)}")
        missing = [kind for kind in kinds if kind not in self.by_kind]
        if missing:
            raise InputError(
                f"the {self.row.family} family's adapter row has no {', '.join(missing)} sites "
                f"({', '.join(site_kind(kind).where for kind in missing)})"
            )
