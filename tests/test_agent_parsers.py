"""Tool-call parsers: calls found in a model turn's text, text outside them kept as content, and every malformed
call turned into a message for the model instead of an exception."""

import json

import pytest

from shardrl.agents.parsers import PARSERS, FunctionCall, get_parser, parse_hermes, parse_llama3_json


def test_hermes_several_calls_with_content_around_them():
    text = ('Let me look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\nDone.')
    turn = parse_hermes(text)
    assert turn.calls == [FunctionCall("get_weather", {"city": "Paris"}), FunctionCall("get_weather", {"city": "Rome"})]
    assert turn.content == "Let me look both up.\n\n\nDone."
    assert turn.errors == []


def test_hermes_nested_arguments_and_tags_inside_strings():
    args = {"query": {"filters": [{"field": "year", "op": ">=", "value": 2020}], "text": "a {brace} and \"quotes\""},
            "limit": 5, "deep": {"a": {"b": {"c": [1, [2, {"d": None}]]}}}}
    text = '<tool_call>\n{"name": "search", "arguments": ' + json.dumps(args) + '}\n</tool_call>'
    assert parse_hermes(text).calls == [FunctionCall("search", args)]
    assert parse_hermes(text).content == ""


def test_hermes_without_calls_is_all_content():
    assert parse_hermes("  The answer is 42.\n") == parse_hermes("The answer is 42.")
    assert parse_hermes("The answer is 42.").calls == [] and parse_hermes("The answer is 42.").errors == []


def test_hermes_arguments_may_be_left_out():
    assert parse_hermes('<tool_call>{"name": "now"}</tool_call>').calls == [FunctionCall("now", {})]


def test_hermes_malformed_calls_become_errors_numbered_in_order():
    text = ('<tool_call>\n{"name": "ok", "arguments": {}}\n</tool_call>'
            '<tool_call>\n{"name": "broken", "arguments": {"x": 1\n</tool_call>'
            '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>'
            '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
            '<tool_call>\n["f", {}]\n</tool_call>'
            'Between. <tool_call>\n{"name": "cut", "argu')
    turn = parse_hermes(text)
    assert turn.calls == [FunctionCall("ok", {})]
    assert [e.split(":")[0] for e in turn.errors] == ["Error"] * 5
    assert turn.errors[0] == "Error: tool call 2 is not valid JSON: Expecting ',' delimiter at character 41"
    assert turn.errors[1] == ('Error: tool call 3 has no "name" (a non-empty string); write '
                              '{"name": <function-name>, "arguments": <args-json-object>}')
    assert turn.errors[2] == 'Error: tool call 4 (f): "arguments" must be a JSON object, got str'
    assert turn.errors[3].startswith("Error: tool call 5 must be a JSON object") and turn.errors[3].endswith("list")
    assert turn.errors[4] == "Error: tool call 6 is not closed with </tool_call>"
    assert turn.content == "Between."  # the unclosed call is not content


def test_llama3_one_call_with_parameters_or_arguments():
    assert parse_llama3_json('{"name": "get_weather", "parameters": {"city": "Paris"}}').calls == [
        FunctionCall("get_weather", {"city": "Paris"})]
    assert parse_llama3_json(' {"name": "get_weather", "arguments": {"city": "Paris"}}\n').calls == [
        FunctionCall("get_weather", {"city": "Paris"})]


def test_llama3_python_tag_and_several_calls():
    text = ('<|python_tag|>{"name": "a", "parameters": {"n": {"deep": [1, 2]}}}; '
            '{"name": "b", "parameters": {}};{"name": "c"} ;')
    turn = parse_llama3_json(text)
    assert turn.calls == [FunctionCall("a", {"n": {"deep": [1, 2]}}), FunctionCall("b", {}), FunctionCall("c", {})]
    assert turn.content == "" and turn.errors == []


def test_llama3_text_is_content_unless_the_turn_is_a_call():
    assert parse_llama3_json("Paris is sunny today.") == parse_llama3_json("Paris is sunny today.\n")
    turn = parse_llama3_json('It is {"name": "x"} maybe.')
    assert turn.calls == [] and turn.errors == [] and turn.content == 'It is {"name": "x"} maybe.'
    after = parse_llama3_json('{"name": "get_weather", "parameters": {"city": "Rome"}} I called it.')
    assert after.calls == [FunctionCall("get_weather", {"city": "Rome"})] and after.content == "I called it."


def test_llama3_malformed_calls_become_errors():
    broken = parse_llama3_json('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": }')
    assert broken.calls == [FunctionCall("a", {})] and broken.content == ""
    assert broken.errors == ["Error: tool call 2 is not valid JSON: Expecting value at character 35"]
    code = parse_llama3_json("<|python_tag|>print(2 + 2)")
    assert code.calls == [] and code.errors[0].startswith("Error: tool call 1 is not valid JSON")
    wrong = parse_llama3_json('{"name": "a", "parameters": [1]}; {"parameters": {}}')
    assert wrong.errors == ['Error: tool call 1 (a): "parameters" must be a JSON object, got list',
                            'Error: tool call 2 has no "name" (a non-empty string); write '
                            '{"name": <function-name>, "parameters": <args-json-object>}']


def test_registry_uses_verl_format_names():
    assert get_parser("hermes") is parse_hermes and get_parser("llama3_json") is parse_llama3_json
    assert sorted(PARSERS) == ["hermes", "llama3_json"]
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.rollout.multi_turn.format: unknown tool-call format "
                                         r"'qwen'; use one of hermes, llama3_json$"):
        get_parser("qwen")
