"""An agent program as people write them: the plain `openai` client in a tool-calling loop. shardrl runs it
unchanged during RL (`agent_loops.yaml` names it; see README.md): it gets the endpoint's base URL, every request it
makes becomes a turn of the trajectory, token-exact.

Two tools run here, in the agent's own process: `calculator` (arithmetic on numbers) and `lookup` (the built-in
digit-lookup task's tool: the sample's secret digit, which only the sample's `extra_info` holds).
"""

from __future__ import annotations

import ast
import functools
import json
import operator

from openai import BadRequestError, OpenAI

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression such as (3 + 4) * 2.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The secret digit of this sample.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}
MAX_TURNS = 4
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The expression's value: numbers and + - * / ** only (parsed, never eval'd)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ** are allowed")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
        return f"Error: {err}"


def run_tool(name: str, arguments: str, extra_info: dict) -> str:
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return "Error: arguments are not JSON"
    if name == "calculator":
        return calculate(str(args.get("expression", "")))
    if name == "lookup":
        return str(extra_info["tools_kwargs"]["lookup"]["create_kwargs"]["value"])
    return f"Error: no tool named {name!r}"


@functools.cache
def shared_client(api_key: str) -> OpenAI:
    """One client per agent process: building one costs ~20 ms (its HTTP pool), `with_options` a copy ~0.1 ms."""
    return OpenAI(base_url="http://unused/v1", api_key=api_key, max_retries=0, timeout=120)


def run_episode(episode) -> float:
    """One episode: ask, run the tools the model calls, answer their results, until it answers without a call or
    the episode's token budget is spent (the endpoint then answers 400 context_length_exceeded, as OpenAI's does).
    The reward: 1 for the right digit after a lookup, 0.1 for a lookup with a wrong answer, 0 without one (the
    built-in task's scoring, done here: the agent knows its task)."""
    client = shared_client(episode.api_key).with_options(base_url=episode.base_url)
    messages = list(episode.messages)
    looked_up = False
    answer = ""
    for _ in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(model=episode.model, messages=messages,
                                                   tools=[LOOKUP, CALCULATOR])
        except BadRequestError as err:
            if err.code == "context_length_exceeded":
                break
            raise
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            looked_up |= call.function.name == "lookup"
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments, episode.extra_info)})
    if not looked_up:
        return 0.0
    secret = str(episode.extra_info["tools_kwargs"]["lookup"]["create_kwargs"]["value"])
    return 1.0 if answer.strip().startswith(secret) else 0.1
