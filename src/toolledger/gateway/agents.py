"""The only code that talks to the Agents API: ``AsyncOpenAI().beta.agents.sessions``."""

from __future__ import annotations

from typing import Any, cast

import openai
from openai import AsyncOpenAI
from openai.types.beta.agent_session import (
    AgentSession,
    RequiredActionSessionRequiredActionResourceFunctionCall,
)
from openai.types.beta.agent_session_input_param import SessionInputParamAgentSessionInputToolResult
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt

from toolledger.errors import SessionGoneError, SubmissionError
from toolledger.gateway.classify import Failure, classify, describe, retry_after_seconds

FunctionCallAction = RequiredActionSessionRequiredActionResourceFunctionCall

MAX_RETRY_AFTER = 60.0


class AgentsGateway:
    """Submits tool results and reads sessions, retrying what is safe to retry."""

    def __init__(
        self,
        client: AsyncOpenAI,
        *,
        attempts: int = 6,
        race_attempts: int = 4,
        initial_wait: float = 0.1,
        max_wait: float = 2.0,
    ) -> None:
        # One retry policy, here: the SDK's own retries would hide attempts from the ledger.
        self.client = client.with_options(max_retries=0)
        self._attempts = attempts
        self._race_attempts = race_attempts
        self._initial_wait = initial_wait
        self._max_wait = max_wait

    @classmethod
    def connect(cls, *, api_key: str | None, base_url: str | None, **policy: Any) -> AgentsGateway:
        return cls(AsyncOpenAI(api_key=api_key or "unused-by-the-emulator", base_url=base_url), **policy)

    async def close(self) -> None:
        await self.client.close()

    async def submit_tool_result(
        self, session_id: str, payload: dict[str, Any], idempotency_key: str
    ) -> None:
        """Send a stored result; every try carries the same body and Idempotency-Key.

        Raises SessionGoneError when the session is gone, SubmissionError otherwise
        (``retryable`` tells whether a later resubmission may still succeed).
        """
        races = 0

        def should_retry(error: BaseException) -> bool:
            nonlocal races
            kind = classify(error, payload.get("call_id"))
            if kind is Failure.PENDING_RACE:
                races += 1
                return races < self._race_attempts
            return kind is Failure.RETRYABLE

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._attempts),
            wait=self._wait,
            retry=retry_if_exception(should_retry),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await self.client.beta.agents.sessions.events.create(
                        session_id,
                        events=[cast(SessionInputParamAgentSessionInputToolResult, payload)],
                        idempotency_key=idempotency_key,
                    )
        except openai.OpenAIError as error:
            kind = classify(error, payload.get("call_id"))
            if kind is Failure.SESSION_GONE:
                raise SessionGoneError(f"session {session_id} not found") from error
            retryable = kind in (Failure.RETRYABLE, Failure.PENDING_RACE)
            raise SubmissionError(describe(error), retryable=retryable) from error

    def _wait(self, state: RetryCallState) -> float:
        error = state.outcome.exception() if state.outcome is not None else None
        hinted = retry_after_seconds(error) if error is not None else None
        if hinted is not None:
            return min(hinted, MAX_RETRY_AFTER)
        return float(min(self._max_wait, self._initial_wait * 2 ** (state.attempt_number - 1)))

    async def retrieve(self, session_id: str) -> AgentSession:
        try:
            return await self.client.beta.agents.sessions.retrieve(session_id)
        except openai.NotFoundError as error:
            raise SessionGoneError(f"session {session_id} not found") from error

    async def pending_function_calls(self, session_id: str) -> list[FunctionCallAction]:
        session = await self.retrieve(session_id)
        return [a for a in session.required_actions if isinstance(a, FunctionCallAction)]
