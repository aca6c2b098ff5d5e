"""Raw ASGI responses for what a framework response cannot do: cut a connection on purpose."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

import anyio
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from toolledger.emulator.state import StreamEnd

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class EventStreamResponse(Response):
    """Server-sent events from ``frames``; ``StreamEnd.DROP`` cuts the connection mid-body."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncGenerator[bytes | StreamEnd, None]) -> None:
        super().__init__(status_code=200)
        self._frames = frames

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        await send({"type": "http.response.body", "body": b"", "more_body": True})
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_cancel_on_disconnect, receive, tasks.cancel_scope)
            async with contextlib.aclosing(self._frames) as frames:
                async for frame in frames:
                    if frame is StreamEnd.END:
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                        break
                    if frame is StreamEnd.DROP:
                        # Returning before the final body message makes the server close the
                        # socket mid-response: the client sees a broken connection.
                        break
                    assert isinstance(frame, bytes)
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
            tasks.cancel_scope.cancel()


class DroppedResponse(Response):
    """Headers promising a body that never comes, then a closed connection.

    The client cannot tell whether its request was applied: the ambiguous outcome a
    proxy timeout or a crashed load balancer produces.
    """

    def __init__(self, status: int = 202) -> None:
        super().__init__(status_code=status)
        self._status = status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": self._status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")],
            }
        )


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return
