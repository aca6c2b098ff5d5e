"""Secret canaries for RELIABILITY.md R13 and R14: unique secrets in every shape the redactor
promises to mask, benign look-alikes it must leave alone, a recording front for the emulator,
and tools that plant the canaries (importable by a `toolledger serve` subprocess as
``tests.chaos.canaries:registry``).

Every canary is built at run time from a seed (``CANARY_SEED``, passed to subprocesses), so no
canary value is written in a source line that a traceback could quote.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import string
import struct
import threading
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator
from sqlalchemy import MetaData, text

from toolledger.domain.redaction import DEFAULT_SECRET_FIELDS, MASK
from toolledger.domain.results import MaybeExecuted, NotExecuted, ToolError
from toolledger.runtime.context import ToolContext
from toolledger.runtime.registry import ToolRegistry
from toolledger.store.engine import create_engine

if TYPE_CHECKING:
    from toolledger.emulator import EmulatorServer

SEED_VARIABLE = "CANARY_SEED"
"""The seed of this run's canaries; subprocesses get it in their environment."""
PLANT_VARIABLE = "CANARY_PLANT_DB_PASSWORD"
"""Set to 1 for a process whose ledger URL carries the database-password canary."""
CUSTOM_FIELD = "signing_key"
"""A secret field name configured on top of the defaults (TOOLLEDGER_SECRET_FIELDS)."""
SECRET_FIELDS = frozenset(DEFAULT_SECRET_FIELDS | {CUSTOM_FIELD})
ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class Canary:
    """One secret: the unique fragments that must never be found, and the ways it is planted."""

    name: str
    needles: tuple[str, ...]
    """Random fragments of the secret (10 characters each): finding any of them is a leak."""
    plantings: tuple[tuple[str, str], ...]
    """(text carrying the secret, the same text once redacted), each self-contained."""
    configured: bool = False
    """Only a redactor configured with it (``Settings.redactor()``) can mask it."""

    @property
    def planted(self) -> str:
        return self.plantings[0][0]

    @property
    def masked(self) -> str:
        return self.plantings[0][1]


def _needles(*tokens: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(part for token in tokens for part in (token[:10], token[-10:])))


def _field_plantings(name: str, value: str) -> tuple[tuple[str, str], ...]:
    """A secret-named field's value in the shapes text gives it: k=v, k: v, JSON, a Python
    repr, JSON inside a JSON string, a URL query, a header, in capitals."""
    plantings = [
        (f"{name}={value}", f"{name}={MASK}"),
        (f"{name}: {value}", f"{name}: {MASK}"),
        (f'"{name}": "{value}"', f'"{name}": "{MASK}"'),
        (f"'{name}': '{value}'", f"'{name}': '{MASK}'"),
        (f'{{\\"{name}\\": \\"{value}\\"}}', f'{{\\"{name}\\": \\"{MASK}\\"}}'),
        (
            f"https://hooks.example.com/cb?{name}={value}&page=2",
            f"https://hooks.example.com/cb?{name}={MASK}&page=2",
        ),
        (f"{name.upper()}={value}", f"{name.upper()}={MASK}"),
    ]
    header = "-".join(part.capitalize() for part in name.split("_"))
    plantings.append((f"X-{header}: {value}", f"X-{header}: {MASK}"))
    return tuple(plantings)


@dataclass(frozen=True)
class CanarySet:
    """This run's canaries."""

    seed: int
    project_key: str
    bearer_token: str
    aws_key: str
    dsn_password: str
    basic_secret: str
    passphrase: tuple[str, str]
    api_key: str
    """The configured OpenAI API key (Settings.openai_api_key): of no known shape."""
    db_password: str
    """The password in the ledger's own database URL (PostgreSQL runs)."""
    fields: Mapping[str, str]
    """A value per secret field name (the defaults and CUSTOM_FIELD)."""

    @classmethod
    def from_seed(cls, seed: int) -> CanarySet:
        rng = random.Random(seed)

        def token(length: int, alphabet: str = ALNUM) -> str:
            return "".join(rng.choice(alphabet) for _ in range(length))

        return cls(
            seed=seed,
            project_key="sk-proj-CANARY" + token(40),
            bearer_token="CANARY" + token(32),
            aws_key="AKIACANARY" + token(10, string.ascii_uppercase + string.digits),
            dsn_password="CANARYdsn" + token(20),
            basic_secret="CANARYbasic" + token(20),
            passphrase=("CANARYpass" + token(16), token(16)),
            api_key="CANARYkey" + token(32),
            db_password="CANARYdb" + token(20),
            fields={name: f"CANARY{name[:3]}" + token(20) for name in sorted(SECRET_FIELDS)},
        )

    def canaries(self, *, db_password: bool) -> list[Canary]:
        """Every canary; the database password only where the ledger's URL carries it."""
        key, token, aws, dsn = self.project_key, self.bearer_token, self.aws_key, self.dsn_password
        basic = base64.b64encode(f"shop:{self.basic_secret}".encode()).decode()
        phrase = f"{self.passphrase[0]} correct horse {self.passphrase[1]}"
        found = [
            Canary(
                "openai_project_key",
                _needles(key.removeprefix("sk-proj-")),
                (
                    (key, MASK),
                    (f"Incorrect API key provided: {key}.", f"Incorrect API key provided: {MASK}."),
                    (f"OPENAI_API_KEY={key}", f"OPENAI_API_KEY={MASK}"),
                    # A line break escaped in a repr ("config:\\nsk-..."): the key starts a line.
                    (f"'config:\\n{key}'", f"'config:\\n{MASK}'"),
                ),
            ),
            Canary(
                "bearer_token",
                _needles(token),
                (
                    (f"Bearer {token}", MASK),
                    (f"Authorization: Bearer {token}", f"Authorization: {MASK}"),
                    (f"{{'authorization': 'Bearer {token}'}}", f"{{'authorization': '{MASK}'}}"),
                ),
            ),
            Canary(
                "aws_access_key",
                _needles(aws[4:]),
                ((aws, MASK), (f"aws_access_key_id={aws}", f"aws_access_key_id={MASK}")),
            ),
            Canary(
                "dsn_password",
                _needles(dsn),
                (
                    (
                        f"postgresql://shop:{dsn}@db.internal:5432/shop",
                        f"postgresql://shop:{MASK}@db.internal:5432/shop",
                    ),
                    (f"redis://:{dsn}@cache.internal:6379/0", f"redis://:{MASK}@cache.internal:6379/0"),
                    (f"amqp://guest:{dsn}@mq.internal/", f"amqp://guest:{MASK}@mq.internal/"),
                ),
            ),
            Canary(
                "basic_credentials",
                (*_needles(self.basic_secret), basic[:10], basic[-12:-2]),
                ((f"Authorization: Basic {basic}", f"Authorization: {MASK}"),),
            ),
            Canary(
                "passphrase",
                _needles(*self.passphrase),
                (
                    (f'"password": "{phrase}"', f'"password": "{MASK}"'),
                    (f"password='{phrase}'", f"password='{MASK}'"),
                ),
            ),
            Canary(
                "configured_api_key",
                _needles(self.api_key),
                (
                    (self.api_key, MASK),
                    (f"the key {self.api_key} was refused", f"the key {MASK} was refused"),
                ),
                configured=True,
            ),
        ]
        if db_password:
            found.append(
                Canary(
                    "configured_db_password",
                    _needles(self.db_password),
                    (
                        (self.db_password, MASK),
                        (f"could not log in with {self.db_password}", f"could not log in with {MASK}"),
                    ),
                    configured=True,
                )
            )
        for name, value in self.fields.items():
            found.append(
                Canary(
                    f"field_{name}",
                    _needles(value),
                    _field_plantings(name, value),
                    configured=name not in DEFAULT_SECRET_FIELDS,
                )
            )
        return found

    def postgres_url(self, url: str) -> str:
        """The same PostgreSQL database, with the password canary (trust auth ignores it)."""
        from sqlalchemy.engine import make_url

        return make_url(url).set(password=self.db_password).render_as_string(hide_password=False)


def _seed() -> int:
    value = os.environ.get(SEED_VARIABLE)
    return int(value) if value else random.SystemRandom().randrange(2**32)


CANARIES = CanarySet.from_seed(_seed())


def needles(canaries: Iterable[Canary]) -> dict[str, str]:
    """Every needle, and the canary it belongs to."""
    return {needle: canary.name for canary in canaries for needle in canary.needles}


def hits(text: str, canaries: Iterable[Canary]) -> list[str]:
    """The canaries found in ``text`` (by any of their needles)."""
    return sorted({name for needle, name in needles(canaries).items() if needle in text})


# ------------------------------------------------------------------- planting


_planted: list[Canary] = CANARIES.canaries(db_password=os.environ.get(PLANT_VARIABLE) == "1")


def plant(canaries: Iterable[Canary]) -> None:
    """Which canaries this process's tools plant (a test sets it for an in-process ledger)."""
    _planted[:] = list(canaries)


def planted() -> list[Canary]:
    return list(_planted)


def leaky_text(*, every_shape: bool = True) -> str:
    """Every planted canary, in every shape (or only its first), one per line."""
    return "\n".join(
        planting
        for canary in _planted
        for planting, _ in (canary.plantings if every_shape else canary.plantings[:1])
    )


def redacted_text(*, every_shape: bool = True) -> str:
    """``leaky_text`` as the redactor must return it."""
    return "\n".join(
        masked
        for canary in _planted
        for _, masked in (canary.plantings if every_shape else canary.plantings[:1])
    )


def leaky_arguments() -> dict[str, Any]:
    """Valid arguments for ``store_credentials``: every secret field's value, and all shapes."""
    fields = {name: value for name, value in CANARIES.fields.items()}
    return {"fields": fields, "note": leaky_text()}


class Leaky:
    """An object whose repr carries canaries (an exception argument, a parameter)."""

    def __init__(self, label: str, carried: str) -> None:
        self.label = label
        self.carried = carried

    def __repr__(self) -> str:
        return f"{self.label}({self.carried})"


# ---------------------------------------------------------------------- tools

registry = ToolRegistry()
LONG_TOOL_ERROR_PREFIX = "The payment provider refused the charge: "


@registry.tool(name="store_credentials", effect="idempotent")
def store_credentials(fields: dict[str, str], note: str = "") -> str:
    """Valid arguments full of secrets: stored whole (a re-run needs them), never echoed."""
    return f"stored {len(fields)} field(s)"


@registry.tool(name="raise_plain")
def raise_plain() -> str:
    raise RuntimeError(leaky_text())


@registry.tool(name="raise_chained")
async def raise_chained() -> str:
    """ConnectionError -> (cause) KeyError -> (context) OSError -> (cause) RuntimeError + a note."""
    try:
        try:
            try:
                raise ConnectionError(leaky_text())
            except ConnectionError as first:
                raise KeyError(leaky_text()) from first
        except KeyError:
            raise OSError(leaky_text())  # noqa: B904 - its __context__ is the point
    except OSError as cause:
        error = RuntimeError("the charge failed")
        error.add_note(leaky_text())
        raise error from cause


@registry.tool(name="raise_group")
def raise_group() -> str:
    raise ExceptionGroup(
        "batch failed",
        [
            ValueError(leaky_text()),
            ExceptionGroup(
                "nested", [TimeoutError(leaky_text()), LookupError(Leaky("Credentials", leaky_text()))]
            ),
        ],
    )


@registry.tool(name="raise_objects")
def raise_objects() -> str:
    """Arguments that are objects: their reprs (and the reprs of reprs) carry the canaries."""
    raise ValueError(
        Leaky("Connection", leaky_text()),
        {"request": {"headers": {"Authorization": f"Bearer {CANARIES.bearer_token}"}, "body": leaky_text()}},
        [leaky_text()],
        json.dumps({"upstream": json.dumps({"password": CANARIES.fields["password"]})}),
    )


@registry.tool(name="raise_tool_error")
def raise_tool_error() -> str:
    """A ToolError's message reaches the model: redacted, and short enough to be whole."""
    raise ToolError(leaky_text(every_shape=False).replace("\n", " | "))


@registry.tool(name="raise_long_tool_error")
def raise_long_tool_error() -> str:
    raise ToolError(LONG_TOOL_ERROR_PREFIX + leaky_text())


@registry.tool(name="return_secrets", effect="idempotent")
def return_secrets() -> dict[str, str]:
    """An output is the tool's answer to the model, stored and sent byte for byte."""
    return {"echo": leaky_text()}


@registry.tool(name="database_error", effect="transactional")
async def database_error(ctx: ToolContext) -> str:
    """A statement of the handler's own fails: the driver's error quotes its parameters."""
    shapes = [planting for canary in _planted for planting, _ in canary.plantings]
    parameters = {f"p{i}": planting for i, planting in enumerate(shapes)}
    columns = ", ".join(f":{name}" for name in parameters)
    await ctx.db.execute(text(f"SELECT {columns} FROM no_such_table_of_canaries"), parameters)  # noqa: S608
    return "unreachable"


# ------------------------------------ bare values of the call's own secret fields (issue 31)
# A handler quoting what it was given, with no field name beside it: no shape to find, only
# the values themselves. Each is in the call's arguments under a secret-named field.


def _luhn(number: str) -> str:
    """A validator that quotes what it refuses (as many do): its words reach the model."""
    raise ValueError(f"{number} is not a card number")


def quoted_arguments() -> dict[str, Any]:
    """The values the tools below quote: every default secret field and the custom one."""
    return {
        "card_number": CANARIES.fields["card_number"],
        "cvv": CANARIES.fields["cvv"],
        "signing_key": CANARIES.fields[CUSTOM_FIELD],
    }


def nested_quoted_arguments() -> dict[str, Any]:
    """A secret field deep in the arguments, and one holding an object."""
    return {
        "order": {"id": "ord_42", "payment": {"card_number": CANARIES.fields["card_number"]}},
        "authorization": {"scheme": "custom", "parts": [CANARIES.fields["token"], 7]},
    }


@registry.tool(name="decline_quoting_values")
def decline_quoting_values(card_number: str, cvv: str, signing_key: str) -> str:
    """The probe's ``ValueError(f"declined for {pin}")``, with a cause quoting a repr."""
    try:
        raise ConnectionError(f"provider said no to {cvv!r} and {signing_key!r}")
    except ConnectionError as cause:
        raise ValueError(f"declined for {card_number}") from cause


@registry.tool(name="tool_error_quoting_values")
def tool_error_quoting_values(card_number: str, cvv: str, signing_key: str) -> str:
    """The probe's ``ToolError(f"card {pin} declined")``: meant for the model."""
    raise ToolError(f"card {card_number} declined (cvv {cvv}, key {signing_key})")


@registry.tool(name="not_executed_quoting_values")
def not_executed_quoting_values(card_number: str, cvv: str, signing_key: str) -> str:
    raise NotExecuted(f"card {card_number} was refused before anything was sent")


@registry.tool(name="maybe_quoting_values")
def maybe_quoting_values(card_number: str, cvv: str, signing_key: str) -> str:
    """at_most_once: the call becomes unknown, the message its audit reason."""
    raise MaybeExecuted(f"timed out charging {card_number} with {signing_key}")


def _hook_quoting_values(ctx: ToolContext) -> Any:
    """A verify hook whose lookup fails quoting the card it looked for."""
    raise LookupError(f"the provider has no charge for {CANARIES.fields['card_number']}")


@registry.tool(name="verified_quoting_values", effect="verified", verify=_hook_quoting_values)
def verified_quoting_values(card_number: str, cvv: str, signing_key: str) -> str:
    """In doubt, then its hook fails: the traceback is kept in the audit trail."""
    raise MaybeExecuted("no answer from the provider")


@registry.tool(name="nested_quoting_values")
def nested_quoting_values(order: dict[str, Any], authorization: dict[str, Any]) -> str:
    number = order["payment"]["card_number"]
    raise RuntimeError(f"order {order['id']}: card {number} failed; credentials {authorization['parts']}")


@registry.tool(name="invalid_quoting_values")
def invalid_quoting_values(card_number: Annotated[str, AfterValidator(_luhn)], signing_key: str) -> str:
    raise AssertionError("its arguments never validate")


# --------------------------------------------------------- benign look-alikes


def _png(rng: random.Random, width: int, height: int) -> bytes:
    """A small, valid PNG of random pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(rng.getrandbits(8) for _ in range(width * 3)) for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


_PROSE = [
    "Your password was changed on {date}. If this was not you, reset it from the account page.",
    "The access token expired after {n} minutes and the client asked for a new one.",
    "Never share your password or your API token with anyone, not even with support.",
    "Password-protected archives are skipped by the importer ({n} so far).",
    "Tokenization split the document into {n} tokens before the summary was written.",
    "Links to reset a forgotten password stay valid for {n} hours.",
    "The token bucket refills at {n} requests per second per customer.",
    "Password strength is measured by entropy, not by length alone.",
    "A refresh token is exchanged for a new access token when the old one expires.",
    "Secrets live in the vault and are rotated every {n} days; logs never hold them.",
    "We could not verify the token you pasted, please request another one.",
    "Ask the customer to choose a password of at least {n} characters.",
    "Card numbers and CVV codes are handled by the payment provider only.",
    "Rate limits count tokens per minute and requests per day for order {id}.",
    "The session {id} ended before the password reset email was sent.",
]


def benign_strings(count: int = 1000, seed: int = 20240611) -> list[str]:
    """Deterministic strings that look technical but carry no secret: ids, uuids, digests,
    base64 of random bytes and of small PNGs, URLs without passwords, prose about tokens."""
    rng = random.Random(seed)

    def token(length: int, alphabet: str = ALNUM) -> str:
        return "".join(rng.choice(alphabet) for _ in range(length))

    hexdigits = "0123456789abcdef"
    makers: list[Callable[[], str]] = [
        lambda: "call_" + token(24),
        lambda: "sess_" + token(24),
        lambda: "turn_" + token(rng.randint(8, 30)),
        lambda: rng.choice(["resp_", "msg_", "fc_", "evt_", "agent_"]) + token(rng.randint(12, 40)),
        lambda: "tl_" + token(48, hexdigits),
        lambda: str(uuid.UUID(int=rng.getrandbits(128), version=4)),
        lambda: uuid.UUID(int=rng.getrandbits(128), version=4).hex.upper(),
        lambda: hashlib.sha256(rng.randbytes(32)).hexdigest(),
        lambda: "sha256:" + hashlib.sha256(rng.randbytes(16)).hexdigest(),
        lambda: hashlib.sha1(rng.randbytes(16)).hexdigest(),  # noqa: S324 - a look-alike, not security
        lambda: hashlib.md5(rng.randbytes(16)).hexdigest(),  # noqa: S324 - a look-alike, not security
        lambda: base64.b64encode(rng.randbytes(rng.randint(1, 300))).decode(),
        lambda: base64.urlsafe_b64encode(rng.randbytes(rng.randint(1, 120))).decode().rstrip("="),
        lambda: base64.encodebytes(rng.randbytes(rng.randint(60, 200))).decode(),
        lambda: (
            "data:image/png;base64,"
            + base64.b64encode(_png(rng, rng.randint(1, 6), rng.randint(1, 6))).decode()
        ),
        lambda: base64.b64encode(_png(rng, rng.randint(1, 4), rng.randint(1, 4))).decode(),
        lambda: rng.choice(
            [
                f"https://example.com/orders/{token(8)}?page={rng.randint(1, 99)}&sort=desc",
                f"https://api.example.com:8443/v1/agents/sessions/sess_{token(20)}/events",
                f"http://127.0.0.1:{rng.randint(1024, 65535)}/v1",
                f"ssh://git@github.com/{token(6)}/{token(8)}.git",
                f"https://{token(6).lower()}@example.org/profile",
                f"https://medium.com/@{token(7).lower()}/a-post-about-passwords-{rng.randint(1, 999)}",
                f"postgresql://shop@db.internal:5432/{token(6).lower()}",
                f"redis://cache.internal:6379/{rng.randint(0, 15)}",
                f"http://[::1]:{rng.randint(1024, 65535)}/health",
                f"https://example.com/account/reset-password?step={rng.randint(1, 3)}",
                f"https://example.com/docs/tokens#{token(6).lower()}",
            ]
        ),
        lambda: rng.choice(_PROSE).format(
            date=f"2024-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}",
            n=rng.randint(2, 500),
            id="call_" + token(12),
        ),
        lambda: f"task-{rng.randint(2020, 2030)}-{token(8, hexdigits)}",
        lambda: f"disk-usage-{token(10, hexdigits)}",
    ]
    return [makers[i % len(makers)]() for i in range(count)]


# ------------------------------------------------------- the emulator, recorded


@dataclass(frozen=True)
class ReceivedRequest:
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((value for key, value in self.headers if key == name), None)


@dataclass
class Refusal:
    status: int
    message: str


@dataclass
class RecordingFront:
    """An ASGI layer in front of the emulator's app: it records every request (headers and
    body, which the emulator does not keep) and can answer some with an HTTP error whose
    message quotes canaries, as a proxy or an upstream service might."""

    app: Any
    """The emulator's ASGI app."""
    requests: list[ReceivedRequest] = field(default_factory=list)
    refuse_submissions: dict[str, Refusal] = field(default_factory=dict)
    """Session id -> the error its tool_result POSTs get (nothing reaches the emulator)."""
    refuse_streams: dict[str, Refusal] = field(default_factory=dict)
    """Session id -> the error its event stream GETs get."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        headers = tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"])
        path: str = scope["path"]
        with self._lock:
            self.requests.append(ReceivedRequest(scope["method"], path, headers, body))
        refusal = self._refusal(scope["method"], path)
        if refusal is not None:
            payload = json.dumps(
                {
                    "error": {
                        "message": refusal.message,
                        "type": "invalid_request_error",
                        "param": None,
                        "code": None,
                    }
                }
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": refusal.status,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _refusal(self, method: str, path: str) -> Refusal | None:
        parts = path.strip("/").split("/")
        # /v1/agents/sessions/{id}/events
        if len(parts) != 5 or parts[:3] != ["v1", "agents", "sessions"] or parts[4] != "events":
            return None
        rules = self.refuse_submissions if method == "POST" else self.refuse_streams
        return rules.get(parts[3])

    def sent_with(self, authorization: str) -> list[ReceivedRequest]:
        """The requests that carried this Authorization header (toolledger's, not the test's)."""
        with self._lock:
            return [r for r in self.requests if r.header("authorization") == authorization]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
        self.refuse_submissions.clear()
        self.refuse_streams.clear()


@contextmanager
def recording_emulator() -> Iterator[tuple[EmulatorServer, RecordingFront]]:
    """The emulator on a thread, behind a RecordingFront."""
    # Imported here: a `serve` subprocess loading these tools needs no web server.
    from toolledger.emulator import EmulatorServer

    server = EmulatorServer()
    config = server._server.config
    front = RecordingFront(config.app)
    config.app = front
    with server:
        yield server, front


# -------------------------------------------------------------------- the ledger


@dataclass(frozen=True)
class StoredValue:
    table: str
    column: str
    row: dict[str, Any]
    value: str


async def ledger_values(database_url: str) -> list[StoredValue]:
    """Every non-null value of every column of every table in the ledger database."""
    engine = create_engine(database_url)
    try:
        metadata = MetaData()
        async with engine.connect() as conn:
            await conn.run_sync(metadata.reflect)
            found = []
            for table in metadata.sorted_tables:
                for row in await conn.execute(table.select()):
                    mapping = dict(row._mapping)
                    for column, value in mapping.items():
                        if value is not None:
                            found.append(StoredValue(table.name, column, mapping, str(value)))
            return found
    finally:
        await engine.dispose()
