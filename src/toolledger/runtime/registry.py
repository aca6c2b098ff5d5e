"""The tools toolledger runs, with how each may be recovered. Schemas come from the SDK.

registry = ToolRegistry()

@registry.tool(effect="idempotent", timeout=10)
async def send_receipt(order_id: str, ctx: ToolContext) -> str:
    await mailer.send(order_id, idempotency_key=ctx.idempotency_key)
    return "sent"
"""

from __future__ import annotations

import inspect
import logging
import re
import types
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, get_args, get_type_hints, overload

import pydantic
from openai import omit
from openai.lib.beta.agents import FunctionTool, function_tool, pydantic_function_tool

from toolledger.domain.results import MaybeExecuted, NotExecuted, bounded_list
from toolledger.domain.states import EffectClass
from toolledger.errors import RegistryError
from toolledger.runtime.context import ToolContext, Verification, current_context, output_limit

log = logging.getLogger("toolledger.registry")

VerifyHook = Callable[[ToolContext], Verification | Awaitable[Verification]]
ApprovalRule = Callable[[dict[str, Any], ToolContext], bool]
"""Whether one call needs a person's approval, from its arguments and context."""
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, ConnectionError)
"""What a re-runnable tool's ``retries`` run again after unless it names its own ``retry_on``."""


@dataclass(frozen=True)
class RegisteredTool:
    """A tool with its recovery policy."""

    function_tool: FunctionTool[Any]
    effect: EffectClass
    timeout: float | None
    retries: int
    retry_on: tuple[type[BaseException], ...]
    """What the handler is run again after within its claim (up to ``retries`` times): as
    declared (``TRANSIENT_ERRORS`` by default) plus ``NotExecuted`` and ``MaybeExecuted``
    where a second run is safe; ``NotExecuted`` alone where it is not."""
    verify: VerifyHook | None
    unknown_deadline: float | None
    """at_most_once: seconds an ``unknown`` call waits for an operator before a fixed failure
    result is submitted so the session is not stuck; None waits for ever."""
    is_async: bool
    max_attempts: int | None = None
    approval: bool | ApprovalRule = False
    """True (every call), or a rule telling which calls wait for a person's approval."""
    approval_timeout: float | None = None
    """Seconds a call waits for approval before the model gets a fixed "not approved in
    time" failure; None waits for ever."""
    threads: int | None = None
    """A sync handler: at most this many of its runs at once, in the process's handler threads
    (``TOOLLEDGER_HANDLER_THREADS``); None: as many as those allow."""

    @property
    def gated(self) -> bool:
        """Some of its calls may need approval."""
        return self.approval is not False

    @property
    def name(self) -> str:
        return self.function_tool.name

    @property
    def definition(self) -> dict[str, Any]:
        return dict(self.function_tool.definition)


@dataclass
class ToolRegistry:
    """Tools by name; ``definitions()`` is what goes in ``agent.tools``."""

    _tools: dict[str, RegisteredTool] = field(default_factory=dict)

    @overload
    def tool(self, function: Callable[..., Any], /) -> FunctionTool[Any]: ...

    @overload
    def tool(
        self,
        function: None = None,
        /,
        *,
        name: str | None = None,
        description: str | None = None,
        effect: EffectClass | str = EffectClass.AT_MOST_ONCE,
        timeout: float | None = None,
        retries: int = 0,
        retry_on: tuple[type[BaseException], ...] | None = None,
        verify: VerifyHook | None = None,
        unknown_deadline: float | None = None,
        defer_loading: bool = False,
        max_attempts: int | None = None,
        approval: bool | ApprovalRule = False,
        approval_timeout: float | None = None,
        threads: int | None = None,
    ) -> Callable[[Callable[..., Any]], FunctionTool[Any]]: ...

    def tool(
        self,
        function: Callable[..., Any] | None = None,
        /,
        *,
        name: str | None = None,
        description: str | None = None,
        effect: EffectClass | str = EffectClass.AT_MOST_ONCE,
        timeout: float | None = None,
        retries: int = 0,
        retry_on: tuple[type[BaseException], ...] | None = None,
        verify: VerifyHook | None = None,
        unknown_deadline: float | None = None,
        defer_loading: bool = False,
        max_attempts: int | None = None,
        approval: bool | ApprovalRule = False,
        approval_timeout: float | None = None,
        threads: int | None = None,
    ) -> FunctionTool[Any] | Callable[[Callable[..., Any]], FunctionTool[Any]]:
        """Register a typed function (sync or async) as a tool; a ``ToolContext`` parameter
        receives the call's context and is left out of the schema.

        ``effect``: what a second run would do (``at_most_once`` by default: never run twice).
        ``timeout``: seconds a run may take (default ``TOOLLEDGER_HANDLER_TIMEOUT_SECONDS``).
        ``retries``/``retry_on``: runs again within one claim on these exceptions (default
        ``TRANSIENT_ERRORS``), and on ``NotExecuted`` and ``MaybeExecuted``, with exponential
        backoff. Where a second run is unsafe (``at_most_once``, ``verified``) ``retries``
        counts ``NotExecuted`` alone (nothing happened, so a retry is no second effect) and
        ``retry_on`` cannot be given.
        ``verify``: for ``verified`` tools, asks downstream whether an interrupted run happened.
        ``unknown_deadline``: seconds (default None: no deadline) an interrupted run of an
        ``at_most_once`` or ``verified`` call may stay ``unknown``, counted from the end of its
        lease, before the model gets a fixed "outcome unknown" failure; without one the call
        waits for an operator (``toolledger calls resolve``) for as long as it takes.
        ``max_attempts``: claims before a re-runnable call is given up (default
        ``TOOLLEDGER_MAX_ATTEMPTS``).
        ``approval``: True, or a rule ``(arguments, ctx) -> bool``: such a call is recorded
        ``awaiting_approval`` and runs only once a person approves it (``toolledger calls
        approve``); a rule that raises counts as "needs approval".
        ``approval_timeout``: seconds it may wait for approval (default None: for ever) before
        the model gets a fixed "not approved in time" failure.
        ``threads``: a sync handler runs in a thread of its own, at most
        ``TOOLLEDGER_HANDLER_THREADS`` of all tools' at once; this caps the tool's own share (a
        tool whose downstream may hang then cannot take every thread). Its ``timeout`` counts
        from its thread's start, not from its wait for one."""

        def register(fn: Callable[..., Any]) -> FunctionTool[Any]:
            where = _where(fn)
            _check_name(name if name is not None else str(getattr(fn, "__name__", "")), where)
            try:
                handler = _handler_for(fn)
                built = function_tool(
                    handler, name=name, description=description, defer_loading=True if defer_loading else omit
                )
            except RegistryError:
                raise
            except Exception as error:
                # Pydantic's or the SDK's words are about their internals: say whose tool it is.
                raise RegistryError(
                    f"tool {name or fn.__name__!r} ({where}): no JSON schema can be made from its "
                    f"signature: {_first_line(error)}"
                ) from None
            _say_if_undescribed(built, where)
            self._register(
                built,
                is_async=inspect.iscoroutinefunction(fn),
                effect=effect,
                timeout=timeout,
                retries=retries,
                retry_on=retry_on,
                verify=verify,
                unknown_deadline=unknown_deadline,
                max_attempts=max_attempts,
                approval=approval,
                approval_timeout=approval_timeout,
                threads=threads,
            )
            return built

        return register if function is None else register(function)

    def add(
        self,
        tool: FunctionTool[Any],
        *,
        effect: EffectClass | str = EffectClass.AT_MOST_ONCE,
        timeout: float | None = None,
        retries: int = 0,
        retry_on: tuple[type[BaseException], ...] | None = None,
        verify: VerifyHook | None = None,
        unknown_deadline: float | None = None,
        max_attempts: int | None = None,
        approval: bool | ApprovalRule = False,
        approval_timeout: float | None = None,
        threads: int | None = None,
    ) -> FunctionTool[Any]:
        """Register an SDK ``FunctionTool`` as it is (its handler may call ``current_context()``)."""
        if not isinstance(tool, FunctionTool):
            raise RegistryError(f"expected an openai FunctionTool, got {type(tool).__name__}")
        handler = getattr(tool, "_handler", None)
        where = _where(handler)
        _check_name(tool.name, where)
        _say_if_undescribed(tool, where)
        self._register(
            tool,
            is_async=inspect.iscoroutinefunction(handler),
            effect=effect,
            timeout=timeout,
            retries=retries,
            retry_on=retry_on,
            verify=verify,
            unknown_deadline=unknown_deadline,
            max_attempts=max_attempts,
            approval=approval,
            approval_timeout=approval_timeout,
            threads=threads,
        )
        return tool

    def add_model(
        self,
        model: type[pydantic.BaseModel],
        handler: Callable[[Any], Any],
        *,
        name: str | None = None,
        description: str | None = None,
        defer_loading: bool = False,
        **policy: Any,
    ) -> FunctionTool[Any]:
        """Register a handler taking one pydantic model of its arguments."""
        tool = pydantic_function_tool(
            model,
            handler=handler,
            name=name,
            description=description,
            defer_loading=True if defer_loading else omit,
        )
        return self.add(tool, **policy)

    def _register(
        self,
        tool: FunctionTool[Any],
        *,
        is_async: bool,
        effect: EffectClass | str,
        timeout: float | None,
        retries: int,
        retry_on: tuple[type[BaseException], ...] | None,
        verify: VerifyHook | None,
        unknown_deadline: float | None,
        max_attempts: int | None,
        approval: bool | ApprovalRule = False,
        approval_timeout: float | None = None,
        threads: int | None = None,
    ) -> None:
        declarable = [e.value for e in EffectClass if e is not EffectClass.UNREGISTERED]
        if effect not in declarable:
            known = ", ".join(declarable)
            raise RegistryError(f"tool {tool.name!r}: unknown effect class {effect!r} (one of {known})")
        effect_class = EffectClass(effect)
        if tool.name in self._tools:
            raise RegistryError(f"a tool named {tool.name!r} is already registered")
        if effect_class is EffectClass.VERIFIED and verify is None:
            raise RegistryError(f"tool {tool.name!r}: effect 'verified' needs a verify hook")
        if verify is not None and effect_class is not EffectClass.VERIFIED:
            raise RegistryError(f"tool {tool.name!r}: a verify hook needs effect 'verified'")
        if retries < 0:
            raise RegistryError(f"tool {tool.name!r}: retries must be >= 0")
        if retry_on is not None and not _exception_classes(retry_on):
            raise RegistryError(f"tool {tool.name!r}: retry_on must be a tuple of exception classes")
        if retry_on is not None and not effect_class.rerun_is_safe:
            raise RegistryError(
                f"tool {tool.name!r}: effect {effect_class.value!r} forbids a second run after an error: "
                "retries count NotExecuted alone (raise it where the effect surely did not happen; "
                "toolledger.classify_http_error tells for HTTP errors), so retry_on cannot be given"
            )
        if timeout is not None and timeout <= 0:
            raise RegistryError(f"tool {tool.name!r}: timeout must be positive")
        if unknown_deadline is not None and unknown_deadline < 0:
            raise RegistryError(f"tool {tool.name!r}: unknown_deadline must be >= 0")
        if max_attempts is not None and max_attempts < 1:
            raise RegistryError(f"tool {tool.name!r}: max_attempts must be >= 1")
        if not isinstance(approval, bool) and not callable(approval):
            raise RegistryError(
                f"tool {tool.name!r}: approval must be True, False or a rule (arguments, ctx)"
            )
        if approval_timeout is not None and (approval is False or approval_timeout <= 0):
            raise RegistryError(
                f"tool {tool.name!r}: approval_timeout must be positive, and needs approval=True or a rule"
            )
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise RegistryError(f"tool {tool.name!r}: threads must be a whole number >= 1")
        if threads is not None and is_async:
            raise RegistryError(
                f"tool {tool.name!r}: threads= is for sync handlers (an async one runs on the event loop)"
            )
        self._tools[tool.name] = RegisteredTool(
            function_tool=tool,
            effect=effect_class,
            timeout=timeout,
            retries=retries,
            retry_on=_retried_after(effect_class, retry_on),
            verify=verify,
            unknown_deadline=unknown_deadline,
            is_async=is_async,
            max_attempts=max_attempts,
            approval=approval,
            approval_timeout=approval_timeout,
            threads=threads,
        )

    def get(self, name: str) -> RegisteredTool | None:
        return self._tools.get(name)

    def __iter__(self) -> Iterator[RegisteredTool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def definitions(self) -> list[dict[str, Any]]:
        """The tools for ``agent.tools``, with ``tool_search`` when any tool is deferred."""
        definitions = [tool.definition for tool in self._tools.values()]
        if any(d.get("defer_loading") for d in definitions):
            definitions.append({"type": "tool_search"})
        return definitions


def _exception_classes(given: Any) -> bool:
    return isinstance(given, tuple) and all(
        isinstance(e, type) and issubclass(e, BaseException) for e in given
    )


def _retried_after(
    effect: EffectClass, declared: tuple[type[BaseException], ...] | None
) -> tuple[type[BaseException], ...]:
    """What ``retries`` run the handler again after, for a tool of ``effect``."""
    if not effect.rerun_is_safe:
        return (NotExecuted,)
    retry_on = TRANSIENT_ERRORS if declared is None else tuple(declared)
    return (*retry_on, *(e for e in (NotExecuted, MaybeExecuted) if e not in retry_on))


def _parameter_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """The parameters' resolved annotations. The return annotation is left alone, as the SDK's
    ``function_tool`` does: it may name a type imported only for type checking."""
    annotations = {k: v for k, v in getattr(fn, "__annotations__", {}).items() if k != "return"}
    probe = types.FunctionType((lambda: None).__code__, inspect.unwrap(fn).__globals__)
    probe.__annotations__ = annotations
    return get_type_hints(probe, include_extras=True)


def _is_context(annotation: Any) -> bool:
    """``ToolContext``, or ``ToolContext | None``."""
    if annotation is ToolContext:
        return True
    arguments = get_args(annotation)
    return ToolContext in arguments and all(a in (ToolContext, type(None)) for a in arguments)


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""The names the Agents API accepts for a function tool (refused at ``agents.create`` else)."""


def _check_name(name: str, where: str) -> None:
    if not TOOL_NAME.fullmatch(name):
        raise RegistryError(
            f"tool {name!r} ({where}): the Agents API accepts tool names of 1 to 64 letters, digits, "
            "'_' and '-' only: give it one with name="
        )


def _say_if_undescribed(tool: FunctionTool[Any], where: str) -> None:
    if not (tool.definition.get("description") or "").strip():
        log.warning(
            "tool %r (%s) has no description: the model sees only its name; give it a docstring "
            "or description=",
            tool.name,
            where,
        )


def _where(fn: object) -> str:
    """Where a function was defined, as its file and line (the user's tool, for an error)."""
    code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
    if code is None:
        return "defined somewhere unknown"
    return f"{code.co_filename}, line {code.co_firstlineno}"


def _first_line(error: BaseException) -> str:
    if isinstance(error, pydantic.PydanticSchemaGenerationError):
        named = re.search(r"schema for (<[^>]*>)", str(error))
        shown = f" ({named.group(1)})" if named else ""
        return (
            f"a parameter's type has no JSON Schema{shown}: use JSON types (str, int, float, bool, "
            "list, dict), a pydantic model, a dataclass or a TypedDict"
        )
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _handler_for(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What the SDK's ``function_tool`` wraps: ``fn`` without its ``ToolContext`` parameter
    (filled at call time), and with an iterator result read only up to the output limit (the
    SDK would otherwise turn all of it into a list before anyone measures it)."""
    signature = inspect.signature(fn)
    hints = _parameter_hints(fn)
    context_names = [name for name in signature.parameters if _is_context(hints.get(name))]
    if len(context_names) > 1:
        raise RegistryError(f"{fn.__name__}: only one parameter may take the ToolContext")
    context = {name: None for name in context_names}
    parameters = [
        parameter.replace(annotation=hints.get(name, parameter.annotation))
        for name, parameter in signature.parameters.items()
        if name not in context
    ]

    def with_context(arguments: dict[str, Any]) -> dict[str, Any]:
        return {**arguments, **{name: current_context() for name in context}}

    wrapper: Callable[..., Any]
    if inspect.iscoroutinefunction(fn):

        async def wrapper(**arguments: Any) -> Any:
            return _bounded(await fn(**with_context(arguments)))

    else:

        def wrapper(**arguments: Any) -> Any:
            return _bounded(fn(**with_context(arguments)))

    # No __wrapped__: the SDK would follow it back to the signature that has the context.
    for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(wrapper, attribute, getattr(fn, attribute))
    setattr(wrapper, "__signature__", signature.replace(parameters=parameters))  # noqa: B010
    return wrapper


def _bounded(value: Any) -> Any:
    if isinstance(value, Iterator) and not isinstance(value, str | bytes):
        return bounded_list(value, output_limit())
    return value
