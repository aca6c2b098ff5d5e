"""HTTP face of the emulator: the Agents API routes the SDK calls, and a control API for tests."""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from toolledger.emulator import wire
from toolledger.emulator.asgi import DroppedResponse, EventStreamResponse
from toolledger.emulator.behaviour import ApiBehaviour
from toolledger.emulator.faults import FaultAdapter
from toolledger.emulator.inputs import (
    AGENT_CREATE_BODY,
    AGENT_UPDATE_BODY,
    EVENTS_BODY,
    SESSION_CREATE_BODY,
    AgentConfig,
    SpendControlBody,
    check_metadata,
    describe,
)
from toolledger.emulator.script import Script
from toolledger.emulator.state import EmulatorAPIError, EmulatorState, SubmissionOutcome
from toolledger.emulator.webhooks import WebhookConfig

MAX_BODY_BYTES = 8 * 1024 * 1024
"""Larger request bodies get 413, as a front proxy would answer."""

log = logging.getLogger("toolledger.emulator")

NOT_EMULATED = frozenset({"environments", "vaults", "automations"})
"""Resources under /v1/agents/ the emulator does not serve: they are not agent ids."""


class SessionUpdateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, str] | None = None
    agent: AgentConfig | None = None
    review: Literal["none", "auto_review"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    spend_control: SpendControlBody | None = None
    vault_ids: list[str] | None = None


class FailSessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str = Field(default="The session failed (injected by the emulator).", max_length=2000)


SESSION_UPDATE_BODY: TypeAdapter[SessionUpdateBody] = TypeAdapter(SessionUpdateBody)
FAIL_SESSION_BODY: TypeAdapter[FailSessionBody] = TypeAdapter(FailSessionBody)
SCRIPT: TypeAdapter[Script] = TypeAdapter(Script)
BEHAVIOUR: TypeAdapter[ApiBehaviour] = TypeAdapter(ApiBehaviour)
WEBHOOK_CONFIG: TypeAdapter[WebhookConfig] = TypeAdapter(WebhookConfig)


def create_app(state: EmulatorState | None = None, *, api_key: str | None = None) -> FastAPI:
    """The emulator as an ASGI app; ``api_key`` makes it refuse other bearer tokens."""
    emulator = state or EmulatorState()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        emulator.close()
        await emulator.webhooks.aclose()

    app = FastAPI(title="toolledger Agents API emulator", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.emulator = emulator

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        supplied = request.headers.get("authorization", "")
        if not hmac.compare_digest(supplied.encode(), f"Bearer {api_key}".encode()):
            raise EmulatorAPIError(401, "Incorrect API key provided.", code="invalid_api_key")

    Authorized = Depends(authorize)

    @app.exception_handler(EmulatorAPIError)
    async def _api_error(_request: Request, error: EmulatorAPIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"][1:]) or None
        message = f"Invalid value for '{param}': {first['msg']}." if param else f"{first['msg']}."
        return JSONResponse(
            wire.error_body(message, error_type="invalid_request_error", code="invalid_value", param=param),
            status_code=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            wire.error_body(str(error.detail), error_type="invalid_request_error", code=None),
            status_code=error.status_code,
        )

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(_request: Request, _error: ClientDisconnect) -> Response:
        # The client died mid-request (a killed worker): nobody reads an answer, nothing applied.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, error: Exception) -> JSONResponse:
        log.exception("emulator bug")
        return JSONResponse(
            wire.error_body("The emulator failed unexpectedly.", error_type="server_error", code=None),
            status_code=500,
        )

    async def read_body(request: Request) -> bytes:
        content_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
        if content_type.lower() != "application/json":
            raise EmulatorAPIError(
                415, f"Unsupported Content-Type '{content_type}': send application/json.", code=None
            )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise EmulatorAPIError(
                413, f"Request body exceeds {MAX_BODY_BYTES} bytes.", code="body_too_large"
            )
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise EmulatorAPIError(
                413, f"Request body exceeds {MAX_BODY_BYTES} bytes.", code="body_too_large"
            )
        return body

    def parse(adapter: TypeAdapter[Any], raw: bytes) -> Any:
        try:
            return adapter.validate_json(raw)
        except ValidationError as error:
            document = None
            if error.errors()[0]["type"] != "json_invalid":
                # pydantic read it as JSON, but Python's parser stops at a lower nesting depth.
                with contextlib.suppress(ValueError, RecursionError):
                    document = json.loads(raw)
            message, param = describe(error, document)
            raise EmulatorAPIError(400, message, code="invalid_value", param=param) from None

    # ------------------------------------------------------------- Agents API

    @app.post("/v1/agents/sessions", dependencies=[Authorized])
    async def create_session(request: Request) -> Response:
        body = parse(SESSION_CREATE_BODY, await read_body(request))
        session, subscriber = emulator.create_session(body)
        if subscriber is not None:
            return EventStreamResponse(emulator.deliveries(subscriber))
        return JSONResponse(session.json())

    @app.get("/v1/agents/sessions", dependencies=[Authorized])
    async def list_sessions(
        request: Request,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
        agent_id: str | None = None,
    ) -> JSONResponse:
        metadata = {
            key[len("metadata[") : -1]: value
            for key, value in request.query_params.multi_items()
            if key.startswith("metadata[") and key.endswith("]")
        }
        try:
            check_metadata(metadata)
        except ValueError as error:
            raise EmulatorAPIError(400, str(error), param="metadata") from None
        return JSONResponse(
            emulator.list_sessions(
                limit=limit, after=after, order=order, agent_id=agent_id, metadata=metadata
            )
        )

    @app.get("/v1/agents/sessions/{session_id}", dependencies=[Authorized])
    async def retrieve_session(session_id: str) -> JSONResponse:
        return JSONResponse(emulator.session(session_id).json())

    @app.post("/v1/agents/sessions/{session_id}", dependencies=[Authorized])
    async def update_session(session_id: str, request: Request) -> JSONResponse:
        update = parse(SESSION_UPDATE_BODY, await read_body(request))
        session = emulator.session(session_id)
        if "metadata" in update.model_fields_set:
            # Given as null, metadata is cleared; left out, it is kept.
            metadata = update.metadata or {}
            try:
                check_metadata(metadata)
            except ValueError as error:
                raise EmulatorAPIError(400, str(error), param="metadata") from None
            session.metadata = dict(metadata)
        if "spend_control" in update.model_fields_set:
            # Null, or a null limit, removes the limit; what was spent is kept.
            session.spend_limit = update.spend_control.limit if update.spend_control else None
        if "vault_ids" in update.model_fields_set:
            session.vault_ids = list(update.vault_ids or [])
        if update.agent is not None:
            merged = {**session.agent, **update.agent.settings()}
            session.agent = wire.agent(session.agent["id"], merged)
        return JSONResponse(session.json())

    @app.delete("/v1/agents/sessions/{session_id}", dependencies=[Authorized])
    async def delete_session(session_id: str) -> JSONResponse:
        return JSONResponse(emulator.delete_session(session_id))

    @app.post("/v1/agents/sessions/{session_id}/events", dependencies=[Authorized])
    async def create_events(session_id: str, request: Request) -> Response:
        emulator.session(session_id)
        raw = await read_body(request)
        body = parse(EVENTS_BODY, raw)
        submission = emulator.submit(
            session_id, body, idempotency_key=request.headers.get("idempotency-key"), raw=raw
        )
        if submission.outcome is SubmissionOutcome.ANSWER:
            return Response(status_code=submission.status)
        return DroppedResponse()

    @app.get("/v1/agents/sessions/{session_id}/events", dependencies=[Authorized])
    async def stream_events(session_id: str, include_obfuscation: bool = True) -> Response:
        subscriber = emulator.subscribe(session_id, obfuscate=include_obfuscation)
        return EventStreamResponse(emulator.deliveries(subscriber))

    # Declared after the sessions routes: /v1/agents/{agent_id} would otherwise take them.

    def saved_agent_id(agent_id: str) -> str:
        if agent_id in NOT_EMULATED:
            raise EmulatorAPIError(
                404, f"The emulator does not serve /v1/agents/{agent_id}.", code="not_found"
            )
        return agent_id

    @app.post("/v1/agents", dependencies=[Authorized])
    async def create_agent(request: Request) -> JSONResponse:
        body = parse(AGENT_CREATE_BODY, await read_body(request))
        return JSONResponse(emulator.create_agent(body).json())

    @app.get("/v1/agents", dependencies=[Authorized])
    async def list_agents(
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> JSONResponse:
        return JSONResponse(emulator.list_agents(limit=limit, after=after, order=order))

    @app.get("/v1/agents/{agent_id}", dependencies=[Authorized])
    async def retrieve_agent(agent_id: str) -> JSONResponse:
        return JSONResponse(emulator.agent(saved_agent_id(agent_id)).json())

    @app.post("/v1/agents/{agent_id}", dependencies=[Authorized])
    async def update_agent(agent_id: str, request: Request) -> JSONResponse:
        emulator.agent(saved_agent_id(agent_id))
        body = parse(AGENT_UPDATE_BODY, await read_body(request))
        return JSONResponse(emulator.update_agent(agent_id, body).json())

    @app.delete("/v1/agents/{agent_id}", dependencies=[Authorized])
    async def delete_agent(agent_id: str) -> JSONResponse:
        return JSONResponse(emulator.delete_agent(saved_agent_id(agent_id)))

    # ------------------------------------------------------------ control API

    @app.get("/_emulator/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/_emulator/faults")
    async def arm_fault(request: Request) -> dict[str, Any]:
        fault = parse(FaultAdapter, await read_body(request))
        armed = emulator.arm(fault)
        return {"id": armed.id, **fault.model_dump()}

    @app.get("/_emulator/faults")
    async def list_faults() -> list[dict[str, object]]:
        return emulator.faults.listing()

    @app.delete("/_emulator/faults")
    async def clear_faults() -> dict[str, bool]:
        emulator.faults.clear()
        return {"cleared": True}

    @app.get("/_emulator/behaviour")
    async def get_behaviour() -> dict[str, Any]:
        return emulator.behaviour.model_dump()

    @app.put("/_emulator/behaviour")
    async def set_behaviour(request: Request) -> dict[str, Any]:
        emulator.behaviour = parse(BEHAVIOUR, await read_body(request))
        return emulator.behaviour.model_dump()

    def webhooks_shown() -> dict[str, Any]:
        return {
            **emulator.webhooks.config.public(),
            "counts": emulator.webhooks.counts().model_dump(),
        }

    @app.get("/_emulator/webhooks")
    async def get_webhooks() -> dict[str, Any]:
        return webhooks_shown()

    @app.put("/_emulator/webhooks")
    async def set_webhooks(request: Request) -> dict[str, Any]:
        emulator.webhooks.configure(parse(WEBHOOK_CONFIG, await read_body(request)))
        return webhooks_shown()

    @app.put("/_emulator/scripts/{name}")
    async def register_script(name: str, request: Request) -> dict[str, str]:
        emulator.scripts[name] = parse(SCRIPT, await read_body(request))
        return {"name": name}

    @app.put("/_emulator/default-script")
    async def set_default_script(request: Request) -> dict[str, bool]:
        emulator.default_script = parse(SCRIPT, await read_body(request))
        return {"ok": True}

    @app.put("/_emulator/sessions/{session_id}/script")
    async def set_session_script(session_id: str, request: Request) -> dict[str, bool]:
        emulator.set_script(session_id, parse(SCRIPT, await read_body(request)))
        return {"ok": True}

    @app.post("/_emulator/sessions/{session_id}/fail")
    async def fail_session(session_id: str, request: Request) -> dict[str, bool]:
        raw = await read_body(request)
        body = parse(FAIL_SESSION_BODY, raw) if raw.strip() else FailSessionBody()
        emulator.fail_session(session_id, body.message)
        return {"ok": True}

    @app.post("/_emulator/sessions/{session_id}/cancel")
    async def cancel_turn(session_id: str) -> dict[str, bool]:
        emulator.cancel_turn(session_id)
        return {"ok": True}

    @app.get("/_emulator/tool-results")
    async def tool_results(session_id: str | None = None) -> list[dict[str, Any]]:
        return emulator.tool_results(session_id)

    @app.post("/_emulator/reset")
    async def reset() -> dict[str, bool]:
        emulator.reset()
        return {"ok": True}

    return app
