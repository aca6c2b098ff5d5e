"""A small round-robin HTTP load balancer in front of `serve` replicas' webhook intakes, as a
deployment puts one: each POST goes to the next replica in turn, forwarded as it came (body and
headers, so the signature still holds) and answered with the replica's answer; a replica that
is down (refused, reset, no answer) gets the POST answered 502, so the sender retries, and its
retry goes to the next replica. On a background thread with its own event loop, so that a test
blocking its own loop never holds a delivery back.

    with LoadBalancer([f"http://127.0.0.1:{port}" for port in ports]) as balancer:
        emulator.control.configure_webhooks(balancer.url + PATH, SECRET)
"""

from __future__ import annotations

import itertools
import socket
import threading
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

FORWARDED_HEADERS = ("content-type", "webhook-id", "webhook-timestamp", "webhook-signature")
FORWARD_TIMEOUT = 10.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (for a replica started later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LoadBalancer:
    """``counts``: ``forwarded`` (answered by a replica, whatever its status), ``status_<n>``
    per replica answer, ``unreachable`` (answered 502); ``by_backend``: POSTs tried per replica."""

    def __init__(self, backends: Sequence[str], host: str = "127.0.0.1") -> None:
        if not backends:
            raise ValueError("a load balancer needs at least one backend")
        self.backends = [backend.rstrip("/") for backend in backends]
        self._turn = itertools.cycle(range(len(self.backends)))
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.by_backend: Counter[str] = Counter()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(256)
        port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self._client: httpx.AsyncClient | None = None
        app = Starlette(
            routes=[Route("/{path:path}", self._forward, methods=["POST"])], lifespan=self._lifespan
        )
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="test-load-balancer", daemon=True)

    def _next(self) -> str:
        with self._lock:
            return self.backends[next(self._turn)]

    async def _forward(self, request: Request) -> Response:
        backend = self._next()
        self.by_backend[backend] += 1
        body = await request.body()
        headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        assert self._client is not None
        try:
            answer = await self._client.post(f"{backend}{request.url.path}", content=body, headers=headers)
        except httpx.HTTPError as error:
            self.counts["unreachable"] += 1
            return Response(f"replica {backend} unreachable: {type(error).__name__}\n", status_code=502)
        self.counts["forwarded"] += 1
        self.counts[f"status_{answer.status_code}"] += 1
        return Response(
            answer.content,
            status_code=answer.status_code,
            media_type=answer.headers.get("content-type"),
        )

    @asynccontextmanager
    async def _lifespan(self, _: Starlette) -> AsyncIterator[None]:
        # Made on the balancer's own loop. No keep-alive: a pooled connection to a replica
        # killed since would fail a POST that a fresh one would have delivered.
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=FORWARD_TIMEOUT, limits=limits) as client:
            self._client = client
            yield
        self._client = None

    def _run(self) -> None:
        self._server.run(sockets=[self._sock])

    def start(self) -> LoadBalancer:
        self._thread.start()
        with httpx.Client(timeout=1.0) as client:
            for _ in range(200):
                try:
                    client.get(self.url + "/")
                    break
                except httpx.HTTPError:
                    threading.Event().wait(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self._sock.close()

    def __enter__(self) -> LoadBalancer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


__all__ = ["LoadBalancer", "free_port"]
