"""Methods are declared once, with `register`, and found by name (what `attnflow explain --method` looks up).

A `MethodSpec` holds everything a caller needs, so the CLI (flags and ``--help``), the explorer,
``attnflow evaluate`` and the docs derive their behaviour from it and never inspect a signature:

- ``takes``: how the function is called — ``"attentions"``: ``fn(attentions, **options)`` with
  ``[layer, head, query, key]`` weights (or batched with a leading axis); ``"trace"``:
  ``fn(trace, **options)``; ``"model"``: ``fn(model, trace, **options)`` (it re-runs the model);
- ``needs``: what the capture must hold (names from `attnflow.trace.NEEDS`), so a forward-only
  method never pays for a gradient method's backward pass; ``uses_target`` follows from it;
- ``options``: `Option` s (name, help line, CLI parser and flag); each is a keyword parameter of
  the function, whose default is the option's default;
- ``rows`` (computes selected output rows, ``rows=``), ``layerwise`` (``layerwise=True`` returns
  ``[layer, query, key]``), ``per_head`` (``head_fusion="none"`` returns ``[head, query, key]``);
- ``cost``: ``"one_pass"`` (one forward pass), ``"backward"`` (one forward and one backward
  pass), ``"expensive"`` (grows with the tokens or steps: max-flow, perturbations, sampling);
- ``scores_only`` (one score per token ``[key]``, no matrix), ``signed`` (scores > 0 speak for the
  target, < 0 against it), ``requires`` (what a model family must provide, names from
  `attnflow.trace.CAPABILITIES`; a family supports the method when its adapter row provides them all;
  a method that ``takes="attentions"`` reads the weights as the whole token mixing, so it requires
  ``attention_mixing`` without saying: a hybrid stack's row does not provide it);
- ``baseline``: the scores are a reference every method must beat (``random``), not an explanation:
  the summary sentence says so;
- ``low_precision`` (optional): why the method's maps cannot be trusted when the model runs in 16
  bits (``attnflow.load(name, dtype="bfloat16")``, ``--dtype``), measured against float32
  (docs/precision.md); an explanation of such a model by such a method warns and keeps the note;
- ``batch`` (optional, ``takes="model"`` and ``scores_only`` methods): the same method over
  several traces at once, ``batch(model, traces, **options)`` → per trace its ``scores [key]`` or
  a `attnflow.methods.extras.Scored` (scores and extras, as the single form may return), for
  methods whose passes batch (the LRP rules: one padded forward and backward pass for all;
  leave-one-out: every trace's variants in one batched set of forward passes);
  `attnflow.explanation.explain_traces` uses it.

A method returns ``[query, key]`` (row i: how much output position i draws on input j),
``[head, query, key]`` when heads stay apart, or ``[key]`` for ``scores_only`` methods.
Adding a method is one function with one `register` decorator, in any module. The registry
finds attnflow's own methods through `CATALOGUE` (the modules that register them, imported on the
first look-up); another package adds its methods by naming its module under the entry-point group
``attnflow.methods`` (`load_plugins`, run when attnflow is imported).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping, Protocol, Sequence

from attnflow.errors import InputError
from attnflow.model_like import ModelLike
from attnflow.trace import CAPABILITIES, NEEDS, TARGET_NEEDS

Takes = Literal["attentions", "trace", "model"]
Cost = Literal["one_pass", "backward", "expensive"]
COSTS = ("one_pass", "backward", "expensive")


class Family(Protocol):
    """A model family as methods see it (`attnflow.rows.adapters.Adapter` is one)."""

    @property
    def family(self) -> str: ...

    @property
    def provides(self) -> frozenset[str]: ...

    @property
    def note(self) -> str: ...


@dataclass(frozen=True)
class Option:
    """One keyword option of a method, as the CLI and the docs show it.

    Attributes:
        name: the keyword parameter of the method's function.
        help: one line for ``--help`` and the docs.
        parse: turns the command-line text into the value (raises ValueError with a message);
            None makes a switch (``--flag`` sets True).
        metavar: how ``--help`` names the value.
        choices: the allowed values, when they are a fixed list of words.
        flag: the command-line flag; default ``--`` + the name with dashes.
    """

    name: str
    help: str
    parse: Callable[[str], Any] | None = str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    flag: str = ""

    def __post_init__(self) -> None:
        if not self.flag:
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))


@dataclass(frozen=True)
class MethodSpec:
    """A registered method's declaration (see the module docstring for each field)."""

    name: str
    function: Callable[..., Any]
    summary: str
    takes: Takes
    needs: frozenset[str]
    options: tuple[Option, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)  # option name -> the function's default
    requires: frozenset[str] = frozenset()
    scores_only: bool = False
    signed: bool = False
    rows: bool = False
    layerwise: bool = False
    per_head: bool = False
    cost: Cost = "one_pass"
    batch: Callable[..., Sequence[Any]] | None = None
    baseline: bool = False
    low_precision: str = ""  # why its maps are untrustworthy in bfloat16/float16 ("": they agree with float32)

    @property
    def uses_target(self) -> bool:
        return bool(self.needs & TARGET_NEEDS)

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(option.name for option in self.options)

    def supports(self, family: Family) -> bool:
        return self.requires <= family.provides

    def missing(self, family: Family) -> list[str]:
        """What the method requires and ``family`` does not provide, each with what it means."""
        return missing_capabilities(self.requires, family)


def missing_capabilities(requires: Iterable[str], family: Family) -> list[str]:
    """What ``requires`` names and ``family`` does not provide, each with what it means and, where a
    part of the row withholds it (`attnflow.rows.adapters.Adapter.withheld`), why."""
    withheld = getattr(family, "withheld", {})
    return [
        f"{name} ({CAPABILITIES[name]}{'; ' + withheld[name] if name in withheld else ''})"
        for name in sorted(set(requires) - family.provides)
    ]


_METHODS: dict[str, MethodSpec] = {}

# The modules that register attnflow's own methods: the pure functions on arrays and traces, then
# the methods that re-run the model (`attnflow.methods.model`). A module that adds a built-in method
# is one more line here.
CATALOGUE = (
    "attnflow.methods.rollout",
    "attnflow.methods.flow",
    "attnflow.methods.relevance",
    "attnflow.methods.model.lrp",
    "attnflow.methods.model.perturbation",
)
_catalogue_lock = threading.RLock()
_catalogue_loaded = False


def _registered() -> dict[str, MethodSpec]:
    """Every registered method by name, once the `CATALOGUE` modules are imported (on the first call;
    the model methods import torch only inside their functions, so this stays cheap). A test that
    swaps ``_METHODS`` for a copy copies this, so the catalogue's methods are in the copy and stay
    in the original."""
    global _catalogue_loaded
    if not _catalogue_loaded:
        with _catalogue_lock:
            if not _catalogue_loaded:
                for module in CATALOGUE:
                    importlib.import_module(module)
                _catalogue_loaded = True
    return _METHODS


AUTO = "auto"  # not a method: asks for the most comprehensive one-pass target method on each input (evaluate.per_input)


def register(
    name: str,
    summary: str,
    *,
    takes: Takes,
    needs: tuple[str, ...] = ("attentions",),
    options: tuple[Option, ...] = (),
    requires: tuple[str, ...] = (),
    scores_only: bool = False,
    signed: bool = False,
    rows: bool = False,
    layerwise: bool = False,
    per_head: bool = False,
    cost: Cost = "one_pass",
    batch: Callable[..., Sequence[Any]] | None = None,
    baseline: bool = False,
    low_precision: str = "",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: declare ``function`` as the method ``name`` (fields: `MethodSpec`).

    The declaration is checked against the function once, here: every option, ``rows`` and
    ``layerwise`` must be a keyword parameter with a default, ``per_head`` needs a ``head_fusion``
    option, and ``takes="model"`` needs ``"model"`` in ``needs``.
    """
    unknown = set(needs) - set(NEEDS)
    if unknown:
        raise InputError(f"method {name!r} needs unknown names {sorted(unknown)}; known: {', '.join(NEEDS)}")
    unknown = set(requires) - set(CAPABILITIES)
    if unknown:
        raise InputError(f"method {name!r} requires unknown {sorted(unknown)}; known: {', '.join(CAPABILITIES)}")
    if takes not in ("attentions", "trace", "model"):
        raise InputError(f"method {name!r}: takes must be 'attentions', 'trace' or 'model', got {takes!r}")
    if (takes == "model") != ("model" in needs):
        raise InputError(f"method {name!r}: takes='model' and needs 'model' go together")
    if cost not in COSTS:
        raise InputError(f"method {name!r}: cost must be one of {COSTS}, got {cost!r}")
    if per_head and "head_fusion" not in {option.name for option in options}:
        raise InputError(f"method {name!r}: per_head needs a head_fusion option")
    if batch is not None and not (takes == "model" and scores_only):
        raise InputError(f"method {name!r}: a batch form is for takes='model' methods with scores_only")

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        if name in _METHODS:
            raise InputError(f"method {name!r} is registered twice")
        parameters = inspect.signature(function).parameters
        keywords = [option.name for option in options] + [
            flag for flag, on in (("rows", rows), ("layerwise", layerwise)) if on
        ]
        missing = [k for k in keywords if k not in parameters or parameters[k].default is inspect.Parameter.empty]
        if missing:
            raise InputError(f"method {name!r} declares {', '.join(missing)} but its function has no such keyword")
        if batch is not None:
            batch_parameters = inspect.signature(batch).parameters
            missing = [k for k in keywords if k not in batch_parameters]
            if missing:
                raise InputError(f"method {name!r}: its batch form lacks the keyword(s) {', '.join(missing)}")
        defaults = {option.name: parameters[option.name].default for option in options}
        _METHODS[name] = MethodSpec(
            name=name,
            function=function,
            summary=summary,
            takes=takes,
            needs=frozenset(needs),
            options=tuple(options),
            defaults=defaults,
            requires=frozenset(requires) | ({"attention_mixing"} if takes == "attentions" else set()),
            scores_only=scores_only,
            signed=signed,
            rows=rows,
            layerwise=layerwise,
            per_head=per_head,
            cost=cost,
            batch=batch,
            baseline=baseline,
            low_precision=low_precision,
        )
        return function

    return decorate


def unregister(name: str) -> None:
    """Remove a registered method (for tests and plug-ins that register temporary methods)."""
    _METHODS.pop(name, None)


ENTRY_POINT_GROUP = "attnflow.methods"
log = logging.getLogger(__name__)


def load_plugins() -> list[str]:
    """Import the modules other installed packages name under the entry-point group
    ``attnflow.methods`` (in their pyproject.toml: ``[project.entry-points."attnflow.methods"]``,
    ``toy = "my_package.methods"``); each registers its methods with `register` when imported.

    Returns the entry points' names, in order. A plug-in that fails to import is skipped with one
    warning naming it and the error (attnflow itself keeps working).
    """
    loaded = []
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as error:  # a broken plug-in must not break attnflow
            log.warning("attnflow: skipped the method plug-in %r (%s): %s", entry.name, entry.value, error)
        else:
            loaded.append(entry.name)
    return loaded


def get_method(name: str) -> MethodSpec:
    """The declaration of a registered method; a ValueError naming the available ones otherwise."""
    try:
        return _registered()[name]
    except KeyError:
        raise InputError(f"unknown method {name!r}; available: {', '.join(available_methods())}") from None


def available_methods() -> list[str]:
    """The registered methods' names, sorted."""
    return sorted(_registered())


def method_names(methods: str | Sequence[str], also: Sequence[str] = ()) -> list[str]:
    """``"a,b"`` (or a list of names) -> the registered names, in order, without repeats; a name
    neither registered nor in ``also`` (e.g. ``"auto"``) is a ValueError naming the available ones,
    ``also`` included."""
    names = [name.strip() for name in (methods.split(",") if isinstance(methods, str) else methods) if name.strip()]
    unknown = [name for name in names if name not in _registered() and name not in also]
    if not names or unknown:
        named = ", ".join(map(repr, unknown)) or repr(methods)
        also_taken = f"; or {', '.join(also)}" if also else ""
        raise InputError(f"unknown method {named}; available: {', '.join(available_methods())}{also_taken}")
    return list(dict.fromkeys(names))


def methods_for(family: Family) -> list[str]:
    """The registered methods that a model family (its adapter row) supports."""
    return [name for name in available_methods() if _registered()[name].supports(family)]


def unsupported_reason(spec: MethodSpec, family: Family) -> str | None:
    """Why ``family`` cannot run ``spec`` (what the method requires and the family's adapter row does
    not provide), or None when it supports it: the reason `check_family` refuses with."""
    if spec.supports(family):
        return None
    mixers = getattr(family, "mixers", None)  # a hybrid stack (`attnflow.rows.adapters.Mixers`)
    if "attention_mixing" in spec.requires - family.provides and mixers is not None:
        return f"method {spec.name!r} does not support the {family.family} family: {mixers.reason(spec.name)}"
    return (
        f"method {spec.name!r} does not support the {family.family} family: it requires "
        f"{'; '.join(spec.missing(family))}{family.note}"
    )


def check_family(spec: MethodSpec, family: Family) -> None:
    """One clear line when ``spec`` requires what ``family`` does not provide, naming the methods it supports."""
    reason = unsupported_reason(spec, family)
    if reason is not None:
        raise InputError(f"{reason}; methods for {family.family}: {', '.join(methods_for(family))}")


def method_options(spec: MethodSpec, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options to pass to ``spec.function``: None values dropped (the default applies), anything
    the method does not declare rejected with an InputError that names the options it takes."""
    chosen = {name: value for name, value in options.items() if value is not None}
    unknown = [name for name in chosen if name not in spec.option_names]
    if unknown:
        takes = ", ".join(_placeholder(name) for name in spec.option_names) or "no options"
        raise InputError(
            f"method {spec.name!r} does not take {', '.join(map(_placeholder, unknown))}; it takes: {takes}",
            parameter=(*unknown, *spec.option_names),
        )
    return chosen


def options_per_method(methods: Sequence[str], given: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each method's share of the options the user set. With one method every option must be its
    own; with several, each option must be taken by at least one of them."""
    specs = [get_method(name) for name in methods]
    if len(specs) == 1:
        return {specs[0].name: method_options(specs[0], given)}
    taken = {name for spec in specs for name in spec.option_names}
    unused = [name for name in given if name not in taken]
    if unused:
        raise InputError(
            f"none of the methods {', '.join(methods)} takes {', '.join(map(_placeholder, unused))}", parameter=unused
        )
    return {
        spec.name: method_options(spec, {name: value for name, value in given.items() if name in spec.option_names})
        for spec in specs
    }


def _placeholder(name: str) -> str:
    """An option in an error message: ``{name}``, which each front end spells (`attnflow.errors`)."""
    return "{" + name + "}"


def option_flags() -> dict[str, str]:
    """Every declared method option's command-line flag, by option name (``n_steps`` -> ``--steps``)."""
    return {option.name: option.flag for spec in _registered().values() for option in spec.options}


def call_method(spec: MethodSpec, trace: Any, model: ModelLike | None = None, **options: Any) -> Any:
    """Call a registered method on a `Trace` the way it declares (``takes``); ``options`` go to the
    function as given (validate them first with `method_options`)."""
    if spec.takes == "model":
        if model is None:
            raise InputError(f"method {spec.name!r} re-runs the model: use model.explain(text, method={spec.name!r})")
        return spec.function(model, trace, **options)
    return spec.function(trace if spec.takes == "trace" else row_stochastic_attentions(trace), **options)


def row_stochastic_attentions(trace: Any) -> Any:
    """What a method that takes ``attentions`` reads: the trace's weights ``[layer, head, query,
    key]``; a trace of a stack with attention sinks (``meta["sinks"]``: rows over the real keys sum
    to less than 1) gets each row's sink share on its diagonal (`transforms.sink_on_diagonal`), said
    in an `ExplanationWarning`."""
    if not (getattr(trace, "meta", None) or {}).get("sinks"):  # any object with attentions is a trace here
        return trace.attentions
    import warnings

    from attnflow.errors import ExplanationWarning
    from attnflow.methods.transforms import sink_on_diagonal

    moved, largest = sink_on_diagonal(trace.attentions)
    warnings.warn(
        "the model's attention has sinks (a learned softmax logit per head with no value): each row's "
        f"sink share (up to {largest:.2f}) moves no information between tokens and is counted on the "
        'diagonal, with the query\'s own stream (docs/methods.md, "Attention sinks")',
        ExplanationWarning,
        stacklevel=2,
    )
    return moved.astype(trace.attentions.dtype, copy=False)


def markdown_table() -> str:
    """The registered methods as a Markdown table (docs/methods.md's "Methods at a glance" is this)."""
    lines = [
        "| method | takes | explains a target | result | signed | cost | options | requires |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in available_methods():
        spec = _registered()[name]
        result = "scores `[key]`" if spec.scores_only else "`[query, key]`"
        views = [view for view, on in (("per layer", spec.layerwise), ("per head", spec.per_head)) if on]
        flags = ", ".join(f"`{option.flag}`" for option in spec.options) or "—"
        lines.append(
            f"| `{name}` | {spec.takes} | {'yes' if spec.uses_target else 'no'} | "
            f"{result}{' (' + ', '.join(views) + ')' if views else ''} | {'yes' if spec.signed else 'no'} | "
            f"{spec.cost.replace('_', ' ')} | {flags} | {', '.join(sorted(spec.requires)) or '—'} |"
        )
    return "\n".join(lines)
