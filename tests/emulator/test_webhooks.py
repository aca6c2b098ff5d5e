"""The emulator's session webhooks, received over real HTTP and verified by the SDK itself
(``client.webhooks.unwrap``): every event type, retries, a receiver that is down, and each
fault."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.webhooks import (
    AgentSessionActionRequiredWebhookEvent,
    AgentSessionCreatedWebhookEvent,
    AgentSessionFailedWebhookEvent,
    AgentSessionIdleWebhookEvent,
    AgentSessionInProgressWebhookEvent,
)

from tests.emulator.processes import emulator_command, toolledger
from tests.emulator.session_driver import first_pending_call, new_session, start_turn, submit, wait_for_status
from tests.support.polling import eventually_sync
from toolledger.emulator import EmulatorServer, Script, WebhookConfig, WebhookCounts

SessionWebhookEvent = (
    AgentSessionCreatedWebhookEvent
    | AgentSessionInProgressWebhookEvent
    | AgentSessionActionRequiredWebhookEvent
    | AgentSessionIdleWebhookEvent
    | AgentSessionFailedWebhookEvent
)

SECRET = "whsec_" + base64.b64encode(b"a webhook secret of 32 bytes....").decode()
ONE_CALL = Script.of_calls([("charge_card", {"cents": 100})])


@dataclass
class Received:
    webhook_id: str
    event: SessionWebhookEvent
    raw: dict[str, Any]
    at: float
    """time.monotonic() when it arrived."""


class Receiver:
    """A webhook endpoint on a real socket: each POST is verified and parsed by the SDK's
    ``webhooks.unwrap``; a bad signature is answered 400, the rest as ``answers`` says (then 200)."""

    def __init__(self, secret: str = SECRET, port: int = 0) -> None:
        self.secret = secret
        self.port = port
        self.received: list[Received] = []
        self.refused: list[tuple[str, str]] = []
        """(webhook-id, why) of every delivery the SDK refused."""
        self.attempts: list[str] = []
        """The webhook-id of every POST, in arrival order."""
        self.answers: list[int] = []
        self._lock = threading.Lock()
        self._verifier = OpenAI(api_key="x")
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                headers = {key.lower(): value for key, value in self.headers.items()}
                status = receiver.handle(body, headers)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._verifier.close()

    def handle(self, body: bytes, headers: dict[str, str]) -> int:
        webhook_id = headers.get("webhook-id", "")
        with self._lock:
            self.attempts.append(webhook_id)
            try:
                event = self._verifier.webhooks.unwrap(body, headers, secret=self.secret)
            except openai.InvalidWebhookSignatureError as error:
                self.refused.append((webhook_id, str(error)))
                return 400
            if not isinstance(event, SessionWebhookEvent):
                self.refused.append((webhook_id, f"not a session webhook: {event!r}"))
                return 400
            status = self.answers.pop(0) if self.answers else 200
            if 200 <= status < 300:
                self.received.append(Received(webhook_id, event, json.loads(body), time.monotonic()))
            return status

    def events(self) -> list[Received]:
        with self._lock:
            return list(self.received)

    def types(self, session_id: str) -> list[str]:
        return [r.event.type for r in self.events() if r.event.data.id == session_id]

    def wait_for(self, count: int, within: float = 10.0) -> list[Received]:
        return eventually_sync(
            lambda: events if len(events := self.events()) >= count else None,
            within=within,
            what=lambda: f"{count} webhooks received, got {[r.event.type for r in self.events()]}",
            interval=0.02,
        )


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver().start()
    yield receiver
    receiver.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def settled(emulator: EmulatorServer, within: float = 10.0) -> WebhookCounts:
    """The counts once nothing is pending any more."""
    last: list[WebhookCounts] = []

    def done() -> WebhookCounts | None:
        last[:] = [emulator.control.webhook_counts()]
        return last[0] if last[0].pending == 0 else None

    return eventually_sync(done, within=within, what=lambda: f"no webhook pending: {last}", interval=0.02)


def balanced(counts: WebhookCounts) -> bool:
    return (
        counts.sent + counts.duplicated - counts.dropped
        == counts.delivered + counts.given_up + counts.pending
    )


def sessions(client: OpenAI, count: int) -> list[str]:
    return [new_session(client) for _ in range(count)]


# --------------------------------------------------------------------- events


def test_a_session_through_its_life__sends_each_webhook_as_the_sdk_types_it(
    client: OpenAI, emulator: EmulatorServer, receiver: Receiver
) -> None:
    emulator.control.configure_webhooks(receiver.url, SECRET)

    served = new_session(client, ONE_CALL)
    start_turn(client, served)
    submit(client, served, first_pending_call(client, served), output="charged")
    wait_for_status(client, served, "idle")
    failing = new_session(client)
    emulator.control.fail_session(failing, "boom")
    received = receiver.wait_for(7)

    assert receiver.types(served) == [
        "agent.session.created",
        "agent.session.in_progress",
        "agent.session.action_required",
        "agent.session.in_progress",
        "agent.session.idle",
    ]
    assert receiver.types(failing) == ["agent.session.created", "agent.session.failed"]
    expected_class = {
        "agent.session.created": AgentSessionCreatedWebhookEvent,
        "agent.session.in_progress": AgentSessionInProgressWebhookEvent,
        "agent.session.action_required": AgentSessionActionRequiredWebhookEvent,
        "agent.session.idle": AgentSessionIdleWebhookEvent,
        "agent.session.failed": AgentSessionFailedWebhookEvent,
    }
    for delivery in received:
        assert isinstance(delivery.event, expected_class[delivery.event.type])
        assert delivery.event.object == "event"
        assert delivery.event.id.startswith("evt_")
        assert abs(delivery.event.created_at - time.time()) < 60
        assert "agent" not in json.dumps(delivery.raw["data"])  # the real events carry no agent id
    action = next(r.event for r in received if r.event.type == "agent.session.action_required")
    assert isinstance(action, AgentSessionActionRequiredWebhookEvent)
    assert action.data.required_action.type == "function_call"
    assert action.data.model_dump() == {"id": served, "required_action": {"type": "function_call"}}
    idle = next(r.event for r in received if r.event.type == "agent.session.idle")
    assert isinstance(idle, AgentSessionIdleWebhookEvent)
    assert idle.data.environment_type == "none"
    assert len({r.webhook_id for r in received}) == len({r.event.id for r in received}) == 7
    counts = settled(emulator)
    assert counts == WebhookCounts(sent=7, delivered=7, attempts=7)


def test_a_session_created_with_a_streamed_first_turn__sends_created_once(
    client: OpenAI, emulator: EmulatorServer, receiver: Receiver
) -> None:
    emulator.control.configure_webhooks(receiver.url, SECRET)

    with client.beta.agents.sessions.create(
        environment={"type": "none"}, agent={"model": "emulated"}, input="hi", stream=True
    ) as stream:
        events = list(stream)
    session_id = next(e.session.id for e in events if e.type == "agent.session.created")
    receiver.wait_for(3)

    assert settled(emulator).sent == 3
    assert receiver.types(session_id) == [
        "agent.session.created",
        "agent.session.in_progress",
        "agent.session.idle",
    ]


def test_no_webhook_is_sent_when_none_is_configured_or_after_it_is_turned_off(
    client: OpenAI, emulator: EmulatorServer, receiver: Receiver
) -> None:
    new_session(client)
    emulator.control.configure_webhooks(receiver.url, SECRET)
    on = new_session(client)
    receiver.wait_for(1)

    shown = emulator.control.configure_webhooks(None, None)
    new_session(client)
    time.sleep(0.3)

    assert shown["url"] is None
    assert [r.event.data.id for r in receiver.events()] == [on]
    assert emulator.control.webhook_counts() == WebhookCounts()


# ------------------------------------------------------------------- delivery


def test_a_receiver_answering_500__gets_retries_with_the_same_webhook_id_until_it_answers_2xx(
    client: OpenAI, emulator: EmulatorServer, receiver: Receiver
) -> None:
    receiver.answers = [500, 503, 500]
    emulator.control.configure_webhooks(receiver.url, SECRET)

    session_id = new_session(client)
    [delivery] = receiver.wait_for(1)

    assert delivery.event.data.id == session_id
    assert receiver.attempts == [delivery.webhook_id] * 4
    assert settled(emulator) == WebhookCounts(sent=1, delivered=1, attempts=4, failed_attempts=3)


def test_a_receiver_down_when_the_event_happens__gets_it_once_it_is_up(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    late = Receiver(port=free_port())
    emulator.control.configure_webhooks(late.url, SECRET)
    session_id = new_session(client)
    eventually_sync(lambda: emulator.control.webhook_counts().failed_attempts >= 2, within=5)

    late.start()
    try:
        [delivery] = late.wait_for(1, within=15)
        counts = settled(emulator)
    finally:
        late.stop()

    assert delivery.event.data.id == session_id
    assert late.attempts == [delivery.webhook_id]
    assert counts.delivered == 1
    assert counts.failed_attempts >= 2
    assert counts.attempts == counts.failed_attempts + 1
    assert counts.pending == counts.given_up == 0


def test_a_delivery_failing_past_the_give_up_time__is_given_up(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    emulator.control.configure_webhooks(
        f"http://127.0.0.1:{free_port()}/hooks", SECRET, give_up_after_seconds=0.5
    )
    new_session(client)

    counts = settled(emulator)

    assert counts.given_up == 1
    assert counts.delivered == 0
    assert counts.attempts == counts.failed_attempts >= 3  # 0.1 + 0.2 s of backoff fit in 0.5 s


# --------------------------------------------------------------------- faults


def test_drop__loses_some_events_and_counts_them(
    client: OpenAI, emulator: EmulatorServer, receiver: Receiver
) -> None:
    emulator.control.configure_webhooks(receiver.url, SECRET, drop=0.5, seed=3)

    created = sessions(client, 20)
    counts = settled(emulator)
    time.sleep(0.2)

    arrived = [r.event.data.id for r in receiver.events()]
    assert counts.sent == 20
    assert 0 < counts.dropped < 20
    assert len(arrived) == counts.delivered == 20 - counts.dropped
    assert set(arrived) < set(created)
    assert balanced(counts)


def test_duplicate__delivers_the_same_event_twice_under_one_webhook_id(
    client: OpenAI, emulator: EmulatorServer, receiver: Receiver
) -> None:
    emulator.control.configure_webhooks(receiver.url, SECRET, duplicate=1.0)

    created = sessions(client, 3)
    received = receiver.wait_for(6)
    counts = settled(emulator)

    for session_id in created:
        copies = [r for r in received if r.event.data.id == session_id]
        assert len(copies) == 2
        assert copies[0].webhook_id == copies[1].webhook_id
        assert copies[0].raw == copies[1].raw
    assert counts == WebhookCounts(sent=3, duplicated=3, delivered=6, attempts=6)


def test_reorder__an_event_held_back_arrives_after_the_next_one(
    client: OpenAI, emulator: EmulatorServer, receiver: Receiver
) -> None:
    emulator.control.configure_webhooks(receiver.url, SECRET, reorder=1.0)

    s1, s2, s3, s4, s5 = sessions(client, 5)
    received = receiver.wait_for(5, within=5)

    # Held one at a time: each event overtakes the one held before it; the last, with none
    # to overtake it, is released after a second rather than lost.
    assert [r.event.data.id for r in received] == [s2, s1, s4, s3, s5]
    assert received[-1].at - received[-2].at > 0.5
    assert settled(emulator) == WebhookCounts(sent=5, delivered=5, attempts=5)


def test_delay__holds_each_event_back_that_long(
    client: OpenAI, emulator: EmulatorServer, receiver: Receiver
) -> None:
    emulator.control.configure_webhooks(receiver.url, SECRET, delay_seconds=0.6)

    started = time.monotonic()
    sessions(client, 2)
    received = receiver.wait_for(2)

    assert all(r.at - started >= 0.6 for r in received)
    # Delays do not add up: both were due 0.6 s after they happened.
    assert received[-1].at - started < 1.5


def test_wrong_signature__is_refused_by_the_sdk_and_retried_until_signed_right(
    client: OpenAI, emulator: EmulatorServer, receiver: Receiver
) -> None:
    emulator.control.configure_webhooks(receiver.url, SECRET, wrong_signature=0.5, seed=11)

    created = sessions(client, 6)
    received = receiver.wait_for(6, within=20)
    counts = settled(emulator, within=20)

    assert sorted(r.event.data.id for r in received) == sorted(created)
    assert receiver.refused  # the seed makes some attempts wrong
    assert all("signature does not match" in why for _id, why in receiver.refused)
    assert counts.failed_attempts == len(receiver.refused)
    assert counts.delivered == 6


def test_wrong_signature_always__never_gets_past_the_sdk(
    client: OpenAI, emulator: EmulatorServer, receiver: Receiver
) -> None:
    emulator.control.configure_webhooks(receiver.url, SECRET, wrong_signature=1.0, give_up_after_seconds=0.5)

    new_session(client)
    counts = settled(emulator)

    assert receiver.events() == []
    assert len(receiver.refused) == counts.attempts >= 3
    assert counts.given_up == 1


def test_a_seed__makes_the_same_faults_happen_again(
    client: OpenAI, emulator: EmulatorServer, receiver: Receiver
) -> None:
    def run(seed: int) -> list[bool]:
        emulator.control.configure_webhooks(receiver.url, SECRET, drop=0.5, duplicate=0.3, seed=seed)
        created = sessions(client, 16)
        settled(emulator)
        time.sleep(0.1)
        arrived = {r.event.data.id for r in receiver.events()}
        return [session_id in arrived for session_id in created]

    first, again, other = run(5), run(5), run(6)

    assert first == again
    assert first != other


# ------------------------------------------------------------------ the routes


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"url": "http://x/h", "secret": "abc"}, "secret", "must start with 'whsec_'"),
        ({"url": "http://x/h", "secret": "whsec_not base64!"}, "secret", "base64"),
        ({"url": "http://x/h", "secret": "whsec_"}, "secret", "empty"),
        ({"url": "http://x/h"}, None, "needs a secret"),
        ({"url": "ftp://x/h", "secret": SECRET}, "url", "http://"),
        ({"url": "http://x/h", "secret": SECRET, "faults": {"drop": 1.5}}, "faults.drop", "less than"),
        ({"url": "http://x/h", "secret": SECRET, "faults": {"duplicate": -0.1}}, "faults.duplicate", ""),
        ({"url": "http://x/h", "secret": SECRET, "faults": {"lose": 0.1}}, "faults.lose", ""),
        ({"url": "http://x/h", "secret": SECRET, "give_up_after_seconds": 0}, "give_up_after_seconds", ""),
    ],
)
def test_put_webhooks__invalid__is_a_400_naming_the_parameter(
    emulator: EmulatorServer, body: dict[str, Any], param: str | None, words: str
) -> None:
    root = emulator.base_url.removesuffix("/v1")

    response = httpx.put(f"{root}/_emulator/webhooks", json=body)

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert httpx.get(f"{root}/_emulator/webhooks").json()["url"] is None  # nothing changed


def test_get_webhooks__shows_the_configuration_without_the_secret(emulator: EmulatorServer) -> None:
    root = emulator.base_url.removesuffix("/v1")
    httpx.put(
        f"{root}/_emulator/webhooks",
        json={"url": "http://127.0.0.1:9/h", "secret": SECRET, "faults": {"reorder": 0.25}, "seed": 4},
    ).raise_for_status()

    shown = httpx.get(f"{root}/_emulator/webhooks").json()

    assert SECRET not in json.dumps(shown)
    assert SECRET.removeprefix("whsec_") not in json.dumps(shown)
    assert shown == {
        "url": "http://127.0.0.1:9/h",
        "secret_set": True,
        "faults": {
            "drop": 0.0,
            "duplicate": 0.0,
            "reorder": 0.25,
            "delay_seconds": 0.0,
            "wrong_signature": 0.0,
        },
        "seed": 4,
        "give_up_after_seconds": 3600.0,
        "counts": WebhookCounts().model_dump(),
    }


def test_reset__turns_webhooks_set_through_the_control_api_off(
    client: OpenAI, emulator: EmulatorServer, receiver: Receiver
) -> None:
    emulator.control.configure_webhooks(receiver.url, SECRET)

    emulator.control.reset()
    new_session(client)
    time.sleep(0.3)

    assert emulator.control.webhooks()["url"] is None
    assert receiver.events() == []


def test_emulator_server__start_up_webhooks__are_sent_and_restored_by_a_reset(receiver: Receiver) -> None:
    config = WebhookConfig(url=receiver.url, secret=SECRET)
    with (
        EmulatorServer(webhooks=config) as server,
        OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client,
    ):
        server.control.configure_webhooks(None, None)
        new_session(client)
        server.control.reset()
        after_reset = new_session(client)
        [delivery] = receiver.wait_for(1)
        shown = server.control.webhooks()

    assert delivery.event.data.id == after_reset
    assert shown["url"] == receiver.url
    assert shown["secret_set"] is True


# -------------------------------------------------------------------- the CLI


def test_emulator_command__webhook_options__send_signed_webhooks(tmp_path: Path, receiver: Receiver) -> None:
    with (
        emulator_command(tmp_path, "--webhook-url", receiver.url, "--webhook-secret", SECRET) as base_url,
        OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client,
    ):
        session_id = new_session(client)
        [delivery] = receiver.wait_for(1)

    assert isinstance(delivery.event, AgentSessionCreatedWebhookEvent)
    assert delivery.event.data.id == session_id


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--webhook-url", "http://127.0.0.1:9/h", "--webhook-secret", "nope"], "whsec_"),
        (["--webhook-url", "http://127.0.0.1:9/h"], "needs a secret"),
    ],
)
def test_emulator_command__bad_webhook_options__exit_2_saying_why(
    tmp_path: Path, args: list[str], words: str
) -> None:
    result = toolledger("emulator", *args, cwd=tmp_path)

    assert result.returncode == 2
    assert words in result.stderr
    assert "Traceback" not in result.stderr
