"""`create_app(pool, config)`: the FastAPI app of `attnflow serve` (the page and the JSON API).

The routes only translate: each request becomes a call of `attnflow.serve.work` in a worker
thread, on models held by the `ModelPool` (one thread per model at a time). Every request gets a
`Job`; the route waits for its worker and stops it (at the next step) when the client cancels it
(``POST /api/cancel/{id}``), disconnects, or passes the time limit, answering with one line.

Every error is one JSON line, ``{"error": "..."}``, with its status: 400 bad input (an attnflow error
the user can fix; a parameter it names is spelled as the request's JSON field, `JSON_FIELDS`), 401 no
or wrong token, 403 a model path outside ``--allow-path``, 404 unknown model, method or result, 409
cancelled, 413 body or text too long, 415 not JSON, 422 a field of the wrong type, 500 anything else
(one line for the client, the traceback in the server's log; the server keeps serving), 504 over the
time limit.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field

from attnflow.errors import AttnflowError, ModelLoadError, spell
from attnflow.serve import work
from attnflow.serve.pool import Cancelled, Job, ModelPool, ModelRefused, PathRefused

LOG = logging.getLogger("attnflow.serve")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
POLL_S = 0.02  # how often a waiting route checks its worker, the client and the clock
REQUEST_ID = r"^[A-Za-z0-9_-]{1,64}$"
TOKEN_COOKIE = "attnflow_token"


@dataclass(frozen=True)
class ServeConfig:
    """The server's limits and access rules.

    Attributes:
        host: the address it binds to; any but 127.0.0.1 / localhost / ::1 needs ``token``.
        token: the secret every request must carry (``Authorization: Bearer T``, ``?token=T`` or
            the cookie the page sets), or None (local binds only).
        max_text_chars: the longest text accepted.
        max_body_bytes: the largest request body accepted.
        time_limit_s: a request still running after this is stopped and answered with 504.
        max_new_tokens: the most tokens ``/api/generate`` generates.
        workers: threads running requests (requests for one model still run one at a time).
        max_results: finished results kept for downloads (the oldest go first).
        allowed_hosts: Host headers accepted (None: any), against DNS rebinding on a local bind.
    """

    host: str = "127.0.0.1"
    token: str | None = None
    max_text_chars: int = 5000
    max_body_bytes: int = 64 * 1024
    time_limit_s: float = 60.0
    max_new_tokens: int = 64
    workers: int = 4
    max_results: int = 32
    allowed_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.host not in LOCAL_HOSTS and not self.token:
            raise AttnflowError(
                f"binding to {self.host} exposes the server beyond this machine: give {{token}} "
                "(requests without it get 401), or bind to 127.0.0.1",
                parameter="token",
            )


class ServeError(Exception):
    """An answer with a status and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# ----- request bodies (the OpenAPI page documents them) --------------------------------------------


class ExplainRequest(BaseModel):
    """``attnflow explain TEXT``'s inputs."""

    text: str = Field(description="the text to explain")
    model: str | None = Field(None, description="an alias the server offers (default: its first)")
    methods: list[str] | None = Field(
        None, description="registered methods, or auto (default: auto when the model has a target, else rollout)"
    )
    options: dict[str, Any] = Field(default_factory=dict, description="method options, e.g. {'discard_ratio': 0.5}")
    target: str | None = Field(None, description="classifiers: a class index or label; causal LMs: the next token")
    target_text: str | None = Field(None, description="sentence encoders: explain the similarity to this text")
    contrast: str | None = Field(
        None, description="a second class or token: explain logit(target) - logit(contrast) ('A rather than B')"
    )
    row: str | int | None = Field(None, description="saliency row: cls, mean, last or a token index")
    max_length: int | None = Field(None, ge=1, description="truncate the text to this many tokens")
    faithfulness: bool = Field(
        True,
        description="each map's faithfulness on this input (bounded by the text's length); false skips it, "
        "and auto then shows its first candidate",
    )
    request_id: str | None = Field(None, pattern=REQUEST_ID, description="your id, for /api/progress and /api/cancel")


class GenerateRequest(BaseModel):
    """``attnflow explain PROMPT --generate N`` (or ``--continuation TEXT``)'s inputs (causal LMs)."""

    text: str = Field(description="the prompt")
    model: str | None = None
    methods: list[str] | None = Field(
        None, description="registered methods, or auto (default: auto, as `attnflow explain --generate`)"
    )
    options: dict[str, Any] = Field(default_factory=dict)
    generate: int | None = Field(None, ge=1, description="greedily generate this many tokens")
    continuation: str | None = Field(None, description="explain this continuation instead (teacher-forced)")
    contrast: str | None = Field(None, description="a single token: explain each generated token rather than it")
    faithfulness: bool = Field(False, description="per step: p(t_k) after removing its top sources")
    request_id: str | None = Field(None, pattern=REQUEST_ID)


class ExploreRequest(BaseModel):
    """``attnflow explore TEXT``'s inputs: the explorer page, every layer and head of each method."""

    text: str
    model: str | None = None
    methods: list[str] | None = Field(None, description="registered methods (default: every one the model supports)")
    target: str | None = None
    target_text: str | None = None
    contrast: str | None = None
    max_length: int | None = Field(None, ge=1)
    request_id: str | None = Field(None, pattern=REQUEST_ID)


class CompareRequest(BaseModel):
    """``attnflow compare TEXT --model A --model B``'s inputs."""

    text: str
    models: list[str] = Field(description="two aliases: model A, then model B (same tokenizer)")
    method: str = "rollout"
    row: str | int | None = None
    top_k: int = Field(5, ge=1)
    target: str | None = None
    target_text: str | None = None
    contrast: str | None = None
    max_length: int | None = Field(None, ge=1)
    request_id: str | None = Field(None, pattern=REQUEST_ID)


# ----- the app -----------------------------------------------------------------------------------


def create_app(pool: ModelPool, config: ServeConfig | None = None) -> FastAPI:
    """The app serving ``pool``'s models under ``config``'s limits (see the module docstring)."""
    config = config or ServeConfig()
    service = _Service(pool, config)
    app = FastAPI(
        title="attnflow serve",
        summary="Explanations of transformer predictions from models loaded once (the library's numbers).",
        version=_version(),
        lifespan=service.lifespan,
    )
    app.state.pool, app.state.config, app.state.jobs = pool, config, service.jobs
    _add_guards(app, config)
    _add_page_routes(app, service)
    _add_catalogue_routes(app, service)
    _add_explain_routes(app, service)
    _add_view_routes(app, service)
    _add_job_routes(app, service)
    _add_result_routes(app, service)
    return app


class _Service:
    """What the routes share: the model pool, the limits, the worker threads, the running jobs and
    the results kept for downloads."""

    def __init__(self, pool: ModelPool, config: ServeConfig) -> None:
        self.pool, self.config = pool, config
        self.executor = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="attnflow-serve")
        self.jobs: dict[str, Job] = {}
        self.results: OrderedDict[str, dict[str, Any]] = OrderedDict()  # id -> {method: explanation}
        self.pages: OrderedDict[str, str] = OrderedDict()  # id -> an explorer page

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        yield
        for job in list(self.jobs.values()):
            job.cancel("the server is stopping")
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def start(
        self, request: Request, request_id: str | None, function: Callable[..., Any], **arguments: Any
    ) -> tuple[Job, Any, float]:
        """A `Job` (with the client's ``request_id``, or a fresh id) running ``function`` (`run`):
        the job, its result and the milliseconds it took."""
        job = Job(id=request_id) if request_id else Job()
        started = time.perf_counter()
        result = await self.run(request, job, function, **arguments)
        return job, result, round(1000 * (time.perf_counter() - started), 1)

    async def run(self, request: Request, job: Job, function: Callable[..., Any], **arguments: Any) -> Any:
        """``function(pool, job, **arguments)`` in a worker; stops it on cancel, disconnect or time limit."""
        if job.id in self.jobs:
            raise ServeError(409, f"a request with id {job.id!r} is already running")
        self.jobs[job.id] = job
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.executor, functools.partial(function, self.pool, job, **arguments))
        deadline = loop.time() + self.config.time_limit_s
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=POLL_S)
                if done:
                    try:
                        return future.result()
                    except Exception as error:  # one line for the client; the traceback in the server's log
                        raise _answer(error) from error
                if await request.is_disconnected():
                    job.cancel("the client disconnected")
                    raise ServeError(409, "the client disconnected; the request was stopped")
                if loop.time() > deadline:
                    job.cancel("over the time limit")
                    raise ServeError(
                        504,
                        f"the request ran longer than the server's time limit ({self.config.time_limit_s:g} s) and "
                        f"was stopped during {job.current}; try fewer or cheaper methods, or a shorter text",
                    )
        finally:
            self.jobs.pop(job.id, None)
            future.add_done_callback(lambda stopped: stopped.exception())  # a stopped job's Cancelled: expected

    def keep(self, job: Job, explanations: list[Any]) -> None:
        """Keep a request's explanations for downloads (the oldest dropped past ``max_results``)."""
        self.results[job.id] = {explanation.method: explanation for explanation in explanations}
        while len(self.results) > self.config.max_results:
            self.results.popitem(last=False)

    def keep_page(self, job: Job, page: str) -> None:
        """Keep an explorer page for ``/api/explorer/{id}`` (the oldest dropped past ``max_results``)."""
        self.pages[job.id] = page
        while len(self.pages) > self.config.max_results:
            self.pages.popitem(last=False)

    def check_text(self, text: str | None, what: str = "text") -> None:
        """413 when ``text`` is longer than the server takes (None: nothing given, nothing to check)."""
        if text is not None and len(text) > self.config.max_text_chars:
            raise ServeError(
                413, f"the {what} has {len(text)} characters; this server takes at most {self.config.max_text_chars}"
            )


def _add_page_routes(app: FastAPI, service: _Service) -> None:
    """``/`` (the page; a valid ``?token=`` becomes its cookie) and ``/favicon.ico``."""

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page(request: Request) -> Response:
        from attnflow.viz.app_page import app_page, app_page_headers

        response = HTMLResponse(app_page(), headers=app_page_headers())
        token = request.query_params.get("token")
        if service.config.token and token:  # the guard checked it: the page's own requests carry it as a cookie
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204)


def _add_catalogue_routes(app: FastAPI, service: _Service) -> None:
    """``/api/models`` and ``/api/methods``: what the server offers."""
    pool = service.pool

    @app.get("/api/models", summary="the models this server offers, and which are loaded")
    def models() -> dict[str, Any]:
        listed = []
        for name in dict.fromkeys([*pool.offered, *pool.loaded()]):
            model = pool.model_if_loaded(name)
            record: dict[str, Any] = {"name": name, "loaded": model is not None, "default": name == pool.default}
            if model is not None:
                from attnflow.evaluate.per_input import auto_methods
                from attnflow.methods.registry import methods_for

                record.update(
                    family=model.adapter.family,
                    target_kind=model.target_kind,
                    methods=methods_for(model.adapter),
                    auto_candidates=auto_methods(model.adapter, model.target_kind),
                )
            listed.append(record)
        return {"models": listed, "loaded": pool.loaded(), "max_models": pool.max_models}

    @app.get("/api/methods", summary="the registered methods and their options (the registry's declarations)")
    def methods() -> dict[str, Any]:
        from attnflow.methods.registry import available_methods

        return {"methods": [work.method_record(name) for name in available_methods()]}


def _add_explain_routes(app: FastAPI, service: _Service) -> None:
    """``/api/explain`` and ``/api/generate``: explanations, kept for downloads, as `attnflow explain` makes them."""

    @app.post("/api/explain", summary="explain a text, as `attnflow explain TEXT --json` does")
    async def explain(body: ExplainRequest, request: Request) -> dict[str, Any]:
        service.check_text(body.text)
        service.check_text(body.target_text, "target text")
        model = body.model or service.pool.default
        job, explanations, elapsed_ms = await service.start(
            request,
            body.request_id,
            work.explain_text,
            text=body.text,
            model=model,
            methods=body.methods,
            options=body.options,
            target=body.target,
            target_text=body.target_text,
            contrast=body.contrast,
            row=body.row,
            faithfulness=body.faithfulness,
            max_length=body.max_length,
        )
        service.keep(job, explanations)
        explained = [work.answer_record(explanation) for explanation in explanations]
        return {"id": job.id, "model": model, "text": body.text, "elapsed_ms": elapsed_ms, "explanations": explained}

    @app.post("/api/generate", summary="explain every generated token, as `attnflow explain --generate N` does")
    async def generate(body: GenerateRequest, request: Request) -> dict[str, Any]:
        service.check_text(body.text, "prompt")
        service.check_text(body.continuation, "continuation")
        limit = service.config.max_new_tokens
        if body.generate is not None and body.generate > limit:
            raise ServeError(413, f"generate at most {limit} tokens on this server, not {body.generate}")
        model = body.model or service.pool.default
        job, explanations, elapsed_ms = await service.start(
            request,
            body.request_id,
            work.generate_text,
            text=body.text,
            model=model,
            methods=body.methods,
            options=body.options,
            generate=body.generate,
            continuation=body.continuation,
            faithfulness=body.faithfulness,
            contrast=body.contrast,
        )
        service.keep(job, explanations)
        explained = [work.answer_record(explanation) for explanation in explanations]
        return {"id": job.id, "model": model, "elapsed_ms": elapsed_ms, "explanations": explained}


def _add_view_routes(app: FastAPI, service: _Service) -> None:
    """``/api/compare`` (one method under two models) and ``/api/explore`` (the explorer page)."""

    @app.post("/api/compare", summary="one method under two models, as `attnflow compare` does")
    async def compare(body: CompareRequest, request: Request) -> dict[str, Any]:
        service.check_text(body.text)
        job, comparison, elapsed_ms = await service.start(
            request,
            body.request_id,
            work.compare_models,
            text=body.text,
            models=body.models,
            method=body.method,
            row=body.row,
            top_k=body.top_k,
            target=body.target,
            target_text=body.target_text,
            contrast=body.contrast,
            max_length=body.max_length,
        )
        return {"id": job.id, "elapsed_ms": elapsed_ms, "comparison": comparison.to_dict()}

    @app.post("/api/explore", summary="the explorer page (layers, heads, matrices), as `attnflow explore` writes it")
    async def explore(body: ExploreRequest, request: Request) -> dict[str, Any]:
        service.check_text(body.text)
        job, page, _ = await service.start(
            request,
            body.request_id,
            work.explore_text,
            text=body.text,
            model=body.model or service.pool.default,
            methods=body.methods,
            target=body.target,
            target_text=body.target_text,
            contrast=body.contrast,
            max_length=body.max_length,
        )
        service.keep_page(job, page)
        return {"id": job.id, "url": f"/api/explorer/{job.id}"}


def _add_job_routes(app: FastAPI, service: _Service) -> None:
    """``/api/progress/{id}`` and ``/api/cancel/{id}``: a running request's step, and stopping it."""

    @app.get("/api/progress/{request_id}", summary="the step a running request is on")
    def progress(request_id: str) -> dict[str, Any]:
        job = service.jobs.get(request_id)
        if job is None:  # finished (or never started): an answer, not an error, for a page that polls
            return {"id": request_id, "running": False}
        return {**job.progress(), "running": True}

    @app.post("/api/cancel/{request_id}", summary="stop a running request at its next step")
    def cancel(request_id: str) -> dict[str, Any]:
        job = service.jobs.get(request_id)
        if job is None:
            raise ServeError(404, f"no running request {request_id!r} (it finished, or never started)")
        job.cancel("cancelled by the client")
        return {"id": request_id, "cancelled": True, "step": job.current}


def _add_result_routes(app: FastAPI, service: _Service) -> None:
    """The kept results: explorer pages and each explanation's files."""
    kept = service.config.max_results

    @app.get("/api/explorer/{page_id}", response_class=HTMLResponse, summary="a page made by /api/explore")
    def explorer(page_id: str) -> HTMLResponse:
        if page_id not in service.pages:
            raise ServeError(404, f"no kept explorer page {page_id!r} (the server keeps the last {kept})")
        return HTMLResponse(service.pages[page_id])

    @app.get(
        "/api/results/{result_id}/{method}.{kind}",
        summary="a kept result's explanation.json / .html / .png, the files `attnflow explain` writes",
        response_class=Response,
    )
    async def download(result_id: str, method: str, kind: Literal["json", "html", "png"]) -> Response:
        explanation = service.results.get(result_id, {}).get(method)
        if explanation is None:
            raise ServeError(
                404, f"no kept result {result_id!r} with method {method!r} (the server keeps the last {kept})"
            )
        loop = asyncio.get_running_loop()
        content = await loop.run_in_executor(service.executor, work.explanation_file, explanation, kind)
        media = {"json": "application/json", "html": "text/html; charset=utf-8", "png": "image/png"}[kind]
        stem = "generation" if hasattr(explanation, "generated") else "explanation"
        disposition = f'attachment; filename="{stem}-{method}.{kind}"'
        return Response(content, media_type=media, headers={"Content-Disposition": disposition})


# ----- guards and errors -------------------------------------------------------------------------


def _add_guards(app: FastAPI, config: ServeConfig) -> None:
    """The checks before any route (`_Guard`), and every error as one JSON line."""
    app.add_middleware(_Guard, config=config)

    @app.exception_handler(ServeError)
    async def serve_error(_request: Request, error: ServeError) -> JSONResponse:
        return _error(error.status, str(error))

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})")
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or "body"
        return _error(422, f"{where}: {first.get('msg', 'invalid value')}")

    @app.exception_handler(Exception)
    async def failed(_request: Request, error: Exception) -> JSONResponse:
        answer = _answer(error)
        return _error(answer.status, str(answer))


# The library's parameters as the request bodies name them, where the two differ (every other
# parameter is its own field): the one place the server spells the parameters errors name.
JSON_FIELDS = {
    "max_new_tokens": "generate",
    "k": "top_k",
    "method": "methods",
    "model_a": "models",
    "model_b": "models",
    "image": "an image (which this server does not explain)",
}


def json_field(parameter: str) -> str:
    """How a request body spells a library parameter (`JSON_FIELDS`, else the parameter itself)."""
    return JSON_FIELDS.get(parameter, parameter)


def _answer(error: Exception) -> ServeError:
    """The status and line an exception answers with: bad input 400 (its parameters spelled as the
    JSON fields), anything unexpected 500 (also logged, with its traceback)."""
    if isinstance(error, ServeError):
        return error
    if isinstance(error, Cancelled):
        return ServeError(409, str(error))
    if isinstance(error, ModelRefused):
        return ServeError(403 if isinstance(error, PathRefused) else 404, str(error))
    if isinstance(error, ModelLoadError):
        return ServeError(404, spell(error, json_field))
    if isinstance(error, AttnflowError):
        return ServeError(400, spell(error, json_field))
    LOG.error("a request failed", exc_info=error)
    return ServeError(500, f"the request failed ({type(error).__name__}: {error}); the server keeps serving")


class _Guard:
    """ASGI middleware: the token, the Host header, JSON bodies only and the body size limit (the body
    is read here, at most ``max_body_bytes`` of it, and replayed to the route), then security headers."""

    def __init__(self, app: Any, config: ServeConfig) -> None:
        self.app, self.config = app, config

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        config = self.config
        request = Request(scope)
        refusal = None
        if config.token is not None and not _has_token(request, config.token):
            refusal = _error(401, "this server needs its token: send 'Authorization: Bearer TOKEN' (or open /?token=…)")
        elif config.allowed_hosts is not None and request.url.hostname not in config.allowed_hosts:
            refusal = _error(400, f"unexpected Host header {request.url.hostname!r}")
        elif request.method == "POST" and request.url.path in _JSON_ROUTES:
            kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                refusal = _error(415, f"send the body as application/json, not {kind or 'no content type'!r}")
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if request.method == "POST":
            body = await _read_body(receive, config.max_body_bytes, request.headers.get("content-length"))
            if body is None:
                too_large = f"the request body is larger than this server's limit ({config.max_body_bytes} bytes)"
                await _error(413, too_large)(scope, receive, send)
                return
            receive = _replay(body, receive)

        async def with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], *_SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


_JSON_ROUTES = ("/api/explain", "/api/generate", "/api/compare", "/api/explore")
_SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]


async def _read_body(receive: Callable[..., Any], limit: int, declared: str | None) -> bytes | None:
    """The whole request body, or None when it is (or says it is) larger than ``limit`` bytes."""
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Callable[..., Any]) -> Callable[..., Any]:
    """A ``receive`` that gives ``body`` once, then the client's own messages (a disconnect)."""
    given = False

    async def replayed() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        message: dict[str, Any] = await receive()
        return message

    return replayed


def _has_token(request: Request, token: str) -> bool:
    given = request.headers.get("authorization", "")
    candidates = [
        given[len("Bearer ") :] if given.startswith("Bearer ") else "",
        request.query_params.get("token", ""),
        request.cookies.get(TOKEN_COOKIE, ""),
    ]
    return any(hmac.compare_digest(candidate.encode(), token.encode()) for candidate in candidates if candidate)


def _error(status: int, message: str) -> JSONResponse:
    """One JSON line: ``{"error": message}`` (newlines folded, so a client can show it as is)."""
    return JSONResponse({"error": " ".join(str(message).split())}, status_code=status)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("attnflow")
    except PackageNotFoundError:  # running from a source tree
        return "0"
