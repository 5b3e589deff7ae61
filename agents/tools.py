"""Tools an agent may call, and the registry that names them.

A tool is an async callable taking the parsed JSON arguments and a ``ToolContext`` and
returning text. The registry holds the built-ins plus tools from modules named in
``settings.SAGE_TOOL_MODULES`` (each module exposes ``TOOLS: list[Tool]``).
"""

from __future__ import annotations

import ast
import importlib
import math
import operator
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sageproject.errors import SageError, ValidationError


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolContext:
    """What a tool may know about the call: who and where, never credentials."""

    owner_id: int | None = None
    session_id: str | None = None
    run_id: str | None = None
    extras: Mapping[str, Any] = field(default_factory=dict)
    # The model's id of the call being made (the engine sets it per call).
    call_id: str | None = None

    @property
    def idempotency_key(self) -> str:
        """The same for every sending of one call (after a crash too): run and call ids."""
        return f"{self.run_id}:{self.call_id}"


ToolHandler = Callable[[dict[str, Any], ToolContext], Awaitable[str]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    handler: ToolHandler
    # The handler caps its own output (with a marker the model sees): the engine's cut
    # (`agents.engine.MAX_TOOL_OUTPUT_CHARS`) is not applied.
    capped: bool = False
    # The MCP server the tool comes from (spans and figures); None for the host's own.
    server: str | None = None


class ToolError(SageError):
    """A tool failed in a way the model should be told about (not a host failure)."""

    def __init__(self, message: str) -> None:
        super().__init__("tool.failed", message)


class ToolSuspends(SageError):
    """A tool cannot act until the user does something (connect a server): the call is
    answered as not run and the run suspends with an interaction of `interaction_type`
    (plus `interaction`'s fields); a ``retry`` reply resumes it."""

    interaction_type = "retry"

    def interaction(self) -> dict[str, Any]:
        return {}


# --- calculator: safe arithmetic by parsing, never eval --------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "log": math.log,
    "sin": math.sin,
    "cos": math.cos,
}
_NAMES = {"pi": math.pi, "e": math.e}
# Bounds that keep one expression from eating the worker: 2**10**10 would otherwise
# allocate gigabytes before anyone could stop it.
_MAX_EXPRESSION_CHARS = 500
_MAX_POW_EXPONENT = 1000
_MAX_MAGNITUDE = 10**100


def calculate(expression: str) -> float | int:
    """Evaluate an arithmetic expression by walking its AST.

    Raises ``ToolError`` for anything that is not plain arithmetic, division by zero,
    or numbers beyond the tool's bounds.
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {exc.msg}") from None

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name) and node.id in _NAMES:
            return _NAMES[node.id]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POW_EXPONENT:
                raise ToolError(f"exponent larger than {_MAX_POW_EXPONENT}")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, int | float) and abs(value) > _MAX_MAGNITUDE:
                raise ToolError("result too large")
            return value
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS
            and not node.keywords
        ):
            return _FUNCS[node.func.id](*(walk(arg) for arg in node.args))
        raise ToolError(f"unsupported element in expression: {type(node).__name__}")

    try:
        return walk(tree)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (ValueError, OverflowError, TypeError) as exc:
        raise ToolError(f"cannot evaluate: {exc}") from None


async def _calculator(args: dict[str, Any], ctx: ToolContext) -> str:
    expression = args.get("expression")
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("argument 'expression' must be a non-empty string")
    value = calculate(expression)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


async def _clock(args: dict[str, Any], ctx: ToolContext) -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


BUILTIN_TOOLS: tuple[Tool, ...] = (
    Tool(
        name="clock",
        description="Current date and time in UTC (ISO 8601).",
        parameters={"type": "object", "properties": {}, "additionalProperties": False},
        handler=_clock,
    ),
    Tool(
        name="calculator",
        description="Evaluate an arithmetic expression such as '(2 + 3) * 4' or 'sqrt(2)'.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        handler=_calculator,
    ),
)


class ToolRegistry:
    """Named tools. ``discovery_errors`` records modules that failed to load."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        self.discovery_errors: dict[str, str] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ValidationError("tool.duplicate", f"tool {tool.name!r} is registered twice")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def load_module(self, dotted: str) -> None:
        """Register every tool of ``dotted.TOOLS``; a failure is recorded, not raised."""
        try:
            module = importlib.import_module(dotted)
            for tool in module.TOOLS:
                self.register(tool)
        except Exception as exc:  # a broken plugin must not stop the host
            self.discovery_errors[dotted] = f"{type(exc).__name__}: {exc}"


def build_registry(modules: Iterable[str] = (), extra: Iterable[Tool] = ()) -> ToolRegistry:
    registry = ToolRegistry(BUILTIN_TOOLS)
    for tool in extra:
        registry.register(tool)
    for dotted in modules:
        registry.load_module(dotted)
    return registry
