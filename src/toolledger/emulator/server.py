"""Serving the emulator: in the foreground for the CLI, or on a background thread for tests."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Generator
from typing import Any

import uvicorn

from toolledger.emulator.app import create_app
from toolledger.emulator.control import EmulatorControl
from toolledger.emulator.script import Script
from toolledger.emulator.state import KEEPALIVE_SECONDS, EmulatorState
from toolledger.emulator.webhooks import WebhookConfig

_INTENDED_DROP = "ASGI callable returned without completing response."


class _IntendedDropFilter(logging.Filter):
    """The emulator cuts connections on purpose (faults); uvicorn logs that as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _INTENDED_DROP


class _EmulatorServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: EmulatorState) -> None:
        super().__init__(config)
        self._state = state

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises SIGTERM/SIGINT after a clean shutdown (the process would then die
        # by the signal, or click would print "Aborted!"); a finished emulator exits 0.
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Event streams never end by themselves; end them first or shutdown waits forever.
        self._state.close()
        await super().shutdown(sockets=sockets)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns TCP_NODELAY on for accepted sockets only when the
    # protocol says TCP; without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def base_url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


def _server(
    sock: socket.socket, state: EmulatorState, api_key: str | None, log_level: str
) -> _EmulatorServer:
    logging.getLogger("uvicorn.error").addFilter(_IntendedDropFilter())
    config = uvicorn.Config(
        create_app(state, api_key=api_key),
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    return _EmulatorServer(config, state)


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    default_script: Script | None = None,
    scripts: dict[str, Script] | None = None,
    log_level: str = "warning",
    webhooks: WebhookConfig | None = None,
) -> None:
    """Serve in the foreground until SIGTERM or SIGINT; print the base URL first.

    ``scripts``: named scripts, selected by the metadata key ``emulator_script``;
    ``webhooks``: where session webhooks go from the start."""
    sock = bind(host, port)
    print(base_url_of(sock), flush=True)
    state = EmulatorState(default_script=default_script, scripts=scripts, webhooks=webhooks)
    server = _server(sock, state, api_key, log_level)
    server.run(sockets=[sock])


class EmulatorServer:
    """The emulator on a background thread, for tests, benchmarks and the demo.

    >>> with EmulatorServer() as emulator:
    ...     client = OpenAI(base_url=emulator.base_url, api_key="test")
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        default_script: Script | None = None,
        scripts: dict[str, Script] | None = None,
        log_level: str = "warning",
        keepalive_seconds: float = KEEPALIVE_SECONDS,
        webhooks: WebhookConfig | None = None,
    ) -> None:
        """``scripts``: named scripts, selected by the metadata key ``emulator_script``;
        ``keepalive_seconds``: how long a stream stays silent before a keep-alive comment;
        ``webhooks``: the start-up webhook configuration, which a reset restores."""
        self._sock = bind(host, port)
        self.base_url = base_url_of(self._sock)
        self._server = _server(
            self._sock,
            EmulatorState(
                default_script=default_script,
                scripts=scripts,
                keepalive_seconds=keepalive_seconds,
                webhooks=webhooks,
            ),
            api_key,
            log_level,
        )
        self._thread = threading.Thread(target=self._run, name="toolledger-emulator", daemon=True)
        self.control = EmulatorControl(self.base_url)

    def _run(self) -> None:
        self._server.run(sockets=[self._sock])

    def start(self) -> EmulatorServer:
        self._thread.start()
        self.control.wait_ready()
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self.control.close()
        self._sock.close()

    def __enter__(self) -> EmulatorServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


__all__ = ["EmulatorServer", "serve"]
