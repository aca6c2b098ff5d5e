"""Arguments to call a tool with in a conformance check: the user's example for it, or else
the simplest arguments its JSON schema accepts.

Generated arguments are a fallback. They satisfy the schema's types and simple bounds
(``examples``, ``default``, ``enum``, ``const``, minimum, lengths, a few formats), not what
the tool's own code expects (an order id that exists): a tool that fails with them is
reported as such, with a request for an example.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_DEPTH = 20

_FORMATS: dict[str, str] = {
    "date-time": "2026-01-01T00:00:00Z",
    "date": "2026-01-01",
    "time": "00:00:00Z",
    "email": "user@example.com",
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "hostname": "example.com",
}


class ExampleError(ValueError):
    """No arguments could be built from the schema."""


def arguments_for(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The simplest arguments object ``schema`` (a tool's ``parameters``) accepts."""
    value = _value(schema, schema, "arguments", 0)
    if not isinstance(value, dict):
        raise ExampleError("the tool's parameters are not a JSON object")
    return value


def _value(schema: Mapping[str, Any], root: Mapping[str, Any], where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ExampleError(f"{where}: nested too deeply (a recursive schema?)")
    if "$ref" in schema:
        return _value(_resolve(schema["$ref"], root, where), root, where, depth + 1)
    if "const" in schema:
        return schema["const"]
    examples = schema.get("examples")
    if isinstance(examples, list) and examples:
        return examples[0]
    if "default" in schema:
        return schema["default"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for choice in ("anyOf", "oneOf"):
        options = schema.get(choice)
        if isinstance(options, list) and options:
            # The first option that is not null: null is seldom what a tool does its work with.
            chosen = next((o for o in options if o.get("type") != "null"), options[0])
            return _value(chosen, root, where, depth + 1)
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and all_of:
        merged: dict[str, Any] = {}
        for part in all_of:
            merged.update(part)
        return _value(merged, root, where, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind == "object" or (kind is None and "properties" in schema):
        return _object(schema, root, where, depth)
    if kind == "array":
        return _array(schema, root, where, depth)
    if kind == "string":
        return _string(schema, where)
    if kind in ("integer", "number"):
        return _number(schema, kind)
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    raise ExampleError(f"{where}: no type to build a value of")


def _object(schema: Mapping[str, Any], root: Mapping[str, Any], where: str, depth: int) -> dict[str, Any]:
    properties: Mapping[str, Any] = schema.get("properties") or {}
    required = schema.get("required") or []
    built: dict[str, Any] = {}
    for name in required:
        if name not in properties:
            raise ExampleError(f"{where}.{name}: required but not described")
        built[name] = _value(properties[name], root, f"{where}.{name}", depth + 1)
    return built


def _array(schema: Mapping[str, Any], root: Mapping[str, Any], where: str, depth: int) -> list[Any]:
    count = int(schema.get("minItems") or 0)
    if not count:
        return []
    items = schema.get("items")
    if not isinstance(items, Mapping):
        raise ExampleError(f"{where}: needs {count} items of no described type")
    return [_value(items, root, f"{where}[{i}]", depth + 1) for i in range(count)]


def _string(schema: Mapping[str, Any], where: str) -> str:
    if "pattern" in schema:
        raise ExampleError(f"{where}: a string matching {schema['pattern']!r}")
    text = _FORMATS.get(str(schema.get("format")), "example")
    low = int(schema.get("minLength") or 0)
    high = schema.get("maxLength")
    if len(text) < low:
        text += "x" * (low - len(text))
    if high is not None and len(text) > int(high):
        text = text[: int(high)]
    return text


def _number(schema: Mapping[str, Any], kind: str) -> int | float:
    # 1, not 0: amounts, counts and ids are more often positive than not.
    value: float = 1
    if "minimum" in schema:
        value = max(value, float(schema["minimum"]))
    if "exclusiveMinimum" in schema:
        value = max(value, float(schema["exclusiveMinimum"]) + 1)
    if "maximum" in schema:
        value = min(value, float(schema["maximum"]))
    if "exclusiveMaximum" in schema:
        value = min(value, float(schema["exclusiveMaximum"]) - 1)
    multiple = schema.get("multipleOf")
    if multiple:
        value = float(multiple) * max(1, round(value / float(multiple)))
    return int(value) if kind == "integer" else value


def _resolve(reference: str, root: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    if not reference.startswith("#/"):
        raise ExampleError(f"{where}: a reference outside the schema ({reference})")
    found: Any = root
    for part in reference[2:].split("/"):
        if not isinstance(found, Mapping) or part not in found:
            raise ExampleError(f"{where}: the reference {reference} leads nowhere")
        found = found[part]
    if not isinstance(found, Mapping):
        raise ExampleError(f"{where}: the reference {reference} is not a schema")
    return found
