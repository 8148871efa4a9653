"""Errors a user can fix; the CLI prints them as one line, without a traceback."""


class AttnflowError(Exception):
    """Base class of attnflow's user-facing errors."""


class ModelLoadError(AttnflowError):
    """A model name, path or file could not be resolved or loaded."""


class CaptureError(AttnflowError):
    """The model did not expose what attnflow needs (attention weights, head outputs)."""


class AdapterCheckError(CaptureError):
    """An adapter row fails a conformance check (`attnflow.capture.check_adapter`); the message
    names the row, the check and the numbers."""


class InputError(AttnflowError):
    """Bad input text, image or corpus."""


class OutputError(AttnflowError):
    """An output folder could not be written (read-only file system, full disk, no permission)."""


class ExplanationWarning(UserWarning):
    """A warning about what an explanation shows (e.g. pruning that left only the diagonal);
    `attnflow.explain` also keeps its message in the Explanation's notes, shown on the page."""
