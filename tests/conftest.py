"""Shared fixtures: tiny random-weight models of every family (see tiny_models.py) and the real
embedded models, each loaded once per session (mpnet's 438 MB of weights, smollm2's GGUF and the
DINOv2 conversion are the suite's most expensive set-ups)."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest

from tiny_models import build_tiny_classifier, build_tiny_model, moe_row

# No hub here: make transformers fail at once instead of retrying the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def read_only_folder(monkeypatch, tmp_path) -> Path:
    """A folder ``tmp_path/ro`` in which nothing can be created (EROFS), as on a read-only mount
    (simulated: root may write anywhere)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    mkdir = Path.mkdir

    def refuse(self, *args, **kwargs):
        if folder in Path(os.path.abspath(self)).parents:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)
    return folder


def _built_once(tmp_path_factory, folder: str, build):
    """``get(family) -> Path``: ``build(family, path)`` on first request, the same path after."""
    root = tmp_path_factory.mktemp(folder)
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build(family, root / family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_architecture_path(tmp_path_factory):
    """``tiny_architecture_path(model_type) -> Path`` of any transformers architecture built tiny
    from its own config (`attnflow.rows.tiny.build_tiny`: a hybrid stack, say), once per session."""
    from attnflow.rows.tiny import build_tiny

    return _built_once(tmp_path_factory, "tiny-architectures", build_tiny)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """``tiny_model_path(family) -> Path`` of a saved tiny random model (built once per session)."""
    return _built_once(tmp_path_factory, "tiny-models", build_tiny_model)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_path):
    """``tiny_loaded(family) -> AttentionModel`` of a tiny model on the CPU, loaded once per session
    (shared: a test must not change its weights)."""
    import attnflow

    loaded: dict[str, attnflow.AttentionModel] = {}

    def get(family: str) -> attnflow.AttentionModel:
        if family not in loaded:
            loaded[family] = attnflow.load(str(tiny_model_path(family)), device="cpu")
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def variant_loaded(tiny_model_path):
    """``variant_loaded(family) -> AttentionModel`` of a tiny architectural variant with no built-in
    row (`tiny_models.VARIANT_FAMILIES`) on the CPU, loaded once per session with its test row
    (tests/variant_rows.py) registered for the load only."""
    import attnflow
    from variant_rows import registered

    loaded: dict[str, attnflow.AttentionModel] = {}

    def get(family: str) -> attnflow.AttentionModel:
        if family not in loaded:
            with registered(family):
                loaded[family] = attnflow.load(str(tiny_model_path(family)), device="cpu")
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def tiny_moe(tiny_model_path):
    """``tiny_moe(family) -> AttentionModel`` of a tiny mixture of experts (`tiny_models.MOE_FAMILIES`)
    on the CPU, loaded once per session with its hand row (`tiny_models.moe_row`), registered for the
    load only."""
    import attnflow
    from attnflow.rows import register_adapter, unregister_adapter

    loaded: dict[str, attnflow.AttentionModel] = {}

    def get(family: str) -> attnflow.AttentionModel:
        if family not in loaded:
            row = moe_row(family)
            register_adapter(row)
            try:
                loaded[family] = attnflow.load(str(tiny_model_path(family)), device="cpu")
            finally:
                unregister_adapter(row.family)
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def tiny_classifier_path(tmp_path_factory):
    """``tiny_classifier_path(family) -> Path`` of a saved tiny random sequence classifier."""
    return _built_once(tmp_path_factory, "tiny-classifiers", build_tiny_classifier)


@pytest.fixture(scope="session")
def minilm_sentiment():
    """The real embedded classifier (minilm + mean pooling + trained head) on the CPU."""
    import attnflow

    return attnflow.load("minilm-sentiment", device="cpu")


@pytest.fixture(scope="session")
def minilm():
    """The real embedded all-MiniLM-L6-v2 on the CPU."""
    import attnflow

    return attnflow.load("minilm", device="cpu")


@pytest.fixture(scope="session")
def mpnet():
    """The real embedded all-mpnet-base-v2 on the CPU."""
    import attnflow

    return attnflow.load("mpnet", device="cpu")


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded SmolLM2-135M-Instruct (Llama decoder) on the CPU."""
    import attnflow

    return attnflow.load("smollm2", device="cpu")


@pytest.fixture(scope="session")
def dinov2():
    """The real embedded DINOv2 ViT-S/14 (converted from its ONNX graph) on the CPU."""
    import attnflow

    return attnflow.load("dinov2-s", device="cpu")


@pytest.fixture(scope="session")
def _ray_session():
    """Ray, shut down at the end of the session if a test left a runtime up."""
    ray = pytest.importorskip("ray")
    yield ray
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_runtime(_ray_session):
    """A private local Ray runtime shared by the session's Ray tests: started on first use (again
    after a test that shut it down, like the cluster tests), 4 logical CPUs (4 actors at once), no
    dashboard. The run engine uses a runtime it finds running and leaves it up, so each run starts
    only its actors. Its workers import attnflow from where this process does."""
    ray = _ray_session
    if not ray.is_initialized():
        from attnflow.runs.actors import LOCAL_OBJECT_STORE_BYTES

        source = os.pathsep.join(sys.path)
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            runtime_env={"env_vars": {"PYTHONPATH": source, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}},
        )
    return ray
