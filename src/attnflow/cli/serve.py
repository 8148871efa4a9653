"""`attnflow serve`: keep models loaded and explain texts in the browser and over a JSON API.

Starts uvicorn on the app of `attnflow.serve` (the page at /, the API under /api/, its OpenAPI
description at /openapi.json and /docs). Binds to 127.0.0.1 unless told otherwise, and then only
with --token.
"""

from __future__ import annotations

import argparse

from attnflow.cli.common import DEFAULT_MODEL, positive_int
from attnflow.errors import InputError

EPILOG = """\
examples:
  attnflow serve                                   # http://127.0.0.1:8765/ with minilm-sentiment
  attnflow serve --model minilm-sentiment --model smollm2 --port 9000
  attnflow serve --host 0.0.0.0 --token "$(openssl rand -hex 16)"   # reachable from other machines
  attnflow serve --allow-path ~/models             # also load model folders under ~/models by path

The API (JSON in, JSON out; every error is one line {"error": "..."} with its status):
  POST /api/explain   {"text": "...", "model": "minilm-sentiment", "methods": ["auto", "rollout"]}
  POST /api/generate  {"text": "Paris is the capital of", "model": "smollm2", "generate": 5}
  POST /api/compare   {"text": "...", "models": ["minilm", "minilm-sentiment"], "method": "rollout"}
  GET  /api/models, GET /api/methods, GET /api/progress/ID, POST /api/cancel/ID
  GET  /api/results/ID/METHOD.json|html|png  (the files `attnflow explain` writes)
A request that runs past --time-limit is stopped and answered with 504; models load on their first
request and stay (at most --max-models, the least recently used goes). docs/serve.md has a client.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="keep models loaded: explain texts in the browser and over a JSON API (FastAPI)",
        description="A local app and JSON API: models load once, each explanation takes a fraction of a second.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        action="append",
        metavar="ALIAS",
        help=f"a model to offer (repeat for several; the first is the default; default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=positive_int, default=8765, help="port (default: 8765)")
    parser.add_argument("--token", metavar="T", help="a secret every request must carry (required off 127.0.0.1)")
    parser.add_argument(
        "--allow-path", metavar="DIR", help="allow loading model folders under DIR by path (default: aliases only)"
    )
    parser.add_argument(
        "--max-models", type=positive_int, default=2, metavar="N", help="models kept loaded (default: 2)"
    )
    parser.add_argument(
        "--max-memory",
        type=positive_int,
        metavar="MB",
        help="unload idle models (least recently used first) while the server's resident memory exceeds MB",
    )
    parser.add_argument(
        "--time-limit", type=float, default=60.0, metavar="S", help="seconds before a request is stopped (default: 60)"
    )
    parser.add_argument(
        "--max-text", type=positive_int, default=5000, metavar="CHARS", help="longest text accepted (default: 5000)"
    )
    parser.add_argument("--preload", action="store_true", help="load the first model before accepting requests")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from attnflow.serve import ModelPool, ServeConfig, create_app
        from attnflow.serve.app import LOCAL_HOSTS
    except ImportError as error:
        raise InputError(f"attnflow serve needs FastAPI and uvicorn: pip install 'attnflow[serve]' ({error})") from None
    if args.time_limit <= 0:
        raise InputError(f"--time-limit must be positive, got {args.time_limit}")
    local = args.host in LOCAL_HOSTS
    config = ServeConfig(
        host=args.host,
        token=args.token,
        max_text_chars=args.max_text,
        time_limit_s=args.time_limit,
        allowed_hosts=LOCAL_HOSTS if local else None,  # a local server answers no other Host (DNS rebinding)
    )
    pool = ModelPool(
        args.model or [DEFAULT_MODEL],
        allow_path=args.allow_path,
        max_models=args.max_models,
        max_rss_mb=args.max_memory,
    )
    if args.preload:
        from attnflow.serve import Job

        with pool.using(pool.default, Job()):
            pass
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"attnflow serve: http://{shown}:{args.port}/{'?token=…' if args.token else ''} (Ctrl-C stops it)")
    uvicorn.run(create_app(pool, config), host=args.host, port=args.port, log_level="warning")
    return 0
