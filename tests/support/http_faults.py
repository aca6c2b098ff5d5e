"""Real sockets on 127.0.0.1 that fail an HTTP request in each way a client can see: refused,
a connect that times out, a server that is not TLS, one that never answers, one that closes
before or in the middle of its answer. Each counts the requests it read, so a test can show
that a "maybe executed" request really arrived and a "not executed" one never did."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

Behaviour = Callable[[socket.socket, "FaultyServer"], None]

HOST = "127.0.0.1"


@dataclass
class FaultyServer:
    """A listener on 127.0.0.1 answering every connection with ``behaviour``."""

    behaviour: Behaviour
    port: int = 0
    requests: list[bytes] = field(default_factory=list)
    """The requests read (head and body), in order."""
    stopping: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str = "/charge", scheme: str = "http") -> str:
        return f"{scheme}://{HOST}:{self.port}{path}"

    def note(self, request: bytes) -> None:
        with self._lock:
            self.requests.append(request)


@contextlib.contextmanager
def faulty_server(behaviour: Behaviour) -> Iterator[FaultyServer]:
    """Serve ``behaviour`` on a fresh port until the block ends (each connection in a thread)."""
    listener = socket.create_server((HOST, 0))
    listener.settimeout(0.05)
    server = FaultyServer(behaviour, port=listener.getsockname()[1])
    connections: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def serve_one(connection: socket.socket) -> None:
        with contextlib.suppress(OSError):
            behaviour(connection, server)

    def accept_loop() -> None:
        while not server.stopping.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            connections.append(connection)
            thread = threading.Thread(target=serve_one, args=(connection,), daemon=True)
            threads.append(thread)
            thread.start()

    acceptor = threading.Thread(target=accept_loop, daemon=True)
    acceptor.start()
    try:
        yield server
    finally:
        server.stopping.set()
        acceptor.join(5)
        listener.close()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.close()
        for thread in threads:
            thread.join(5)


def read_request(connection: socket.socket, server: FaultyServer) -> bytes:
    """Read one request (its head and a Content-Length body) and note it."""
    connection.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = connection.recv(65536)
        if not chunk:
            break
        body += chunk
    request = head + b"\r\n\r\n" + body
    server.note(request)
    return request


def never_answers(connection: socket.socket, server: FaultyServer) -> None:
    """Reads the request, then holds the connection open without a word."""
    read_request(connection, server)
    server.stopping.wait(30)


def closes_without_answer(connection: socket.socket, server: FaultyServer) -> None:
    """Reads the request, then closes the connection (as a server that crashed mid-request)."""
    read_request(connection, server)
    connection.close()


def closes_mid_answer(connection: socket.socket, server: FaultyServer) -> None:
    """Reads the request, sends the head of a 200 and part of its body, then closes."""
    read_request(connection, server)
    connection.sendall(
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"charge": "ch_'
    )
    connection.close()


def answers_500(connection: socket.socket, server: FaultyServer) -> None:
    """Reads the request and answers 500 (a status: the application's to read)."""
    read_request(connection, server)
    connection.sendall(
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno"
    )
    connection.close()


def not_tls(connection: socket.socket, server: FaultyServer) -> None:
    """Answers a TLS ClientHello with plain HTTP: the client's TLS handshake fails."""
    connection.settimeout(5)
    hello = connection.recv(65536)
    if hello:
        connection.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    connection.close()


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A port on 127.0.0.1 that is bound but not listening: a connection is refused (RST).
    Kept bound meanwhile, so nothing else takes the port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bound:
        bound.bind((HOST, 0))
        yield bound.getsockname()[1]


@contextlib.contextmanager
def full_backlog_port() -> Iterator[int]:
    """A port whose listener never accepts and whose accept queue is full: the kernel drops
    a new connection's SYN, so connecting times out (nothing is ever sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((HOST, 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(4):
                filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                filler.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    filler.connect((HOST, port))
                fillers.append(filler)
            yield port
        finally:
            for filler in fillers:
                filler.close()


UNRESOLVABLE_HOST = "payments.nonexistent.invalid"
"""A name under .invalid, which RFC 2606 reserves never to resolve."""
