"""How an alert is signed, and how its receiver checks it (``verify_alert_signature``).

The scheme is Stripe's: ``X-Toolledger-Signature: t=<unix seconds>,v1=<hex>``, where the hex
is HMAC-SHA256, keyed with ``TOOLLEDGER_ALERT_WEBHOOK_SECRET``, of the timestamp, a dot and
the raw body. Signing the timestamp with the body lets a receiver refuse an old request
replayed later; the raw body (not a re-encoding of its JSON) is what must be checked.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time

SIGNATURE_HEADER = "X-Toolledger-Signature"
ALERT_ID_HEADER = "X-Toolledger-Alert-Id"
SIGNATURE_SCHEME = "v1"
DEFAULT_TOLERANCE_SECONDS = 300.0
"""How far a signature's timestamp may be from the receiver's clock (Stripe's default)."""
_TIMESTAMP = re.compile(r"[0-9]{1,15}")
"""Unix seconds as sent: ASCII digits, few enough that any clock can be compared with them
(``re`` with ``fullmatch``: no sign, space, underscore or other script's digits, which int()
would take)."""
_SIGNATURE = re.compile(r"[0-9a-f]{64}")
"""A hex HMAC-SHA256, as ``sign_alert`` writes it."""


def _digest(body: bytes, secret: str | bytes, timestamp: int) -> str:
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def sign_alert(body: bytes, secret: str | bytes, timestamp: int) -> str:
    """The ``X-Toolledger-Signature`` header's value for ``body`` sent at ``timestamp``."""
    return f"t={timestamp},{SIGNATURE_SCHEME}={_digest(body, secret, timestamp)}"


def verify_alert_signature(
    body: bytes | str,
    header: str | None,
    secret: str | bytes,
    *,
    tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS,
    now: float | None = None,
) -> bool:
    """Whether ``header`` (the request's ``X-Toolledger-Signature``) signs ``body`` (the raw
    request body, as received) with ``secret``, at a time within ``tolerance_seconds`` of
    ``now`` (default: this machine's clock). Any ``v1=`` entry may match (several may be
    sent while a secret is being changed).

    Never raises over what a request carries: a header that is not ``t=<digits>`` once and
    ``v1=<64 lowercase hex digits>`` at least once (a timestamp of hundreds of digits, a
    sign, a fraction or other digits than 0-9, a repeated ``t``, any character), or a text
    body that cannot be encoded, is simply not a valid signature: False."""
    if not isinstance(header, str) or not header:
        return False
    timestamp: int | None = None
    signatures: list[bytes] = []
    for item in header.split(","):
        name, _, value = item.strip().partition("=")
        if name == "t":
            if timestamp is not None or not _TIMESTAMP.fullmatch(value):
                return False  # two timestamps: which one was signed?
            timestamp = int(value)
        elif name == SIGNATURE_SCHEME and _SIGNATURE.fullmatch(value):
            signatures.append(value.encode("ascii"))
    if timestamp is None or not signatures:
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_seconds:
        return False
    try:
        raw = body.encode() if isinstance(body, str) else body
    except UnicodeEncodeError:  # a lone surrogate: no request carried these bytes
        return False
    expected = _digest(raw, secret, timestamp).encode("ascii")
    # Each entry compared in constant time, and as bytes.
    matches = [hmac.compare_digest(expected, signature) for signature in signatures]
    return any(matches)


__all__ = [
    "ALERT_ID_HEADER",
    "DEFAULT_TOLERANCE_SECONDS",
    "SIGNATURE_HEADER",
    "sign_alert",
    "verify_alert_signature",
]
