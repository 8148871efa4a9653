"""`attnflow serve`: models loaded once, explained in the browser and over a JSON API.

    from attnflow.serve import ModelPool, ServeConfig, create_app
    app = create_app(ModelPool(["minilm-sentiment"]), ServeConfig())   # run it with uvicorn

`ModelPool` keeps the loaded models (least recently used evicted, one lock per model);
`create_app` builds the FastAPI app (routes in `attnflow.serve.app`, each model's queue and thread
in `attnflow.serve.lanes`, the estimates that refuse what cannot finish in `attnflow.serve.costs`,
the work itself in `attnflow.serve.work`, through the library's own functions). Needs the ``serve`` extra
(``pip install attnflow[serve]``: FastAPI and uvicorn).
"""

from attnflow.serve.app import ServeConfig, create_app
from attnflow.serve.pool import Job, ModelPool

__all__ = ["Job", "ModelPool", "ServeConfig", "create_app"]
