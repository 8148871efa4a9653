"""Errors a user can fix; the CLI prints them as one line, without a traceback.

A message that names one of the library's parameters writes it as ``{name}`` (``"give {samples} >= 1"``)
and lists it in ``parameters``: ``str(error)`` spells it as the parameter itself (what a Python caller
passed), and each front end respells it once, in one place, as its own spelling of that parameter
(`AttnflowError.spelled`: the command line's flag, ``--samples``; the server's JSON field).
"""

from __future__ import annotations

from typing import Callable, Sequence


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


class ModelLoadError(AttnflowError):
    """A model name, path or file could not be resolved or loaded."""


class CaptureError(AttnflowError):
    """The model did not expose what attnflow needs (attention weights, head outputs)."""


class AdapterCheckError(CaptureError):
    """An adapter row fails a conformance check (`attnflow.capture.check_adapter`); the message
    names the row, the check and the numbers."""


class InputError(AttnflowError, ValueError):
    """Bad input: a text, image or corpus, or a parameter's value (a ValueError too, so code that
    validates with ValueError catches it)."""


class OutputError(AttnflowError):
    """An output folder could not be written (read-only file system, full disk, no permission)."""


class ExplanationWarning(UserWarning):
    """A warning about what an explanation shows (e.g. pruning that left only the diagonal);
    `attnflow.explain` also keeps its message in the Explanation's notes, shown on the page."""


def spell(error: BaseException, spelling: Callable[[str], str]) -> str:
    """One line for ``error``: an `AttnflowError`'s parameters in a front end's ``spelling``, any
    other exception as it is."""
    return error.spelled(spelling) if isinstance(error, AttnflowError) else str(error)
