"""The corpus study: readers, windowing, mergeable statistics, the local and Ray engines.

from attnflow.corpus import StudyOptions, run_study
summary = run_study(StudyOptions(model="minilm", data="wiki", samples=200), "out/study")
"""

_EXPORTS = {
    "open_corpus": "attnflow.corpus.readers",
    "WindowStream": "attnflow.corpus.windows",
    "StudyOptions": "attnflow.corpus.study",
    "ReadOptions": "attnflow.corpus.readers",
    "run_study": "attnflow.corpus.engine",
    "rebuild_report": "attnflow.corpus.engine",
    "StudyConfig": "attnflow.corpus.stats",
    "StudyStats": "attnflow.corpus.stats",
}


def __getattr__(name: str):
    # Lazy: `import attnflow.corpus.readers` must not pull in torch.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'attnflow.corpus' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
