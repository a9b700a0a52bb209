"""Tool-call parsers: the calls a model wrote in one turn, found in the turn's text.

The text is the model's sampled ids decoded only to find the calls (decode with ``skip_special_tokens=True`` so end
tokens such as ``<|im_end|>`` stay out of `content`); the trajectory keeps the ids themselves. A malformed call is
never an exception: it becomes an entry of `ParsedTurn.errors`, a short message the agent loop can hand back to the
model as the tool result, so the model learns from the mistake instead of the rollout dying on it.

The registry is keyed by verl's `actor_rollout_ref.rollout.multi_turn.format` names.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FunctionCall:
    """One call: the function's name and its decoded JSON arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn split into its text outside calls (ends stripped), its well-formed calls in order, and one
    model-readable message per malformed call."""

    content: str
    calls: list[FunctionCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _call_from_json(body: str, number: int, arguments_keys: tuple[str, ...]) -> FunctionCall | str:
    """The call that `body` (one JSON object) describes, or the error message naming call `number` (1-based)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return _json_error(number, e, len(body) - len(body.lstrip()))
    return _call_from_value(value, number, arguments_keys)


def _json_error(number: int, error: json.JSONDecodeError, call_start: int) -> str:
    """The message for call `number`'s broken JSON, placed within the call (not the turn) so the model can find it."""
    return f"Error: tool call {number} is not valid JSON: {error.msg} at character {error.pos - call_start + 1}"


def _call_from_value(value: Any, number: int, arguments_keys: tuple[str, ...]) -> FunctionCall | str:
    """`value` (decoded JSON) as a call, or the error message. Arguments may be left out (a function without
    parameters); the first key of `arguments_keys` present holds them."""
    expected = f'{{"name": <function-name>, "{arguments_keys[0]}": <args-json-object>}}'
    if not isinstance(value, dict):
        return f"Error: tool call {number} must be a JSON object {expected}, got {type(value).__name__}"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return f'Error: tool call {number} has no "name" (a non-empty string); write {expected}'
    key = next((k for k in arguments_keys if k in value), None)
    arguments = {} if key is None else value[key]
    if not isinstance(arguments, dict):
        return (f'Error: tool call {number} ({name}): "{key}" must be a JSON object, '
                f"got {type(arguments).__name__}")
    return FunctionCall(name, arguments)


def parse_hermes(text: str) -> ParsedTurn:
    """Qwen2.5 / Qwen3 (Hermes) calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any
    number per turn. A ``<tool_call>`` never closed ends the parse (the rest of the turn is that broken call)."""
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    content: list[str] = []
    calls: list[FunctionCall] = []
    errors: list[str] = []
    pos = 0
    while (start := text.find(open_tag, pos)) >= 0:
        content.append(text[pos:start])
        number = len(calls) + len(errors) + 1
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            errors.append(f"Error: tool call {number} is not closed with {close_tag}")
            pos = len(text)
            break
        call = _call_from_json(text[start + len(open_tag):end], number, ("arguments",))
        (errors if isinstance(call, str) else calls).append(call)
        pos = end + len(close_tag)
    content.append(text[pos:])
    return ParsedTurn("".join(content).strip(), calls, errors)


def parse_llama3_json(text: str) -> ParsedTurn:
    """Llama 3.1 / 3.2 JSON tool calling: the turn is a JSON object ``{"name": ..., "parameters": {...}}``
    ("arguments" is accepted too), optionally after ``<|python_tag|>``, several separated by ``;``.

    A turn that starts with neither is plain content. Text after the last call is content; a call that is not valid
    JSON ends the parse, since the next call's start cannot be found inside broken JSON.
    """
    python_tag = "<|python_tag|>"
    rest = text.strip()
    tagged = rest.startswith(python_tag)
    if tagged:
        rest = rest[len(python_tag):].lstrip()
    if not tagged and not rest.startswith("{"):
        return ParsedTurn(rest)
    decoder = json.JSONDecoder()
    calls: list[FunctionCall] = []
    errors: list[str] = []
    pos = 0
    while True:
        number, start = len(calls) + len(errors) + 1, pos
        try:
            value, pos = decoder.raw_decode(rest, start)
        except json.JSONDecodeError as e:
            errors.append(_json_error(number, e, start))
            return ParsedTurn("", calls, errors)
        call = _call_from_value(value, number, ("parameters", "arguments"))
        (errors if isinstance(call, str) else calls).append(call)
        pos = _skip_space(rest, pos)
        if pos == len(rest) or rest[pos] != ";":
            return ParsedTurn(rest[pos:].strip(), calls, errors)
        pos = _skip_space(rest, pos + 1)
        if pos == len(rest):
            return ParsedTurn("", calls, errors)  # a trailing `;`


def _skip_space(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not whitespace (`raw_decode` takes none before a value)."""
    return len(text) - len(text[pos:].lstrip())


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def get_parser(name: str) -> Callable[[str], ParsedTurn]:
    """The parser registered as `name`."""
    if name not in PARSERS:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format: unknown tool-call format {name!r}; "
                         f"use one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]
