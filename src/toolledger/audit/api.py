"""The audit HTTP API: the ``AuditService`` over JSON, its health probes and Prometheus metrics,
and the web view's static files.

Every ``/api`` route depends on ``auth.authenticated``; only ``/healthz``, ``/readyz``,
``/metrics`` (unless ``TOOLLEDGER_METRICS_TOKEN`` closes it), the OpenAPI document, the docs
page when enabled, and the static page itself are open. Errors keep to ``{"detail": "..."}``:
any request the API cannot use (a bad filter, reference or body, whoever noticed it: our
parsers or FastAPI's validation) is 400, a missing or invalid token 401, a read token on a
write 403, a call nobody has 404, the wrong method 405, an ambiguous or settled call (or one
no longer awaiting approval, or whose arguments are not those approved; or a bulk
resolution matching more calls than its max_calls) 409, a body over
64 KiB 413, a database away 503, anything else a bare 500 (the exception is logged,
redacted). The OpenAPI document declares exactly these (``_openapi``), and a contract test
holds the app to it.

Every route's JSON body is parsed once, strictly (``strict_json``, through the router's
route class): bounded in depth before any parser walks it, and refusing a key given twice
(``{"dry_run": true, "dry_run": false}`` is not a dry run nor a run: it is 400).

``create_app`` builds the app; ``serve_api`` runs one with uvicorn until told to stop;
``api_server_task`` does both, for ``toolledger api`` and for ``toolledger serve --api``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import traceback
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Body, Depends, FastAPI, HTTPException, Query, Request
from fastapi import Path as PathParameter
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from toolledger.audit import bulk
from toolledger.audit.auth import Principal, Reader, TokenRing, Writer, ensure_safe_exposure, metrics_reader
from toolledger.audit.docs import DOCS_PATHS, DOCS_POLICY, add_docs_routes
from toolledger.audit.exports import ExportWriter
from toolledger.audit.service import (
    MAX_OPERATOR_CHARS,
    MAX_REASON_CHARS,
    REASON_PATTERN,
    AmbiguousCallError,
    AuditService,
    Decision,
    NotAwaitingApprovalError,
    NotResolvableError,
    Resolution,
    ResolutionKind,
    ResolveAction,
)
from toolledger.audit.trail import TrailReport
from toolledger.audit.views import CallCountsView, CallDetail, CallPage, CallView, IntakeView, SessionView
from toolledger.domain.queries import (
    DEFAULT_PAGE,
    MAX_FILTER_CHARS,
    MAX_PAGE,
    MAX_TEXT_CHARS,
    MAX_TIME_CHARS,
    CallQuery,
    Cursor,
    QueryError,
    parse_effect_classes,
    parse_moment,
    parse_outcomes,
    parse_sort,
    parse_statuses,
)
from toolledger.domain.redaction import Redactor
from toolledger.domain.results import DENIED_PREFIX, TOOL_ERROR_MAX_CHARS
from toolledger.domain.states import CallStatus
from toolledger.errors import (
    CallNotFoundError,
    FencedError,
    SchemaNotCurrentError,
    TransitionError,
)
from toolledger.gateway.agents import AgentsGateway
from toolledger.metrics import LedgerCollector, LedgerSnapshot
from toolledger.runtime.composition import Runtime
from toolledger.runtime.http_serving import serve_app
from toolledger.runtime.registry import ToolRegistry
from toolledger.settings import Settings
from toolledger.store import migrate
from toolledger.store.engine import is_transient
from toolledger.version import __version__

log = logging.getLogger("toolledger.api")

MAX_BODY_BYTES = 64 * 1024
"""A resolution's text is the largest body: a tool output an operator types or pastes."""
MAX_BODY_DEPTH = 64
"""Objects and arrays inside one another in a body, the body's own included: deeper is 400,
said before anything walks the body (a parser, a validator, a check of repeated keys)."""
MAX_QUOTED_KEY_CHARS = 60
"""A repeated key is named in the refusal, cut to this length."""
MAX_DETAIL_CHARS = 500
"""An error message quotes what was sent; a 10 KB filter is not echoed back whole."""
MAX_REFERENCE_CHARS = 3 * MAX_FILTER_CHARS + 2
READY_TIMEOUT_SECONDS = 5.0
WEB_DIRECTORY = Path(__file__).with_name("web")
_PAGE_POLICY = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    b"img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
_DATA_POLICY = b"default-src 'none'; frame-ancestors 'none'"
"""Everything else is data: a browser shown it runs and loads nothing."""
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/", "/ui", "/openapi.json", *DOCS_PATHS})
"""Served without an API token: probes, metrics (unless a metrics token closes them), the
API's own description and docs, and the static page (which asks for a token and sends it
with every data request)."""
NO_NUL = "^[^\\u0000]*$"
"""A JSON Schema pattern: PostgreSQL cannot store NUL, so no filter may hold one."""


# ------------------------------------------------------------------------------ bodies


class ErrorDetail(BaseModel):
    detail: str = Field(description="What was wrong, in one line.")


def _unicode(text: str) -> str:
    # JSON may spell a lone surrogate (\ud800); Python then holds text that no database
    # driver, JSON encoder or Agents API can send on.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode text (a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class _OperatorBody(BaseModel):
    """What every operator's decision carries: why, and (only without tokens) who."""

    model_config = ConfigDict(extra="forbid")

    reason: Text = Field(
        min_length=1,
        max_length=MAX_REASON_CHARS,
        # The pattern is documentation: Resolution refuses a blank reason, with its own message.
        json_schema_extra={"pattern": REASON_PATTERN},
        description="Why, not blank: recorded in the call's timeline with your token's name.",
    )
    operator: Text | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_OPERATOR_CHARS,
        description="Who decides, only when the API has no tokens (loopback only): recorded "
        "instead of 'local'. With tokens the token's name is the operator, and this is 400.",
    )


class OutputResolution(_OperatorBody):
    kind: Literal["output"] = Field(description="It happened: this is its output.")
    text: Text = Field(description="The output the model is given, as the tool would have returned it.")


class ErrorResolution(_OperatorBody):
    kind: Literal["error"] = Field(description="It did not happen (or failed): the model gets this message.")
    text: Text = Field(min_length=1, max_length=TOOL_ERROR_MAX_CHARS, description="The error message.")


class RerunResolution(_OperatorBody):
    kind: Literal["rerun"] = Field(description="Running it again is safe: it is handed back to a handler.")


ResolveRequest = Annotated[OutputResolution | ErrorResolution | RerunResolution, Field(discriminator="kind")]


SHA256_PATTERN = "^[0-9a-f]{64}$"
DENIAL_MAX_CHARS = TOOL_ERROR_MAX_CHARS - len(DENIED_PREFIX)
"""A denial's reason is sent to the model after a fixed prefix, within a tool error's length."""


class _DecisionBody(_OperatorBody):
    arguments_sha256: str | None = Field(
        default=None,
        pattern=SHA256_PATTERN,
        description="The call's `arguments_sha256` as you saw it with its arguments: if the call's "
        "arguments are other, the decision is refused (409). Leave it out to decide on whatever "
        "the call holds.",
    )


class ApproveRequest(_DecisionBody):
    arguments_sha256: str = Field(
        pattern=SHA256_PATTERN,
        description="Required: the call's `arguments_sha256` as you saw it with its arguments. An "
        "approval is bound to them: if the call's arguments are other, it is refused (409).",
    )
    arguments: dict[str, Any] | None = Field(
        default=None,
        description="Amended arguments (a JSON object) the handler receives instead of the model's; "
        "both are kept. Checked as strictly as the model's (finite numbers, within the size limit), "
        "without a masked value ([REDACTED]), and against the tool's parameters, which only an API "
        "given the tools has (`serve --api`): elsewhere, or when they do not fit, 400 and nothing "
        "is stored. Leave it out to run the call as the model asked.",
    )


class DenyRequest(_DecisionBody):
    reason: Text = Field(
        min_length=1,
        max_length=DENIAL_MAX_CHARS,
        json_schema_extra={"pattern": REASON_PATTERN},
        description="Why, not blank: recorded in the call's timeline with your token's name, and sent "
        f"to the model as the call's failure (after {DENIED_PREFIX!r}).",
    )


class ResolveResponse(BaseModel):
    action: ResolveAction = Field(
        description="submitted; abandoned (the session no longer awaits it); submit_failed (left for "
        "the reconciler); not_sent (no Agents API configured here: `serve` submits it); rerun (ran "
        "again here and submitted); rerunning (re-opened, and being run again here in the "
        "background: follow the call); ran (approved, run here and submitted); left_for_service "
        "(re-opened or approved: `serve` runs it, or another worker took it first)."
    )
    call: CallView


RERUN_ACCEPTED = (
    "A re-run (`kind` rerun) is answered at once, before any handler runs: the call is re-opened "
    "(`pending`) and run again here in the background (`rerunning`; this API has the tools: "
    "`serve --api`), or by `serve` (`left_for_service`). A handler may run for minutes: follow "
    "the call with `GET /api/calls/{ref}` (pending, running, succeeded or failed, then "
    "`submitted`; or `abandoned` if the session no longer awaits it, `unknown` again if the run "
    "was cut off); its timeline says what happened."
)


MAX_BULK_SECONDS = 120
"""The longest one bulk resolution may hold its request open: longer is cut by proxies and
browsers alike (the calls would go on being resolved, the summary lost). Kept by the clock:
a run whose time is up stops and answers what it did and what it left (``stopped_early``);
the same request again takes up the rest. The CLI (`toolledger calls resolve --filter`) has
no such limit."""
BULK_NO_HOOK_HINT = (
    "verified: this API does not have the application's tools, so its verify hook cannot be asked: "
    "resolve it with `toolledger calls resolve --filter ... --tools`, or through `serve --api`"
)


BULK_DESCRIPTION = (
    "The filters are those of `GET /api/calls`, as query parameters; at least one besides the "
    "status must narrow the selection, and a status may only say `unknown`. Each call is resolved "
    "as `POST /api/calls/{ref}/resolve` would, with its own event in its timeline (your token's "
    "name, the reason, and the run's id). A `verified` call's hook is asked first where the API "
    "has the application's tools (`serve --api`); the stand-alone `toolledger api` has none and "
    f"skips those calls (`{bulk.SKIPPED_NO_HOOK}`). A dry run answers what the run would do, and "
    f"is refused as the run would be. One run selects at most {bulk.MAX_CALLS} calls, and must "
    f"fit `max_seconds` (at most {MAX_BULK_SECONDS}, the default) at its rate (matched / rate), "
    "else 400.\n\n"
    "**The time is kept by the clock.** Resolving a call takes its own time too (a verify hook, "
    "a submission), so a run may not end when its rate says. No call is started that, taking as "
    "long as the slowest so far, would end after `max_seconds` (counted from when the request "
    "arrived); a call under way is always finished. The answer then says `stopped_early: true`, "
    "with `done` (the calls gone through, each in `calls`) and `left` (the calls not reached: "
    "untouched, still unknown), and `how_to_continue`: send the same request again, which selects "
    "only the calls still unknown (those resolved are not, those skipped are again), until "
    "`stopped_early` is false. Nothing is resolved after the answer. For one long run, use "
    "`toolledger calls resolve --filter`."
)


class _BulkOptions(BaseModel):
    dry_run: StrictBool = Field(
        description="true: answer which calls would be resolved, and how, changing nothing. false: "
        "resolve them. Required: there is no confirmation step here, so say which you mean."
    )
    rate: float = Field(
        default=bulk.DEFAULT_RATE,
        gt=0,
        le=bulk.MAX_RATE,
        description="Calls resolved per second at most. The run must fit `max_seconds` at this "
        "rate (matched / rate), else 400.",
    )
    max_calls: int | None = Field(
        default=None,
        ge=0,
        le=bulk.MAX_CALLS,
        description="Refuse (409) if more calls match than this: send a dry run's `matched`, so "
        "that calls recorded since the dry run are not resolved unseen.",
    )
    max_seconds: float = Field(
        default=MAX_BULK_SECONDS,
        gt=0,
        le=MAX_BULK_SECONDS,
        description="How long this request may take, in seconds, from its arrival (at most "
        f"{MAX_BULK_SECONDS}, the default): lower it to fit a proxy's timeout. Kept by the clock: "
        "the run stops in time and says what it left (`stopped_early`).",
    )


class BulkOutputResolution(OutputResolution, _BulkOptions):
    pass


class BulkErrorResolution(ErrorResolution, _BulkOptions):
    pass


class BulkRerunResolution(RerunResolution, _BulkOptions):
    pass


BulkResolveRequest = Annotated[
    BulkOutputResolution | BulkErrorResolution | BulkRerunResolution, Field(discriminator="kind")
]


class BulkResolveItem(BaseModel):
    action: str = Field(
        description="What happened to the call: a resolution's action (submitted, not_sent, "
        f"left_for_service, ...); or {bulk.SETTLED_BY_HOOK} (its verify hook found it happened: "
        f"the true outcome was submitted), {bulk.SKIPPED_NO_HOOK} (verified, and this API has no "
        f"tools to ask its hook), {bulk.SKIPPED_CONTRADICTED} (the hook says it did not happen: "
        f"not told otherwise), {bulk.SKIPPED_CHANGED} (settled meanwhile). A dry run: "
        f"{bulk.WOULD_RESOLVE}, {bulk.WOULD_VERIFY}, {bulk.WOULD_SKIP_NO_HOOK}."
    )
    note: str | None = Field(default=None, description="Why, where the action alone does not say.")
    call: CallView = Field(description="The call as it is now (as it was, in a dry run).")


class BulkResolveResponse(BaseModel):
    run_id: str = Field(description="Named in each resolved call's reason: `(bulk RUN_ID, 3/12)`.")
    dry_run: bool
    matched: int = Field(description="The unknown calls the filters selected.")
    estimated_seconds: float = Field(description="matched / rate: how long the run takes, at least.")
    stopped_early: bool = Field(
        description="true: `max_seconds` ran out before every matched call was reached; `left` "
        "calls were not touched. Send the same request again to go on (`how_to_continue`). "
        "Always false for a dry run."
    )
    done: int = Field(
        description="Calls gone through (resolved, settled by a hook, or skipped): each in `calls`."
    )
    left: int = Field(description="Matched calls not reached (stopped early): untouched, still unknown.")
    how_to_continue: str | None = Field(
        description="When stopped early: what to send to resolve the calls left. Else null."
    )
    elapsed_seconds: float = Field(description="How long the run took (not counting the selection).")
    counts: dict[str, int] = Field(description="How many calls came to each action.")
    calls: list[BulkResolveItem] = Field(
        description="Each call gone through, in the order resolved (newest first, as listed)."
    )


class UnwatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: Text = Field(min_length=1, max_length=2000, description="Recorded on the session.")


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready", "unavailable"]
    detail: str | None = Field(default=None, description="Why not ready.")


# ------------------------------------------------------------------------------- state


@dataclass
class ApiState:
    """What one app holds: its service over a runtime, and whether it closes that runtime
    when it stops (it does when it built it)."""

    service: AuditService
    head_revision: str | None
    owns_runtime: bool

    @property
    def runtime(self) -> Runtime:
        return self.service.runtime

    @property
    def engine(self) -> AsyncEngine:
        return self.runtime.engine

    @property
    def redactor(self) -> Redactor:
        return self.runtime.redactor

    async def aclose(self) -> None:
        # Operators' re-runs still going get the shutdown grace, as `serve`'s calls do; the
        # rest are cut off (unknown again once their leases run out).
        cut = await self.service.stop_reruns(self.runtime.settings.shutdown_grace_seconds)
        for key in cut:
            log.warning("shutdown: the operator's re-run of call %s was cut off", key)
        if self.owns_runtime:
            await self.runtime.aclose()


def create_app(
    settings: Settings,
    *,
    engine: AsyncEngine | None = None,
    gateway: AgentsGateway | None = None,
    registry: ToolRegistry | None = None,
    runtime: Runtime | None = None,
) -> FastAPI:
    """The audit API over ``settings``' ledger; refuses (ApiConfigurationError) to be built for
    a non-loopback ``api_host`` with no token configured, with a weak or shared token, or with
    /docs asked for and Swagger UI's files not installed.

    Its engine and gateway come from ``runtime`` (left open when the app stops), else from
    one built here over ``engine`` and ``gateway`` if given. Without a gateway, resolutions
    are submitted only to an Agents API that ``settings`` configure
    (``Runtime.configured_gateway``)."""
    tokens = TokenRing.from_settings(settings)
    ensure_safe_exposure(tokens, settings.api_host)
    if tokens.empty:
        log.warning(
            "no API token configured: anyone on this machine can read and resolve calls "
            "(set TOOLLEDGER_API_TOKENS to require one)"
        )
    owns_runtime = runtime is None
    if runtime is None:
        runtime = Runtime.from_settings(settings, engine=engine, gateway=gateway)
    redactor = runtime.redactor
    app = FastAPI(
        title="toolledger audit API",
        version=__version__,
        description="List, show and resolve the ledger's tool calls; list and watch sessions. "
        'Send `Authorization: Bearer <token>`. Every error is `{"detail": "..."}`; any request '
        "the API cannot use is 400. A JSON body is read strictly, on every route that takes one: "
        f"UTF-8, nested at most {MAX_BODY_DEPTH} levels deep (objects and arrays, the body's own "
        "included), each key at most once in an object, no NaN or Infinity; else 400, saying "
        "which (a repeated key is named), before anything else reads the body.",
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )
    # Every route added from here on parses its JSON body strictly (``strict_json``).
    app.router.route_class = _StrictJsonRoute
    if settings.api_docs:
        add_docs_routes(app)
    app.state.tokens = tokens
    app.state.api = ApiState(
        service=AuditService(runtime, registry=registry),
        head_revision=migrate.head_revision(settings.database_url),
        owns_runtime=owns_runtime,
    )
    _add_error_handlers(app)
    # Added last, so outermost: nothing escapes the boundary with a traceback. The body limit
    # is inside it and answers for itself: an oversized body is the client's doing.
    app.add_middleware(_BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(_SecurityHeaders)
    app.add_middleware(_ErrorBoundary, redactor=redactor)
    _add_routes(app)
    if WEB_DIRECTORY.is_dir():
        app.mount("/ui", StaticFiles(directory=WEB_DIRECTORY, html=True), name="ui")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


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

_MEANINGS = {
    400: "A filter, reference or body the API cannot use (a body nested more than "
    f"{MAX_BODY_DEPTH} levels deep, or giving a key twice in one object, included); the detail "
    "says which and why.",
    401: "No bearer token, or not a configured one.",
    403: "A read-only token where the ledger would change; or, with no token configured, a request "
    "not addressed to this machine's loopback address.",
    404: "Nothing by that name in the ledger.",
    405: "The path ends in /resolve, /approve or /deny, which take POST only.",
    409: "The reference names several calls (give SESSION/TURN/CALL), or the call is not in the "
    "state the action needs (only an unknown outcome can be resolved, only a call awaiting "
    "approval approved or denied, and approved only before its deadline: not approved in "
    "time), or its arguments are not the sha256 given, or it changed meanwhile; or more calls "
    "match a bulk resolution than its max_calls.",
    413: f"The body is over {MAX_BODY_BYTES // 1024} KiB.",
    503: "The ledger database is unavailable (or its schema is not current): try again.",
}
_EVERY_API_ROUTE = (400, 401, 403, 503)


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorDetail, "description": _MEANINGS[code]} for code in codes}


def _add_routes(app: FastAPI) -> None:
    """The route table, flat on the app: ``app.routes`` is all of it (a test walks it)."""
    data: list[tuple[str, str, Callable[..., Any], Any, str, tuple[int, ...]]] = [
        ("GET", "/api/calls", list_calls, CallPage, "List calls, newest first, a page at a time", ()),
        (
            "GET",
            "/api/counts",
            count_calls,
            CallCountsView,
            "Count the calls the filters match, by status and by outcome",
            (),
        ),
        (
            "POST",
            "/api/calls/{ref:path}/resolve",
            resolve_call,
            ResolveResponse,
            "Settle an unknown call",
            (404, 409, 413),
        ),
        (
            "POST",
            "/api/calls/{ref:path}/approve",
            approve_call,
            ResolveResponse,
            "Let a call awaiting approval run once, maybe with amended arguments",
            (404, 409, 413),
        ),
        (
            "POST",
            "/api/calls/{ref:path}/deny",
            deny_call,
            ResolveResponse,
            "Refuse a call awaiting approval: the model gets the reason",
            (404, 409, 413),
        ),
        ("GET", "/api/calls/{ref:path}", show_call, CallDetail, "A call and its timeline", (404, 405, 409)),
        (
            # Not under /api/calls: that path's reference swallows slashes, so any path there
            # could name a call.
            "POST",
            "/api/bulk/resolve",
            bulk_resolve,
            BulkResolveResponse,
            "Resolve every unknown call the filters select, one by one, at a bounded rate",
            (409, 413),
        ),
        (
            "GET",
            "/api/trail",
            verify_trail,
            TrailReport,
            "Recompute the audit trail's hash chains: one call, a session's calls, or every call",
            (404, 409),
        ),
        ("GET", "/api/sessions", list_sessions, list[SessionView], "Sessions, newest first", ()),
        (
            "GET",
            "/api/sessions/{session_id}",
            show_session,
            SessionView,
            "A session and its calls by status",
            (404,),
        ),
        (
            "POST",
            "/api/sessions/{session_id}/watch",
            watch_session,
            SessionView,
            "Have `serve` follow it",
            (),
        ),
        (
            "POST",
            "/api/sessions/{session_id}/unwatch",
            unwatch_session,
            SessionView,
            "Stop following it",
            (404, 413),
        ),
        (
            "GET",
            "/api/intake",
            show_intake,
            IntakeView,
            "How sessions come in: intake modes, looks due, webhook counts, each agent's sweep",
            (),
        ),
    ]
    described = {
        "/api/bulk/resolve": BULK_DESCRIPTION,
        "/api/calls/{ref:path}/resolve": RERUN_ACCEPTED,
        "/api/intake": INTAKE_DESCRIPTION,
    }
    accepted: dict[str, dict[int | str, dict[str, Any]]] = {
        "/api/calls/{ref:path}/resolve": {
            202: {
                "model": ResolveResponse,
                "description": "A re-run, accepted: the call is re-opened and runs in the background "
                "(`rerunning`) or in `serve` (`left_for_service`); follow it with GET /api/calls/{ref}.",
            }
        }
    }
    for method, path, endpoint, model, summary, errors in data:
        app.add_api_route(
            path,
            endpoint,
            methods=[method],
            response_model=model,
            summary=summary,
            description=described.get(path),
            responses={**accepted.get(path, {}), **_errors(*sorted({*_EVERY_API_ROUTE, *errors}))},
            dependencies=[Depends(_each_given_once)],
        )
    app.add_api_route(
        "/api/export",
        export_calls,
        methods=["GET"],
        response_class=StreamingResponse,
        summary="Export the calls the filters match, each with its trail's chain head",
        description="JSON lines or CSV (a header first), streamed, as `toolledger calls export` writes "
        "them: the last line is the digest of every byte before it (docs/audit-trail.md). A "
        "stream cut short has no digest line.",
        responses={
            200: {
                "content": {media: {"schema": {"type": "string"}} for media in EXPORT_MEDIA_TYPES.values()},
                "description": "The export.",
            },
            **_errors(*_EVERY_API_ROUTE),
        },
        dependencies=[Depends(_each_given_once)],
    )
    app.add_api_route(
        "/healthz",
        healthz,
        methods=["GET"],
        response_model=Health,
        summary="The process answers (no database check)",
    )
    app.add_api_route(
        "/readyz",
        readyz,
        methods=["GET"],
        response_model=Readiness,
        summary="The ledger database answers and its schema is current",
        responses={503: {"model": Readiness, "description": "Not ready: the detail says why."}},
    )
    app.add_api_route(
        "/metrics",
        metrics,
        methods=["GET"],
        summary="Prometheus metrics",
        description="Needs a bearer token (the metrics token or any API token) when "
        "TOOLLEDGER_METRICS_TOKEN is set.",
        response_class=Response,
        dependencies=[Depends(metrics_reader)],
        responses={
            200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}, "description": "Metrics"},
            **_errors(401),
        },
    )
    app.add_api_route("/", home, methods=["GET"], include_in_schema=False)


_ToolName = Annotated[str, Field(max_length=MAX_FILTER_CHARS, json_schema_extra={"pattern": NO_NUL})]


def _text_filter(description: str, max_length: int = MAX_FILTER_CHARS) -> Any:
    return Query(description=description, max_length=max_length, json_schema_extra={"pattern": NO_NUL})


async def call_filters(
    session_id: Annotated[str | None, _text_filter("Session id; empty: any.")] = None,
    turn_id: Annotated[str | None, _text_filter("Turn id; empty: any.")] = None,
    # A plain array, not "array or null": a query carries only strings, and a tool may be
    # named "false" or "null", which a schema allowing null would call another type.
    tool: Annotated[list[_ToolName], Query(description="Tool name (repeatable).")] = [],  # noqa: B006 - FastAPI copies it
    # Plain arrays too: with null allowed, a value that a query spells as "" (how an empty
    # form field comes) would be "null" to the document and a filter-less list to the API.
    status: Annotated[
        list[str],
        Query(
            description="Status (repeatable, or comma-separated): "
            + ", ".join(status.value for status in CallStatus)
            + "."
        ),
    ] = [],  # noqa: B006 - FastAPI copies it
    outcome: Annotated[
        list[str],
        Query(
            description="Outcome (repeatable, or comma-separated): succeeded or failed, whatever the "
            "status (a failure stays failed once submitted)."
        ),
    ] = [],  # noqa: B006 - FastAPI copies it
    effect_class: Annotated[
        list[str], Query(description="Effect class (repeatable, or comma-separated).")
    ] = [],  # noqa: B006 - FastAPI copies it
    since: Annotated[
        str | None,
        Query(
            description="Recorded at or after: ISO 8601, or a duration ago (24h; s, m, h, d or w, "
            "at most 100000 of them).",
            max_length=MAX_TIME_CHARS,
        ),
    ] = None,
    until: Annotated[
        str | None,
        Query(description="Recorded before: ISO 8601, or a duration ago.", max_length=MAX_TIME_CHARS),
    ] = None,
    unknown_only: Annotated[bool, Query(description="Only calls waiting for an operator.")] = False,
    q: Annotated[
        str | None,
        _text_filter("Text in the tool name or the ids (case-insensitive).", max_length=MAX_TEXT_CHARS),
    ] = None,
) -> CallQuery | None:
    """The filters of a listing and of its counts alike; None: they contradict each other
    (only unknown calls, and a status that is not unknown), so nothing matches."""
    statuses = parse_statuses(_present(status))
    if unknown_only:
        if statuses and CallStatus.UNKNOWN not in statuses:
            return None
        statuses = (CallStatus.UNKNOWN,)
    now = datetime.now(UTC)
    since, until = _blank_is_none(since), _blank_is_none(until)
    return CallQuery(
        session_id=_blank_is_none(session_id),
        turn_id=_blank_is_none(turn_id),
        tool_names=tuple(_present(tool)),
        statuses=statuses,
        outcomes=parse_outcomes(_present(outcome)),
        effect_classes=parse_effect_classes(_present(effect_class)),
        since=parse_moment(since, now) if since else None,
        until=parse_moment(until, now) if until else None,
        text=_blank_is_none(q),
    )


CallFilters = Annotated[CallQuery | None, Depends(call_filters)]


async def list_calls(
    _principal: Reader,
    audit: Audit,
    filters: CallFilters,
    sort: Annotated[
        str, Query(description="created, finished, tool or status; '-' descends.", max_length=10)
    ] = "-created",
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description=f"1 to {MAX_PAGE}.")] = DEFAULT_PAGE,
    cursor: Annotated[
        str | None,
        Query(description="next_cursor of the previous page, unchanged (anything else is 400)."),
    ] = None,
) -> CallPage:
    sort_key, descending = parse_sort(sort)
    page_cursor = _cursor(cursor)
    if filters is None:
        return CallPage(calls=[], next_cursor=None)
    query = replace(filters, sort=sort_key, descending=descending, limit=limit, cursor=page_cursor)
    return await audit.list_calls(query)


async def count_calls(_principal: Reader, audit: Audit, filters: CallFilters) -> CallCountsView:
    if filters is None:
        return CallCountsView(total=0, by_status={}, by_outcome={}, failed_by_stage={})
    return await audit.counts(filters)


_Reference = Annotated[
    str,
    PathParameter(
        description="The call's id (tl_..., or a unique prefix of it), its call id, or SESSION/TURN/CALL.",
        min_length=1,
        max_length=MAX_REFERENCE_CHARS,
        json_schema_extra={"pattern": NO_NUL},
    ),
]
_SessionId = Annotated[
    str,
    PathParameter(min_length=1, max_length=MAX_FILTER_CHARS, json_schema_extra={"pattern": NO_NUL}),
]


def _operator(principal: Principal, body: _OperatorBody) -> str:
    """The token's name; without tokens (loopback only) whoever the body names, else 'local'."""
    if body.operator is None:
        return principal.name
    if not principal.local:
        raise QueryError("operator: with API tokens the operator is your token's name; leave it out")
    return body.operator.strip()


async def resolve_call(
    ref: _Reference, body: Annotated[ResolveRequest, Body()], principal: Writer, audit: Audit
) -> ResolveResponse | JSONResponse:
    """An output or an error is settled and submitted before the answer (200); a re-run is
    answered at once, 202 (RERUN_ACCEPTED)."""
    resolution = Resolution(
        kind=ResolutionKind(body.kind),
        operator=_operator(principal, body),
        reason=body.reason,
        text=None if isinstance(body, RerunResolution) else body.text,
    )
    report = await audit.resolve(ref, resolution, wait=False)
    answer = ResolveResponse.model_validate({"action": report.action, "call": report.call})
    if resolution.kind is ResolutionKind.RERUN:
        return JSONResponse(answer.model_dump(mode="json"), status_code=202)
    return answer


async def approve_call(
    ref: _Reference, body: ApproveRequest, principal: Writer, audit: Audit, request: Request
) -> ResolveResponse:
    if body.arguments is not None:
        _refuse_repeated_keys(await request.body())
    decision = Decision(
        operator=_operator(principal, body),
        reason=body.reason,
        arguments_sha256=body.arguments_sha256,
        # Text, as the CLI passes it: the service checks it as strictly as the model's.
        amended_arguments=None if body.arguments is None else json.dumps(body.arguments),
    )
    report = await audit.approve(ref, decision)
    return ResolveResponse.model_validate({"action": report.action, "call": report.call})


async def bulk_resolve(
    principal: Writer,
    filters: CallFilters,
    body: Annotated[BulkResolveRequest, Body()],
    request: Request,
) -> BulkResolveResponse:
    """Every unknown call ``filters`` select, resolved one by one (BULK_DESCRIPTION)."""
    stop_at = asyncio.get_running_loop().time() + body.max_seconds
    if filters is None:
        raise QueryError("only calls whose outcome is unknown can be resolved: filter on status unknown")
    if not _narrows(filters):
        raise QueryError(
            "say which unknown calls to resolve: give at least one filter besides the status "
            "(session_id, turn_id, tool, effect_class, since, until, q)"
        )
    resolution = Resolution(
        kind=ResolutionKind(body.kind),
        operator=_operator(principal, body),
        reason=body.reason,
        text=None if isinstance(body, BulkRerunResolution) else body.text,
    )
    resolver = bulk.BulkResolver(_audit(request), rate=body.rate, no_hook_hint=BULK_NO_HOOK_HINT)
    calls = await resolver.matching(filters)
    seconds = len(calls) / body.rate
    if seconds > body.max_seconds:
        raise QueryError(
            f"{len(calls)} calls at {body.rate:g} per second take {seconds:.0f} s, more than the "
            f"{body.max_seconds:g} s this request may (max_seconds, at most {MAX_BULK_SECONDS}): "
            f"narrow the filters, raise the rate (at most {bulk.MAX_RATE:g}), or use "
            "`toolledger calls resolve --filter`"
        )
    if body.max_calls is not None and len(calls) > body.max_calls:
        raise NotResolvableError(
            f"the filters now select {len(calls)} unknown calls, more than max_calls "
            f"({body.max_calls}): look again with a dry run"
        )
    report = await resolver.resolve_calls(calls, resolution, dry_run=body.dry_run, stop_at=stop_at)
    if not body.dry_run:
        log.info(
            "bulk resolution %s by %s: %d of %d call(s) by %s in %.1f s%s: %s",
            report.run_id,
            resolution.operator,
            report.done,
            report.matched,
            resolution.kind.value,
            report.elapsed_seconds,
            f" (stopped at max_seconds {body.max_seconds:g}: {report.left} left)"
            if report.stopped_early
            else "",
            report.counts,
        )
    return BulkResolveResponse.model_validate(
        {
            "run_id": report.run_id,
            "dry_run": report.dry_run,
            "matched": report.matched,
            "estimated_seconds": seconds,
            "stopped_early": report.stopped_early,
            "done": report.done,
            "left": report.left,
            "how_to_continue": _how_to_continue(report, body.max_seconds),
            "elapsed_seconds": round(report.elapsed_seconds, 3),
            "counts": report.counts,
            "calls": [{"action": i.action, "note": i.note, "call": i.call} for i in report.items],
        }
    )


def _how_to_continue(report: bulk.BulkReport, max_seconds: float) -> str | None:
    if not report.stopped_early:
        return None
    return (
        f"stopped at max_seconds ({max_seconds:g} s) after {report.done} of {report.matched} calls; "
        f"the {report.left} left are untouched: send the same request again (it selects only the "
        "calls still unknown) until stopped_early is false, or resolve them with "
        "`toolledger calls resolve --filter`"
    )


def _narrows(query: CallQuery) -> bool:
    """Some filter besides the status selects calls: a bulk resolution takes unknown calls
    only, so "status unknown" alone would be every one the ledger holds."""
    return any(
        (
            query.session_id,
            query.turn_id,
            query.tool_names,
            query.outcomes,
            query.effect_classes,
            query.since,
            query.until,
            query.text,
        )
    )


def _refuse_repeated_keys(raw: bytes) -> None:
    """A JSON parser keeps the last of a repeated key, silently; amended arguments are held to
    the model's rules, which refuse one (which amount did the approver mean?)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({key for key, _ in pairs}) != len(pairs):
            raise QueryError("a key appears twice in one object of the body: which one was meant?")
        return dict(pairs)

    json.loads(raw, object_pairs_hook=unique)


async def deny_call(ref: _Reference, body: DenyRequest, principal: Writer, audit: Audit) -> ResolveResponse:
    decision = Decision(
        operator=_operator(principal, body), reason=body.reason, arguments_sha256=body.arguments_sha256
    )
    report = await audit.deny(ref, decision)
    return ResolveResponse.model_validate({"action": report.action, "call": report.call})


POST_ONLY = ("resolve", "approve", "deny")
"""The actions on a call, each a POST to ``/api/calls/{ref}/<action>``."""


async def show_call(ref: _Reference, _principal: Reader, audit: Audit) -> CallDetail:
    action = ref.rsplit("/", 1)[-1]
    if "/" in ref and action in POST_ONLY:
        # Routing gives a GET of .../resolve (or .../approve, .../deny) to this route (its path
        # swallows slashes): it is that action asked with the wrong method, not a reference.
        raise HTTPException(405, f"{action} takes POST", headers={"Allow": "POST"})
    return await audit.show(ref)


EXPORT_MEDIA_TYPES = {"jsonl": "application/x-ndjson", "csv": "text/csv; charset=utf-8"}


async def export_calls(
    _principal: Reader,
    audit: Audit,
    filters: CallFilters,
    export_format: Annotated[
        Literal["jsonl", "csv"], Query(alias="format", description="jsonl or csv.")
    ] = "jsonl",
    sort: Annotated[
        str, Query(description="created, finished, tool or status; '-' descends.", max_length=10)
    ] = "-created",
) -> StreamingResponse:
    sort_key, descending = parse_sort(sort)
    query = None if filters is None else replace(filters, sort=sort_key, descending=descending)

    async def lines() -> AsyncIterator[bytes]:
        if query is None:
            # Filters that contradict each other match nothing: an export of no call.
            writer = ExportWriter(export_format)
            for line in (writer.header(), writer.digest()):
                if line is not None:
                    yield line.text.encode("utf-8")
            return
        async for line in audit.export(query, export_format):
            yield line.text.encode("utf-8")

    return StreamingResponse(
        lines(),
        media_type=EXPORT_MEDIA_TYPES[export_format],
        headers={"Content-Disposition": f'attachment; filename="toolledger-calls.{export_format}"'},
    )


MAX_TRAIL_BREAKS = 1000


async def verify_trail(
    _principal: Reader,
    audit: Audit,
    call: Annotated[
        str | None,
        Query(
            description="One call: its id (tl_..., or a unique prefix of it), its call id, or "
            "SESSION/TURN/CALL.",
            min_length=1,
            max_length=MAX_REFERENCE_CHARS,
            json_schema_extra={"pattern": NO_NUL},
        ),
    ] = None,
    session_id: Annotated[str | None, _text_filter("Every call of this session.")] = None,
    whole_ledger: Annotated[
        bool,
        Query(
            alias="all",
            description="Every call in the ledger (as long as `toolledger calls verify-trail --all`).",
        ),
    ] = False,
    limit: Annotated[
        int, Query(ge=1, le=MAX_TRAIL_BREAKS, description=f"Broken calls listed, 1 to {MAX_TRAIL_BREAKS}.")
    ] = 100,
    keyed: Annotated[
        bool,
        Query(
            description="Also check every event's keyed MAC with the server's TOOLLEDGER_TRAIL_KEY "
            "(400 when it has none); an event without one is a break."
        ),
    ] = False,
) -> TrailReport:
    """``intact`` false: some trail is broken (an event, or a call's content changed after its
    last event); each broken call's first broken link is listed (up to ``limit``). Exactly one
    of ``call``, ``session_id`` or ``all=true``."""
    session_id = _blank_is_none(session_id)
    if sum([call is not None, session_id is not None, whole_ledger]) != 1:
        raise QueryError("give exactly one of call, session_id or all=true")
    scope = await audit.trail_scope(call, session_id=session_id)
    return await audit.verify_trail(scope, keyed=keyed, max_listed=limit)


async def list_sessions(
    _principal: Reader,
    audit: Audit,
    watched: Annotated[bool | None, Query(description="Only watched (true) or unwatched (false).")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description=f"1 to {MAX_PAGE}.")] = 100,
) -> list[SessionView]:
    return await audit.session_list(watched=watched, limit=limit)


async def show_session(session_id: _SessionId, _principal: Reader, audit: Audit) -> SessionView:
    return await audit.session(_session_id(session_id))


async def watch_session(session_id: _SessionId, principal: Writer, audit: Audit) -> SessionView:
    await audit.watch(_session_id(session_id))
    log.info("session %r watched by %s", session_id, principal.name)
    return await audit.session(session_id)


async def unwatch_session(
    session_id: _SessionId, body: UnwatchRequest, principal: Writer, audit: Audit
) -> SessionView:
    await audit.unwatch(_session_id(session_id), f"{body.reason} (by {principal.name})")
    log.info("session %r unwatched by %s", session_id, principal.name)
    return await audit.session(session_id)


INTAKE_DESCRIPTION = (
    "What `toolledger status` reports of the intake. The modes and agent ids are this API's own "
    "configuration (TOOLLEDGER_AGENT_IDS, TOOLLEDGER_LISTEN): give it the same as `serve`'s. The "
    "looks, kept webhook ids and sweeps are read from the ledger; the counts are each live "
    "replica's since it started, as its last heartbeat carried them, summed."
)


async def show_intake(_principal: Reader, audit: Audit) -> IntakeView:
    return await audit.intake()


REPEATABLE = frozenset({"tool", "status", "outcome", "effect_class"})
"""The query parameters that take several values; any other is given once."""


async def _each_given_once(_principal: Reader, request: Request) -> None:
    """``q=a&q=b`` would otherwise search for b alone, silently: which was meant is unknown.
    (After authentication: an anonymous caller learns nothing about the parameters.)"""
    given = Counter(name for name, _ in request.query_params.multi_items())
    repeated = sorted(name for name, count in given.items() if count > 1 and name not in REPEATABLE)
    if repeated:
        raise QueryError(f"{', '.join(repeated)}: give each only once")


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


async def healthz() -> Health:
    return Health(status="ok")


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
            snapshot = await state.runtime.operator_views().ledger_snapshot()
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
        async with asyncio.timeout(READY_TIMEOUT_SECONDS):
            current = await state.runtime.operator_views().schema_revision()
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


# ------------------------------------------------------------------------------ openapi


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, made to say what this app does: no 422 anywhere (a request the
    API cannot use is 400, declared on every route that takes input), and security only
    where this app's configuration enforces it."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    document = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    tokens: TokenRing = app.state.tokens
    for path, operations in document.get("paths", {}).items():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
            enforced = not tokens.empty if path.startswith("/api/") else tokens.metrics_closed
            if not enforced:
                # With no API token configured the API serves loopback only, to anyone; with
                # no metrics token /metrics is open: no credential is asked for.
                operation.pop("security", None)
                operation.get("responses", {}).pop("401", None)
    schemas = document.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    app.openapi_schema = document
    return document


# ------------------------------------------------------------------------------ errors


def _add_error_handlers(app: FastAPI) -> None:
    def answer(status_code: int) -> Callable[[Request, Exception], Any]:
        async def handler(_request: Request, error: Exception) -> JSONResponse:
            return JSONResponse({"detail": _detail(str(error))}, status_code=status_code)

        return handler

    app.add_exception_handler(QueryError, answer(400))
    app.add_exception_handler(CallNotFoundError, answer(404))
    for conflict in (
        AmbiguousCallError,
        NotResolvableError,
        NotAwaitingApprovalError,
        TransitionError,
        FencedError,
    ):
        app.add_exception_handler(conflict, answer(409))
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(SQLAlchemyError, _database_error)
    app.add_exception_handler(SchemaNotCurrentError, _database_error)


async def _invalid_request(_request: Request, error: Exception) -> JSONResponse:
    """400, like every request the API cannot use: one line per problem, naming the field;
    the value sent is not echoed."""
    assert isinstance(error, RequestValidationError)
    problems = []
    for problem in error.errors():
        where = ".".join(
            str(part) for part in problem.get("loc", ()) if part not in ("query", "body", "path")
        )
        problems.append(f"{where or 'request'}: {problem.get('msg', 'invalid')}")
    return JSONResponse({"detail": _detail("; ".join(problems))}, status_code=400)


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


class _BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive`` once a streamed body passes the limit: FastAPI passes an
    HTTPException from reading the body on to its handler, which answers 413 in our shape."""

    def __init__(self) -> None:
        super().__init__(413, f"the request body is over {MAX_BODY_BYTES // 1024} KiB")


class _BodyLimit:
    """Bodies over ``max_bytes`` get a 413: refused before the app runs when Content-Length
    says so, or as soon as a streamed body passes the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            too_large = _BodyTooLarge()
            await JSONResponse({"detail": too_large.detail}, status_code=413)(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        await self.app(scope, limited, send)


class _StrictJsonRequest(Request):
    """A request whose JSON body is read as ``strict_json`` says: FastAPI reads every JSON
    body through ``Request.json``, before any dependency or validation runs."""

    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            self._strict_json = strict_json(await self.body())
        return self._strict_json


class _StrictJsonRoute(APIRoute):
    """Every route of the app (the router's ``route_class``): its JSON body, if it takes one,
    is parsed once, strictly (``strict_json``). Not a dependency: FastAPI parses a body before
    it solves any dependency, so one could neither bound that parse nor see the keys a plain
    parse keeps the last of."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJsonRequest(request.scope, request.receive))

        return strict


_JSON_SPECIAL = re.compile(r'["\\\[\]{}]')
"""What decides JSON's nesting: quotes and backslashes (strings), brackets and braces."""


def _deeper_than(text: str, limit: int) -> bool:
    """Whether JSON ``text`` nests objects and arrays more than ``limit`` deep: one pass over
    its quotes, backslashes and brackets, no recursion and no backtracking. On text that is
    not JSON the count is exact up to where a parser would stop, which is all that matters:
    it is asked before one runs."""
    depth = 0
    in_string = False
    escaped_at = -1
    for special in _JSON_SPECIAL.finditer(text):
        at, char = special.start(), special.group()
        if at == escaped_at:
            continue
        if in_string:
            if char == "\\":
                escaped_at = at + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def strict_json(raw: bytes) -> Any:
    """A request body as JSON the API can use, or an HTTPException 400 saying why not: UTF-8;
    at most MAX_BODY_DEPTH objects and arrays deep (checked before parsing); no key given twice
    in one object (a parser keeps the last, silently: ``"dry_run": true, "dry_run": false``
    would run for real); no NaN or Infinity; no number too long to read. Text that is not JSON
    at all raises JSONDecodeError, which FastAPI answers as invalid (400)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise HTTPException(400, "the body is not UTF-8 text: send JSON encoded as UTF-8") from None
    if _deeper_than(text, MAX_BODY_DEPTH):
        raise HTTPException(
            400, f"the body is nested more than {MAX_BODY_DEPTH} levels deep (objects and arrays)"
        )
    try:
        return json.loads(text, object_pairs_hook=_each_key_once, parse_constant=_not_json)
    except json.JSONDecodeError:
        raise
    except ValueError:  # int() refuses more than 4,300 digits
        raise HTTPException(400, "the body holds a number too long to read") from None


def _each_key_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        repeated = next(key for index, key in enumerate(keys) if key in keys[:index])
        quoted = json.dumps(repeated[:MAX_QUOTED_KEY_CHARS], ensure_ascii=True)
        raise HTTPException(
            400, f"{quoted} is given twice in one object of the body: give each key once (which was meant?)"
        )
    return dict(pairs)


def _not_json(constant: str) -> Any:
    raise HTTPException(400, f"the body holds {constant}, which is not JSON: send a number or null")


class _ErrorBoundary:
    """Any exception left becomes a bare 500; its traceback is logged, redacted.

    Starlette's own handler would send the same 500 and then re-raise, so that the server
    logs the exception again, unredacted: it never gets that far. A client error that gets
    this far (an HTTPException under 500) is answered as one and logged as nothing worse
    than what it is: a client's mistake, which anyone without a token could repeat at will,
    must not fill the log with tracebacks.
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
        except StarletteHTTPException as error:
            if error.status_code >= 500:
                raise
            log.info("%s %s: %s %s", scope.get("method"), scope.get("path"), error.status_code, error.detail)
            if not started:
                response = JSONResponse(
                    {"detail": _detail(str(error.detail))},
                    status_code=error.status_code,
                    headers=error.headers,
                )
                await response(scope, receive, send)
        except Exception as error:
            text = self.redactor.text("".join(traceback.format_exception(error)))
            log.error("%s %s failed:\n%s", scope.get("method"), scope.get("path"), text)
            if not started:
                response = JSONResponse({"detail": "internal error"}, status_code=500)
                await response(scope, receive, send)


class _SecurityHeaders:
    """Audit data is not cached; nothing is sniffed, framed or referred elsewhere; no page
    loads anything from another origin."""

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
                    (b"content-security-policy", _policy(scope["path"])),
                ]
                if scope["path"].startswith("/api/"):
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


def _policy(path: str) -> bytes:
    if path.startswith("/ui"):
        # The page's own files only: a value that slipped past textContent still could not
        # run a script or send data anywhere else.
        return _PAGE_POLICY
    if path == "/docs" or path.startswith("/docs/"):
        return DOCS_POLICY
    return _DATA_POLICY


# ----------------------------------------------------------------------------- serving


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
    await serve_app(
        app, host, port, name="audit API", stop=stop, on_listening=on_listening, log_level=log_level
    )


async def api_server_task(
    settings: Settings,
    *,
    engine: AsyncEngine | None = None,
    gateway: AgentsGateway | None = None,
    registry: ToolRegistry | None = None,
    runtime: Runtime | None = None,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[str, int], None] | None = None,
    log_level: str = "info",
) -> None:
    """The audit API on ``settings.api_host``/``api_port`` until ``stop`` is set (or cancelled).

    ``toolledger serve --api`` runs it beside the service, sharing its stop event (and, if it
    likes, its engine and registry: then an operator's re-run executes in that process).
    """
    app = create_app(settings, engine=engine, gateway=gateway, registry=registry, runtime=runtime)
    await serve_api(
        app, settings.api_host, settings.api_port, stop=stop, on_listening=on_listening, log_level=log_level
    )


__all__ = ["ApiState", "api_server_task", "create_app", "serve_api"]
