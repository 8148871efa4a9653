"""Every activation reached one way: the table of site kinds.

A site kind is one row (`SiteKind`): where its modules live in a family's adapter row (``where``,
the path of a regex in the row, e.g. ``"sites.block"``), which tensor of each module's call it is
(``side``: the module's output or one of its inputs, as a `HookPoint` names it), its index axes
(rows: one per layer, plus one for a ``stream`` kind whose row 0 is the input of the first layer;
columns: a ``"position"`` or a ``"head"``), and how a site's value is read and written. Patching,
its approximations, the report, the dataset summary and ``attnflow patch --sites`` read this table;
a new kind is one row here (plus its read and write functions where they are new).

The rows (``L`` layers, ``T`` tokens, ``H`` heads; the array each sweep fills):

- ``residual`` ``[L + 1, T]``: the input of each block (row 0: the embeddings entering the first
  layer) and its output (row l + 1: the stream leaving layer l), ``[batch, token, d_model]``;
- ``attn`` ``[L, T]``: what layer l's attention block adds to the residual stream at one position
  (in a hybrid stack, `attnflow.rows.adapters.Mixers`: what layer l's token mixer adds, attention
  or not; ``heads`` and ``knockout`` exist in its attention layers only: their rows are the block
  indices, NaN in the other blocks' rows);
- ``mlp`` ``[L, T]``: what layer l's MLP adds at one position;
- ``heads`` ``[L, H]``: one head's output, its ``d_head`` slice of the input of the attention output
  projection ``[batch, token, head * d_head]``, at every position or at one (``head_position``);
- ``experts`` ``[L, E (+ 1)]``: one expert's part of a mixture of experts' output (its routing
  weight times its output; 0 where the router did not choose it; a shared expert's part is column
  E), at every position or at one (``expert_position``): the MoE block's output seen through an
  `attnflow.rows.experts.ExpertsView` ``[batch, token, E (+ 1), d_model]``, so that writing a
  part changes the block's output by the new part less the old; rows with `Experts` only;
- ``knockout`` ``[L, T]``: attention knockout (Geva et al. 2023): the edge from key position j (the
  column) to one query position (``target``) is blocked in a window of layers centred on layer l
  (the row): the score is set to −∞ before the softmax in the additive ``attention_mask`` the
  attention module receives ``[batch, 1, query, key]``, so A[target, j] = 0 and the rest of the row
  is renormalised. An intervention, not an activation: no other run supplies its value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from attnflow.errors import CaptureError, InputError

if TYPE_CHECKING:
    import torch

    from attnflow.rows.adapters import Adapter
    from attnflow.rows.hook_points import HookPoint, Side, View


@dataclass(frozen=True)
class Write:
    """The sites of one hook point patched in one forward pass: batch ``rows [n]``, ``indices [n]``
    (positions, heads or key positions, by the kind's column), their ``values`` (None for an
    intervention) and the one ``position`` the group shares (a head's position, a knockout's query;
    None: every position)."""

    rows: torch.Tensor
    indices: torch.Tensor
    values: torch.Tensor | None
    position: int | None


# (tensor at the hook point or None, the writes, n_heads, the module's first input) -> new tensor
WriteFunction = Callable[[Any, Sequence[Write], int, Any], Any]
# (one sample's activation of one layer [token, width], index, position, n_heads) -> the site's value
ReadFunction = Callable[[Any, int, "int | None", int], Any]
# ((source − base) · gradient [sample, row, token, width], position, n_heads) -> [sample, row, column]
DotFunction = Callable[[Any, "int | None", int], Any]


def write_positions(hidden: Any, writes: Sequence[Write], _n_heads: int, _first: Any) -> Any:
    """``hidden [batch, token, d_model]`` with ``values [n, d_model]`` written at (row, position)."""
    new = hidden.clone()
    for write in writes:
        new[write.rows, write.indices] = write.values
    return new


def read_position(activation: Any, index: int, _position: int | None, _n_heads: int) -> Any:
    """``[d_model]``: the activation ``[token, d_model]`` at position ``index``."""
    return activation[index]


def dot_positions(product: Any, _position: int | None, _n_heads: int) -> Any:
    """``[sample, row, position]``: the product summed over the model width."""
    return product.sum(dim=-1)


def _per_column(tensor: Any, n_heads: int, split_rank: int) -> Any:
    """``[..., token, column, width]``: heads' ``[..., token, head * d_head]`` split per head (a view);
    a tensor of rank ``split_rank`` (the experts' parts) is split already."""
    if tensor.dim() == split_rank:
        return tensor
    return tensor.view(*tensor.shape[:-1], n_heads, tensor.shape[-1] // n_heads)


def write_heads(heads_input: Any, writes: Sequence[Write], n_heads: int, _first: Any) -> Any:
    """``heads_input [batch, token, head * d_head]`` with head ``index`` set to ``values`` (``[n,
    token, d_head]`` at every position, ``[n, d_head]`` at the write's one position); the same for
    an expert's part of ``[batch, token, expert, d_model]``."""
    new = heads_input.clone()
    heads = _per_column(new, n_heads, 4)  # [batch, token, head, d_head]
    for write in writes:
        if write.position is None:
            heads[write.rows, :, write.indices] = write.values
        else:
            heads[write.rows, write.position, write.indices] = write.values
    return new


def read_head(activation: Any, index: int, position: int | None, n_heads: int) -> Any:
    """Head ``index`` of ``activation [token, head * d_head]``: ``[token, d_head]``, or ``[d_head]``
    at ``position``; expert ``index`` of ``[token, expert, d_model]`` likewise."""
    head = _per_column(activation, n_heads, 3)[:, index]  # [token, d_head]
    return head if position is None else head[position]


def dot_heads(product: Any, position: int | None, n_heads: int) -> Any:
    """``[sample, row, head]``: the product summed over each head's ``d_head`` and every position
    (or read at ``position``)."""
    samples, rows, tokens, width = product.shape
    heads = product.view(samples, rows, tokens, n_heads, width // n_heads)  # [sample, row, token, head, d_head]
    if position is not None:
        return heads[:, :, position].sum(dim=-1)
    return heads.sum(dim=(2, 4))


def write_knockout(mask: Any, writes: Sequence[Write], _n_heads: int, hidden: Any) -> Any:
    """The attention mask ``[batch, 1, query, key]`` with the edge (row, query ``position``, key
    ``index``) blocked for every head: the blocked key gets weight exactly 0 and the query's other
    weights are renormalised by the softmax. An additive float mask gets −∞ there (None: the model
    passed none, as BERT-like encoders do without padding; zeros are made from ``hidden [batch,
    token, d_model]``; ``[batch, 1, 1, key]``, a padding mask broadcast over the queries (GPT-1's,
    whose causal mask is a buffer of its own): spread over every query). A boolean mask gets the
    value a query's own key does not hold: a query always reads itself, so its diagonal entry is the
    mask's "visible" value, whichever convention the model uses (True kept, or MPT's True masked);
    an integer mask of 0 and 1 (DeBERTa's, which the attention turns boolean) likewise."""
    import torch

    batch, tokens = hidden.shape[:2]
    if mask is None:
        mask = torch.zeros(batch, 1, tokens, tokens, dtype=hidden.dtype, device=hidden.device)
    elif not torch.is_tensor(mask) or mask.dim() != 4 or not (mask.is_floating_point() or _two_valued(mask)):
        raise CaptureError(
            "attention knockout needs the 4-D attention_mask [batch, 1, query, key] of eager attention (additive "
            f"float, boolean or 0/1); the attention module received {type(mask).__name__} {getattr(mask, 'shape', '')}"
        )
    queries = tokens if mask.shape[2] == 1 else -1  # a padding mask: one row for every query
    new = mask.expand(batch, -1, queries, -1).clone()  # the model shares one mask across rows and layers
    for write in writes:
        visible = _visible(new, write)
        blocked = float("-inf") if visible is None else visible.logical_not()[:, None].to(new.dtype)
        new[write.rows, :, write.position, write.indices] = blocked
        _check_a_key_is_left(new, write, visible)
    return new


def _two_valued(mask: Any) -> bool:
    """A boolean mask, or an integer one holding only 0 and 1."""
    import torch

    if mask.dtype == torch.bool:
        return True
    return not mask.is_floating_point() and not mask.is_complex() and bool(((mask == 0) | (mask == 1)).all())


def _visible(mask: Any, write: Write) -> Any:
    """None for an additive float mask; for a boolean one, per row of ``write``, the value of the
    query's own (always visible) key: ``[n]``."""
    if mask.is_floating_point():
        return None
    return mask[write.rows, 0, write.position, write.position]


def _check_a_key_is_left(mask: Any, write: Write, visible: Any = None) -> None:
    """A query whose every key is blocked has no attention to renormalise (the softmax of a row of
    −∞ is undefined); masked keys hold −∞ or the dtype's minimum (a boolean mask: the value
    ``visible [n]`` is not), visible ones 0."""
    import torch

    row = mask[write.rows, 0, write.position]  # [n, key]
    readable = row > torch.finfo(mask.dtype).min / 2 if visible is None else row == visible[:, None]
    if not bool(readable.any(dim=-1).all()):
        raise InputError(
            f"attention knockout leaves query position {write.position} no key to read: "
            "choose a target that reads more than the blocked position(s)"
        )


@dataclass(frozen=True)
class SiteKind:
    """One row of the site table (module docstring).

    ``where``: the adapter row's regex for the kind's modules (``"sites.block"``: ``Adapter.sites.
    block``; group 1 the layer). ``side``/``argument``: the tensor of each call (`HookPoint`).
    ``column``: the second index axis, ``"position"``, ``"head"`` or ``"expert"``. ``stream``: one more row than
    layers, row 0 the input of the first layer's module and row l + 1 layer l's output. ``read``:
    a site's value in a recorded activation (None: an intervention, which runs on the clean input
    and records nothing). ``write``: sets the sites of one hook point. ``dot``: per-site sums of
    (a_source − a_base) · gradient for the approximations (None: they do not estimate this kind).
    ``adds_to_stream``: what a block adds to the residual stream (AtP*'s GradDrop stops gradients
    here; the conformance checks add these up). ``position_option``: the sweep option that gives
    every site its one position (heads: ``head_position``; knockout: ``target``). ``window``: each
    site spans the sweep's window of layers centred on its row. ``title``/``title_at``: the report's
    heading (``title_at`` when the position option is set; ``{position}``, ``{token}``, ``{window}``
    filled in; ``title_mixers``: in a hybrid stack, whose sites of the kind are each layer's token
    mixer, attention or not); ``help``: one line for ``attnflow patch --help``. ``view``: the `View` its hook
    points see the output through, made from the adapter row (None: the output itself).
    ``default``: in the default sweep (`attnflow.causal.sites.SITE_KINDS`).
    """

    name: str
    where: str
    side: Literal["input", "output"]
    column: Literal["position", "head", "expert"]
    write: WriteFunction
    read: ReadFunction | None
    dot: DotFunction | None
    title: str
    help: str
    argument: str | None = None
    stream: bool = False
    adds_to_stream: bool = False
    position_option: str | None = None
    window: bool = False
    title_at: str = ""
    view: Callable[[Adapter], View] | None = None
    default: bool = True
    title_mixers: str = ""

    @property
    def is_activation(self) -> bool:
        """Whether a site holds an activation another run supplies (else it is an intervention)."""
        return self.read is not None

    def pattern(self, adapter: Adapter) -> str | None:
        """The adapter row's regex for this kind's modules (None where the row leaves it out)."""
        value: Any = adapter
        for part in self.where.split("."):
            value = getattr(value, part, None)
        return value

    def shape(self, n_layers: int, n_tokens: int, n_heads: int, n_experts: int = 0) -> tuple[int, int]:
        """The sweep array's shape: ``[layer (+ 1 for a stream), position, head or expert]``
        (``n_experts``: the experts' columns, a shared expert's included)."""
        columns = {"position": n_tokens, "head": n_heads, "expert": n_experts}[self.column]
        return n_layers + int(self.stream), columns

    def columns(self, tensor: Any, n_heads: int) -> int:
        """The columns of a tensor at one of the kind's hook points ``[batch, token, ...]``."""
        return {"position": tensor.shape[1], "head": n_heads, "expert": tensor.shape[2]}[self.column]

    def hook_points(
        self, modules: Sequence[Any], row: Adapter | None = None, layers: Sequence[int] | None = None
    ) -> list[HookPoint]:
        """The hook point of each row of the sweep array, given the kind's modules in layer order
        (a stream: row 0 the first module's input, row l + 1 module l's output) and, for a kind with
        a ``view``, the adapter ``row`` it is made from; ``layers``: the block of each module, where
        they are some blocks only (a hybrid stack's attention layers; None: 0, 1, ...). Where the
        kind reads an argument other than the first, its write also receives the call's first input
        (the hidden states ``[batch, token, d_model]``, to size a tensor the call left out)."""
        from attnflow.rows.hook_points import HookPoint

        if not modules:  # a kind the row has no modules for
            return []
        if self.stream:
            sides: list[tuple[Any, Side]] = [(modules[0], "input"), *((module, "output") for module in modules)]
            return [HookPoint(module, side, name=f"{self.name} row {n}") for n, (module, side) in enumerate(sides)]
        reads_first = self.argument is not None
        view = None if self.view is None or row is None else self.view(row)
        return [
            HookPoint(
                module, self.side, self.argument, with_input=reads_first, name=f"{self.name} layer {layer}", view=view
            )
            for layer, module in zip(range(len(modules)) if layers is None else layers, modules, strict=True)
        ]

    def on_tokens(self, tensor: Any, batch: int, change: Callable[[Any], Any]) -> Any:
        """``change`` applied to a hook point's tensor, which a per-position kind sees ``[batch,
        token, d_model]`` also where a flattened feed-forward block holds it ``[batch * token,
        d_model]`` (`attnflow.rows.adapters.as_tokens`); the result comes back in the tensor's own
        shape."""
        from attnflow.rows.adapters import as_tokens

        shaped = as_tokens(tensor, batch) if self.column == "position" else tensor
        new = change(shaped)
        return new if shaped is tensor or new is None else new.reshape(tensor.shape)

    def heading(self, position: int | None, tokens: Sequence[str], window: int = 1, mixers: bool = False) -> str:
        """The report's heading of this kind's heatmap (``mixers``: the run's row is a hybrid stack's)."""
        if mixers and self.title_mixers:
            return self.title_mixers
        if position is None or not self.title_at:
            return self.title
        return self.title_at.format(position=position, token=tokens[position], window=window)


def _experts_view(row: Adapter) -> View:
    """A MoE block's output seen as each expert's part (`attnflow.rows.experts.ExpertsView`)."""
    from attnflow.rows.experts import ExpertsView

    assert row.experts is not None  # the kind's modules are found from the row's experts
    return ExpertsView(row.experts)


def _per_position(name: str, where: str, title: str, help: str, **options: Any) -> SiteKind:
    """A kind whose sites are one layer's output ``[batch, token, d_model]`` at one position."""
    return SiteKind(
        name, where, "output", "position", write_positions, read_position, dot_positions, title, help, **options
    )


SITE_TABLE: tuple[SiteKind, ...] = (
    _per_position(
        "residual",
        "sites.block",
        "residual stream (row 0: entering the first layer)",
        "the residual stream per (layer, position); row 0 enters the first layer",
        stream=True,
    ),
    _per_position(
        "attn",
        "sites.attention",
        "attention block outputs",
        "what each attention block (in a hybrid stack: each layer's token mixer) adds to the stream, per "
        "(layer, position)",
        adds_to_stream=True,
        title_mixers="token mixer outputs (attention or not, per layer)",
    ),
    _per_position(
        "mlp",
        "sites.mlp",
        "MLP outputs",
        "what each MLP adds to the stream, per (layer, position)",
        adds_to_stream=True,
    ),
    SiteKind(
        "heads",
        "stack.output_projection",
        "input",
        column="head",
        write=write_heads,
        read=read_head,
        dot=dot_heads,
        position_option="head_position",
        title="head outputs (every position)",
        title_at="head outputs at token {position} ({token})",
        help="each head's output per (layer, head), at every position or at --head-position",
    ),
    SiteKind(
        "experts",
        "experts.block",
        "output",
        column="expert",
        write=write_heads,
        read=read_head,
        dot=None,
        position_option="expert_position",
        view=_experts_view,
        default=False,
        title="expert parts (every position)",
        title_at="expert parts at token {position} ({token})",
        help="each expert's part of a mixture of experts per (layer, expert), at every position "
        "(exact only; rows with experts)",
    ),
    SiteKind(
        "knockout",
        "stack.attention",
        "input",
        argument="attention_mask",
        column="position",
        write=write_knockout,
        read=None,
        dot=None,
        position_option="target",
        window=True,
        title="attention knockout",
        title_at="attention knockout: key → token {position} ({token}) blocked in {window} layer(s) around each layer",
        help="attention knockout per (layer, key position): the edge key -> --knockout-target blocked "
        "in --knockout-window layers around the layer (exact only)",
    ),
)
SITE_KIND_ROWS = {row.name: row for row in SITE_TABLE}


def window_layers(layer: int, window: int, n_layers: int) -> tuple[int, ...]:
    """The layers of a window of ``window`` layers centred on ``layer`` (layer − ⌊(window − 1)/2⌋
    to layer + ⌊window/2⌋), clipped to the model's layers."""
    first = max(0, layer - (window - 1) // 2)
    return tuple(range(first, min(n_layers, layer + window // 2 + 1)))
