"""`attnflow serve`: keep models loaded and explain texts in the browser and over a JSON API.

Starts uvicorn on the app of `attnflow.serve` (the page at /, the API under /api/, its OpenAPI
description at /openapi.json and /docs). Binds to 127.0.0.1 unless told otherwise, and then only
with a token (--token-file PATH or ATTNFLOW_TOKEN, which stay out of the process list; --token T).

The first Ctrl-C or SIGTERM stops the server: requests still waiting or running are stopped and
answered 503, and the process exits within `GRACE_S` seconds more even when a method runs on
without reaching a check (its thread is abandoned); a second one exits at once. The same holds
while ``--preload`` loads the first model (the load stops at its next block or tensor, leaving no
half-written file).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from attnflow.cli.common import DEFAULT_MODEL, add_dtype_argument, flag, positive_int
from attnflow.errors import InputError

GRACE_S = 2.0  # after the server has stopped: how long its threads may take to reach a check
TOKEN_VARIABLE = "ATTNFLOW_TOKEN"

EPILOG = """\
examples:
  attnflow serve                                   # http://127.0.0.1:8765/ with minilm-sentiment
  attnflow serve --model minilm-sentiment --model smollm2 --port 9000
  openssl rand -hex 16 > ~/.attnflow-token && chmod 600 ~/.attnflow-token
  attnflow serve --host 0.0.0.0 --token-file ~/.attnflow-token   # reachable from other machines
  attnflow serve --allow-path ~/models             # also load model folders under ~/models by path

The API (JSON in, JSON out; every error is one line {"error": "..."} with its status):
  POST /api/explain   {"text": "...", "model": "minilm-sentiment", "methods": ["auto", "rollout"]}
  POST /api/generate  {"text": "Paris is the capital of", "model": "smollm2", "generate": 5}
  POST /api/compare   {"text": "...", "models": ["minilm", "minilm-sentiment"], "method": "rollout"}
  GET  /api/models, GET /api/methods, POST /api/load, GET /api/progress/ID, POST /api/cancel/ID
  GET  /api/results/ID/METHOD.json|html|png  (the files `attnflow explain` writes)
A request that runs past --time-limit is stopped and answered with 504, and one estimated to take
longer is refused at once (413); models load on their first request and stay (at most --max-models,
the least recently used goes); only the --model aliases load unless --allow-any-model. Ctrl-C stops
it (running requests get 503); a second Ctrl-C exits at once. docs/serve.md has a client.
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
    given = parser.add_mutually_exclusive_group()
    given.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"read the secret every request must carry from PATH (required off 127.0.0.1; or set {TOKEN_VARIABLE})",
    )
    given.add_argument(
        "--token", metavar="T", help="the secret itself (other users see it in `ps`: prefer --token-file)"
    )
    parser.add_argument("--allow-any-model", action="store_true", help="load any embedded alias asked for, too")
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
    parser.add_argument(
        "--threads-per-model",
        type=positive_int,
        metavar="N",
        help="CPU threads each model's work runs on (default: the machine's threads shared out among the --model "
        "aliases, so heavy work on one model does not starve another)",
    )
    parser.add_argument("--preload", action="store_true", help="load the first model before accepting requests")
    add_dtype_argument(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401 - used by _serve; missing, it is named here with the extra to install

        from attnflow.serve import ModelPool, ServeConfig, create_app
        from attnflow.serve.app import LOCAL_HOSTS
    except ImportError as error:
        raise InputError(f"attnflow serve needs FastAPI and uvicorn: pip install 'attnflow[serve]' ({error})") from None
    if args.time_limit <= 0:
        raise InputError(f"--time-limit must be positive, got {args.time_limit}")
    local = args.host in LOCAL_HOSTS
    token = _token(args)
    config = ServeConfig(
        host=args.host,
        token=token,
        max_text_chars=args.max_text,
        time_limit_s=args.time_limit,
        allowed_hosts=LOCAL_HOSTS if local else None,  # a local server answers no other Host (DNS rebinding)
        threads_per_model=args.threads_per_model,
        operator_spelling=flag,  # a refused model's answer names this command's flags (--allow-any-model)
    )
    pool = ModelPool(
        args.model or [DEFAULT_MODEL],
        allow_path=args.allow_path,
        max_models=args.max_models,
        max_rss_mb=args.max_memory,
        allow_any_model=args.allow_any_model,
        dtype=args.dtype,
    )
    app = create_app(pool, config)
    at_once = {number: signal.signal(number, _at_once) for number in (signal.SIGINT, signal.SIGTERM)}
    try:  # uvicorn's own handlers replace these while it serves, and put them back once it has stopped
        _serve(app, args, token)
    finally:
        for number, handler in at_once.items():
            signal.signal(number, handler)
    return 0


def _serve(app: Any, args: argparse.Namespace, token: str | None) -> None:
    """Preload (``--preload``), then serve until a signal; threads still busy after `GRACE_S` are left."""
    import uvicorn

    service = app.state.service
    if args.preload and not _preload(service):
        return
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"attnflow serve: http://{shown}:{args.port}/{'?token=…' if token else ''} (Ctrl-C stops it)", flush=True)
    server = _server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"), service)
    try:
        server.run()
    finally:
        if not service.close(GRACE_S):  # a thread still inside a method that reaches no check
            _exit_now(0)


def _at_once(signal_number: int, _frame: FrameType | None) -> None:
    """A signal while the server stops (or its first model loads and has been told to stop): exit now."""
    _exit_now(128 + signal_number)


def _token(args: argparse.Namespace) -> str | None:
    """The token: --token, the first line of --token-file, or $ATTNFLOW_TOKEN (None: none given)."""
    if args.token is not None:
        return str(args.token)
    if args.token_file is not None:
        try:
            lines = Path(args.token_file).expanduser().read_text(encoding="utf-8").splitlines()
        except OSError as error:
            raise InputError(f"cannot read --token-file {args.token_file}: {error.strerror or error}") from None
        return lines[0].strip() if lines else ""
    return os.environ.get(TOKEN_VARIABLE) or None  # set but empty: no token, as unset (a local server starts)


def _exit_now(code: int) -> None:
    """Leave the process at once (threads abandoned, no traceback): the output flushed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _stopping(signal_number: int) -> None:
    name = signal.Signals(signal_number).name
    print(
        f"attnflow serve: stopping ({name}; running requests are answered 503, a second {name} exits at once)",
        file=sys.stderr,
        flush=True,
    )


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, stopped our way: the first signal stops the requests (503) and the
        server; a second one exits at once. No signal is raised again once it has stopped (uvicorn
        would: a KeyboardInterrupt and its traceback)."""

        def __init__(self, config: Any, service: Any) -> None:
            super().__init__(config)
            self.service = service

        def handle_exit(self, sig: int, _frame: FrameType | None) -> None:
            if self.should_exit:
                _exit_now(128 + sig)
            _stopping(sig)
            self.service.stop()
            self.should_exit = True

    return Server


def _server(config: Any, service: Any) -> Any:
    """A `Server` (its class is made once uvicorn is imported) for ``config``, stopping ``service``."""
    return _server_class()(config, service)


def _preload(service: Any) -> bool:
    """Load the default model on its own thread before serving; False when a signal stopped it."""
    from attnflow.serve import Job
    from attnflow.serve.work import Asked, load_model

    job, stop = Job(), threading.Event()
    name = service.pool.default
    asked = Asked("", (name,))
    lane = service.lane(name)
    loading = service.submit(lane.executor, lane.budgeted(lambda: load_model(service.pool, job, service.costs, asked)))

    def handle(signal_number: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            _exit_now(128 + signal_number)
        _stopping(signal_number)
        stop.set()
        job.cancel("the server is stopping")

    previous = {number: signal.signal(number, handle) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not loading.done() and not stop.is_set():
            concurrent.futures.wait([loading], timeout=0.1)
        if stop.is_set():
            if not service.close(GRACE_S):
                _exit_now(0)
            return False
        loading.result()  # a failed load: its error, one line
        return True
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
