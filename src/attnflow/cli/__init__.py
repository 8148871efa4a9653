"""The `attnflow` command. Each subcommand lives in its own module with `register(subparsers)`.

Errors the user can fix (bad text, unknown model, missing file, bad corpus) are raised as
`attnflow.errors.AttnflowError` subclasses, ValueError or FileNotFoundError and printed as one
line, ``attnflow: error: ...``, with exit status 2, never as a traceback; the library parameters an
error names are printed as the subcommand's flags (`attnflow.cli.common.spelling`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

from attnflow.cli import audit, compare, corpus, evaluate, explain, explore, models, patch, routes, serve, why
from attnflow.cli.common import spelling
from attnflow.errors import AttnflowError, once_per_run, spell

SUBCOMMANDS = (why, explain, explore, compare, models, corpus, evaluate, audit, patch, routes, serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnflow",
        description="Show how information flows through a transformer's attention.",
        epilog="Run `attnflow COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="attnflow: %(levelname)s: %(message)s")
    try:
        with warnings.catch_warnings(), _holding(args):
            warnings.showwarning = _show_warning
            with once_per_run():  # a collapse warning is said once per command, not per text or step
                return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("attnflow: interrupted", file=sys.stderr)
        if argv is None:  # the program is ending: another Ctrl-C while it shuts down is ignored, not a traceback
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return 130
    except (AttnflowError, ValueError, OSError) as error:  # OSError: unreadable input, no such file, ...
        print(f"attnflow: error: {spell(error, spelling(args))}", file=sys.stderr)  # its parameters as flags
        return 2


def _holding(args: argparse.Namespace) -> Any:
    """The lock on the command's output folder (`attnflow.staging.folder_lock`), taken before the
    command checks or loads anything: a second run into a folder in use stops at once. Commands
    that write a folder name it with ``set_defaults(output_folder=FUNCTION(args) -> Path | None)``."""
    from attnflow.staging import folder_lock

    folder: Path | None = args.output_folder(args) if getattr(args, "output_folder", None) else None
    return folder_lock(folder) if folder is not None else nullcontext()


def _show_warning(  # the signature of warnings.showwarning, which this replaces
    message: Warning | str,
    category: type[Warning],  # noqa: ARG001
    filename: str,  # noqa: ARG001
    lineno: int,  # noqa: ARG001
    file: Any = None,
    line: str | None = None,  # noqa: ARG001
) -> None:
    """Python warnings as one line, like attnflow's logged warnings (no file, line or source)."""
    print(f"attnflow: WARNING: {message}", file=sys.stderr if file is None else file)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"attnflow {version('attnflow')}"
    except PackageNotFoundError:
        return "attnflow (not installed)"


if __name__ == "__main__":
    sys.exit(main())
