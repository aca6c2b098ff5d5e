"""The emulated Agents API: sessions, turns, pending calls, event streams and their faults.

All of it lives on one asyncio loop, so every method that mutates runs without awaiting
between its checks and its writes: a request is applied whole or not at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from pydantic import ValidationError

from toolledger.emulator import wire
from toolledger.emulator.behaviour import AlreadyAnswered, ApiBehaviour
from toolledger.emulator.faults import (
    AcceptThenDrop,
    AcceptWithoutApply,
    ArmedFault,
    CloseStreams,
    DelayRegistration,
    DropBeforeApply,
    DuplicateEvents,
    FailSubmissions,
    Fault,
    FaultBoard,
    UnknownPending,
)
from toolledger.emulator.inputs import (
    AgentCreateBody,
    AgentUpdateBody,
    CancelInput,
    EventsBody,
    InputEvent,
    InputMessage,
    MessageInput,
    SessionCreateBody,
    ToolResultInput,
    first_error,
    message_text,
)
from toolledger.emulator.script import SCRIPT_METADATA_KEY, Script, ToolOutcome, final_answer
from toolledger.emulator.webhooks import WebhookConfig, WebhookSender

log = logging.getLogger("toolledger.emulator")

KEEPALIVE_SECONDS = 15.0
"""An idle stream sends an SSE comment this often, so proxies keep it open."""

TERMINAL_TURN_STATUSES = frozenset({"completed", "failed", "cancelled"})


class _Listed(Protocol):
    id: str

    def json(self) -> dict[str, Any]: ...


def _page(ordered: Sequence[_Listed], *, limit: int, after: str | None, what: str) -> dict[str, Any]:
    """One page of a list, after the item ``after``, as the API's cursor pages are."""
    if after is not None:
        ids = [item.id for item in ordered]
        if after not in ids:
            raise EmulatorAPIError(400, f"Invalid 'after': no {what} '{after}'.", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": [item.json() for item in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": len(ordered) > len(page),
    }


class EmulatorAPIError(Exception):
    """An error answered the way the real service answers it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.error_type = error_type
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return wire.error_body(self.message, error_type=self.error_type, code=self.code, param=self.param)


def unknown_pending_call(call_id: str) -> EmulatorAPIError:
    # The SDK recognises the registration race by exactly this code and message.
    return EmulatorAPIError(400, f"Unknown pending tool call: {call_id}", code="invalid_request_error")


def already_answered(style: AlreadyAnswered, turn_id: str, call_id: str) -> EmulatorAPIError:
    """The refusal of a result for a call that has one already, in one of the ways a real API
    might word it (``emulator.behaviour``)."""
    if style == "worded":
        return EmulatorAPIError(400, f"Tool call {call_id} in turn {turn_id} has already been answered.")
    if style == "conflict":
        return EmulatorAPIError(409, f"A result for tool call {call_id} was already received.")
    if style == "unknown_pending":
        return unknown_pending_call(call_id)
    return EmulatorAPIError(
        400,
        f"Tool call {call_id} of turn {turn_id} already has a result.",
        code="tool_result_already_submitted",
        param="call_id",
    )


class StreamEnd(Enum):
    END = "end"
    """End the response cleanly."""
    DROP = "drop"
    """Cut the connection mid-response."""


class SubmissionOutcome(Enum):
    ANSWER = "answer"
    ANSWER_THEN_DROP = "answer_then_drop"
    DROP = "drop"


@dataclass
class Submission:
    """What the HTTP layer should do with an events POST."""

    outcome: SubmissionOutcome
    status: int = 202


@dataclass
class Call:
    call_id: str
    turn_id: str
    name: str
    arguments: Any
    item_id: str
    step: int
    registered: bool = False
    result: dict[str, Any] | None = None


@dataclass
class Turn:
    id: str
    session_id: str
    agent_id: str
    user_text: str
    created_at: int
    started_at: int | None = None
    completed_at: int | None = None
    status: str = "queued"
    error: dict[str, str] | None = None
    step: int = -1
    calls: dict[str, Call] = field(default_factory=dict)
    outcomes: list[ToolOutcome] = field(default_factory=list)
    approvals: list[dict[str, Any]] = field(default_factory=list)
    """The current step's MCP approval requests (listed while the step waits)."""

    def step_calls(self) -> list[Call]:
        return [call for call in self.calls.values() if call.step == self.step]

    def json(self) -> dict[str, Any]:
        return wire.turn(
            turn_id=self.id,
            session_id=self.session_id,
            agent_id=self.agent_id,
            status=self.status,
            created_at=self.created_at,
            started_at=self.started_at,
            completed_at=self.completed_at,
            error=self.error,
        )


class Subscriber:
    _ids = itertools.count(1)

    def __init__(self, session_id: str, *, obfuscate: bool, ends_with_turn: bool) -> None:
        self.id = next(self._ids)
        self.session_id = session_id
        self.obfuscate = obfuscate
        self.ends_with_turn = ends_with_turn
        self.queue: asyncio.Queue[dict[str, Any] | StreamEnd | None] = asyncio.Queue()
        self.seen_by_fault: dict[int, int] = {}


@dataclass
class Session:
    id: str
    agent: dict[str, Any]
    metadata: dict[str, str]
    created_at: int
    seq: int
    last_active_at: int
    status: str = "idle"
    error: str | None = None
    spend_limit: int | None = None
    """USD cents; the emulated model costs nothing, so the budget is never reached."""
    vault_ids: list[str] = field(default_factory=list)
    script: Script | None = None
    turns: list[Turn] = field(default_factory=list)
    active: Turn | None = None
    items: list[dict[str, Any]] = field(default_factory=list)
    subscribers: list[Subscriber] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def required_actions(self) -> list[dict[str, Any]]:
        if self.active is None:
            return []
        actions = [
            wire.function_call_action(
                turn_id=call.turn_id, call_id=call.call_id, name=call.name, arguments=call.arguments
            )
            for call in self.active.calls.values()
            if call.registered and call.result is None
        ]
        return [*actions, *self.active.approvals] if actions else actions

    def json(self) -> dict[str, Any]:
        return wire.session(
            session_id=self.id,
            agent_json=self.agent,
            created_at=self.created_at,
            last_active_at=self.last_active_at,
            metadata=self.metadata,
            status=self.status,
            error=self.error,
            required_actions=self.required_actions(),
            spend_limit=self.spend_limit,
            vault_ids=self.vault_ids,
        )


@dataclass
class StoredAgent:
    """A reusable agent: the create and update fields it was given, as JSON."""

    id: str
    config: dict[str, Any]
    created_at: int
    updated_at: int
    seq: int

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.config.get("metadata") or {})

    def json(self) -> dict[str, Any]:
        return wire.reusable_agent(
            self.id, self.config, created_at=self.created_at, updated_at=self.updated_at
        )


@dataclass
class ToolResultReceipt:
    """One tool_result the emulator received, and what became of it."""

    session_id: str
    turn_id: str
    call_id: str
    outcome: str
    """accepted, replayed (an idempotent repeat) or rejected."""
    reason: str | None
    idempotency_key: str | None
    payload: dict[str, Any]
    received_at: float
    request_sha256: str = ""
    """The whole request's body (with its session), hashed: the same for every post of one
    request, whoever sent it."""

    def json(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "turn_id": self.turn_id,
            "call_id": self.call_id,
            "outcome": self.outcome,
            "reason": self.reason,
            "idempotency_key": self.idempotency_key,
            "payload": self.payload,
            "received_at": self.received_at,
            "request_sha256": self.request_sha256,
        }


@dataclass
class _StoredResponse:
    fingerprint: str
    status: int


class EmulatorState:
    """Everything the emulated service knows."""

    def __init__(
        self,
        *,
        default_script: Script | None = None,
        scripts: dict[str, Script] | None = None,
        keepalive_seconds: float = KEEPALIVE_SECONDS,
        webhooks: WebhookConfig | None = None,
    ) -> None:
        """``default_script``, ``scripts`` (by name) and ``webhooks`` are the start-up ones:
        a reset restores them, as it forgets what was set later."""
        self.sessions: dict[str, Session] = {}
        self.agents: dict[str, StoredAgent] = {}
        self.keepalive_seconds = keepalive_seconds
        self._startup_scripts = dict(scripts or {})
        self._startup_default = default_script or Script()
        self.scripts: dict[str, Script] = dict(self._startup_scripts)
        self.default_script = self._startup_default
        self.faults = FaultBoard()
        self.behaviour = ApiBehaviour()
        self.receipts: list[ToolResultReceipt] = []
        self.webhooks = WebhookSender(webhooks)
        self._idempotent: dict[str, _StoredResponse] = {}
        self._seq = itertools.count()
        self._closed = False
        self._told_unscripted = False

    # ------------------------------------------------------------------ agents

    def create_agent(self, body: AgentCreateBody) -> StoredAgent:
        config = body.settings()
        self._check_script_selector(config.get("metadata") or {})
        created = wire.now()
        stored = StoredAgent(
            id=wire.new_id("agent"),
            config=config,
            created_at=created,
            updated_at=created,
            seq=next(self._seq),
        )
        self.agents[stored.id] = stored
        return stored

    def agent(self, agent_id: str, *, param: str | None = None) -> StoredAgent:
        stored = self.agents.get(agent_id)
        if stored is None:
            raise EmulatorAPIError(
                404, f"No agent found with id '{agent_id}'.", code="not_found", param=param
            )
        return stored

    def update_agent(self, agent_id: str, body: AgentUpdateBody) -> StoredAgent:
        stored = self.agent(agent_id)
        changes = body.settings()
        self._check_script_selector(changes.get("metadata") or {})
        config = dict(stored.config)
        for key, value in changes.items():
            if key == "experimental":
                # Experimental settings merge by key; every other field is replaced whole.
                config[key] = {**(config.get(key) or {}), **value}
            elif value is None:
                config.pop(key, None)
            else:
                config[key] = value
        stored.config = config
        stored.updated_at = wire.now()
        return stored

    def list_agents(self, *, limit: int, after: str | None, order: str) -> dict[str, Any]:
        ordered = sorted(self.agents.values(), key=lambda a: a.seq, reverse=order == "desc")
        return _page(ordered, limit=limit, after=after, what="agent")

    def delete_agent(self, agent_id: str) -> dict[str, Any]:
        # Sessions already created keep the agent they were created with, as the service's do.
        self.agent(agent_id)
        del self.agents[agent_id]
        return wire.agent_deleted(agent_id)

    def _check_script_selector(self, metadata: dict[str, str]) -> None:
        """An inline script in an agent's metadata is checked when it is saved; a name may
        be registered later, so it is looked up when a session starts."""
        selector = metadata.get(SCRIPT_METADATA_KEY)
        if selector is None or not selector.lstrip().startswith("{"):
            return
        try:
            Script.model_validate_json(selector)
        except ValidationError as error:
            raise EmulatorAPIError(
                400,
                f"metadata.{SCRIPT_METADATA_KEY} is not a valid script: {first_error(error)}",
                code="invalid_value",
                param=f"metadata.{SCRIPT_METADATA_KEY}",
            ) from None

    # ----------------------------------------------------------------- sessions

    def create_session(self, body: SessionCreateBody) -> tuple[Session, Subscriber | None]:
        """Create a session; with ``stream`` also subscribe before its first turn starts."""
        config = body.agent.settings() if body.agent is not None else {}
        saved = self.agent(body.agent_id, param="agent_id") if body.agent_id is not None else None
        if saved is not None:
            # The saved agent's settings, with the fields the session supplies over them.
            experimental = {**(saved.config.get("experimental") or {}), **(config.get("experimental") or {})}
            config = {**saved.config, **config, "experimental": experimental}
        if saved is None and not config.get("model"):
            raise EmulatorAPIError(
                400,
                "Missing required parameter: 'agent.model'.",
                code="missing_required_parameter",
                param="agent.model",
            )
        if body.stream and body.input is None:
            raise EmulatorAPIError(
                400,
                "'input' is required when 'stream' is true.",
                code="missing_required_parameter",
                param="input",
            )
        metadata = dict(body.metadata or {})
        script = self._script_from_metadata(metadata)
        if script is None and saved is not None:
            script = self._script_from_metadata(saved.metadata, owner=f"agent {saved.id}")
        created = wire.now()
        session = Session(
            id=wire.new_id("sess"),
            agent=wire.agent(body.agent_id or wire.new_id("agent"), config),
            metadata=metadata,
            created_at=created,
            seq=next(self._seq),
            last_active_at=created,
            script=script,
            spend_limit=body.spend_control.limit if body.spend_control else None,
            vault_ids=list(body.vault_ids or []),
        )
        self.sessions[session.id] = session
        subscriber = None
        if body.stream:
            subscriber = Subscriber(session.id, obfuscate=True, ends_with_turn=True)
            session.subscribers.append(subscriber)
            self._emit(session, "agent.session.created", session=session.json())
        else:
            # Not on any stream (none can be open yet), but a webhook all the same.
            self.webhooks.session_event("agent.session.created", session.json())
        if body.input is not None:
            self._start_turn(session, _as_messages(body.input))
        return session, subscriber

    def _script_from_metadata(self, metadata: dict[str, str], *, owner: str | None = None) -> Script | None:
        selector = metadata.get(SCRIPT_METADATA_KEY)
        if selector is None:
            return None
        if selector in self.scripts:
            return self.scripts[selector]
        try:
            return Script.model_validate_json(selector)
        except ValidationError:
            where = f"metadata.{SCRIPT_METADATA_KEY}" + (f" of {owner}" if owner else "")
            raise EmulatorAPIError(
                400,
                f"{where} must name a registered script or hold a script as JSON.",
                param="agent_id" if owner else f"metadata.{SCRIPT_METADATA_KEY}",
            ) from None

    def session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise EmulatorAPIError(404, f"No session found with id '{session_id}'.", code="not_found")
        return session

    def list_sessions(
        self,
        *,
        limit: int,
        after: str | None,
        order: str,
        agent_id: str | None,
        metadata: dict[str, str],
    ) -> dict[str, Any]:
        ordered = sorted(self.sessions.values(), key=lambda s: s.seq, reverse=order == "desc")
        matching = [
            s
            for s in ordered
            if (agent_id is None or s.agent["id"] == agent_id)
            and all(s.metadata.get(k) == v for k, v in metadata.items())
        ]
        return _page(matching, limit=limit, after=after, what="session")

    def delete_session(self, session_id: str) -> dict[str, Any]:
        session = self.session(session_id)
        del self.sessions[session_id]
        for task in session.tasks:
            task.cancel()
        for subscriber in session.subscribers:
            subscriber.queue.put_nowait(StreamEnd.END)
        session.subscribers.clear()
        return wire.session_deleted(session_id)

    def set_script(self, session_id: str, script: Script) -> None:
        self.session(session_id).script = script

    # ------------------------------------------------------------------ events

    def submit(
        self, session_id: str, body: EventsBody, *, idempotency_key: str | None, raw: bytes
    ) -> Submission:
        """Apply an events POST: whole, or not at all."""
        session = self.session(session_id)
        results = [e for e in body.events if isinstance(e, ToolResultInput)]
        fingerprint = hashlib.sha256(session_id.encode() + b"\0" + raw).hexdigest()

        def record(outcome: str, reason: str | None) -> None:
            self._record(session_id, results, outcome, reason, idempotency_key, fingerprint)

        def reject(reason: str) -> None:
            record("rejected", reason)

        failing = self.faults.take_if(
            FailSubmissions, session_id, lambda f: bool(results) or not f.only_tool_results
        )
        if failing is not None:
            assert isinstance(failing.fault, FailSubmissions)
            reason = f"injected HTTP {failing.fault.status}"
            reject(reason)
            headers = {}
            if failing.fault.retry_after is not None:
                headers["retry-after"] = f"{failing.fault.retry_after:g}"
            raise EmulatorAPIError(
                failing.fault.status,
                "The server had an error while processing your request (injected fault).",
                error_type="server_error" if failing.fault.status >= 500 else "invalid_request_error",
                headers=headers,
            )

        keys_kept = self.behaviour.idempotency_keys == "honoured"
        if keys_kept and idempotency_key is not None and idempotency_key in self._idempotent:
            stored = self._idempotent[idempotency_key]
            if stored.fingerprint != fingerprint:
                reject("idempotency key reused with a different request")
                raise EmulatorAPIError(
                    400,
                    "Keys for idempotent requests can only be used with the same parameters "
                    "they were first used with.",
                    code="idempotency_key_reused",
                )
            record("replayed", None)
            return Submission(SubmissionOutcome.ANSWER, stored.status)

        if results and self.faults.take(DropBeforeApply, session_id) is not None:
            reject("injected connection drop before applying")
            return Submission(SubmissionOutcome.DROP)
        if results and self.faults.take(AcceptWithoutApply, session_id) is not None:
            record("lost", "injected: answered 202, not applied")
            if keys_kept and idempotency_key is not None:
                self._idempotent[idempotency_key] = _StoredResponse(fingerprint, 202)
            return Submission(SubmissionOutcome.ANSWER)
        if results and self.faults.take(UnknownPending, session_id) is not None:
            reject("injected pending-call race")
            raise unknown_pending_call(results[0].call_id)

        try:
            self._check(session, body.events)
        except EmulatorAPIError as error:
            reject(error.message)
            raise
        for input_event in body.events:
            self._apply(session, input_event)
        record("accepted", None)
        if keys_kept and idempotency_key is not None:
            self._idempotent[idempotency_key] = _StoredResponse(fingerprint, 202)
        session.last_active_at = wire.now()
        if results and self.faults.take(AcceptThenDrop, session_id) is not None:
            return Submission(SubmissionOutcome.ANSWER_THEN_DROP)
        return Submission(SubmissionOutcome.ANSWER)

    def _check(self, session: Session, events: list[InputEvent]) -> None:
        if session.status == "failed":
            raise EmulatorAPIError(
                400, f"Session '{session.id}' has failed and accepts no input.", code="session_failed"
            )
        answered: set[str] = set()
        for input_event in events:
            if isinstance(input_event, MessageInput):
                if session.active is not None:
                    raise EmulatorAPIError(
                        400,
                        "The session cannot accept additional input while a turn is running.",
                        code="active_turn_not_steerable",
                    )
            elif isinstance(input_event, CancelInput):
                if session.active is None:
                    raise EmulatorAPIError(
                        400, "The session has no active turn to cancel.", code="no_active_turn"
                    )
            elif isinstance(input_event, ToolResultInput):
                self._check_tool_result(session, input_event, answered)
            else:
                raise EmulatorAPIError(
                    400, f"No pending approval request: {input_event.request_id}", param="request_id"
                )

    def _check_tool_result(self, session: Session, result: ToolResultInput, answered: set[str]) -> None:
        call = self._find_call(session, result.turn_id, result.call_id)
        if call is not None and (call.result is not None or call.call_id in answered):
            style = self._script(session).already_answered or self.behaviour.already_answered
            raise already_answered(style, result.turn_id, result.call_id)
        active = session.active
        if call is None or not call.registered or active is None or call.turn_id != active.id:
            raise unknown_pending_call(result.call_id)
        answered.add(call.call_id)

    def _find_call(self, session: Session, turn_id: str, call_id: str) -> Call | None:
        for turn in reversed(session.turns):
            if turn.id == turn_id:
                return turn.calls.get(call_id)
        return None

    def _apply(self, session: Session, input_event: InputEvent) -> None:
        if isinstance(input_event, MessageInput):
            self._start_turn(session, input_event.input)
        elif isinstance(input_event, CancelInput):
            self.cancel_turn(session.id)
        elif isinstance(input_event, ToolResultInput):
            self._accept_result(session, input_event)

    def _record(
        self,
        session_id: str,
        results: list[ToolResultInput],
        outcome: str,
        reason: str | None,
        idempotency_key: str | None,
        request_sha256: str,
    ) -> None:
        for result in results:
            self.receipts.append(
                ToolResultReceipt(
                    session_id=session_id,
                    turn_id=result.turn_id,
                    call_id=result.call_id,
                    outcome=outcome,
                    reason=reason,
                    idempotency_key=idempotency_key,
                    payload=result.model_dump(mode="json", exclude_unset=True),
                    received_at=time.time(),
                    request_sha256=request_sha256,
                )
            )

    # --------------------------------------------------------------- the model

    def _script(self, session: Session) -> Script:
        return session.script or self.default_script

    def _start_turn(self, session: Session, messages: list[InputMessage]) -> None:
        created = wire.now()
        turn = Turn(
            id=wire.new_id("turn"),
            session_id=session.id,
            agent_id=session.agent["id"],
            user_text=message_text(messages),
            created_at=created,
        )
        session.turns.append(turn)
        session.active = turn
        self._emit(
            session, "agent.session.turn.created", session_id=session.id, turn_id=turn.id, turn=turn.json()
        )
        for message in messages:
            item = wire.user_message_item(
                item_id=wire.new_id("msg"),
                turn_id=turn.id,
                content=[part.model_dump(exclude_none=True) for part in message.content],
            )
            session.items.append(item)
            self._emit(
                session,
                "agent.session.turn.item.added",
                session_id=session.id,
                turn_id=turn.id,
                item=item,
                output_index=None,
            )
        turn.status = "in_progress"
        turn.started_at = created
        session.status = "in_progress"
        self._emit(session, "agent.session.in_progress", session=session.json())
        self._emit(
            session,
            "agent.session.turn.in_progress",
            session_id=session.id,
            turn_id=turn.id,
            turn=turn.json(),
        )
        self._schedule(session, self._advance(session, turn))

    def _schedule(self, session: Session, work: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(work)
        session.tasks.add(task)
        task.add_done_callback(session.tasks.discard)

    async def _advance(self, session: Session, turn: Turn) -> None:
        """The model's next move: the next step's calls, or the final answer."""
        script = self._script(session)
        if script.think_seconds:
            await asyncio.sleep(script.think_seconds)
        if session.active is not turn or turn.status in TERMINAL_TURN_STATUSES:
            return
        turn.step += 1
        if turn.step >= len(script.steps):
            unscripted = self._unscripted_tools(session, script)
            text = final_answer(script, turn.outcomes, turn.user_text, unscripted_tools=unscripted)
            self._complete_turn(session, turn, text)
            return
        output_index = len(turn.calls)
        calls = []
        turn.approvals = [
            wire.mcp_approval_action(turn_id=turn.id, request_id=wire.new_id("mcpr"), server_label=label)
            for label in script.steps[turn.step].approvals
        ]
        for scripted in script.steps[turn.step].calls:
            call = Call(
                call_id=wire.new_id("call"),
                turn_id=turn.id,
                name=scripted.name,
                arguments=scripted.arguments,
                item_id=wire.new_id("fc"),
                step=turn.step,
            )
            turn.calls[call.call_id] = call
            calls.append(call)
        for offset, call in enumerate(calls):
            for status, event_type in (("in_progress", "added"), ("completed", "done")):
                item = wire.function_call_item(
                    item_id=call.item_id,
                    turn_id=turn.id,
                    call_id=call.call_id,
                    name=call.name,
                    arguments=call.arguments,
                    status=status,
                )
                self._emit(
                    session,
                    f"agent.session.turn.item.{event_type}",
                    session_id=session.id,
                    turn_id=turn.id,
                    item=item,
                    output_index=output_index + offset,
                )
            session.items.append(item)
        delay = self.faults.take(DelayRegistration, session.id)
        if delay is not None:
            assert isinstance(delay.fault, DelayRegistration)
            await asyncio.sleep(delay.fault.seconds)
            if session.active is not turn or turn.status in TERMINAL_TURN_STATUSES:
                return
        for call in calls:
            call.registered = True
        turn.status = "waiting"
        session.status = "requires_action"
        self._emit(session, "agent.session.requires_action", session=session.json())

    def _unscripted_tools(self, session: Session, script: Script) -> list[str]:
        """The agent's function tools when no script says to call any: the emulated model
        cannot choose calls itself, and a user who expected them should learn why at once."""
        if script.steps or script.final_message is not None:
            return []
        names = [tool["name"] for tool in session.agent["tools"]]
        if names and not self._told_unscripted:
            self._told_unscripted = True
            log.warning(
                "session %s: its agent has tools (%s) but no script, so the emulated model "
                "calls none; give one with `toolledger emulator --script FILE` or the agent's "
                "metadata %r (docs/emulator.md)",
                session.id,
                ", ".join(names),
                SCRIPT_METADATA_KEY,
            )
        return names

    def _accept_result(self, session: Session, result: ToolResultInput) -> None:
        turn = session.active
        assert turn is not None
        call = turn.calls[result.call_id]
        call.result = result.model_dump(mode="json", exclude_unset=True)
        turn.outcomes.append(
            ToolOutcome(
                name=call.name,
                success=result.success,
                output=result.output if result.success else None,
                error=None if result.success else result.error,
            )
        )
        item = wire.function_call_output_item(item_id=wire.new_id("fco"), turn_id=turn.id, result=call.result)
        session.items.append(item)
        self._emit(
            session,
            "agent.session.turn.item.added",
            session_id=session.id,
            turn_id=turn.id,
            item=item,
            output_index=None,
        )
        if all(c.result is not None for c in turn.step_calls()):
            turn.status = "in_progress"
            session.status = "in_progress"
            self._emit(session, "agent.session.in_progress", session=session.json())
            self._schedule(session, self._advance(session, turn))

    def _complete_turn(self, session: Session, turn: Turn, text: str) -> None:
        item_id = wire.new_id("msg")
        output_index = len(turn.calls)
        self._emit(
            session,
            "agent.session.turn.item.added",
            session_id=session.id,
            turn_id=turn.id,
            item=wire.assistant_message_item(item_id=item_id, turn_id=turn.id, text="", status="in_progress"),
            output_index=output_index,
        )
        done = wire.assistant_message_item(item_id=item_id, turn_id=turn.id, text=text, status="completed")
        session.items.append(done)
        self._emit(
            session,
            "agent.session.turn.item.done",
            session_id=session.id,
            turn_id=turn.id,
            item=done,
            output_index=output_index,
        )
        self._end_turn(session, turn, "completed")

    def _end_turn(
        self, session: Session, turn: Turn, status: str, error: dict[str, str] | None = None
    ) -> None:
        turn.status = status
        turn.error = error
        turn.completed_at = wire.now()
        session.active = None
        session.last_active_at = turn.completed_at
        self._emit(
            session,
            f"agent.session.turn.{status}",
            session_id=session.id,
            turn_id=turn.id,
            turn=turn.json(),
            usage=None,
        )
        if session.status != "failed":
            session.status = "idle"
            self._emit(session, "agent.session.idle", session=session.json())

    def cancel_turn(self, session_id: str) -> None:
        session = self.session(session_id)
        if session.active is None:
            raise EmulatorAPIError(400, "The session has no active turn to cancel.", code="no_active_turn")
        self._end_turn(session, session.active, "cancelled")

    def fail_session(self, session_id: str, message: str) -> None:
        session = self.session(session_id)
        session.status = "failed"
        session.error = message
        if session.active is not None:
            self._end_turn(session, session.active, "failed", {"code": "internal_error", "message": message})
        self._emit(session, "agent.session.failed", session=session.json())

    # ----------------------------------------------------------------- streams

    def subscribe(self, session_id: str, *, obfuscate: bool) -> Subscriber:
        """A live stream; its first event is a snapshot of the session's status."""
        session = self.session(session_id)
        subscriber = Subscriber(session_id, obfuscate=obfuscate, ends_with_turn=False)
        session.subscribers.append(subscriber)
        snapshot_type = {
            "idle": "agent.session.idle",
            "in_progress": "agent.session.in_progress",
            "requires_action": "agent.session.requires_action",
            "failed": "agent.session.failed",
        }[session.status]
        subscriber.queue.put_nowait(wire.event(snapshot_type, session=session.json()))
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        session = self.sessions.get(subscriber.session_id)
        if session is not None and subscriber in session.subscribers:
            session.subscribers.remove(subscriber)

    def _emit(self, target: Session, event_type: str, /, **fields: Any) -> None:
        payload = wire.event(event_type, **fields)
        if "session" in fields:
            # Every change of a session's status passes here: the sender picks the ones
            # with a webhook (created, in_progress, requires_action, idle, failed).
            self.webhooks.session_event(event_type, fields["session"])
        copies = 2 if self.faults.take(DuplicateEvents, target.id) is not None else 1
        for subscriber in list(target.subscribers):
            for _ in range(copies):
                subscriber.queue.put_nowait(payload)
            if subscriber.ends_with_turn and _ends_stream(event_type, target):
                subscriber.queue.put_nowait(StreamEnd.END)

    def poke_streams(self) -> None:
        """Wake every stream so a newly armed close fault is seen at once."""
        for session in self.sessions.values():
            for subscriber in session.subscribers:
                subscriber.queue.put_nowait(None)

    async def deliveries(self, subscriber: Subscriber) -> AsyncGenerator[bytes | StreamEnd, None]:
        """The SSE frames of one stream, ending with how the stream ends."""
        try:
            while True:
                closing = self._due_close(subscriber)
                if closing is not None:
                    yield closing
                    return
                if self._closed:
                    yield StreamEnd.END
                    return
                try:
                    # Not wait_for: on 3.11 it swallows a cancellation that comes as an item
                    # does (gh-86296), and a stream the client left would run on.
                    async with asyncio.timeout(self.keepalive_seconds):
                        item = await subscriber.queue.get()
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if item is None:
                    continue
                if isinstance(item, StreamEnd):
                    yield item
                    return
                yield _frame(item, subscriber.obfuscate)
                for armed in self.faults.armed(CloseStreams, subscriber.session_id):
                    subscriber.seen_by_fault[armed.id] = subscriber.seen_by_fault.get(armed.id, 0) + 1
        finally:
            self.unsubscribe(subscriber)

    def _due_close(self, subscriber: Subscriber) -> StreamEnd | None:
        for armed in self.faults.armed(CloseStreams, subscriber.session_id):
            fault = armed.fault
            assert isinstance(fault, CloseStreams)
            if subscriber.seen_by_fault.get(armed.id, 0) >= fault.after_events:
                self.faults.use(armed)
                return StreamEnd.DROP if fault.mode == "drop" else StreamEnd.END
        return None

    # ----------------------------------------------------------------- control

    def arm(self, fault: Fault) -> ArmedFault:
        armed = self.faults.arm(fault)
        if isinstance(fault, CloseStreams):
            self.poke_streams()
        return armed

    def tool_results(self, session_id: str | None = None) -> list[dict[str, Any]]:
        return [r.json() for r in self.receipts if session_id is None or r.session_id == session_id]

    def reset(self) -> None:
        for session_id in list(self.sessions):
            self.delete_session(session_id)
        self.agents.clear()
        self.scripts = dict(self._startup_scripts)
        self.default_script = self._startup_default
        self.faults.clear()
        self.behaviour = ApiBehaviour()
        self.receipts.clear()
        self._idempotent.clear()
        self.webhooks.reset()

    def close(self) -> None:
        """End every stream, as a shutting-down server does."""
        self._closed = True
        self.webhooks.close()
        for session in self.sessions.values():
            for task in session.tasks:
                task.cancel()
            for subscriber in session.subscribers:
                subscriber.queue.put_nowait(StreamEnd.END)


def _as_messages(value: str | list[InputMessage]) -> list[InputMessage]:
    if isinstance(value, str):
        return [
            InputMessage.model_validate({"role": "user", "content": [{"type": "input_text", "text": value}]})
        ]
    return value


def _ends_stream(event_type: str, session: Session) -> bool:
    """A creation stream ends with the session's state after its first turn."""
    return event_type == "agent.session.failed" or (
        event_type == "agent.session.idle" and session.active is None
    )


def _frame(payload: dict[str, Any], obfuscate: bool) -> bytes:
    if obfuscate:
        payload = {**payload, "obfuscation": wire.obfuscation()}
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"id: {payload['event_id']}\nevent: {payload['type']}\ndata: {data}\n\n".encode()
