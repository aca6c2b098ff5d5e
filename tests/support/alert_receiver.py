"""A real HTTP receiver of alert webhooks, in a thread of the test's process (``http.server``):
it keeps every request as it arrived (headers and raw body) and answers as it is told, or
hangs until it is let go. ``free_port`` gives an address nobody listens on yet, for a
receiver that is down at first and comes up later on it."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from toolledger.runtime.alert_signature import ALERT_ID_HEADER, SIGNATURE_HEADER


@dataclass(frozen=True)
class ReceivedAlert:
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.body)
        return parsed

    @property
    def alert_id(self) -> str:
        return self.headers[ALERT_ID_HEADER.lower()]

    @property
    def signature(self) -> str:
        return self.headers[SIGNATURE_HEADER.lower()]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class AlertReceiver:
    """``status``: what every POST is answered with; ``hang``: hold each request unanswered
    until ``release()`` (or the receiver stops)."""

    def __init__(self, port: int = 0, *, status: int = 204, hang: bool = False) -> None:
        self.status = status
        self.hang = hang
        self.received: list[ReceivedAlert] = []
        self.arrived = threading.Event()
        self._released = threading.Event()
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                with receiver._lock:
                    receiver.received.append(
                        ReceivedAlert({k.lower(): v for k, v in self.headers.items()}, body)
                    )
                receiver.arrived.set()
                if receiver.hang:
                    receiver._released.wait()
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the test reads ``received``, not a log

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="alert receiver", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/hooks/toolledger"

    def alerts(self) -> list[ReceivedAlert]:
        with self._lock:
            return list(self.received)

    def release(self) -> None:
        self.hang = False
        self._released.set()

    def __enter__(self) -> AlertReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def receiver_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/hooks/toolledger"
