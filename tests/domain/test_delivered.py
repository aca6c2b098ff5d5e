"""A delivered call read once: its key, its text, its arguments or their refusal, its fingerprint."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.beta.agent_session import RequiredActionSessionRequiredActionResourceFunctionCall

from toolledger.domain.delivered import DeliveredCall, delivered_key
from toolledger.domain.keys import ArgumentsRefused, CallKey, arguments_fingerprint, arguments_text

LIMIT = 1024


def sdk_action(arguments: str) -> RequiredActionSessionRequiredActionResourceFunctionCall:
    return RequiredActionSessionRequiredActionResourceFunctionCall.model_validate(
        {
            "type": "function_call",
            "turn_id": "turn_1",
            "call_id": "call_1",
            "name": "charge",
            "arguments": arguments,
        }
    )


def test_an_sdk_action__read_into_one_value() -> None:
    delivered = DeliveredCall.parse("sess", sdk_action('{"cents": 250}'), LIMIT)

    assert delivered.key == CallKey("sess", "turn_1", "call_1")
    assert delivered.tool_name == "charge"
    assert delivered.text == '{"cents": 250}'
    assert delivered.arguments == {"cents": 250}
    assert delivered.refused is None
    assert delivered.fingerprint == arguments_fingerprint('{"cents": 250}')


def test_a_mapping_action__its_arguments_as_canonical_text() -> None:
    action = {"turn_id": "t", "call_id": "c", "name": "charge", "arguments": {"b": 1, "a": [2]}}

    delivered = DeliveredCall.parse("s", action, LIMIT)

    assert delivered.key == delivered_key("s", action) == CallKey("s", "t", "c")
    assert delivered.text == '{"a":[2],"b":1}' == arguments_text(action["arguments"])
    assert delivered.arguments == {"a": [2], "b": 1}
    assert delivered.fingerprint == arguments_fingerprint(action["arguments"])


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1, "a": 2}',
        '{"x": NaN}',
        "[1, 2]",
        "not json",
        '{"x": "' + "y" * LIMIT + '"}',
        '{"x": 1e999}',
        "{" * 5000,
    ],
    ids=["duplicate-key", "nan", "not-an-object", "not-json", "too-large", "infinite", "too-deep"],
)
def test_refused_arguments__the_refusal_kept_and_the_same_fingerprint_as_the_ledgers(text: str) -> None:
    delivered = DeliveredCall.parse("s", sdk_action(text), LIMIT)

    assert delivered.arguments is None
    assert isinstance(delivered.refused, ArgumentsRefused)
    assert delivered.fingerprint == arguments_fingerprint(text)


@pytest.mark.parametrize(
    "arguments",
    [{"cents": 250}, {"nested": {"z": [1, 2.5, None, True], "a": "é\u2028"}}, {}],
)
def test_accepted_arguments__the_fingerprint_of_their_text_whatever_its_spacing(arguments: Any) -> None:
    for text in (json.dumps(arguments), json.dumps(arguments, indent=2, ensure_ascii=False)):
        delivered = DeliveredCall.parse("s", sdk_action(text), LIMIT)

        assert delivered.arguments == arguments
        assert delivered.fingerprint == arguments_fingerprint(text)


def test_a_delivered_call_is_passed_on_as_it_is() -> None:
    delivered = DeliveredCall.parse("s", sdk_action("{}"), LIMIT)

    assert DeliveredCall.parse("other", delivered, 1) is delivered
    assert delivered_key("other", delivered) == delivered.key
