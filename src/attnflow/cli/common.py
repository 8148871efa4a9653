"""What several subcommands share: the default model, loading with progress lines, argument types,
the method flags, which are derived from the methods' declarations (`MethodSpec.options`), and the
options of the run engine every dataset command takes (`add_run_arguments`, `engine_options`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from attnflow.methods import options as method_option_parsers
from attnflow.methods.registry import Option, available_methods, get_method, method_names
from attnflow.methods.registry import options_per_method as options_per_method  # the subcommands' import

DEFAULT_MODEL = "minilm-sentiment"
# The library's parameters that the command line spells otherwise than ``--`` + the parameter with
# dashes (``samples`` -> ``--samples``) or a method option's own flag: the one place errors' parameters
# become flags (`flag`; a subcommand whose flag differs sets ``parameter_flags``, `spelling`).
FLAGS = {
    "max_new_tokens": "--generate",
    "k": "--top-k",
    "method": "--method",
    "methods": "--methods",
    "model_a": "--model",
    "model_b": "--model",
    "models": "--model",  # `attnflow serve`'s offered models (a ModelPool's models)
    "target": "--target",
    "path": "--file",
    "token": "a token (--token-file PATH or ATTNFLOW_TOKEN)",  # `attnflow serve`'s; --token shows it in `ps`
}
# A command whose --batch-size is the library's batch_size (not a method option's --perturbation-batch).
BATCH_SIZE = {"batch_size": "--batch-size"}
_DEST = "method_option_"  # argparse destination prefix of the method options (they never clash with other flags)


def argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type=`` from a parser that raises ValueError (argparse then shows its message)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


positive_int = argument_type(method_option_parsers.positive_int)


def flag(parameter: str) -> str:
    """How the command line spells a library parameter an error names (`attnflow.errors`): `FLAGS`,
    a method option's declared flag, else ``--`` + the parameter with dashes."""
    from attnflow.methods.registry import option_flags

    return FLAGS.get(parameter) or option_flags().get(parameter) or "--" + parameter.replace("_", "-")


def spelling(args: argparse.Namespace) -> Callable[[str], str]:
    """How this subcommand spells the parameters an error names: its own ``parameter_flags``
    (``parser.set_defaults(parameter_flags={...})``, where its flags differ from the others'), else `flag`."""
    own: dict[str, str] = getattr(args, "parameter_flags", None) or {}
    return lambda parameter: own.get(parameter) or flag(parameter)


def parse_methods(text: str, also: tuple[str, ...] = ()) -> list[str]:
    """``"a,b"`` -> registered method names (and names in ``also``), in order, without repeats (argparse type)."""
    return argument_type(lambda names: method_names(names, also))(text)


def parse_row(text: str) -> str | int:
    from attnflow.methods.saliency import parse_row as parse

    try:
        return parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def method_table() -> str:
    """One line per registered method: its name and summary (for --help texts)."""
    return "\n".join(f"  {name:<21} {get_method(name).summary}" for name in available_methods())


def declared_options() -> dict[str, tuple[Option, list[str]]]:
    """Every option name the registered methods declare -> (its `Option`, the methods that take it).

    Two methods that declare the same name must agree on its flag (they share one argument)."""
    found: dict[str, tuple[Option, list[str]]] = {}
    for name in available_methods():
        for option in get_method(name).options:
            first, takers = found.setdefault(option.name, (option, []))
            if option.flag != first.flag:
                raise ValueError(
                    f"option {option.name!r} has the flag {option.flag} in {name!r} but {first.flag} in {takers[0]!r}"
                )
            takers.append(name)
    return found


def add_method_options(group: argparse._ArgumentGroup) -> None:
    """One flag per declared method option; its help names the methods that take it."""
    for option, takers in declared_options().values():
        where = f" [{', '.join(takers)}]"
        if option.parse is None:
            group.add_argument(
                option.flag, dest=_DEST + option.name, action="store_const", const=True, help=option.help + where
            )
        else:
            group.add_argument(
                option.flag,
                dest=_DEST + option.name,
                type=argument_type(option.parse),
                choices=option.choices,
                metavar=option.metavar,
                help=option.help + where,
            )


def given_method_options(args: argparse.Namespace) -> dict[str, Any]:
    """The method options the user set on the command line (the methods' defaults apply to the rest)."""
    return {
        key[len(_DEST) :]: value for key, value in vars(args).items() if key.startswith(_DEST) and value is not None
    }


DEVICES = ("auto", "cpu", "cuda")


def add_loading_arguments(
    group: argparse._ActionsContainer,
    *,
    devices: tuple[str, ...] | None = DEVICES,
    device_help: str = "auto: a GPU when present (default: auto)",
) -> None:
    """--device and --dtype: where and in what precision the model runs (every command that loads
    one takes both, from here). ``devices=None``: any torch device name (mps, cuda:1, ...)."""
    group.add_argument("--device", choices=devices, default="auto", help=device_help)
    add_dtype_argument(group)


def add_dtype_argument(group: argparse._ActionsContainer) -> None:
    """--dtype: the precision the models load and run in (`attnflow.load`'s ``dtype``)."""
    from attnflow.capture.loading import DEFAULT_DTYPE, DTYPES

    group.add_argument(
        "--dtype",
        choices=DTYPES,
        default=DEFAULT_DTYPE,
        help="the precision of the weights and passes (default: float32); bfloat16/float16 halve the memory, and "
        "methods whose maps are untrustworthy in 16 bits warn (docs/precision.md)",
    )


def add_text_options(parser: argparse.ArgumentParser, row_help: str, out: str) -> None:
    """--row, --max-length, --device, --dtype, --out and --quiet (shared by explore and compare)."""
    parser.add_argument("--row", type=parse_row, metavar="cls|mean|last|N", help=row_help)
    parser.add_argument(
        "--max-length", "--max-tokens", type=positive_int, metavar="N", help="truncate the text to N tokens"
    )
    add_loading_arguments(parser)
    parser.add_argument("--out", default=out, metavar="DIR", help=f"output folder (default: {out})")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress or report lines")
    parser.add_argument(
        "--target",
        metavar="CLASS|TOKEN",
        help="what target-dependent methods explain: classifiers: a class index or label; "
        "causal LMs: the next token (default: the prediction)",
    )
    parser.add_argument("--target-text", metavar="TEXT", help="sentence encoders: explain the similarity to this text")


def target_of(args: argparse.Namespace) -> Any:
    """The `attnflow.targets.Target` the target flags ask for (``--target`` or ``--target-token``,
    ``--target-text``, ``--contrast``, where the subcommand has them): the one place they join."""
    from attnflow.targets import as_target

    label = getattr(args, "target", None)
    label = getattr(args, "target_token", None) if label is None else label
    return as_target(label, text=getattr(args, "target_text", None), contrast=getattr(args, "contrast", None))


def load_model(name: str, device: str, quiet: bool, dtype: str = "float32") -> Any:
    """`attnflow.load` with transformers' own logging silenced under ``--quiet``."""
    quiet_loading(quiet)
    from attnflow.model import load

    return load(name, device=device, progress=not quiet, dtype=dtype)


def quiet_loading(quiet: bool) -> None:
    """Under ``--quiet``, silence transformers' own logging and progress bars (for every load after)."""
    if quiet:
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        except ImportError:  # pragma: no cover - transformers is a dependency
            pass


class Progress:
    """Progress lines on stderr (stdout stays clean for --json)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"attnflow: {message}", file=sys.stderr, flush=True)


RUNS_NOTE = """\
runs (docs/runs.md): checkpointed as they go; Ctrl-C or SIGTERM stops after the batch in progress
and keeps the checkpoint; the same command with --resume continues it (a changed option is refused,
named); --engine ray runs the batches on model replicas as Ray actors and gives the local numbers.
"""


def add_run_arguments(
    group: argparse._ActionsContainer, *, checkpoint_every: int | None = None, overwrite: bool = True, scope: str = ""
) -> None:
    """The run engine's options, worded the same for every dataset command (docs/runs.md):
    --resume and --overwrite (one of them; without ``overwrite``: --resume only, the command has
    its own --overwrite), --checkpoint-every (``checkpoint_every``: its default, None: the
    engine's), --engine, --workers, --ray-address. ``scope``: prefixed to each help (``"--file: "``)."""
    again = group.add_mutually_exclusive_group() if overwrite else group
    again.add_argument(
        "--resume",
        action="store_true",
        help=f"{scope}continue the run checkpointed in --out (same options: a changed one is refused, named)",
    )
    if overwrite:
        again.add_argument(
            "--overwrite", action="store_true", help=f"{scope}delete the earlier run's files in --out and start again"
        )
    default = f"{checkpoint_every}" if checkpoint_every else "1 locally, 2 per actor on Ray"
    group.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=checkpoint_every,
        metavar="K",
        help=f"{scope}batches between checkpoints (default: {default})",
    )
    group.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help=f"{scope}local: this process (default); ray: model replicas as Ray actors, results merged here",
    )
    group.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help=f"{scope}local: torch threads; ray: model replicas (default: torch's choice / 2 on a private Ray "
        "runtime, one per CPU of a cluster)",
    )
    group.add_argument(
        "--ray-address",
        metavar="ADDR",
        help=f"{scope}a running Ray cluster to join (e.g. auto; token authentication: set RAY_AUTH_MODE=token and "
        "RAY_AUTH_TOKEN); default: a private local Ray runtime",
    )


def engine_options(args: argparse.Namespace) -> Any:
    """The `attnflow.runs.engine.EngineOptions` of a command's parsed `add_run_arguments`."""
    from attnflow.runs.engine import EngineOptions

    return EngineOptions(
        engine=args.engine,
        workers=args.workers,
        ray_address=args.ray_address,
        device=args.device,
        checkpoint_every=args.checkpoint_every,
        quiet=args.quiet,
    )
