"""Signing an alert and checking it as a receiver would (``verify_alert_signature``)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from tests.support.paths import ROOT
from toolledger import verify_alert_signature
from toolledger.runtime.alert_signature import sign_alert
from toolledger.settings import Settings
from toolledger.settings_reference import effective

KEY = "whsec-unit-0123456789abcdef"
BODY = b'{"id":"tla_1","kind":"unknown"}'
NOW = 1_800_000_000


def test_sign_alert__the_documented_scheme__hmac_sha256_of_timestamp_dot_body() -> None:
    expected = hmac.new(KEY.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert sign_alert(BODY, KEY, NOW) == f"t={NOW},v1={expected}"


def test_verify__own_signature__accepted_within_tolerance_as_bytes_or_text() -> None:
    header = sign_alert(BODY, KEY, NOW)
    assert verify_alert_signature(BODY, header, KEY, now=NOW)
    assert verify_alert_signature(BODY.decode(), header, KEY.encode(), now=NOW + 299)


@pytest.mark.parametrize(
    ("body", "header", "key", "now"),
    [
        (BODY, sign_alert(BODY, KEY, NOW), "whsec-another-key-0123456789", NOW),
        (BODY + b" ", sign_alert(BODY, KEY, NOW), KEY, NOW),
        (BODY, sign_alert(BODY, KEY, NOW), KEY, NOW + 301),
        (BODY, sign_alert(BODY, KEY, NOW), KEY, NOW - 301),
        (BODY, sign_alert(BODY, KEY, NOW).replace(f"t={NOW}", f"t={NOW + 1}"), KEY, NOW),
        (BODY, None, KEY, NOW),
        (BODY, "", KEY, NOW),
        (BODY, f"t={NOW}", KEY, NOW),
        (BODY, "v1=" + "0" * 64, KEY, NOW),
        (BODY, f"t=soon,v1={'0' * 64}", KEY, NOW),
        (BODY, f"t={NOW},v1=ünïcode", KEY, NOW),
    ],
    ids=[
        "other-key",
        "body-changed",
        "too-old",
        "from-the-future",
        "timestamp-changed",
        "no-header",
        "empty-header",
        "no-signature",
        "no-timestamp",
        "timestamp-not-a-number",
        "not-hex",
    ],
)
def test_verify__anything_else__refused(body: bytes, header: str | None, key: str, now: int) -> None:
    assert not verify_alert_signature(body, header, key, now=now)


def test_verify__several_signatures__any_one_matching_is_enough() -> None:
    """A sender changing its key may sign with both for a while."""
    good = sign_alert(BODY, KEY, NOW).split(",")[1]
    assert verify_alert_signature(BODY, f"t={NOW},v1={'0' * 64},{good}", KEY, now=NOW)


def test_example_receiver__prints_a_signed_alert_once__refuses_a_forged_one(tmp_path: Path) -> None:
    """examples/alert_receiver.py, as the docs run it: verified, repeats dropped by id."""
    env = {**os.environ, "TOOLLEDGER_ALERT_WEBHOOK_SECRET": KEY, "PYTHONPATH": str(ROOT)}
    receiver = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "alert_receiver.py"), "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        url = receiver.stdout.readline().split(" at ")[1].strip()
        alert = {
            "id": "tla_0123",
            "kind": "unknown",
            "reason": "lease of w-1 expired without a result",
            "call": {
                "tool": "charge",
                "session_id": "s",
                "turn_id": "t",
                "call_id": "c",
                "status": "unknown",
            },
            "url": "https://ledger.example.com/ui/#call=tl_1",
        }
        body = json.dumps(alert).encode()
        signed = {"X-Toolledger-Signature": sign_alert(body, KEY, int(time.time()))}
        forged = {"X-Toolledger-Signature": sign_alert(body, "whsec-forger-0123456789", int(time.time()))}
        statuses = [
            httpx.post(url, content=body, headers=headers, timeout=10).status_code
            for headers in (signed, signed, forged)
        ]
    finally:
        receiver.terminate()
        printed, _ = receiver.communicate(timeout=10)

    assert statuses == [204, 204, 401]
    assert printed.splitlines() == [
        "unknown: charge s/t/c (unknown): lease of w-1 expired without a result "
        "https://ledger.example.com/ui/#call=tl_1"
    ]


def test_settings__webhook_secret__masked_in_logs_audit_text_and_toolledger_config() -> None:
    canary = "whsec-canary-5b8e0c1d9f"
    settings = Settings(alert_webhook_url="https://ops.example.com/hooks", alert_webhook_secret=canary)

    assert settings.redactor().text(f"signing with {canary} failed") == "signing with [REDACTED] failed"
    [shown] = [o["value"] for o in effective(settings) if o["name"] == "alert_webhook_secret"]
    assert shown == "[REDACTED]"


# ------------------------------------------------------------ malformed headers (issue 31)

HUGE_TIMESTAMP = "9" * 400
"""A ``t=`` of hundreds of digits: int() takes it, and comparing it with a clock's float overflowed."""

_ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)
"""Any characters, lone surrogates included (a header decoded with surrogateescape holds them)."""
_NUMBERS = st.one_of(
    st.integers().map(str),
    st.integers(min_value=10**15).map(str),
    st.integers(min_value=1, max_value=5000).map(lambda digits: "9" * digits),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["", "+1800000000", " 1800000000", "1_800_000_000", "١٨٠٠٠٠٠٠٠٠", "0x6b49d200", "-0"]),
)
_SIGNATURES = st.one_of(
    _ANY_TEXT,
    st.text("0123456789abcdef", min_size=64, max_size=64),
    st.text("0123456789ABCDEF", min_size=64, max_size=64),
    st.just(sign_alert(BODY, KEY, NOW).split("v1=")[1] + "0"),
)
_ENTRIES = st.one_of(
    st.tuples(st.just("t"), _NUMBERS),
    st.tuples(st.just("t"), _ANY_TEXT),
    st.tuples(st.just("v1"), _SIGNATURES),
    st.tuples(_ANY_TEXT, _ANY_TEXT),
)


@st.composite
def malformed_headers(draw: st.DrawFn) -> str:
    """Headers toolledger never sends: huge, negative, fractional or foreign-digit timestamps,
    signatures of any text, repeated or missing entries, stray separators, any characters."""
    entries = draw(st.lists(_ENTRIES, max_size=6))
    separator = draw(st.sampled_from([",", ", ", ",,", ";", " , "]))
    header = separator.join(f"{name}={value}" for name, value in entries)
    return draw(st.one_of(st.just(header), _ANY_TEXT, st.just(header + draw(_ANY_TEXT))))


@pytest.mark.parametrize(
    "header",
    [
        f"t={HUGE_TIMESTAMP},v1={'0' * 64}",
        f"t=-{HUGE_TIMESTAMP},v1={'0' * 64}",
        f"t={'9' * 5000},v1={'0' * 64}",
        f"t=1e400,v1={'0' * 64}",
        f"t={NOW},v1=\udcff{'0' * 63}",
        f"t={NOW},t={NOW + 1},{sign_alert(BODY, KEY, NOW).split(',')[1]}",
    ],
    ids=["huge", "huge-negative", "beyond-int-parsing", "float", "lone-surrogate", "two-timestamps"],
)
def test_verify__malformed_header__false_not_an_exception(header: str) -> None:
    assert verify_alert_signature(BODY, header, KEY, now=NOW) is False
    assert verify_alert_signature(BODY, header, KEY) is False


@given(header=malformed_headers(), body=st.one_of(st.binary(max_size=64), _ANY_TEXT))
@hypothesis_settings(max_examples=400, deadline=None)
def test_verify__any_malformed_header_or_body__never_raises(header: str, body: bytes | str) -> None:
    """Whatever a sender (or anyone on the network) puts in the header, the answer is a bool:
    never an exception a receiver would drop the connection over."""
    for now in (NOW, None):
        assert verify_alert_signature(body, header, KEY, now=now) is False


def test_example_receiver__a_timestamp_of_hundreds_of_digits__401_not_a_dropped_connection() -> None:
    env = {**os.environ, "TOOLLEDGER_ALERT_WEBHOOK_SECRET": KEY, "PYTHONPATH": str(ROOT)}
    receiver = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "alert_receiver.py"), "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        url = receiver.stdout.readline().split(" at ")[1].strip()
        headers = {"X-Toolledger-Signature": f"t={HUGE_TIMESTAMP},v1={'0' * 64}"}
        answer = httpx.post(url, content=BODY, headers=headers, timeout=10)
    finally:
        receiver.terminate()
        _, errors = receiver.communicate(timeout=10)
    assert answer.status_code == 401
    assert "Traceback" not in errors
