"""OpenTelemetry spans per call, when the optional ``otel`` extra is installed
(``pip install toolledger[otel]``) and the application configured a tracer provider;
otherwise, or while no tracer provider is set, a span here costs a lookup and records nothing
(OpenTelemetry's own no-op spans still set the current context: a tenth of a recovering
``serve``'s time went into spans nobody recorded).

Spans: ``toolledger.call`` (one delivery of a call, from its record to its answer),
``toolledger.handler`` (the handler's run, its retries included) and ``toolledger.submit``
(one submission of a stored result). Attributes name the session, turn, call, tool and effect
class, and the outcome; never arguments, outputs or exception text (they may hold secrets):
a failure is marked by its exception's type only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from toolledger.domain.keys import CallKey
from toolledger.version import __version__

try:
    from opentelemetry import trace as _trace
    from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider, Status, StatusCode

    _NOT_RECORDING: tuple[type, ...] = (ProxyTracerProvider, NoOpTracerProvider)

    AVAILABLE = True
except ImportError:  # pragma: no cover - the extra is not installed
    AVAILABLE = False


class CallSpan:
    """A span to add outcome attributes to (or nothing, without OpenTelemetry)."""

    def __init__(self, span: Any) -> None:
        self._span = span

    def set(self, name: str, value: str | int | float | bool | None) -> None:
        if self._span is not None and value is not None:
            self._span.set_attribute(f"toolledger.{name}", value)

    def failed(self, kind: str) -> None:
        """Marks the span as an error, by a kind (an exception's type name), not a message."""
        if self._span is not None:
            self._span.set_status(Status(StatusCode.ERROR, kind))
            self._span.set_attribute("error.type", kind)


@contextmanager
def call_span(name: str, key: CallKey, **attributes: str | None) -> Iterator[CallSpan]:
    provider = _trace.get_tracer_provider() if AVAILABLE else None
    if provider is None or isinstance(provider, _NOT_RECORDING):
        yield CallSpan(None)
        return
    tracer = provider.get_tracer("toolledger", __version__)
    # record_exception would store the exception's text: ours is failed(type name) instead.
    with tracer.start_as_current_span(name, record_exception=False, set_status_on_exception=False) as span:
        handle = CallSpan(span)
        handle.set("session_id", key.session_id)
        handle.set("turn_id", key.turn_id)
        handle.set("call_id", key.call_id)
        for attribute, value in attributes.items():
            handle.set(attribute, value)
        try:
            yield handle
        except BaseException as error:
            handle.failed(type(error).__qualname__)
            raise
