"""The audit HTTP API: the ``AuditService`` over JSON, its health probes and Prometheus metrics,
and the web view's static files.

Every ``/api`` route depends on ``auth.authenticated``; only ``/healthz``, ``/readyz``,
``/metrics``, the OpenAPI document and docs, and the static page itself are open. Errors keep
to ``{"detail": "..."}``: a bad filter is 422, a call nobody has 404, an ambiguous or settled
one 409, a database away 503, anything else a bare 500 (the exception is logged, redacted).

``create_app`` builds the app; ``serve_api`` runs one with uvicorn until told to stop;
``api_server_task`` does both, for ``toolledger api`` and for ``toolledger serve --api``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from alembic.runtime.migration import MigrationContext
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Connection, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from toolledger import __version__
from toolledger.audit.auth import Reader, TokenRing, Writer, ensure_safe_exposure
from toolledger.audit.service import (
    AmbiguousCallError,
    AuditService,
    NotResolvableError,
    Resolution,
    ResolutionKind,
)
from toolledger.audit.views import CallDetail, CallPage, CallView, SessionView
from toolledger.domain.queries import (
    DEFAULT_PAGE,
    MAX_FILTER_CHARS,
    MAX_PAGE,
    CallQuery,
    Cursor,
    QueryError,
    parse_effect_classes,
    parse_moment,
    parse_sort,
    parse_statuses,
)
from toolledger.domain.redaction import Redactor
from toolledger.domain.states import RESULT_STATUSES, CallStatus
from toolledger.errors import (
    CallNotFoundError,
    FencedError,
    SchemaNotCurrentError,
    TransitionError,
)
from toolledger.gateway.agents import AgentsGateway
from toolledger.ledger import configured_redactor
from toolledger.metrics import LedgerCollector, LedgerSnapshot
from toolledger.runtime.registry import ToolRegistry
from toolledger.settings import Settings
from toolledger.store import migrate
from toolledger.store.engine import create_engine, is_transient
from toolledger.store.schema import sessions, tool_calls

log = logging.getLogger("toolledger.api")

MAX_BODY_BYTES = 64 * 1024
"""A resolution's text is the largest body: a tool output an operator types or pastes."""
MAX_DETAIL_CHARS = 500
"""An error message quotes what was sent; a 10 KB filter is not echoed back whole."""
READY_TIMEOUT_SECONDS = 5.0
WEB_DIRECTORY = Path(__file__).with_name("web")
_PAGE_POLICY = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    b"img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
OPEN_PATHS = frozenset(
    {"/healthz", "/readyz", "/metrics", "/", "/ui", "/openapi.json", "/docs", "/docs/oauth2-redirect"}
)
"""Served without a token: probes, metrics, the API's own description and the static page
(which asks for a token and sends it with every data request)."""


# ------------------------------------------------------------------------------ bodies


class ResolveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: ResolutionKind = Field(
        description="output: it happened, this is its output; error: it did not, the model gets "
        "this message; rerun: running it again is safe."
    )
    text: str | None = Field(default=None, description="The output or the error message; none for rerun.")
    reason: str = Field(description="Why: recorded in the call's timeline with your token's name.")


class ResolveResponse(BaseModel):
    action: str = Field(
        description="submitted, abandoned, submit_failed, not_sent, rerun or left_for_service."
    )
    call: CallView


class UnwatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=2000, description="Recorded on the session.")


# ------------------------------------------------------------------------------- state


@dataclass
class ApiState:
    """What one app holds: its service, and what it must close when it stops."""

    service: AuditService
    engine: AsyncEngine
    head_revision: str | None
    redactor: Redactor
    owns_engine: bool
    owns_gateway: bool

    async def aclose(self) -> None:
        gateway = self.service.gateway
        if gateway is not None and self.owns_gateway:
            await gateway.close()
        if self.owns_engine:
            await self.engine.dispose()


def create_app(
    settings: Settings,
    *,
    engine: AsyncEngine | None = None,
    gateway: AgentsGateway | None = None,
    registry: ToolRegistry | None = None,
) -> FastAPI:
    """The audit API over ``settings``' ledger; refuses (ApiConfigurationError) to be built for
    a non-loopback ``api_host`` with no token configured."""
    tokens = TokenRing.from_settings(settings)
    ensure_safe_exposure(tokens, settings.api_host)
    if tokens.empty:
        log.warning(
            "no API token configured: anyone on this machine can read and resolve calls "
            "(set TOOLLEDGER_API_TOKENS to require one)"
        )
    redactor = api_redactor(settings)
    owns_engine = engine is None
    if engine is None:
        engine = create_engine(settings.database_url, **_pool_options(settings))
    owns_gateway = gateway is None
    if gateway is None:
        key = settings.openai_api_key
        gateway = AgentsGateway.connect(
            api_key=key.get_secret_value() if key else None,
            base_url=settings.openai_base_url,
            attempts=settings.submit_attempts,
        )
    service = AuditService(engine, settings, redactor=redactor, gateway=gateway, registry=registry)

    app = FastAPI(
        title="toolledger audit API",
        version=__version__,
        description="List, show and resolve the ledger's tool calls; list and watch sessions. "
        "Send `Authorization: Bearer <token>`.",
        lifespan=_lifespan,
        max_body_size=MAX_BODY_BYTES,
        redoc_url=None,
    )
    app.state.tokens = tokens
    app.state.api = ApiState(
        service=service,
        engine=engine,
        head_revision=migrate.head_revision(settings.database_url),
        redactor=redactor,
        owns_engine=owns_engine,
        owns_gateway=owns_gateway,
    )
    _add_error_handlers(app)
    # Added last, so outermost: nothing escapes it with a traceback.
    app.add_middleware(_SecurityHeaders)
    app.add_middleware(_ErrorBoundary, redactor=redactor)
    _add_routes(app)
    if WEB_DIRECTORY.is_dir():
        app.mount("/ui", StaticFiles(directory=WEB_DIRECTORY, html=True), name="ui")
    return app


def api_redactor(settings: Settings) -> Redactor:
    """The configured redaction, which masks the API tokens too: none may reach a log line."""
    return configured_redactor(settings)


def _pool_options(settings: Settings) -> dict[str, Any]:
    # Statement parameters are tool arguments and outputs: never in an error's text.
    options: dict[str, Any] = {"hide_parameters": True}
    if make_url(settings.database_url).get_backend_name() != "sqlite":
        options.update(pool_size=settings.database_pool_size, max_overflow=settings.database_max_overflow)
    return options


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    await _state(app).aclose()


def _state(app: FastAPI) -> ApiState:
    state: ApiState = app.state.api
    return state


def _audit(request: Request) -> AuditService:
    return _state(request.app).service


Audit = Annotated[AuditService, Depends(_audit)]


# ------------------------------------------------------------------------------ routes


def _add_routes(app: FastAPI) -> None:
    """The route table, flat on the app: ``app.routes`` is all of it (a test walks it)."""
    data: list[tuple[str, str, Callable[..., Any], Any, str]] = [
        ("GET", "/api/calls", list_calls, CallPage, "List calls, newest first, a page at a time"),
        ("POST", "/api/calls/{ref:path}/resolve", resolve_call, ResolveResponse, "Settle an unknown call"),
        ("GET", "/api/calls/{ref:path}", show_call, CallDetail, "A call and its timeline"),
        ("GET", "/api/sessions", list_sessions, list[SessionView], "Sessions, newest first"),
        ("GET", "/api/sessions/{session_id}", show_session, SessionView, "A session and its calls by status"),
        ("POST", "/api/sessions/{session_id}/watch", watch_session, SessionView, "Have `serve` follow it"),
        ("POST", "/api/sessions/{session_id}/unwatch", unwatch_session, SessionView, "Stop following it"),
    ]
    for method, path, endpoint, model, summary in data:
        app.add_api_route(path, endpoint, methods=[method], response_model=model, summary=summary)
    app.add_api_route("/healthz", healthz, methods=["GET"], summary="The process answers (no database check)")
    app.add_api_route(
        "/readyz", readyz, methods=["GET"], summary="The ledger database answers and its schema is current"
    )
    app.add_api_route(
        "/metrics", metrics, methods=["GET"], summary="Prometheus metrics", response_class=Response
    )
    app.add_api_route("/", home, methods=["GET"], include_in_schema=False)


async def list_calls(
    _principal: Reader,
    audit: Audit,
    session_id: str | None = None,
    turn_id: str | None = None,
    tool: Annotated[list[str] | None, Query(description="Tool name (repeatable).")] = None,
    status: Annotated[list[str] | None, Query(description="Status (repeatable, or comma-separated).")] = None,
    effect_class: Annotated[list[str] | None, Query(description="Effect class (repeatable).")] = None,
    since: Annotated[
        str | None, Query(description="Recorded at or after: ISO 8601, or a duration ago (24h).")
    ] = None,
    until: Annotated[str | None, Query(description="Recorded before: ISO 8601, or a duration ago.")] = None,
    unknown_only: Annotated[bool, Query(description="Only calls waiting for an operator.")] = False,
    q: Annotated[
        str | None, Query(description="Text in the tool name or the ids (case-insensitive).")
    ] = None,
    sort: Annotated[str, Query(description="created, finished, tool or status; '-' descends.")] = "-created",
    limit: Annotated[int, Query(description=f"1 to {MAX_PAGE}.")] = DEFAULT_PAGE,
    cursor: Annotated[str | None, Query(description="next_cursor of the previous page.")] = None,
) -> CallPage:
    statuses = parse_statuses(_present(status))
    if unknown_only:
        if statuses and CallStatus.UNKNOWN not in statuses:
            return CallPage(calls=[], next_cursor=None)
        statuses = (CallStatus.UNKNOWN,)
    sort_key, descending = parse_sort(sort)
    now = datetime.now(UTC)
    since, until = _blank_is_none(since), _blank_is_none(until)
    query = CallQuery(
        session_id=_blank_is_none(session_id),
        turn_id=_blank_is_none(turn_id),
        tool_names=tuple(_present(tool)),
        statuses=statuses,
        effect_classes=parse_effect_classes(_present(effect_class)),
        since=parse_moment(since, now) if since else None,
        until=parse_moment(until, now) if until else None,
        text=_blank_is_none(q),
        sort=sort_key,
        descending=descending,
        limit=limit,
        cursor=_cursor(cursor),
    )
    return await audit.list_calls(query)


async def resolve_call(ref: str, body: ResolveRequest, principal: Writer, audit: Audit) -> ResolveResponse:
    resolution = Resolution(kind=body.kind, operator=principal.name, reason=body.reason, text=body.text)
    report = await audit.resolve(ref, resolution)
    return ResolveResponse(action=report.action, call=report.call)


async def show_call(ref: str, _principal: Reader, audit: Audit) -> CallDetail:
    return await audit.show(ref)


async def list_sessions(
    _principal: Reader, audit: Audit, watched: bool | None = None, limit: int = 100
) -> list[SessionView]:
    if not 1 <= limit <= MAX_PAGE:
        raise QueryError(f"limit must be between 1 and {MAX_PAGE}, got {limit}")
    return await audit.session_list(watched=watched, limit=limit)


async def show_session(session_id: str, _principal: Reader, audit: Audit) -> SessionView:
    return await audit.session(_session_id(session_id))


async def watch_session(session_id: str, principal: Writer, audit: Audit) -> SessionView:
    await audit.watch(_session_id(session_id))
    log.info("session %r watched by %s", session_id, principal.name)
    return await audit.session(session_id)


async def unwatch_session(
    session_id: str, body: UnwatchRequest, principal: Writer, audit: Audit
) -> SessionView:
    await audit.unwatch(_session_id(session_id), f"{body.reason} (by {principal.name})")
    log.info("session %r unwatched by %s", session_id, principal.name)
    return await audit.session(session_id)


def _present(values: list[str] | None) -> list[str]:
    """Empty form fields mean "no filter": a web form sends ``tool=`` for an empty box."""
    return [v for v in values or [] if v != ""]


def _blank_is_none(value: str | None) -> str | None:
    return value if value else None


def _cursor(text: str | None) -> Cursor | None:
    return Cursor.decode(text) if text else None


def _session_id(session_id: str) -> str:
    if not session_id or len(session_id) > MAX_FILTER_CHARS or "\x00" in session_id:
        raise QueryError(f"a session id is 1 to {MAX_FILTER_CHARS} characters")
    return session_id


# ------------------------------------------------------------------------------ probes


async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def readyz(request: Request) -> JSONResponse:
    problem = await _not_ready_because(_state(request.app))
    if problem is not None:
        return JSONResponse({"status": "unavailable", "detail": problem}, status_code=503)
    return JSONResponse({"status": "ready"})


async def metrics(request: Request) -> Response:
    state = _state(request.app)
    snapshot: LedgerSnapshot | None = None
    try:
        async with asyncio.timeout(READY_TIMEOUT_SECONDS):
            snapshot = await _ledger_snapshot(state.engine)
    except (TimeoutError, SQLAlchemyError, OSError) as error:
        log.warning("metrics: the ledger could not be read: %s", state.redactor.text(_first_line(error)))
    ledger = CollectorRegistry(auto_describe=False)
    ledger.register(LedgerCollector(snapshot))
    # The process's own histograms and counters, then the ledger's gauges read just now.
    return Response(generate_latest(REGISTRY) + generate_latest(ledger), media_type=CONTENT_TYPE_LATEST)


async def home() -> RedirectResponse:
    return RedirectResponse("/ui/")


async def _not_ready_because(state: ApiState) -> str | None:
    try:
        async with asyncio.timeout(READY_TIMEOUT_SECONDS), state.engine.connect() as conn:
            current = await conn.run_sync(_schema_revision)
    except TimeoutError:
        return f"the ledger database did not answer within {READY_TIMEOUT_SECONDS:g}s"
    except (SQLAlchemyError, OSError) as error:
        # The details (host names) go to the log, not to an unauthenticated caller.
        log.warning("readiness: ledger database unreachable: %s", state.redactor.text(_first_line(error)))
        return f"the ledger database is unreachable ({type(error).__name__})"
    if current != state.head_revision:
        return (
            f"the ledger schema is at {current or 'no revision'}, this release needs "
            f"{state.head_revision}: run `toolledger migrate`"
        )
    return None


def _schema_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def _ledger_snapshot(engine: AsyncEngine) -> LedgerSnapshot:
    """One GROUP BY over the calls (the oldest waiting result rides along as a MIN), and one
    count of the watched sessions."""
    by_status_and_tool = select(
        tool_calls.c.status, tool_calls.c.tool_name, func.count(), func.min(tool_calls.c.finished_at)
    ).group_by(tool_calls.c.status, tool_calls.c.tool_name)
    watched = select(func.count()).select_from(sessions).where(sessions.c.watched.is_(True))
    async with engine.connect() as conn:
        rows = list(await conn.execute(by_status_and_tool))
        watched_count = int((await conn.execute(watched)).scalar_one())
    waiting_since = [
        _aware(finished) for status, _, _, finished in rows if status in RESULT_STATUSES and finished
    ]
    oldest = (datetime.now(UTC) - min(waiting_since)).total_seconds() if waiting_since else 0.0
    return LedgerSnapshot(
        calls={(status, tool): int(count) for status, tool, count, _ in rows},
        oldest_unsubmitted_result_age_seconds=max(oldest, 0.0),
        watched_sessions=watched_count,
    )


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


# ------------------------------------------------------------------------------ errors


def _add_error_handlers(app: FastAPI) -> None:
    def answer(status_code: int) -> Callable[[Request, Exception], Any]:
        async def handler(_request: Request, error: Exception) -> JSONResponse:
            return JSONResponse({"detail": _detail(str(error))}, status_code=status_code)

        return handler

    app.add_exception_handler(QueryError, answer(422))
    app.add_exception_handler(CallNotFoundError, answer(404))
    for conflict in (AmbiguousCallError, NotResolvableError, TransitionError, FencedError):
        app.add_exception_handler(conflict, answer(409))
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(SQLAlchemyError, _database_error)
    app.add_exception_handler(SchemaNotCurrentError, _database_error)


async def _invalid_request(_request: Request, error: Exception) -> JSONResponse:
    """One line per problem, naming the field; the value sent is not echoed."""
    assert isinstance(error, RequestValidationError)
    problems = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem.get("loc", ()) if part not in ("query", "body"))
        problems.append(f"{where or 'request'}: {problem.get('msg', 'invalid')}")
    return JSONResponse({"detail": _detail("; ".join(problems))}, status_code=422)


async def _database_error(request: Request, error: Exception) -> JSONResponse:
    if isinstance(error, SchemaNotCurrentError) or is_transient(error):
        log.warning(
            "%s %s: ledger database unavailable: %s",
            request.method,
            request.url.path,
            _state(request.app).redactor.text(_first_line(error)),
        )
        return JSONResponse({"detail": "the ledger database is unavailable: try again"}, status_code=503)
    raise error  # not the database being away: a bug, for the error boundary


def _detail(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + "..."


def _first_line(error: BaseException) -> str:
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class _ErrorBoundary:
    """Any exception left becomes a bare 500; its traceback is logged, redacted.

    Starlette's own handler would send the same 500 and then re-raise, so that the server
    logs the exception again, unredacted: it never gets that far.
    """

    def __init__(self, app: ASGIApp, redactor: Redactor) -> None:
        self.app = app
        self.redactor = redactor

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as error:
            text = self.redactor.text("".join(traceback.format_exception(error)))
            log.error("%s %s failed:\n%s", scope.get("method"), scope.get("path"), text)
            if not started:
                response = JSONResponse({"detail": "internal error"}, status_code=500)
                await response(scope, receive, send)


class _SecurityHeaders:
    """Audit data is not cached; nothing is sniffed, framed or referred elsewhere."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"x-content-type-options", b"nosniff"),
                    (b"x-frame-options", b"DENY"),
                    (b"referrer-policy", b"no-referrer"),
                ]
                if scope["path"].startswith("/api/"):
                    headers.append((b"cache-control", b"no-store"))
                if scope["path"].startswith("/ui"):
                    # The page's own files only: a value that slipped past textContent still
                    # could not run a script or send data anywhere else.
                    headers.append((b"content-security-policy", _PAGE_POLICY))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


# ----------------------------------------------------------------------------- serving


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: whoever runs it (``toolledger api``, ``serve``)
    owns SIGTERM and tells it to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when the protocol
    # says TCP; without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    return sock


async def serve_api(
    app: FastAPI,
    host: str,
    port: int,
    *,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[str, int], None] | None = None,
    log_level: str = "info",
) -> None:
    """Serve ``app`` until ``stop`` is set or the task is cancelled; ``on_listening(host, port)``
    is called once connections are accepted (with the real port when ``port`` is 0)."""
    ensure_safe_exposure(app.state.tokens, host)
    sock = listening_socket(host, port)
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=log_level,
        lifespan="on",
        server_header=False,
        timeout_graceful_shutdown=5,
    )
    server = _EmbeddedServer(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if serving.done():
                await serving
                raise RuntimeError("the audit API stopped while starting")
            await asyncio.sleep(0.02)
        if on_listening is not None:
            bound_host, bound_port = sock.getsockname()[:2]
            on_listening(bound_host, bound_port)
        stopping = asyncio.create_task((stop or asyncio.Event()).wait())
        try:
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        sock.close()


async def api_server_task(
    settings: Settings,
    *,
    engine: AsyncEngine | None = None,
    gateway: AgentsGateway | None = None,
    registry: ToolRegistry | None = None,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[str, int], None] | None = None,
    log_level: str = "info",
) -> None:
    """The audit API on ``settings.api_host``/``api_port`` until ``stop`` is set (or cancelled).

    ``toolledger serve --api`` runs it beside the service, sharing its stop event (and, if it
    likes, its engine and registry: then an operator's re-run executes in that process).
    """
    app = create_app(settings, engine=engine, gateway=gateway, registry=registry)
    await serve_api(
        app, settings.api_host, settings.api_port, stop=stop, on_listening=on_listening, log_level=log_level
    )


__all__ = ["ApiState", "api_redactor", "api_server_task", "create_app", "listening_socket", "serve_api"]
