"""verl 0.9's function tools (`rollout.multi_turn.function_tool_path`): plain Python functions as tools.

The file at `function_tool_path` decorates functions with `@function_tool` (bare, `@function_tool("name")`, or
`@function_tool(schema={...})`); each becomes a tool of that name beside the tool config's (a given schema's
function name is replaced by the tool's, so the prompt names the tool that is called). Its OpenAI schema comes
from the function as verl infers it (`transformers.utils.get_json_schema`: a Google-style docstring with an `Args:`
block and a type hint on every parameter) unless given. What it returns becomes the tool's response as verl's
`normalize_function_tool_return` reads it: a string; a dict (as JSON); a tuple (response,), (response, reward) or
(response, reward, metrics); anything else as str().

A verl file runs here after one import changes: `from verl.tools.function_tool import function_tool` ->
`from shardrl.agents.function_tools import function_tool`. The file is user code, so it is never imported into a
trainer or rollout process: it runs in processes of its own (`usercode.FunctionPool`, one pool per rollout worker,
and short-lived ones that read the schemas), where a crash, a hang or a runaway allocation fails the
call (the model reads the error) and the process is replaced; each call is timed out at `multi_turn.tool_timeout`.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardrl.agents.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse
from shardrl.errors import UserError
from shardrl.usercode.pool import FunctionPool
from shardrl.usercode.wire import LoadError

# What `function_tool` sets on a function: (tool name, schema dict or None to infer it).
_MARK = "__shardrl_function_tool__"
_SERVE = f"{__name__}:serve"  # what the tool processes run
SCHEMA_TIMEOUT = 120.0  # seconds to import the file and infer its schemas (transformers' import included)


class FunctionToolError(UserError, ValueError):
    """A function-tool file that cannot be loaded or a tool that cannot be declared; one line naming it."""


def function_tool(name: str | Callable[..., Any] | None = None, *,
                  schema: dict[str, Any] | None = None) -> Callable[..., Any]:
    """Declare a function a tool (verl's decorator): `@function_tool`, `@function_tool("name")` or
    `@function_tool(schema={"type": "function", "function": {...}})`. The function itself is returned unchanged."""
    def mark(fn: Callable[..., Any], tool_name: str | None) -> Callable[..., Any]:
        setattr(fn, _MARK, (tool_name or fn.__name__, schema))
        return fn

    if callable(name) and schema is None:
        return mark(name, None)
    return functools.partial(mark, tool_name=name)


@functools.cache
def _declared(path: str) -> dict[str, tuple[Callable[..., Any], dict[str, Any] | None]]:
    """name -> (function, the schema it was given or None) of the file's `@function_tool`s, in definition order
    (imported once per process)."""
    spec = importlib.util.spec_from_file_location(f"_shardrl_function_tools_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise FunctionToolError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so its dataclasses and pickling find it
    spec.loader.exec_module(module)
    tools: dict[str, tuple[Callable[..., Any], dict[str, Any] | None]] = {}
    for fn in vars(module).values():
        mark = getattr(fn, _MARK, None) if callable(fn) else None
        if mark is None:
            continue
        tool_name, schema = mark
        if tool_name in tools and tools[tool_name][0] is not fn:
            raise FunctionToolError(f"{path}: two functions declare the tool {tool_name!r}; rename one")
        tools[tool_name] = fn, schema
    return tools


def _schema(fn: Callable[..., Any], tool_name: str, given: dict[str, Any] | None, path: str) -> dict[str, Any]:
    """The tool's OpenAI schema: the one given, or verl's inference from the signature and docstring."""
    where = f"{path}: @function_tool {tool_name!r}"
    if given is None:
        variadic = [p.name for p in inspect.signature(fn).parameters.values()
                    if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        if variadic:
            raise FunctionToolError(f"{where}: *args / **kwargs ({', '.join(variadic)}) have no JSON schema; "
                                    "name every parameter")
        from transformers.utils import get_json_schema  # the tool processes only

        try:
            given = get_json_schema(fn)
        except Exception as exc:  # transformers' docstring / type-hint exceptions
            raise FunctionToolError(f"{where}: {type(exc).__name__}: {exc} (it needs a Google-style docstring with "
                                    "an Args: block and a type hint on every parameter, or schema=...)") from None
    if isinstance(given, dict) and isinstance(given.get("function"), dict):  # the tool's name wins: the prompt
        given = {**given, "function": {**given["function"], "name": tool_name}}  # names the tool that is called
    try:
        return OpenAIFunctionToolSchema.model_validate(given).model_dump()
    except ValueError as exc:
        raise FunctionToolError(f"{where}: {exc}") from None


def serve(op: str, path: str, name: str | None = None, arguments: dict[str, Any] | None = None) -> Any:
    """What the tool processes run: `schemas` (every tool's schema dict, in order) or `call` (the tool `name` on
    `arguments` -> [text, reward, metrics])."""
    tools = _declared(path)
    if op == "schemas":  # only here is transformers imported (the schema inference): calls never wait for it
        return [_schema(fn, tool_name, given, path) for tool_name, (fn, given) in tools.items()]
    fn, _ = tools[name]
    result = fn(**(arguments or {}))
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    return _normalised(result)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _normalised(result: Any) -> list[Any]:
    """verl's reading of a function tool's return value -> [text, reward, metrics]."""
    if isinstance(result, tuple):
        if not 1 <= len(result) <= 3:
            raise TypeError(f"a function tool's tuple must be (response,), (response, reward) or (response, reward, "
                            f"metrics); got {len(result)} items")
        text = _text(result[0])
        reward = 0.0 if len(result) < 2 or result[1] is None else float(result[1])
        metrics = {} if len(result) < 3 or result[2] is None else dict(result[2])
        return [text, reward, metrics]
    return [_text(result), 0.0, {}]


def _text(value: Any) -> str:
    if isinstance(value, ToolResponse):
        return value.text or ""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return value if isinstance(value, str) else str(value)


def _pool(path: str, num_processes: int, timeout: float, concurrency: int) -> FunctionPool:
    pool = FunctionPool(_SERVE, num_processes=num_processes, timeout=timeout, max_concurrent_per_process=concurrency,
                        label="function tool")
    try:
        pool.start()
    except LoadError as err:
        raise FunctionToolError(f"{path}: {err}") from None
    return pool


def function_tool_schemas(path: str | Path) -> list[dict[str, Any]]:
    """The schemas of the file's tools, read in a process of their own (prompts are rendered with them before
    workers start); a file that cannot be loaded is a FunctionToolError naming it."""
    pool = _pool(_file(path), num_processes=1, timeout=SCHEMA_TIMEOUT, concurrency=1)
    try:
        return _schemas(pool, path)
    finally:
        pool.close()


def _file(path: str | Path) -> str:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FunctionToolError(f"{path}: function tool file not found")
    return str(file)


def _schemas(pool: FunctionPool, path: str | Path) -> list[dict[str, Any]]:
    (result,) = pool.map([("schemas", _file(path))])
    if result.error is not None:
        raise FunctionToolError(f"{path}: {result.error}")
    if not result.value:
        raise FunctionToolError(f"{path}: declares no @function_tool (from shardrl.agents.function_tools import "
                                "function_tool)")
    return result.value


def check_unique_names(names: list[str], path: str | Path) -> None:
    """The tool config's and the file's tools together: a name twice is a FunctionToolError (verl's check)."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise FunctionToolError(f"{path}: the tool {name!r} is declared by the tool config and by this file; "
                                    "rename one")
        seen.add(name)


class FunctionTool(BaseTool):
    """One `@function_tool` as a tool of the agent loop: each call runs in the worker's tool processes."""

    def __init__(self, pool: FunctionPool, path: str, schema: dict[str, Any]) -> None:
        super().__init__({"type": "function"}, OpenAIFunctionToolSchema.model_validate(schema))
        self.pool, self.path = pool, path

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        result = await self.pool.call("call", self.path, self.name, parameters)
        if result.error is not None:
            raise RuntimeError(result.error)  # the tool box answers the model with it
        text, reward, metrics = result.value
        return ToolResponse(text=text), reward, metrics


def load_function_tools(path: str | Path, timeout: float, concurrency: int) -> list[FunctionTool]:
    """Every tool of the file, backed by one pool of tool processes (`concurrency` calls at once)."""
    schemas = function_tool_schemas(path)
    file = _file(path)
    pool = _pool(file, num_processes=1, timeout=timeout, concurrency=concurrency)
    return [FunctionTool(pool, file, schema) for schema in schemas]
