"""ToolRegistry: the definitions it puts in ``agent.tools``, the policy it keeps per tool, what it
refuses, and how a call's arguments are validated before a handler runs. No database needed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, cast

import pydantic
import pytest
from openai.lib.beta.agents import FunctionTool, function_tool, pydantic_function_tool

from toolledger.domain.keys import ArgumentsRefused, CallKey, parse_arguments
from toolledger.domain.results import FailureStage, MaybeExecuted, NotExecuted, validation_message
from toolledger.domain.states import EffectClass
from toolledger.errors import RegistryError
from toolledger.runtime.context import ToolContext, Verification, bind_context, reset_context
from toolledger.runtime.executor import _failure, _Stage
from toolledger.runtime.registry import TRANSIENT_ERRORS, RegisteredTool, ToolRegistry

if TYPE_CHECKING:
    from decimal import Decimal

ECHO_PROBE = "do-not-echo-7731"
TOOL_SEARCH: dict[str, Any] = {"type": "tool_search"}


class Address(pydantic.BaseModel):
    """A postal address."""

    street: str
    city: str = pydantic.Field(description="The city.")


class Refund(pydantic.BaseModel):
    """Refund an order."""

    order_id: str
    amount_cents: int = pydantic.Field(ge=1)


def make_context(tool_name: str = "tool") -> ToolContext:
    key = CallKey("sess_1", "turn_1", "call_1")
    return ToolContext(
        key=key,
        tool_name=tool_name,
        attempt=1,
        idempotency_key=key.idempotency_key,
        logger=logging.LoggerAdapter(logging.getLogger("tests.registry"), {}),
    )


@pytest.fixture
def context() -> Iterator[ToolContext]:
    """A ToolContext bound as the current call's, as the executor binds it around a handler."""
    ctx = make_context()
    token = bind_context(ctx)
    yield ctx
    reset_context(token)


def registered(registry: ToolRegistry, name: str) -> RegisteredTool:
    tool = registry.get(name)
    assert tool is not None, f"{name!r} is not registered"
    return tool


def parameters(registry: ToolRegistry, name: str) -> dict[str, Any]:
    params: dict[str, Any] = registered(registry, name).definition["parameters"]
    return params


def accept_verify(ctx: ToolContext) -> Verification:
    return Verification.not_executed()


# --- schemas of decorated functions ---------------------------------------------------------


def test_tool_decorator__sync_typed_function__gives_function_definition_from_signature_and_docstring() -> (
    None
):
    registry = ToolRegistry()

    @registry.tool
    def add(a: int, b: float = 2.5, label: str | None = None) -> float:
        """Add two numbers.

        The label is ignored."""
        return a + b

    definition = registered(registry, "add").definition
    assert definition["type"] == "function"
    assert definition["name"] == "add"
    assert definition["description"] == "Add two numbers.\n\nThe label is ignored."
    assert "defer_loading" not in definition
    params = definition["parameters"]
    assert params["type"] == "object"
    assert params["additionalProperties"] is False
    assert params["required"] == ["a"]
    assert params["properties"]["a"]["type"] == "integer"
    assert params["properties"]["b"] == {"default": 2.5, "title": "B", "type": "number"}
    assert params["properties"]["label"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
    assert registered(registry, "add").is_async is False
    assert isinstance(add, FunctionTool)
    assert add({"a": 1}) == "3.5"  # the SDK returns outputs as JSON text


async def test_tool_decorator__async_function_with_literal_and_list__gives_enum_and_array_schema() -> None:
    registry = ToolRegistry()

    @registry.tool
    async def search(query: str, kinds: list[Literal["order", "refund"]], limit: int = 10) -> list[str]:
        """Search the shop."""
        return [f"{query}:{kind}" for kind in kinds][:limit]

    tool = registered(registry, "search")
    params = parameters(registry, "search")
    assert tool.is_async is True
    assert tool.definition["description"] == "Search the shop."
    assert params["required"] == ["query", "kinds"]
    assert params["properties"]["query"]["type"] == "string"
    assert params["properties"]["kinds"]["type"] == "array"
    assert params["properties"]["kinds"]["items"] == {"enum": ["order", "refund"], "type": "string"}
    assert params["properties"]["limit"]["default"] == 10
    assert await tool.function_tool({"query": "q", "kinds": ["refund"]}) == '["q:refund"]'


def test_tool_decorator__name_and_description_given__override_function_name_and_docstring() -> None:
    registry = ToolRegistry()

    @registry.tool(name="lookup_order", description="Find an order by id.")
    def find(order_id: str) -> str:
        """Not this."""
        return order_id

    assert registry.get("find") is None
    definition = registered(registry, "lookup_order").definition
    assert (definition["name"], definition["description"]) == ("lookup_order", "Find an order by id.")
    assert find.name == "lookup_order"


def test_tool_decorator__no_docstring__gives_empty_description() -> None:
    registry = ToolRegistry()
    registry.tool(name="ping")(lambda: "pong")

    definition = registered(registry, "ping").definition
    assert definition["description"] == ""
    assert definition["parameters"]["properties"] == {}
    assert "required" not in definition["parameters"]


def test_tool_decorator__pydantic_model_argument__is_a_ref_and_the_handler_gets_the_model() -> None:
    registry = ToolRegistry()
    received: list[Address] = []

    @registry.tool
    def ship(address: Address, express: bool = False) -> str:
        """Ship to an address."""
        received.append(address)
        return address.city

    params = parameters(registry, "ship")
    assert params["required"] == ["address"]
    assert params["properties"]["address"] == {"$ref": "#/$defs/Address"}
    address_schema = params["$defs"]["Address"]
    assert address_schema["description"] == "A postal address."
    assert address_schema["required"] == ["street", "city"]
    assert address_schema["properties"]["city"]["description"] == "The city."
    assert ship({"address": {"street": "Main St 1", "city": "Ghent"}}) == "Ghent"
    assert received == [Address(street="Main St 1", city="Ghent")]


def test_definition__mutated_by_the_caller__leaves_the_registered_tool_unchanged() -> None:
    registry = ToolRegistry()
    registry.tool(name="ping")(lambda: "pong")

    first = registry.definitions()
    first[0]["name"] = "changed"
    first[0]["parameters"]["properties"]["x"] = {"type": "string"}

    assert registry.definitions()[0]["name"] == "ping"
    assert registry.definitions()[0]["parameters"]["properties"] == {}


# --- the ToolContext parameter ----------------------------------------------------------------


async def test_tool_context_parameter__async_function__is_left_out_of_schema_and_injected(
    context: ToolContext,
) -> None:
    registry = ToolRegistry()
    seen: list[ToolContext] = []

    @registry.tool(effect="idempotent")
    async def send_receipt(order_id: str, ctx: ToolContext, copies: int = 1) -> str:
        """Mail the receipt."""
        seen.append(ctx)
        return f"{order_id}:{ctx.idempotency_key}:{copies}"

    tool = registered(registry, "send_receipt")
    params = parameters(registry, "send_receipt")
    assert set(params["properties"]) == {"order_id", "copies"}
    assert params["required"] == ["order_id"]
    assert tool.definition["description"] == "Mail the receipt."
    assert tool.is_async is True
    assert await tool.function_tool({"order_id": "o1"}) == f"o1:{context.idempotency_key}:1"
    assert seen == [context]


def test_tool_context_parameter__sync_function__is_left_out_of_schema_and_injected(
    context: ToolContext,
) -> None:
    registry = ToolRegistry()

    @registry.tool
    def charge(ctx: ToolContext, amount_cents: int) -> str:
        return f"{ctx.call_id}:{ctx.tool_name}:{amount_cents}"

    tool = registered(registry, "charge")
    assert set(parameters(registry, "charge")["properties"]) == {"amount_cents"}
    assert tool.is_async is False
    assert tool.function_tool({"amount_cents": 5}) == "call_1:tool:5"


def test_tool_context_parameter__passed_as_an_argument_by_the_model__is_refused(context: ToolContext) -> None:
    registry = ToolRegistry()

    @registry.tool
    def charge(amount_cents: int, ctx: ToolContext) -> int:
        return amount_cents

    with pytest.raises(pydantic.ValidationError) as caught:
        registered(registry, "charge").function_tool({"amount_cents": 5, "ctx": {"call_id": "forged"}})
    assert "ctx: Extra inputs are not permitted" in validation_message(caught.value)


def test_tool_context_parameter__called_outside_a_run__raises_a_clear_error() -> None:
    registry = ToolRegistry()

    @registry.tool
    def charge(amount_cents: int, ctx: ToolContext) -> int:
        return amount_cents

    with pytest.raises(RuntimeError, match=r"current_context\(\) is only available while toolledger runs"):
        registered(registry, "charge").function_tool({"amount_cents": 5})


def test_tool_context_parameter__declared_twice__is_refused() -> None:
    registry = ToolRegistry()

    def both(first: ToolContext, second: ToolContext) -> None:
        return None

    with pytest.raises(RegistryError, match="both: only one parameter may take the ToolContext"):
        registry.tool(both)
    assert len(registry) == 0


def test_tool_decorator__return_type_imported_only_for_type_checking__registers_like_function_tool() -> None:
    def price(sku: str) -> Decimal:
        """Price of a product."""
        raise NotImplementedError

    assert function_tool(price).name == "price"  # the SDK accepts it
    registry = ToolRegistry()
    registry.tool(price)
    assert parameters(registry, "price")["required"] == ["sku"]


def test_tool_decorator__optional_context_parameter__is_left_out_of_the_schema() -> None:
    registry = ToolRegistry()

    def refund(order_id: str, ctx: ToolContext | None = None) -> str:
        """Refund an order."""
        return order_id

    registry.tool(refund)

    schema = parameters(registry, "refund")
    assert list(schema["properties"]) == ["order_id"]
    assert schema["required"] == ["order_id"]


# --- SDK FunctionTool objects and pydantic models --------------------------------------------


async def test_add__sdk_function_tools__register_as_they_are(context: ToolContext) -> None:
    registry = ToolRegistry()

    async def lookup(order_id: str) -> str:
        """Look up an order."""
        return f"order {order_id}"

    def handle_refund(refund: Refund) -> dict[str, Any]:
        return {"refunded": refund.amount_cents, "call": context.call_id}

    async_tool = function_tool(lookup)
    model_tool = pydantic_function_tool(Refund, handler=handle_refund)

    assert registry.add(async_tool) is async_tool
    assert registry.add(model_tool, effect="idempotent", timeout=4) is model_tool

    assert registered(registry, "lookup").function_tool is async_tool
    assert registered(registry, "lookup").definition == async_tool.definition
    assert registered(registry, "lookup").is_async is True
    assert registered(registry, "lookup").effect is EffectClass.AT_MOST_ONCE
    refund = registered(registry, "Refund")
    assert refund.function_tool is model_tool
    assert refund.is_async is False
    assert (refund.effect, refund.timeout) == (EffectClass.IDEMPOTENT, 4)
    assert registry.definitions() == [async_tool.definition, model_tool.definition]
    assert await registered(registry, "lookup").function_tool({"order_id": "7"}) == "order 7"


def test_add__not_a_function_tool__is_refused() -> None:
    registry = ToolRegistry()

    with pytest.raises(RegistryError, match="expected an openai FunctionTool, got dict"):
        registry.add(cast(Any, {"type": "function", "name": "raw"}))
    assert len(registry) == 0


def test_add_model__handler_takes_the_model__name_and_description_come_from_the_model() -> None:
    registry = ToolRegistry()
    received: list[Refund] = []

    def handle(refund: Refund) -> dict[str, int]:
        received.append(refund)
        return {"refunded": refund.amount_cents}

    tool = registry.add_model(Refund, handle, effect="idempotent", retries=1, timeout=2.0)

    assert tool is registered(registry, "Refund").function_tool
    definition = registered(registry, "Refund").definition
    assert definition["name"] == "Refund"
    assert definition["description"] == "Refund an order."
    assert definition["parameters"]["required"] == ["order_id", "amount_cents"]
    assert definition["parameters"]["properties"]["amount_cents"]["minimum"] == 1
    stored = registered(registry, "Refund")
    assert (stored.effect, stored.retries, stored.timeout) == (EffectClass.IDEMPOTENT, 1, 2.0)
    assert tool({"order_id": "o1", "amount_cents": 250}) == '{"refunded":250}'
    assert received == [Refund(order_id="o1", amount_cents=250)]


def test_add_model__name_description_and_defer_loading_given__are_used() -> None:
    registry = ToolRegistry()

    async def handle(refund: Refund) -> str:
        return refund.order_id

    registry.add_model(Refund, handle, name="refund_order", description="Refund it.", defer_loading=True)

    definition = registered(registry, "refund_order").definition
    assert (definition["name"], definition["description"]) == ("refund_order", "Refund it.")
    assert definition["defer_loading"] is True
    assert registered(registry, "refund_order").is_async is True
    assert registry.definitions()[-1] == TOOL_SEARCH


# --- per-tool options ---------------------------------------------------------------------------


def test_tool_options__none_given__default_to_at_most_once_without_retries_or_deadlines() -> None:
    registry = ToolRegistry()
    registry.tool(name="ping")(lambda: "pong")

    tool = registered(registry, "ping")
    assert tool.effect is EffectClass.AT_MOST_ONCE
    assert (tool.timeout, tool.retries, tool.verify, tool.unknown_deadline, tool.max_attempts) == (
        None,
        0,
        None,
        None,
        None,
    )
    assert tool.retry_on == (NotExecuted,), "at_most_once retries only what surely did not happen"
    assert tool.name == "ping"


def test_tool_options__each_effect_class_and_policy__are_stored() -> None:
    registry = ToolRegistry()

    @registry.tool(effect="idempotent", timeout=2.5, retries=3, retry_on=(KeyError,), max_attempts=5)
    def idem() -> None: ...

    @registry.tool(effect=EffectClass.TRANSACTIONAL)
    def trans() -> None: ...

    @registry.tool(effect="read_only", retries=1)
    def read() -> None: ...

    @registry.tool(retries=2)
    def charge() -> None: ...

    @registry.tool(effect="verified", verify=accept_verify, unknown_deadline=60)
    def verified() -> None: ...

    @registry.tool(unknown_deadline=0, defer_loading=True)
    def once() -> None: ...

    idem_tool = registered(registry, "idem")
    assert idem_tool.effect is EffectClass.IDEMPOTENT
    assert (idem_tool.timeout, idem_tool.retries, idem_tool.retry_on, idem_tool.max_attempts) == (
        2.5,
        3,
        (KeyError, NotExecuted, MaybeExecuted),
        5,
    )
    assert registered(registry, "trans").effect is EffectClass.TRANSACTIONAL
    assert (registered(registry, "read").effect, registered(registry, "read").retries) == (
        EffectClass.READ_ONLY,
        1,
    )
    assert registered(registry, "read").retry_on == (*TRANSIENT_ERRORS, NotExecuted, MaybeExecuted)
    charge_tool = registered(registry, "charge")
    assert (charge_tool.effect, charge_tool.retries, charge_tool.retry_on) == (
        EffectClass.AT_MOST_ONCE,
        2,
        (NotExecuted,),
    )
    verified_tool = registered(registry, "verified")
    assert verified_tool.effect is EffectClass.VERIFIED
    assert verified_tool.verify is accept_verify
    assert verified_tool.unknown_deadline == 60
    once_tool = registered(registry, "once")
    assert once_tool.effect is EffectClass.AT_MOST_ONCE
    assert once_tool.unknown_deadline == 0
    assert once_tool.definition["defer_loading"] is True
    assert [tool.name for tool in registry] == ["idem", "trans", "read", "charge", "verified", "once"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param(
            {"effect": "exactly_once"},
            r"unknown effect class 'exactly_once' \(one of "
            r"at_most_once, idempotent, read_only, transactional, verified\)",
            id="unknown-effect",
        ),
        pytest.param({"effect": "verified"}, "effect 'verified' needs a verify hook", id="verified-no-hook"),
        pytest.param(
            {"verify": accept_verify}, "a verify hook needs effect 'verified'", id="hook-not-verified"
        ),
        pytest.param({"effect": "idempotent", "retries": -1}, "retries must be >= 0", id="negative-retries"),
        pytest.param(
            {"retries": 1, "retry_on": (ConnectionError,)},
            "effect 'at_most_once' forbids a second run after an error: retries count NotExecuted alone",
            id="retry-on-at-most-once",
        ),
        pytest.param(
            {"effect": "verified", "verify": accept_verify, "retries": 2, "retry_on": (NotExecuted,)},
            "effect 'verified' forbids a second run after an error: retries count NotExecuted alone",
            id="retry-on-verified",
        ),
        pytest.param(
            {"effect": "idempotent", "retries": 1, "retry_on": ConnectionError},
            "retry_on must be a tuple of exception classes",
            id="retry-on-not-a-tuple",
        ),
        pytest.param(
            {"effect": "idempotent", "retries": 1, "retry_on": ("ConnectionError",)},
            "retry_on must be a tuple of exception classes",
            id="retry-on-not-classes",
        ),
        pytest.param({"timeout": 0}, "timeout must be positive", id="zero-timeout"),
        pytest.param({"timeout": -1.5}, "timeout must be positive", id="negative-timeout"),
        pytest.param({"unknown_deadline": -1}, "unknown_deadline must be >= 0", id="negative-deadline"),
        pytest.param({"max_attempts": 0}, "max_attempts must be >= 1", id="zero-max-attempts"),
        pytest.param({"threads": 0}, "threads must be a whole number >= 1", id="zero-threads"),
        pytest.param({"threads": True}, "threads must be a whole number >= 1", id="boolean-threads"),
        pytest.param(
            {"effect": "unregistered"},
            r"unknown effect class 'unregistered' \(one of at_most_once, idempotent, read_only, "
            r"transactional, verified\)",
            id="unregistered-is-not-declarable",
        ),
    ],
)
def test_tool_options__invalid__are_refused_with_a_message_naming_the_tool(
    options: dict[str, Any], message: str
) -> None:
    registry = ToolRegistry()

    def charge(amount_cents: int) -> int:
        return amount_cents

    with pytest.raises(RegistryError, match=f"^tool 'charge': {message}"):
        registry.tool(**options)(charge)
    with pytest.raises(RegistryError, match=f"^tool 'charge': {message}"):
        registry.add(function_tool(charge), **options)
    assert len(registry) == 0
    assert registry.definitions() == []


def test_tool_options__threads__cap_a_sync_tool_and_are_refused_for_an_async_one() -> None:
    registry = ToolRegistry()

    @registry.tool(threads=2)
    def lookup(order_id: str) -> str:
        return order_id

    tool = registry.get("lookup")
    assert tool is not None
    assert tool.threads == 2
    assert registry.get("lookup") is not None

    async def notify(message: str) -> str:
        return message

    with pytest.raises(RegistryError, match=r"^tool 'notify': threads= is for sync handlers"):
        registry.tool(threads=2)(notify)
    assert registry.get("notify") is None


# --- definitions() and tool_search ----------------------------------------------------------------


def test_definitions__no_deferred_tool__are_the_function_definitions_without_tool_search() -> None:
    registry = ToolRegistry()
    registry.tool(name="a")(lambda: "a")
    registry.add(function_tool(lambda: "b", name="b", defer_loading=False))

    definitions = registry.definitions()
    assert [d["name"] for d in definitions] == ["a", "b"]
    assert all(d["type"] == "function" for d in definitions)
    assert TOOL_SEARCH not in definitions


def test_definitions__empty_registry__are_empty() -> None:
    assert ToolRegistry().definitions() == []


def test_definitions__several_deferred_tools__end_with_tool_search_exactly_once() -> None:
    registry = ToolRegistry()
    registry.tool(name="eager")(lambda: "e")
    registry.tool(name="lazy_1", defer_loading=True)(lambda: "1")
    registry.add(function_tool(lambda: "2", name="lazy_2", defer_loading=True))

    definitions = registry.definitions()
    assert definitions[-1] == TOOL_SEARCH
    assert definitions.count(TOOL_SEARCH) == 1
    assert [d.get("defer_loading") for d in definitions[:-1]] == [None, True, True]
    assert registry.definitions() == definitions  # asking again adds no second tool_search
    assert len(registry) == 3


# --- names ----------------------------------------------------------------------------------------


def test_register__duplicate_name__is_refused_naming_the_tool_and_keeps_the_first() -> None:
    registry = ToolRegistry()

    @registry.tool
    def lookup(order_id: str) -> str:
        return order_id

    def other(sku: str) -> str:
        return sku

    with pytest.raises(RegistryError, match=r"^a tool named 'lookup' is already registered$"):
        registry.tool(name="lookup")(other)
    with pytest.raises(RegistryError, match=r"^a tool named 'lookup' is already registered$"):
        registry.add(function_tool(other, name="lookup"))
    with pytest.raises(RegistryError, match=r"^a tool named 'lookup' is already registered$"):
        registry.add_model(Refund, lambda refund: None, name="lookup")

    assert len(registry) == 1
    assert registered(registry, "lookup").function_tool is lookup
    assert registry.definitions() == [lookup.definition]


@pytest.mark.parametrize("name", ["", "has space", "dot.ted", "x" * 65, "<lambda>", "naïve"])
def test_register__a_name_the_agents_api_refuses__is_refused_at_registration(name: str) -> None:
    """Not at ``agents.create``, far from the tool: the API takes ^[A-Za-z0-9_-]{1,64}$."""
    registry = ToolRegistry()

    with pytest.raises(RegistryError, match=r"accepts tool names of 1 to 64 letters, digits") as refused:
        registry.tool(name=name)(lambda: "x")
    assert __file__ in str(refused.value), "the error names where the tool is defined"
    assert len(registry) == 0
    registry.tool(name="x" * 64)(lambda: "x")
    registry.tool(name="Refund_order-2")(lambda: "x")
    assert len(registry) == 2


def test_register__a_tool_without_a_description__is_registered_with_a_warning_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = ToolRegistry()

    def undocumented(order_id: str) -> str:
        return order_id

    with caplog.at_level(logging.WARNING, logger="toolledger.registry"):
        registry.tool(undocumented)
        registry.add(function_tool(undocumented, name="also_undocumented"))
        registry.tool(name="described", description="Described.")(undocumented)  # it has one
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2
    assert warned[0].startswith("tool 'undocumented' (")
    assert __file__ in warned[0]
    assert "has no description: the model sees only its name" in warned[0]


class NoSchema:
    """A type pydantic cannot describe."""


@pytest.mark.parametrize(
    ("source", "said"),
    [
        ("def untyped(order_id): return order_id", "needs a public name and type annotation: order_id"),
        ("def opaque(thing: NoSchema) -> str: return ''", "a parameter's type has no JSON Schema (<class"),
        ("def varargs(*orders: str) -> str: return ''", "Unsupported tool parameter: orders"),
    ],
)
def test_register__a_signature_with_no_json_schema__is_refused_naming_the_tool_and_its_file(
    source: str, said: str
) -> None:
    namespace: dict[str, Any] = {"NoSchema": NoSchema}
    exec(compile(source, "/srv/app/myapp/tools.py", "exec"), namespace)  # noqa: S102 - the test's own source
    [function] = [v for k, v in namespace.items() if callable(v) and k not in ("NoSchema", "__builtins__")]

    with pytest.raises(RegistryError) as refused:
        ToolRegistry().tool(function)

    message = str(refused.value)
    assert message.startswith(f"tool {function.__name__!r} (/srv/app/myapp/tools.py, line 1): ")
    assert said in message
    assert "arbitrary_types_allowed" not in message, "pydantic's internals are not the user's business"


# --- argument validation (the path the executor takes before a handler runs) ----------------------


def validation_registry() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool
    def refund(order_id: str, amount_cents: int, address: Address | None = None) -> str:
        return f"{order_id}:{amount_cents}"

    return registry


def test_arguments__valid_json_object__are_parsed_and_passed_to_the_handler() -> None:
    tool = registered(validation_registry(), "refund")
    stage = _Stage()

    arguments = parse_arguments('{"order_id": "o1", "amount_cents": "250"}', 1024)

    assert arguments == {"order_id": "o1", "amount_cents": "250"}
    assert tool.function_tool._call(arguments, stage.set) == "o1:250"  # lax mode coerces "250"
    assert stage.value == "output"  # past validation and execution


@pytest.mark.parametrize(
    "raw",
    ["{not json", "", "null", "[1, 2]", '"a string"', "42", '{"order_id": "o1"'],
)
def test_arguments__not_a_json_object__are_not_parsed(raw: str) -> None:
    with pytest.raises(ArgumentsRefused, match="expected a JSON object"):
        parse_arguments(raw, 1024)


@pytest.mark.parametrize(
    ("arguments", "problems"),
    [
        pytest.param({"order_id": "o1"}, ["amount_cents: Field required"], id="missing"),
        pytest.param(
            {"order_id": "o1", "amount_cents": ECHO_PROBE},
            ["amount_cents: Input should be a valid integer, unable to parse string as an integer"],
            id="wrong-type",
        ),
        pytest.param(
            {"order_id": ["o1"], "amount_cents": 5, "note": ECHO_PROBE},
            ["order_id: Input should be a valid string", "note: Extra inputs are not permitted"],
            id="wrong-type-and-extra",
        ),
        pytest.param(
            {"order_id": "o1", "amount_cents": 5, "address": {"street": ECHO_PROBE}},
            ["address.city: Field required"],
            id="nested-model",
        ),
    ],
)
def test_arguments__violating_the_schema__give_a_clear_arguments_failure_without_their_values(
    arguments: dict[str, Any], problems: list[str]
) -> None:
    tool = registered(validation_registry(), "refund")
    stage = _Stage()

    with pytest.raises(pydantic.ValidationError) as caught:
        tool.function_tool._call(arguments, stage.set)
    outcome = _failure(CallKey("s", "t", "c"), caught.value, stage)

    assert stage.value == "arguments"
    assert outcome.stage is FailureStage.ARGUMENTS
    assert outcome.success is False
    message = outcome.payload["error"]
    assert message == "Invalid arguments: " + "; ".join(problems)
    assert ECHO_PROBE not in message


def test_validation_message__a_secret_named_field__keeps_pydantic_s_words_unmasked() -> None:
    class Strict(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        user: str

    with pytest.raises(pydantic.ValidationError) as caught:
        Strict.model_validate({"user": "u", "password": "hunter2"})
    message = validation_message(caught.value)
    assert message == "Invalid arguments: password: Extra inputs are not permitted"


def test_validation_message__a_validator_quoting_a_secret__is_still_masked() -> None:
    class Checked(pydantic.BaseModel):
        note: str

        @pydantic.field_validator("note")
        @classmethod
        def _no_keys(cls, value: str) -> str:
            raise ValueError(f"looks like a key: {value}")

    with pytest.raises(pydantic.ValidationError) as caught:
        Checked.model_validate({"note": "sk-proj-ABCDEFGHIJKLMNOPQRST"})
    message = validation_message(caught.value)
    assert "sk-proj-ABCDEFGHIJKLMNOPQRST" not in message
    assert message.startswith("Invalid arguments: note: Value error, looks like a key: ")
