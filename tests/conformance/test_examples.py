"""Arguments built from a tool's JSON schema when no example is given."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic
import pytest

from toolledger import ToolContext, ToolRegistry
from toolledger.testing.examples import ExampleError, arguments_for


class Address(pydantic.BaseModel):
    city: str
    zip_code: Annotated[str, pydantic.Field(min_length=5, max_length=5)]


def parameters_of(function: Any) -> dict[str, Any]:
    registry = ToolRegistry()
    registry.tool(function)
    (tool,) = registry
    parameters: dict[str, Any] = tool.definition["parameters"]
    return parameters


def test_arguments_for__fills_every_required_parameter_with_a_value_its_schema_accepts() -> None:
    def ship(
        order_id: str,
        cents: Annotated[int, pydantic.Field(ge=100, multiple_of=50)],
        speed: Literal["slow", "fast"],
        tags: list[str],
        address: Address,
        insured: bool,
        weight: Annotated[float, pydantic.Field(gt=0.5)],
        note: str | None = None,
        ctx: ToolContext | None = None,
    ) -> str:
        return ""

    arguments = arguments_for(parameters_of(ship))

    assert arguments == {
        "order_id": "example",
        "cents": 100,
        "speed": "slow",
        "tags": [],
        "address": {"city": "example", "zip_code": "examp"},
        "insured": False,
        "weight": 1.5,
    }
    ship(**arguments)  # and the handler's own signature takes them


def test_arguments_for__prefers_the_schema_s_own_examples_and_defaults() -> None:
    schema = {
        "type": "object",
        "properties": {
            "email": {"type": "string", "format": "email"},
            "amount": {"type": "integer", "examples": [2500]},
            "currency": {"type": "string", "default": "EUR"},
            "kind": {"const": "refund"},
            "count": {"type": "integer", "maximum": 0},
            "ids": {"type": "array", "minItems": 2, "items": {"type": "string", "format": "uuid"}},
        },
        "required": ["email", "amount", "currency", "kind", "count", "ids"],
    }

    assert arguments_for(schema) == {
        "email": "user@example.com",
        "amount": 2500,
        "currency": "EUR",
        "kind": "refund",
        "count": 0,
        "ids": ["00000000-0000-4000-8000-000000000000"] * 2,
    }


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        (
            {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                "required": ["sku"],
            },
            "arguments.sku: a string matching '^[A-Z]{3}$'",
        ),
        (
            {"type": "object", "properties": {}, "required": ["id"]},
            "arguments.id: required but not described",
        ),
        (
            {"type": "object", "properties": {"x": {"$ref": "#/$defs/Nowhere"}}, "required": ["x"]},
            "arguments.x: the reference #/$defs/Nowhere leads nowhere",
        ),
        (
            {
                "$defs": {
                    "N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}, "required": ["n"]}
                },
                "$ref": "#/$defs/N",
            },
            "nested too deeply (a recursive schema?)",
        ),
    ],
)
def test_arguments_for__says_why_it_cannot_build_arguments(schema: dict[str, Any], why: str) -> None:
    with pytest.raises(ExampleError, match=None) as raised:
        arguments_for(schema)

    assert why in str(raised.value)
