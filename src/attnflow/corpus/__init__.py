"""The corpus study: windowing, mergeable statistics, its step and job on the run engine (what it
shares with every dataset command — the engine, readers, checkpoints, Ray actors — lives in
`attnflow.runs`).

from attnflow.corpus import StudyOptions, run_study
summary = run_study(StudyOptions(model="minilm", data="wiki", samples=200), "out/study")
"""

from attnflow.lazy import lazy_attributes

_EXPORTS = {
    "open_corpus": "attnflow.runs.readers",
    "WindowStream": "attnflow.corpus.windows",
    "StudyOptions": "attnflow.corpus.study",
    "ReadOptions": "attnflow.runs.readers",
    "run_study": "attnflow.corpus.engine",
    "rebuild_report": "attnflow.corpus.engine",
    "StudyConfig": "attnflow.corpus.stats",
    "StudyStats": "attnflow.corpus.stats",
}


# Lazy: importing one module of the package (`attnflow.corpus.windows`) must not pull in torch.
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())


__all__ = sorted(_EXPORTS)
