"""The only code that talks to the Agents API: ``AsyncOpenAI().beta.agents.sessions``."""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, get_args

import httpx2
import openai
from openai import AsyncOpenAI, AsyncStream, DefaultAsyncHttpxClient
from openai._models import construct_type
from openai._streaming import ServerSentEvent, SSEDecoder
from openai.types.beta.agent_session import (
    AgentSession,
    RequiredActionSessionRequiredActionResourceFunctionCall,
)
from openai.types.beta.agent_session_event import AgentSessionEvent
from openai.types.beta.agent_session_input_param import SessionInputParamAgentSessionInputToolResult
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from toolledger import crashpoints, metrics
from toolledger.domain.submissions import SubmissionFailure
from toolledger.errors import (
    AgentsAuthError,
    AgentsUnavailableError,
    SessionGoneError,
    StreamInterruptedError,
    SubmissionError,
)
from toolledger.gateway.classify import classify, describe, maybe_applied, retry_after_seconds

FunctionCallAction = RequiredActionSessionRequiredActionResourceFunctionCall
_NO_TYPED_EVENTS: tuple[SessionInputParamAgentSessionInputToolResult, ...] = ()

MAX_RETRY_AFTER = 60.0
CONNECT_TIMEOUT = 10.0
CHECK_TIMEOUT = 10.0
DISCOVERY_PAGE = 100
STREAM_POOLS = 16
"""Connection pools the event streams are spread over (each followed session holds a
connection): a pool looks over all its connections for each stream it opens."""


class AgentsGateway:
    """Submits tool results and reads sessions, retrying what is safe to retry."""

    def __init__(
        self,
        client: AsyncOpenAI,
        *,
        stream_clients: Sequence[AsyncOpenAI] = (),
        attempts: int = 6,
        race_attempts: int = 4,
        initial_wait: float = 0.1,
        max_wait: float = 2.0,
    ) -> None:
        """``stream_clients``: the clients whose connections hold the sessions' event streams,
        each session's always in the same one (``client`` itself when none)."""
        # One retry policy, here: the SDK's own retries would hide attempts from the ledger.
        self.client = client.with_options(max_retries=0)
        self.stream_clients = [c.with_options(max_retries=0) for c in stream_clients] or [self.client]
        self._attempts = attempts
        self._race_attempts = race_attempts
        self._initial_wait = initial_wait
        self._max_wait = max_wait

    @classmethod
    def connect(cls, *, api_key: str | None, base_url: str | None, **policy: Any) -> AgentsGateway:
        """Two connection pools: the event streams', where every followed session holds a
        connection for as long as it is followed (the SDK's default pool, 1,000 connections,
        would make the thousand-and-first session wait for ever), and the requests', kept
        apart because the pool looks over every connection it holds for each request it
        sends (with a thousand streams in it, that look was a tenth of a busy serve's CPU).
        For the same reason the streams are spread over ``STREAM_POOLS`` pools: opening a
        stream looks over its own pool's connections only."""
        hooks = {"response": [_crash_when_submission_accepted]} if crashpoints.armed() else {}
        key = api_key or "unused-by-the-emulator"
        # One TLS context for every pool, as each would have built it: building one loads the
        # CA bundle (0.1 s apiece, 1.7 s of each process's start for the seventeen).
        tls = httpx2.create_ssl_context()
        requests = DefaultAsyncHttpxClient(
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=200),
            event_hooks=hooks,
            verify=tls,
        )
        streams = [
            KeepAliveTolerantClient(
                api_key=key,
                base_url=base_url,
                http_client=DefaultAsyncHttpxClient(
                    limits=httpx2.Limits(max_connections=None, max_keepalive_connections=0), verify=tls
                ),
            )
            for _ in range(STREAM_POOLS)
        ]
        return cls(
            KeepAliveTolerantClient(api_key=key, base_url=base_url, http_client=requests),
            stream_clients=streams,
            **policy,
        )

    async def close(self) -> None:
        await self.client.close()
        for stream_client in self.stream_clients:
            if stream_client is not self.client:
                await stream_client.close()

    def stream_client_for(self, session_id: str) -> AsyncOpenAI:
        """The client whose pool holds ``session_id``'s event stream (always the same one)."""
        return self.stream_clients[zlib.crc32(session_id.encode()) % len(self.stream_clients)]

    async def submit_tool_results(
        self, session_id: str, payloads: Sequence[dict[str, Any]], idempotency_key: str
    ) -> None:
        """Send stored results of one session in ONE request (the API applies it whole or not
        at all); every try carries the same body and Idempotency-Key. Transport errors,
        timeouts, 408, 409, 429 and 5xx are tried again, and so, a few times, is the answer
        the SDK documents for its registration race (a call just announced, not registered
        yet): the SDK's own helper does the same.

        Raises SessionGoneError on 404, SubmissionError otherwise; either says whether any
        try may have been applied (``maybe_applied``). What became of the calls is not
        decided here: the session's state says (``runtime.submitter``).
        """
        call_id = payloads[0].get("call_id") if len(payloads) == 1 else None
        races = 0
        applied_maybe = False

        def should_retry(error: BaseException) -> bool:
            nonlocal races, applied_maybe
            applied_maybe = applied_maybe or maybe_applied(error)
            kind = classify(error, call_id)
            if kind is SubmissionFailure.NOT_PENDING:
                races += 1
                retry = races < self._race_attempts
            else:
                retry = kind is SubmissionFailure.RETRYABLE
            if retry:
                metrics.RETRIES.labels("submission").inc()
            return retry

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._attempts),
            wait=self._wait,
            retry=retry_if_exception(should_retry),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    # The stored results are the body's events as they are (``extra_body``
                    # replaces the key): JSON read back from the ledger, which the SDK's
                    # per-field transform of typed input would copy unchanged at 2.7 ms a
                    # request of ten (8% of a recovering serve's loop).
                    await self.client.beta.agents.sessions.events.create(
                        session_id,
                        events=_NO_TYPED_EVENTS,
                        idempotency_key=idempotency_key,
                        extra_body={"events": list(payloads)},
                    )
        except _REFUSED_CREDENTIALS as error:
            # Not these results' fault: nothing is recorded against the calls.
            raise _auth_error(error) from error
        except openai.OpenAIError as error:
            # The last try's error was seen by should_retry too (tenacity asks before it stops).
            kind = classify(error, call_id)
            if kind is SubmissionFailure.SESSION_GONE:
                raise SessionGoneError(
                    f"session {session_id} not found", maybe_applied=applied_maybe
                ) from error
            raise SubmissionError(describe(error), kind=kind, maybe_applied=applied_maybe) from error

    def _wait(self, state: RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome is not None else None
        hinted = retry_after_seconds(error) if error is not None else None
        if hinted is not None:
            return min(hinted, MAX_RETRY_AFTER)
        return float(min(self._max_wait, self._initial_wait * 2 ** (state.attempt_number - 1)))

    async def check(self) -> None:
        """One cheap authenticated read: AgentsAuthError when the credentials are refused,
        AgentsUnavailableError when the API cannot be reached."""
        try:
            # Bounded: an API that accepts the connection and never answers must not hold
            # the start (and the recovery after it) for the SDK's default ten minutes.
            await self.client.beta.agents.sessions.list(limit=1, timeout=CHECK_TIMEOUT)
        except (openai.AuthenticationError, openai.PermissionDeniedError) as error:
            # Refused before any session is named: the key cannot use the Agents API at all.
            raise _auth_error(error) from error
        except openai.OpenAIError as error:
            raise AgentsUnavailableError(describe(error)) from error

    async def retrieve(self, session_id: str) -> AgentSession:
        try:
            return await self.client.beta.agents.sessions.retrieve(session_id)
        except openai.NotFoundError as error:
            raise SessionGoneError(f"session {session_id} not found") from error
        except _REFUSED_CREDENTIALS as error:
            raise _auth_error(error) from error
        except openai.OpenAIError as error:
            if classify(error) is SubmissionFailure.RETRYABLE:
                raise AgentsUnavailableError(describe(error)) from error
            raise

    async def pending_function_calls(self, session_id: str) -> list[FunctionCallAction]:
        session = await self.retrieve(session_id)
        return [a for a in session.required_actions if isinstance(a, FunctionCallAction)]

    @asynccontextmanager
    async def events(
        self, session_id: str, *, idle_timeout: float, types: frozenset[str] | None = None
    ) -> AsyncIterator[SessionEvents]:
        """Open the session's live event stream; iterate it inside the block. ``types``: only
        events of these types are yielded; the others are read and dropped without being
        built (a model's turn streams many text deltas nobody here reads).

        The stream is open (the service buffers events for it) before the block runs, so
        reconciling there leaves no gap in which an event could be missed. Raises
        SessionGoneError (404) or StreamInterruptedError; a stream silent for
        ``idle_timeout`` seconds (no event, no keep-alive) counts as failed, so a half-open
        connection cannot stall a session for ever.
        """
        try:
            stream = await self.stream_client_for(session_id).beta.agents.sessions.events.stream(
                session_id, timeout=httpx2.Timeout(idle_timeout, connect=CONNECT_TIMEOUT)
            )
        except openai.NotFoundError as error:
            raise SessionGoneError(f"session {session_id} not found") from error
        except _REFUSED_CREDENTIALS as error:
            raise _auth_error(error) from error
        except (openai.OpenAIError, httpx2.HTTPError) as error:
            raise StreamInterruptedError(describe(error)) from error
        async with stream:
            yield SessionEvents(stream, types)

    async def discover(self, metadata: dict[str, str]) -> list[AgentSession]:
        """Every session whose metadata matches (all pages)."""
        found: list[AgentSession] = []
        try:
            async for session in self.client.beta.agents.sessions.list(
                metadata=metadata, limit=DISCOVERY_PAGE
            ):
                found.append(session)
        except _REFUSED_CREDENTIALS as error:
            raise _auth_error(error) from error
        return found

    async def agent_sessions(self, agent_id: str, *, after: str | None = None) -> AsyncIterator[AgentSession]:
        """The sessions of one agent, newest first (those older than ``after``, if given), page
        by page as the caller reads on."""
        options: dict[str, Any] = {} if after is None else {"after": after}
        try:
            async for session in self.client.beta.agents.sessions.list(
                agent_id=agent_id, order="desc", limit=DISCOVERY_PAGE, **options
            ):
                yield session
        except _REFUSED_CREDENTIALS as error:
            raise _auth_error(error) from error

    def verify_webhook(self, body: bytes, headers: Mapping[str, str], secret: str) -> None:
        """The SDK's own Standard Webhooks check (signature over ``id.timestamp.body``, a
        300 s window): InvalidWebhookSignatureError (or ValueError for a missing header)
        when it fails."""
        self.client.webhooks.verify_signature(body, headers, secret=secret)


_REFUSED_CREDENTIALS = (openai.AuthenticationError,)
"""401: the key itself is refused, whatever it is used for. (A 403 about one session is that
session's refusal: a submission records it and is tried again later, a stream reconnects.)"""


def _auth_error(error: openai.APIStatusError) -> AgentsAuthError:
    return AgentsAuthError(
        f"the Agents API refused the credentials ({describe(error)}): "
        "check TOOLLEDGER_OPENAI_API_KEY and TOOLLEDGER_OPENAI_BASE_URL"
    )


class _KeepAliveTolerantDecoder(SSEDecoder):
    """The SDK's SSE decoder, except that a block without data (a keep-alive comment on an
    idle stream) dispatches nothing, as the SSE standard says.

    The SDK's decoder keeps the last event id across events (as it should) but also takes
    it as a reason to dispatch: after the first event, every keep-alive became an event
    with empty data, ``json.loads("")`` failed and the stream died. Under load that was a
    reconnect and a full reconcile of every idle session at every keep-alive.
    """

    def decode(self, line: str) -> ServerSentEvent | None:
        if not line and not self._data:
            self._event = None
            self._retry = None
            return None
        return super().decode(line)


class KeepAliveTolerantClient(AsyncOpenAI):
    """The SDK's client with a keep-alive tolerant SSE decoder for event streams, which
    builds each event as the variant its ``type`` names."""

    def _make_sse_decoder(self) -> SSEDecoder:
        return _KeepAliveTolerantDecoder()

    def _process_response_data(self, *, data: object, cast_to: Any, response: httpx2.Response) -> Any:
        # The SDK validates an event against all 34 variants of the union before it falls
        # back to the one its discriminator names (and builds that one without validating):
        # a tenth of a recovering serve's time went into validating events. Its own fallback
        # is taken at once; anything else (other types, strict validation) is the SDK's.
        if cast_to is AgentSessionEvent and not self._strict_response_validation and isinstance(data, dict):
            kind = data.get("type")
            wanted = _EVENT_TYPES_READ.get()
            if wanted is not None and kind not in wanted:
                return None  # dropped unbuilt: SessionEvents skips it
            variant = _EVENT_VARIANTS.get(kind)
            if variant is not None:
                return construct_type(type_=variant, value=data)
        return super()._process_response_data(data=data, cast_to=cast_to, response=response)


def _event_variants() -> dict[object, type]:
    """Each variant of ``AgentSessionEvent`` by the value of its ``type`` field."""
    (union, *_metadata) = get_args(AgentSessionEvent)
    variants: dict[object, type] = {}
    for variant in get_args(union):
        for value in get_args(variant.model_fields["type"].annotation):
            variants[value] = variant
    return variants


_EVENT_VARIANTS = _event_variants()
_EVENT_TYPES_READ: ContextVar[frozenset[str] | None] = ContextVar("_EVENT_TYPES_READ", default=None)
"""The event types the stream being read now yields (``SessionEvents`` sets it for each step)."""


class SessionEvents:
    """A session's event stream, its failures spoken in toolledger's errors."""

    def __init__(self, stream: AsyncStream[AgentSessionEvent], types: frozenset[str] | None = None) -> None:
        self._events = stream.__aiter__()
        self._types = types

    def __aiter__(self) -> SessionEvents:
        return self

    async def __anext__(self) -> AgentSessionEvent:
        reading = _EVENT_TYPES_READ.set(self._types)
        try:
            while True:
                event = await self._events.__anext__()
                if event is not None:
                    return event
        except (openai.OpenAIError, httpx2.HTTPError) as error:
            raise StreamInterruptedError(describe(error)) from error
        except ValueError as error:  # an event whose data is not JSON: a garbled stream
            raise StreamInterruptedError(f"malformed event ({type(error).__name__})") from error
        finally:
            _EVENT_TYPES_READ.reset(reading)


async def _crash_when_submission_accepted(response: httpx2.Response) -> None:
    request = response.request
    if request.method == "POST" and request.url.path.endswith("/events") and response.is_success:
        if len(json.loads(request.content).get("events", [])) > 1:
            crashpoints.crash_point(crashpoints.CP_BATCH_SUBMIT_ACCEPTED)
        else:
            crashpoints.crash_point(crashpoints.CP_SUBMIT_ACCEPTED)
