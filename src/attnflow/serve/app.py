"""`create_app(pool, config)`: the FastAPI app of `attnflow serve` (the page and the JSON API).

The routes only translate: each request is checked on the event loop (a bad one is answered at
once), estimated (`attnflow.serve.costs`: refused at once when it cannot finish within the time
limit, or when its model's queue holds more work than that), then waits in its model's queue and
runs on that model's own thread (`attnflow.serve.lanes`: a request for one model never waits behind
another model's work), where its answer's JSON is also written. Every request gets a `Job`; the
route waits for its worker and stops it (at the next step) when the client cancels it
(``POST /api/cancel/{id}``), disconnects, passes the time limit or the server stops, answering with
one line.

Every error is one JSON line, ``{"error": "..."}``, with its status: 400 bad input (an attnflow error
the user can fix; a parameter it names is spelled as the request's JSON field, `JSON_FIELDS`), 401 no
or wrong token, 403 a model path outside ``--allow-path``, 404 unknown model, method, result or
route, 405 a method the route does not take, 409 cancelled, 413 body or text too long or a request
that cannot finish within the time limit, 415 not JSON, 422 a field of the wrong type, 429 the
model's queue is full (``Retry-After``), 500 anything else (one line for the client, the traceback in
the server's log; the server keeps serving), 503 the server is stopping, 504 over the time limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hmac
import logging
import math
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Literal, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from attnflow.errors import AttnflowError, ModelLoadError, OutputError, spell
from attnflow.serve import work
from attnflow.serve.costs import Costs, TooExpensive
from attnflow.serve.lanes import Lane, hold, release_when_done
from attnflow.serve.pool import Cancelled, Job, ModelPool, ModelRefused, PathRefused

LOG = logging.getLogger("attnflow.serve")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
POLL_S = 0.02  # how often a waiting route checks its worker, the client and the clock
REQUEST_ID = r"^[A-Za-z0-9_-]{1,64}$"
TOKEN_COOKIE = "attnflow_token"
MIN_TOKEN_CHARS = 16
STOPPING = "the server is stopping"


@dataclass(frozen=True)
class ServeConfig:
    """The server's limits and access rules.

    Attributes:
        host: the address it binds to; any but 127.0.0.1 / localhost / ::1 needs ``token``.
        token: the secret every request must carry (``Authorization: Bearer T``, the scheme in any
            case, or the cookie the page sets from ``/?token=T``), or None (local binds only).
        max_text_chars: the longest text accepted.
        max_body_bytes: the largest request body accepted.
        time_limit_s: a request still running after this (counted from its arrival, the wait for
            its model included) is stopped and answered with 504; one estimated to take longer is
            refused at once (413), and one whose model's queue holds more work than that (429).
        max_new_tokens: the most tokens ``/api/generate`` generates.
        max_batch_size, max_evals, max_steps: the largest ``batch_size`` (altered inputs per forward
            pass), ``max_evals`` (SHAP's coalitions) and ``n_steps`` (integrated gradients) a request
            may ask for.
        max_results: finished results kept for downloads, and explorer and routes pages kept (the
            oldest go first).
        max_kept_bytes: at most this many bytes of kept results, and as many of pages.
        allowed_hosts: Host headers accepted (None: any), against DNS rebinding on a local bind.
        threads_per_model: the CPU threads each model's work runs on (None: torch's threads shared
            out evenly among the offered models, at least one each), so that heavy work on one
            model does not starve a cheap request on another (`attnflow.serve.lanes`).
        operator_spelling: how an answer names the server's own options (a `ModelPool`'s ``models``,
            ``allow_any_model``, ``allow_path``: what a refused model needs), which no request body
            holds: as its operator set them (`attnflow serve`: its flags; default: the parameters).
    """

    host: str = "127.0.0.1"
    token: str | None = None
    max_text_chars: int = 5000
    max_body_bytes: int = 64 * 1024
    time_limit_s: float = 60.0
    max_new_tokens: int = 64
    max_batch_size: int = 64
    max_evals: int = 4096
    max_steps: int = 256
    max_results: int = 32
    max_kept_bytes: int = 64 * 2**20
    allowed_hosts: tuple[str, ...] | None = None
    threads_per_model: int | None = None
    operator_spelling: Callable[[str], str] = str

    def __post_init__(self) -> None:
        if self.token is not None and (len(self.token) < MIN_TOKEN_CHARS or any(c.isspace() for c in self.token)):
            raise AttnflowError(
                f"the token must be at least {MIN_TOKEN_CHARS} characters without spaces (this one has "
                f"{len(''.join(self.token.split()))} besides spaces), e.g. from openssl rand -hex 16"
            )
        if self.threads_per_model is not None and self.threads_per_model < 1:
            raise AttnflowError(
                f"threads per model must be at least 1, got {self.threads_per_model}", parameter="threads_per_model"
            )
        if self.host not in LOCAL_HOSTS and not self.token:
            raise AttnflowError(
                f"binding to {self.host} exposes the server beyond this machine: give {{token}}, or bind to "
                "127.0.0.1 (requests without the token get 401)",
                parameter="token",
            )

    @property
    def caps(self) -> dict[str, int]:
        """The largest value of each capped method option (`work.parsed_options`)."""
        return {"batch_size": self.max_batch_size, "max_evals": self.max_evals, "n_steps": self.max_steps}


class ServeError(Exception):
    """An answer with a status and a one-line message (and ``headers``, such as Retry-After)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


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


class LoadRequest(BaseModel):
    """A model to load before its first request."""

    model: str | None = Field(None, description="an alias the server offers (default: its first)")
    request_id: str | None = Field(None, pattern=REQUEST_ID)


class RoutesRequest(BaseModel):
    """``attnflow routes TEXT``'s inputs: the information flow routes of one prediction."""

    text: str
    model: str | None = None
    position: int | None = Field(None, description="the top node's token (default: the last; negative from the end)")
    threshold: float = Field(0.04, ge=0, lt=1, description="keep the edges with weight above this")
    target: str | None = Field(None, description="causal LMs: the token the lens reads (default: the prediction)")
    contrast: str | None = Field(None, description="causal LMs: contrastive route, logit(target) − logit(contrast)")
    request_id: str | None = Field(None, pattern=REQUEST_ID)


class WhyRequest(BaseModel):
    """``attnflow why TEXT``'s inputs: every kind of evidence about one prediction, and its reading."""

    text: str
    model: str | None = None
    target: str | None = Field(None, description="the class or next token explained (default: the prediction)")
    contrast: str | None = Field(None, description="why the target rather than this class or token")
    corrupt: str | None = Field(None, description="a counterfactual text of the same token length, for patching")
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
    app.state.service, app.state.costs = service, service.costs
    _add_guards(app, service)
    _add_page_routes(app, service)
    _add_catalogue_routes(app, service)
    _add_explain_routes(app, service)
    _add_view_routes(app, service)
    _add_job_routes(app, service)
    _add_result_routes(app, service)
    return app


Answer = Callable[[Job, Any], dict[str, Any]]  # a finished job and its result -> the answer's JSON
Estimate = Callable[[Costs, Job, work.Loaded, Any, work.Asked], Any]  # `work.estimate_explain` and the like
Work = Callable[[ModelPool, Job, Costs, work.Asked], Any]  # `work.explain_text` and the like


class _Kept:
    """Finished answers kept for later requests: the last ``count``, at most ``size`` bytes in all."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size
        self.entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()

    def get(self, key: str) -> Any:
        entry = self.entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: str, value: Any, size: int) -> None:
        self.entries[key] = (value, size)
        while len(self.entries) > self.count or sum(kept for _, kept in self.entries.values()) > self.size:
            self.entries.popitem(last=False)


class _Service:
    """What the routes share: the model pool, the limits, the estimates, each model's queue and
    thread (`Lane`), the running jobs and the answers kept for later requests."""

    def __init__(self, pool: ModelPool, config: ServeConfig) -> None:
        self.pool, self.config = pool, config
        self.costs = Costs(config.time_limit_s)
        self.jobs: dict[str, Job] = {}  # waiting or running
        self.results = _Kept(config.max_results, config.max_kept_bytes)  # id -> {method: explanation}
        self.pages = _Kept(config.max_results, config.max_kept_bytes)  # id -> an explorer or routes page
        self.lanes: dict[str, Lane] = {}
        self.files: ThreadPoolExecutor | None = None  # writes downloads (png, html)
        self.busy: set[Future] = set()  # work handed to a thread and not finished
        self.stopping = False

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        self.stopping = False
        for lane in self.lanes.values():  # queues of another event loop (an app served again): new ones
            lane.close()
        self.lanes = {}
        yield
        self.close()

    def lane(self, name: str) -> Lane:
        """The queue and thread of the model ``name`` (as `ModelPool.check_name` gives it)."""
        lane = self.lanes.get(name)
        if lane is None:
            lane = self.lanes[name] = Lane(name, self.threads_per_model())
        return lane

    def threads_per_model(self) -> int:
        """The CPU threads each model's work runs on (`ServeConfig.threads_per_model`)."""
        if self.config.threads_per_model is not None:
            return self.config.threads_per_model
        import torch

        return max(1, torch.get_num_threads() // len(self.pool.offered))

    def stop(self, reason: str = STOPPING) -> None:
        """Stop everything: new requests get 503, waiting and running ones are stopped and answered 503."""
        self.stopping = True
        for job in list(self.jobs.values()):
            job.cancel(reason)

    def close(self, grace_s: float = 0.0) -> bool:
        """`stop`, let the threads go, and wait up to ``grace_s`` for the work they still run (a
        method that reaches no check); True when none is left."""
        self.stop()
        lanes, self.lanes = list(self.lanes.values()), {}
        for lane in lanes:
            lane.close()
        if self.files is not None:
            self.files.shutdown(wait=False, cancel_futures=True)
            self.files = None
        _, running = concurrent.futures.wait(list(self.busy), timeout=grace_s)
        return not running

    def submit(self, executor: ThreadPoolExecutor, function: Callable[[], Any]) -> Future:
        """``function()`` on ``executor``'s thread, counted in `busy` until it ends."""
        future = executor.submit(function)
        self.busy.add(future)
        future.add_done_callback(self.busy.discard)
        return future

    def checked(self, function: Callable[..., Any], **arguments: Any) -> Any:
        """``function(**arguments)`` (a check or an estimate), its error as the answer it gives."""
        try:
            return function(**arguments)
        except Exception as error:
            raise _answer(error, self.config.operator_spelling) from error

    def model_name(self, name: str | None) -> str:
        """The model a request asks for (None: the default), as the pool loads it; 403/404 if refused."""
        return str(self.checked(self.pool.check_name, name=name or self.pool.default))

    def asked(self, check: Callable[..., work.Asked], body: BaseModel, **extra: Any) -> work.Asked:
        """``body``'s fields checked by ``check`` (`work.check_explain` and the like), its model names resolved."""
        fields = body.model_dump(exclude={"request_id"})
        if "models" in fields:
            fields["models"] = [self.model_name(name) for name in fields["models"]]
        else:
            fields["model"] = self.model_name(fields["model"])
        return self.checked(check, **fields, **extra)

    def admit(self, job: Job, asked: work.Asked, estimate: Estimate) -> None:
        """Before queueing: ``estimate`` (model-dependent checks, and `TooExpensive`) when every
        model is loaded and measured, then 429 when the queue ahead and this request together
        would pass the time limit."""
        loaded = [(name, self.pool.model_if_loaded(name)) for name in asked.models]
        tokenizer = self.costs.tokenizer(asked.model)
        if tokenizer is not None and all(model is not None for _, model in loaded):
            try:
                estimate(self.costs, job, loaded, tokenizer, asked)
            except AttnflowError as error:  # a bad request, or one that cannot finish (`TooExpensive`)
                raise _answer(error) from error
            except Exception:  # an estimate never fails a request: the worker checks again, exactly
                LOG.debug("no estimate before queueing", exc_info=True)
        ahead = max(self.lane(name).backlog_s() for name in asked.models)
        own, limit = job.estimate_s or 0.0, self.config.time_limit_s
        if ahead > 0 and ahead + own > limit:
            retry = math.ceil(ahead + own - limit)
            raise ServeError(
                429,
                f"{', '.join(asked.models)} has about {ahead:.0f} s of work queued; with this request (about "
                f"{own:.1f} s) it would pass the time limit ({limit:g} s): try again in {retry} s",
                headers={"Retry-After": str(retry)},
            )

    async def start(
        self, request: Request, request_id: str | None, asked: work.Asked, estimate: Estimate, run: Work, answer: Answer
    ) -> tuple[Job, Any, JSONResponse]:
        """Admit a request (`admit`), queue it on its models' lanes and ``run`` it on the first
        one's thread, which also writes ``answer(job, result)`` as the JSON response: the job, its
        result and that response."""
        job = Job(id=request_id) if request_id else Job()
        if job.id in self.jobs:
            raise ServeError(409, f"a request with id {job.id!r} is already running")
        self.admit(job, asked, estimate)

        def in_lane() -> tuple[Any, JSONResponse]:
            result = run(self.pool, job, self.costs, asked)
            return result, JSONResponse(answer(job, result))

        result, response = await self.run(request, job, sorted(set(asked.models)), in_lane)
        return job, result, response

    async def run(self, request: Request, job: Job, models: list[str], function: Callable[[], Any]) -> Any:
        """``function()`` on the lane of ``models[0]``, once every lane of ``models`` is held; the
        request gives up (and stops the job) on cancel, disconnect, time limit or server stop."""
        if self.stopping:
            raise ServeError(503, f"{STOPPING}; try again once it is back")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.time_limit_s
        job.deadline = time.monotonic() + self.config.time_limit_s
        lanes = [self.lane(name) for name in models]
        wait = functools.partial(self._wait, request, job, deadline)
        self.jobs[job.id] = job
        for lane in lanes:
            lane.jobs[job.id] = job
        handed = False
        try:
            held = await hold(lanes, job, functools.partial(wait, queued=True))
            threads = sum(lane.threads or 0 for lane in lanes) or None  # two models held (compare): both shares
            future = self.submit(lanes[0].executor, lanes[0].budgeted(function, threads))
            release_when_done(future, held, job, loop)
            handed = True
            return await wait(asyncio.wrap_future(future), queued=False)
        finally:
            self.jobs.pop(job.id, None)
            if not handed:
                for lane in lanes:
                    lane.jobs.pop(job.id, None)

    async def _wait(
        self, request: Request, job: Job, deadline: float, awaitable: asyncio.Future[Any], queued: bool
    ) -> Any:
        """``awaitable``'s result; raises the answer once the request gives up (the job is stopped).
        A client's cancel answers here while the job waits for its model (``queued``); once it runs,
        its thread stops at its next check and answers (the model free of its hooks by then)."""
        while True:
            done, _ = await asyncio.wait({awaitable}, timeout=POLL_S)
            if done:
                try:
                    return awaitable.result()
                except Exception as error:  # one line for the client; the traceback in the server's log
                    raise _answer(error, self.config.operator_spelling) from error
            given_up = await self._given_up(request, job, deadline, queued)
            if given_up is not None:
                awaitable.add_done_callback(_retrieved)  # the abandoned work's `Cancelled`: no "never retrieved"
                raise given_up

    async def _given_up(self, request: Request, job: Job, deadline: float, queued: bool) -> ServeError | None:
        """The answer of a request that gives up now (its job stopped), or None: the server stops,
        the client cancelled it while it waits, disconnected, or it passed the time limit. A
        disconnect and a time limit are one line each in the server's log (never a traceback)."""
        if self.stopping:
            job.cancel(STOPPING)
            return ServeError(503, f"{STOPPING}; the request was stopped at {job.current}")
        if queued and job.cancelled:
            return _answer(Cancelled(f"the request was stopped at {job.current}: {job.reason}"))
        if await request.is_disconnected():
            job.cancel("the client disconnected")
            LOG.warning("request %s: the client disconnected; stopped at %s", job.id, job.current)
            return ServeError(409, "the client disconnected; the request was stopped")
        if asyncio.get_running_loop().time() > deadline:
            job.cancel("over the time limit")
            limit = self.config.time_limit_s
            LOG.warning("request %s: over the time limit (%g s); stopped at %s", job.id, limit, job.current)
            return ServeError(
                504,
                f"the request ran longer than the server's time limit ({limit:g} s) and "
                f"was stopped during {job.current}; try fewer or cheaper methods, or a shorter text",
            )
        return None

    async def in_files_thread(self, function: Callable[[], Any]) -> Any:
        """``function()`` on the thread that writes downloads (not a model's)."""
        if self.files is None:
            self.files = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnflow-serve-files")
        return await asyncio.wrap_future(self.submit(self.files, function))

    async def explained(
        self, request: Request, body: Any, check: Callable[..., work.Asked], estimate: Estimate, run: Work
    ) -> JSONResponse:
        """An explanation request (``body``: explain's or generate's), its explanations kept for downloads."""
        asked = self.asked(check, body, caps=self.config.caps)
        text = body.text if isinstance(body, ExplainRequest) else None  # generate answers without its prompt
        job, explained, response = await self.start(
            request, body.request_id, asked, estimate, run, _explained(asked.model, text)
        )
        kept = {explanation.method: explanation for explanation in explained.explanations}
        self.results.put(job.id, kept, len(response.body))  # the answer's bytes: about what they hold
        return response

    async def viewed(
        self, request: Request, body: Any, check: Callable[..., work.Asked], estimate: Estimate, run: Work
    ) -> JSONResponse:
        """A request answered by a page of its own, kept for ``/api/explorer/{id}``: the explorer
        (``run`` gives the page) or the routes (``run`` gives routes.json's content, answered under
        ``"routes"``, and the page)."""
        self.check_text(body.text)
        asked = self.asked(check, body)
        what = "routes" if isinstance(body, RoutesRequest) else "explorer"

        def answer(job: Job, result: Any) -> dict[str, Any]:
            content = {} if isinstance(result, str) else {what: result[0]}
            timed = {"elapsed_ms": _elapsed_ms(job), "estimated_s": job.estimate_s}
            return {"id": job.id, "model": asked.model, **timed, "url": f"/api/explorer/{job.id}", **content}

        job, result, response = await self.start(request, body.request_id, asked, estimate, run, answer)
        self.keep_page(job, result if isinstance(result, str) else result[1], what)
        return response

    def keep_page(self, job: Job, page: str, what: str) -> None:
        """Keep an explorer or routes page (``what``) for ``/api/explorer/{id}`` (the oldest dropped
        past ``max_results`` or ``max_kept_bytes``); 413 for a page larger than all it may keep."""
        size, kept = len(page.encode()), self.config.max_kept_bytes
        if size > kept:
            raise ServeError(
                413,
                f"the {what} page is {size / 2**20:.1f} MB, more than this server keeps ({kept / 2**20:.0f} MB): "
                "ask for fewer methods or a shorter text",
            )
        self.pages.put(job.id, page, size)

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
        token, expected = request.query_params.get("token"), service.config.token
        if expected and token and _same(token, expected):  # the page's own requests then carry it as a cookie
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
        listed = [_model_record(pool, name) for name in dict.fromkeys([*pool.offered, *pool.loaded()])]
        return {"models": listed, "loaded": pool.loaded(), "max_models": pool.max_models}

    @app.post("/api/load", response_model=None, summary="load a model now (the page: when it is chosen)")
    async def load(body: LoadRequest, request: Request) -> Response:
        name = service.model_name(body.model)

        def answer(_job: Job, _result: Any) -> dict[str, Any]:
            return _model_record(pool, name)

        asked = work.Asked("", (name,))
        _, _, response = await service.start(request, body.request_id, asked, _nothing, work.load_model, answer)
        return response

    @app.get("/api/methods", summary="the registered methods and their options (the registry's declarations)")
    def methods() -> dict[str, Any]:
        from attnflow.methods.registry import available_methods

        return {"methods": [work.method_record(name) for name in available_methods()]}


def _model_record(pool: ModelPool, name: str) -> dict[str, Any]:
    """``/api/models``' record of one model: its name, whether it is loaded and the default; once
    loaded, its family, target kind, the methods its family supports, those it does not (each with
    the reason the library refuses it with, `attnflow.methods.registry.unsupported_reason`) and
    auto's candidates."""
    model = pool.model_if_loaded(name)
    record: dict[str, Any] = {"name": name, "loaded": model is not None, "default": name == pool.default}
    if model is not None:
        from attnflow.evaluate.per_input import auto_methods
        from attnflow.methods.registry import available_methods, get_method, methods_for, unsupported_reason

        reasons = {method: unsupported_reason(get_method(method), model.adapter) for method in available_methods()}
        record.update(
            family=model.adapter.family,
            target_kind=model.target_kind,
            methods=methods_for(model.adapter),
            unsupported={method: reason for method, reason in reasons.items() if reason is not None},
            auto_candidates=auto_methods(model.adapter, model.target_kind),
        )
    return record


def _nothing(*_arguments: Any) -> None:
    """The estimate of a request with no work to estimate (a load: its model is measured as it loads)."""


def _explained(model: str, text: str | None = None) -> Answer:
    """The answer of /api/explain (with ``text``) and /api/generate: the explanations' JSON."""

    def answer(job: Job, explained: work.Explained) -> dict[str, Any]:
        shown = {"text": text} if text is not None else {}
        return {
            "id": job.id,
            "model": model,
            **shown,
            "elapsed_ms": _elapsed_ms(job),
            "estimated_s": job.estimate_s,
            "explanations": [work.answer_record(explanation) for explanation in explained.explanations],
            "skipped": [{"method": name, "reason": reason} for name, reason in explained.skipped.items()],
        }

    return answer


def _add_explain_routes(app: FastAPI, service: _Service) -> None:
    """``/api/explain`` and ``/api/generate``: explanations, kept for downloads, as `attnflow explain` makes them."""

    @app.post("/api/explain", response_model=None, summary="explain a text, as `attnflow explain TEXT --json` does")
    async def explain(body: ExplainRequest, request: Request) -> Response:
        service.check_text(body.text)
        service.check_text(body.target_text, "target text")
        return await service.explained(request, body, work.check_explain, work.estimate_explain, work.explain_text)

    @app.post(
        "/api/generate",
        response_model=None,
        summary="explain every generated token, as `attnflow explain --generate N` does",
    )
    async def generate(body: GenerateRequest, request: Request) -> Response:
        service.check_text(body.text, "prompt")
        service.check_text(body.continuation, "continuation")
        limit = service.config.max_new_tokens
        if body.generate is not None and body.generate > limit:
            raise ServeError(413, f"generate at most {limit} tokens on this server, not {body.generate}")
        return await service.explained(request, body, work.check_generate, work.estimate_generate, work.generate_text)


def _add_view_routes(app: FastAPI, service: _Service) -> None:
    """``/api/compare`` (one method under two models), ``/api/explore`` (the explorer page),
    ``/api/routes`` (routes.json's content; its page is kept like the explorer's) and ``/api/why``
    (why.json's content and the page's evidence sections; the whole page kept like the explorer's)."""

    @app.post("/api/compare", response_model=None, summary="one method under two models, as `attnflow compare` does")
    async def compare(body: CompareRequest, request: Request) -> Response:
        service.check_text(body.text)
        asked = service.asked(work.check_compare, body)

        def answer(job: Job, comparison: Any) -> dict[str, Any]:
            return {"id": job.id, "elapsed_ms": _elapsed_ms(job), "comparison": comparison.to_dict()}

        _, _, response = await service.start(
            request, body.request_id, asked, work.estimate_compare, work.compare_models, answer
        )
        return response

    @app.post(
        "/api/explore",
        response_model=None,
        summary="the explorer page (layers, heads, matrices), as `attnflow explore` writes it",
    )
    async def explore(body: ExploreRequest, request: Request) -> Response:
        return await service.viewed(request, body, work.check_explore, work.estimate_explore, work.explore_text)

    @app.post("/api/routes", response_model=None, summary="information flow routes, as `attnflow routes` computes them")
    async def routes(body: RoutesRequest, request: Request) -> Response:
        return await service.viewed(request, body, work.check_routes, work.estimate_routes, work.routes_text)

    @app.post(
        "/api/why",
        response_model=None,
        summary="why the model gives its answer, as `attnflow why` reads it (the time limit is its budget)",
    )
    async def why(body: WhyRequest, request: Request) -> Response:
        service.check_text(body.text)
        service.check_text(body.corrupt, "counterfactual text")
        asked = service.asked(work.check_why, body)

        def answer(job: Job, result: Any) -> dict[str, Any]:
            timed = {"elapsed_ms": _elapsed_ms(job), "estimated_s": job.estimate_s}
            url = f"/api/explorer/{job.id}"
            return {"id": job.id, "model": asked.model, **timed, "url": url, "why": result[0], "page": result[1]}

        job, result, response = await service.start(
            request, body.request_id, asked, work.estimate_why, work.why_text, answer
        )
        service.keep_page(job, result[2], "why")
        return response


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
    """The kept results: explorer and routes pages, and each explanation's files."""
    kept = service.config.max_results

    @app.get(
        "/api/explorer/{page_id}",
        response_class=HTMLResponse,
        summary="a page made by /api/explore, /api/routes or /api/why",
    )
    def explorer(page_id: str) -> HTMLResponse:
        page = service.pages.get(page_id)
        if page is None:
            raise ServeError(404, f"no kept page {page_id!r} (the server keeps the last {kept})")
        return HTMLResponse(page)

    @app.get(
        "/api/results/{result_id}/{method}.{kind}",
        summary="a kept result's explanation.json / .html / .png, the files `attnflow explain` writes",
        response_class=Response,
    )
    async def download(result_id: str, method: str, kind: Literal["json", "html", "png"]) -> Response:
        explanation = (service.results.get(result_id) or {}).get(method)
        if explanation is None:
            raise ServeError(
                404, f"no kept result {result_id!r} with method {method!r} (the server keeps the last {kept})"
            )
        content = await service.in_files_thread(functools.partial(work.explanation_file, explanation, kind))
        media = {"json": "application/json", "html": "text/html; charset=utf-8", "png": "image/png"}[kind]
        stem = "generation" if hasattr(explanation, "generated") else "explanation"
        disposition = f'attachment; filename="{stem}-{method}.{kind}"'
        return Response(content, media_type=media, headers={"Content-Disposition": disposition})


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Read an abandoned future's outcome (its exception, if any), so asyncio does not log it as
    "never retrieved" with a traceback: the request that gave up has already said why, in one line."""
    if not future.cancelled():
        future.exception()


def _elapsed_ms(job: Job) -> float:
    return round(1000 * (time.monotonic() - job.started), 1)


# ----- guards and errors -------------------------------------------------------------------------


def _add_guards(app: FastAPI, service: _Service) -> None:
    """The checks before any route (`_Guard`), and every error as one JSON line."""
    app.add_middleware(_Guard, config=service.config, stopping=lambda: service.stopping)

    @app.exception_handler(ServeError)
    async def serve_error(_request: Request, error: ServeError) -> JSONResponse:
        return _error(error.status, str(error), error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's own answers (no such route, a method the route does not take, a body it could
        not parse) as one line, like every other error."""
        where = f"{request.method} {request.url.path}"
        allowed = {key.lower(): value for key, value in (error.headers or {}).items()}.get("allow", "another method")
        lines = {
            404: f"no such route: {where} (the API is under /api/; /openapi.json lists it)",
            405: f"{where}: the route takes {allowed}, not {request.method}",
            400: f"{where}: the body could not be read as JSON ({error.detail})",
        }
        return _error(error.status_code, lines.get(error.status_code, str(error.detail)), error.headers)

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


def _answer(error: Exception, operator_spelling: Callable[[str], str] = str) -> ServeError:
    """The status and line an exception answers with: bad input 400 (its parameters spelled as the
    JSON fields), anything unexpected 500 (also logged, with its traceback), a file the server could
    not write (`OutputError`: its own disk, not the request) included."""
    if isinstance(error, ServeError):
        return error
    if isinstance(error, Cancelled):
        return ServeError(409, str(error))
    if isinstance(error, ModelRefused):  # names the server's own options, as its operator set them
        return ServeError(403 if isinstance(error, PathRefused) else 404, spell(error, operator_spelling))
    if isinstance(error, ModelLoadError):
        return ServeError(404, spell(error, json_field))
    if isinstance(error, TooExpensive):
        return ServeError(413, spell(error, json_field))
    if isinstance(error, AttnflowError) and not isinstance(error, OutputError):  # not the server's own disk
        return ServeError(400, spell(error, json_field))
    LOG.error("a request failed", exc_info=error)
    return ServeError(500, f"the request failed ({type(error).__name__}: {error}); the server keeps serving")


class _Guard:
    """ASGI middleware: the token, the Host header, JSON bodies only and the body size limit (the body
    is read here, at most ``max_body_bytes`` of it, and replayed to the route), then security headers."""

    def __init__(self, app: Any, config: ServeConfig, stopping: Callable[[], bool]) -> None:
        self.app, self.config, self.stopping = app, config, stopping

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        config = self.config
        request = Request(scope)
        refusal = None
        if self.stopping():
            refusal = _error(503, f"{STOPPING}; try again once it is back")
        elif config.token is not None and not _has_token(request, config.token):
            refusal = _error(401, "this server needs its token: send 'Authorization: Bearer TOKEN' (or open /?token=…)")
        elif config.allowed_hosts is not None and request.url.hostname not in config.allowed_hosts:
            refusal = _error(400, f"unexpected Host header {request.url.hostname!r}")
        elif request.method == "POST" and _takes_json(request.url.path):
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


# POST routes that take only application/json: a cross-site form or beacon cannot send that type
# without the browser asking first (a CORS preflight, which this server never allows), so none of
# them can be posted from another site, not even the body-less cancel.
_JSON_ROUTES = (
    "/api/explain",
    "/api/generate",
    "/api/compare",
    "/api/explore",
    "/api/routes",
    "/api/why",
    "/api/load",
    "/api/cancel/{id}",
)


def _takes_json(path: str) -> bool:
    """``path`` is one of `_JSON_ROUTES`."""
    return path in _JSON_ROUTES or (path.startswith("/api/cancel/") and path.count("/") == 3)


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
    """The request carries ``token``: ``Authorization: Bearer T`` (the scheme in any case), the page's
    cookie, or (on the page itself, ``/``, which turns it into the cookie) ``?token=T``; an API route
    never takes it from the address, which logs and histories keep."""
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    candidates = [
        given.strip() if scheme.lower() == "bearer" else "",
        request.query_params.get("token", "") if request.url.path == "/" else "",
        request.cookies.get(TOKEN_COOKIE, ""),
    ]
    return any(_same(candidate, token) for candidate in candidates if candidate)


def _same(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode(), token.encode())


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """One JSON line: ``{"error": message}`` (newlines folded, so a client can show it as is)."""
    return JSONResponse({"error": " ".join(str(message).split())}, status_code=status, headers=headers)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("attnflow")
    except PackageNotFoundError:  # running from a source tree
        return "0"
