"""Serving an ASGI app inside a process that owns its signals: the audit API (``toolledger
api``, ``serve --api``) and the webhook intake (``serve --listen``) run this way."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any, Literal

import uvicorn


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: whoever runs it (``toolledger api``, ``serve``)
    owns SIGTERM and tells it to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listening_socket(host: str, port: int, *, shared: bool = False) -> socket.socket:
    """``shared``: other processes may listen on the same port (SO_REUSEPORT; the kernel
    spreads connections among them), as the serve processes of one machine do for webhooks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when the protocol
    # says TCP; without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared and hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(512)
    return sock


async def serve_app(
    app: Any,
    host: str,
    port: int,
    *,
    name: str,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[str, int], None] | None = None,
    log_level: str | int = "info",
    lifespan: Literal["on", "off"] = "on",
    shared_port: bool = False,
) -> None:
    """Serve ``app`` until ``stop`` is set or the task is cancelled; ``on_listening(host, port)``
    is called once connections are accepted (with the real port when ``port`` is 0).
    ``log_level``: uvicorn sets its own loggers (``uvicorn.error``, ``uvicorn.access``) to it,
    whatever the process's level."""
    sock = listening_socket(host, port, shared=shared_port)
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=log_level,
        lifespan=lifespan,
        server_header=False,
        timeout_graceful_shutdown=5,
    )
    server = EmbeddedServer(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if serving.done():
                await serving
                raise RuntimeError(f"the {name} stopped while starting")
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


__all__ = ["EmbeddedServer", "listening_socket", "serve_app"]
