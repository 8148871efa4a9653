"""Errors a user can fix; the CLI prints them as one line, without a traceback. Warnings about
what an explanation shows, and saying one of them once per run (`warn_once`, `once_per_run`).

A message that names one of the library's parameters writes it as ``{name}`` (``"give {samples} >= 1"``)
and lists it in ``parameters``: ``str(error)`` spells it as the parameter itself (what a Python caller
passed), and each front end respells it once, in one place, as its own spelling of that parameter
(`AttnflowError.spelled`: the command line's flag, ``--samples``; the server's JSON field).
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Sequence


class AttnflowError(Exception):
    """Base class of attnflow's user-facing errors.

    ``parameters``: the library parameters the message is about, each written ``{name}`` in the
    message (the first is ``parameter``, the one to fix)."""

    def __init__(self, message: str = "", *, parameter: str | Sequence[str] | None = None) -> None:
        names = (parameter,) if isinstance(parameter, str) else tuple(parameter or ())
        self.template = message
        self.parameters: tuple[str, ...] = names
        super().__init__(self.spelled(str))

    @property
    def parameter(self) -> str | None:
        """The parameter to fix (the first the message names), or None."""
        return self.parameters[0] if self.parameters else None

    def spelled(self, spelling: Callable[[str], str]) -> str:
        """The message with each ``{parameter}`` written as ``spelling(parameter)`` (``str``: the
        parameter's own name)."""
        message = self.template
        for name in self.parameters:
            message = message.replace("{" + name + "}", spelling(name))
        return message

    def renamed(self, names: dict[str, str]) -> "AttnflowError":
        """The same error (its class, its message) naming the parameters in ``names`` as their new
        names: a function that reads its input through another one's (whose parameters are
        named otherwise) says what its own caller passed."""
        template = self.template
        for old, new in names.items():
            template = template.replace("{" + old + "}", "{" + new + "}")
        return type(self)(template, parameter=[names.get(name, name) for name in self.parameters])


class ModelLoadError(AttnflowError):
    """A model name, path or file could not be resolved or loaded."""


class CaptureError(AttnflowError):
    """The model did not expose what attnflow needs (attention weights, head outputs)."""


class AdapterCheckError(CaptureError):
    """An adapter row fails a conformance check (`attnflow.rows.check_adapter`); the message
    names the row, the check and the numbers."""


class InferenceError(CaptureError):
    """No adapter row could be inferred for a model (`attnflow.rows.infer`): the message names the
    part inference could not find and where to learn to write it by hand."""


class InputError(AttnflowError, ValueError):
    """Bad input: a text, image or corpus, or a parameter's value (a ValueError too, so code that
    validates with ValueError catches it)."""


class OutputError(AttnflowError):
    """An output folder could not be written (read-only file system, full disk, no permission)."""


class OccupiedError(AttnflowError, FileExistsError):
    """An output folder holds an earlier run's output, and ``overwrite`` was not given (a
    FileExistsError too)."""


class ExplanationWarning(UserWarning):
    """A warning about what an explanation shows (e.g. pruning that left only the diagonal);
    `attnflow.explain` also keeps its message in the Explanation's notes, shown on the page."""


class PatchingWarning(UserWarning):
    """A patching run whose metric does not read as what the clean text predicts: the clean text
    prefers the contrast, or the corruption does not lower the metric (`attnflow.patch` runs on, and
    says so in one line)."""


def spell(error: BaseException, spelling: Callable[[str], str]) -> str:
    """One line for ``error``: an `AttnflowError`'s parameters in a front end's ``spelling``, any
    other exception as it is."""
    return error.spelled(spelling) if isinstance(error, AttnflowError) else str(error)


class PrecisionWarning(ExplanationWarning):
    """A method whose maps are untrustworthy in 16 bits (its declaration's ``low_precision``) ran
    on a model loaded in bfloat16 or float16 (said by one rule, `attnflow.explanation`, naming the
    method and why)."""


class CollapseWarning(ExplanationWarning):
    """A saliency row collapsed on one token (the attention sink on the first one): said for every
    method by one rule (`attnflow.methods.diagnostics.collapse_note`), naming the method."""


# Warnings said once per run: within `once_per_run`, the kinds of warning already said (a message
# with its numbers and quoted tokens left out) -> [what it concerns, how many more times it came].
_SAID: ContextVar[dict[str, list[Any]] | None] = ContextVar("attnflow_said_once", default=None)
_VARYING = re.compile(r"\d+(?:\.\d+)?|'[^']*'")


def warn_once(message: str, category: type[Warning] = CollapseWarning, about: str = "", stacklevel: int = 2) -> None:
    """``warnings.warn(message)``, except within `once_per_run` where a message of a kind already
    said (the same words, other numbers or tokens) is only counted. ``about``: what it concerns
    (a method's name), for the count said at the end of the run."""
    said = _SAID.get()
    if said is not None:
        kind = _VARYING.sub("#", message)
        if kind in said:
            said[kind][1] += 1
            return
        said[kind] = [about, 0]
    warnings.warn(message, category, stacklevel=stacklevel + 1)


@contextmanager
def once_per_run() -> Iterator[None]:
    """One run (a command: a file of texts, a generation's steps, several methods): each kind of
    warning given to `warn_once` is said once; at the end, a line per kind that came again says how
    many more times (each Explanation still keeps its own note)."""
    said: dict[str, list[Any]] = {}
    token = _SAID.set(said)
    try:
        yield
    finally:
        _SAID.reset(token)
        for about, more in said.values():
            if more:
                who = f"{about}: " if about else ""
                warnings.warn(
                    f"{who}the warning above came {more} more time{'s' if more > 1 else ''} in this run "
                    "(each explanation keeps its note)",
                    CollapseWarning,
                    stacklevel=3,
                )
