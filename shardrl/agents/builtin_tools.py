"""Tools that ship with shardrl: a sandboxed Python interpreter (verl's `code_interpreter`) and a calculator.

Both are verl-style native tools, named in a tool config file as any other:

    tools:
      - class_name: shardrl.agents.builtin_tools.PythonTool
        config: {type: native, wall_seconds: 10, memory_mb: 512}   # tool_schema may be left out
      - class_name: shardrl.agents.builtin_tools.CalculatorTool
        config: {type: native}

Whatever the model sends, `execute` answers with text (`Error: ...` when the call failed); only a bug raises.
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar

from shardrl.agents.sandbox import SandboxLimits, require_isolation, run_python
from shardrl.agents.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse

_Config = TypeVar("_Config")


@dataclass(frozen=True)
class PythonToolConfig:
    """The `config:` of a PythonTool entry; the limits are per call."""

    type: Literal["native"] = "native"  # verl's tool kind (the registry builds native tools only)
    wall_seconds: float = SandboxLimits.wall_seconds  # wall-clock limit of one call
    cpu_seconds: float = SandboxLimits.cpu_seconds  # CPU limit of each of the call's processes
    memory_mb: int = SandboxLimits.memory_bytes >> 20  # address-space limit of each of the call's processes
    max_output_bytes: int = SandboxLimits.max_output_bytes  # stdout + stderr; the run is stopped past it
    max_concurrency: int = 4  # calls running at once, over every trajectory this tool serves
    allow_network: bool = False  # true: the code may open sockets (no network namespace, no socket filter)
    allow_host_writes: bool = False  # true: run even on a host without Landlock, where writes are not confined


@dataclass(frozen=True)
class CalculatorToolConfig:
    type: Literal["native"] = "native"


class PythonTool(BaseTool):
    """Runs the call's `code` in the sandbox (`shardrl.agents.sandbox`) and answers with what it printed.

    Construction refuses a host that cannot confine the code (`require_isolation` says what is missing); a call
    never raises for what the code does.
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        self.settings = _read_config(PythonToolConfig, config, type(self).__name__)
        require_isolation(allow_host_writes=self.settings.allow_host_writes)
        super().__init__(config, tool_schema)
        self.limits = SandboxLimits(cpu_seconds=self.settings.cpu_seconds, wall_seconds=self.settings.wall_seconds,
                                    memory_bytes=self.settings.memory_mb << 20,
                                    max_output_bytes=self.settings.max_output_bytes)
        self._slots = asyncio.Semaphore(self.settings.max_concurrency)

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        network = "" if self.settings.allow_network else ", no network"
        return getattr(self, "tool_schema", None) or _schema(
            "code_interpreter", f"Run Python 3 code (standard library only{network}) and return what it prints to "
                                f"stdout and stderr; it is stopped after {self.settings.wall_seconds:g} s.",
            "code", "The Python code to run; print() the values you want to see.")

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text=f"Error: `code` must be a non-empty string of Python, got {code!r}"), 0.0, {
                "invalid_call": 1.0}
        async with self._slots:
            result = await run_python(code, self.limits, allow_network=self.settings.allow_network)
        return ToolResponse(text=result.render()), 0.0, {**result.metrics(), "invalid_call": 0.0}


class CalculatorTool(BaseTool):
    """Evaluates the call's arithmetic `expression` by walking its syntax tree; nothing else is ever evaluated."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        self.settings = _read_config(CalculatorToolConfig, config, type(self).__name__)
        super().__init__(config, tool_schema)

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None) or _schema(
            "calculator", "Evaluate an arithmetic expression: numbers, + - * / // % **, unary minus and parentheses.",
            "expression", "The expression, e.g. (3 + 4) * 2 ** 10 / 7")

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        expression = parameters.get("expression")
        try:
            if not isinstance(expression, str):
                raise CalculatorError(f"`expression` must be a string, got {expression!r}")
            value = evaluate(expression)
        except CalculatorError as exc:
            return ToolResponse(text=f"Error: {exc}"), 0.0, {"error": 1.0}
        return ToolResponse(text=repr(value)), 0.0, {"error": 0.0}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is what the model reads."""


_MAX_EXPRESSION_CHARS = 2000
_MAX_RESULT_BITS = 4096  # about 1233 decimal digits: big enough for arithmetic, too small to stall the loop
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; anything else (names, calls, attributes, ...) is refused."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        return _value(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    except RecursionError:  # thousands of nested unary minuses, say: the parser and the walk are recursive
        raise CalculatorError("expression nested too deeply") from None
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:  # float arithmetic past ~1e308
        raise CalculatorError("result too large") from None


def _value(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # bool is an int: refused by `type`
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and left not in (0, 1, -1) and right * math.log2(abs(left)) > _MAX_RESULT_BITS:
            raise CalculatorError(f"result too large: {left!r} ** {right!r}")  # refused before it is computed
        return _checked(_BINARY[type(node.op)](left, right))
    raise CalculatorError(f"unsupported {type(node).__name__} {ast.unparse(node)[:40]!r}: only numbers, "
                          f"+ - * / // % **, unary minus and parentheses")


def _checked(value: int | float | complex) -> int | float:
    if isinstance(value, complex):
        raise CalculatorError("complex result (a fractional power of a negative number)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError(f"result is not a finite number ({value!r})")
    if isinstance(value, int) and value.bit_length() > _MAX_RESULT_BITS:
        raise CalculatorError("result too large")
    return value


def _schema(name: str, description: str, parameter: str, parameter_description: str) -> OpenAIFunctionToolSchema:
    """An OpenAI function schema with one required string parameter."""
    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
        "name": name, "description": description, "parameters": {
            "type": "object", "properties": {parameter: {"type": "string", "description": parameter_description}},
            "required": [parameter]}}})


def _read_config(cls: type[_Config], config: dict[str, Any], tool: str) -> _Config:
    """`config` as `cls`, refusing an unknown key or a value of the wrong kind with one line naming the key."""
    defaults = {f.name: f.default for f in fields(cls)}
    for key, value in config.items():
        if key not in defaults:
            raise ValueError(f"{tool} config: unknown key {key!r}; the keys are {sorted(defaults)}")
        default = defaults[key]
        if key == "type":
            ok, want = value == "native", "native"
        elif isinstance(default, bool):
            ok, want = isinstance(value, bool), "true or false"
        else:
            kinds = (int,) if isinstance(default, int) else (int, float)
            ok, want = isinstance(value, kinds) and not isinstance(value, bool) and value > 0, \
                f"a positive {type(default).__name__}"
        if not ok:
            raise ValueError(f"{tool} config: {key} must be {want}, got {value!r}")
    return cls(**config)
