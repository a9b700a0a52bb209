"""The environment's turns are token-exact: a trajectory built from the first prompt, the model's sampled ids and
`TurnRenderer.env_ids` reads exactly as the chat template renders the whole conversation, with the real Qwen3
tokenizer and with a Llama 3.1-style template, while the model's ids stay the ones it sampled."""

from pathlib import Path
from typing import Any

import pytest

from shardrl.agents.parsers import parse_hermes, parse_llama3_json
from shardrl.agents.render import TurnRenderer

TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "qwen3"
pytestmark = pytest.mark.skipif(not TOKENIZER.is_dir(), reason=f"needs the shared Qwen3 tokenizer at {TOKENIZER}")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PROMPT = [{"role": "system", "content": "You are a weather assistant."},
          {"role": "user", "content": "Is it sunny in Paris and in Rome?"}]


def _call(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


def _tool(content: str) -> dict[str, str]:
    return {"role": "tool", "content": content}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def _rollout(renderer: TurnRenderer, parse, end: str, turns: list[tuple[str, list[dict[str, Any]]]]):
    """The trajectory of `turns` (model text as sampled, ending with `end`; then the environment's messages) and
    the conversation the chat template would render for it, assistant turns rebuilt from their parsed calls."""
    tokenizer = renderer.tokenizer
    ids = renderer.prompt_ids(PROMPT)
    conversation = list(PROMPT)
    for model_text, env_messages in turns:
        model_ids = tokenizer(model_text + end, add_special_tokens=False)["input_ids"]  # as if sampled
        ids += model_ids + renderer.env_ids(env_messages, model_ids)
        parsed = parse(model_text)
        calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        conversation += [{"role": "assistant", "content": parsed.content, **({"tool_calls": calls} if calls else {})},
                         *env_messages]
    return ids, conversation


def _template_text(tokenizer, conversation, **template_kwargs) -> str:
    return tokenizer.apply_chat_template(conversation, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                         **template_kwargs)


def test_tool_turns_read_as_the_template_renders_the_conversation(tokenizer):
    renderer = TurnRenderer(tokenizer, TOOLS)
    ids, conversation = _rollout(renderer, parse_hermes, "<|im_end|>", [
        (f"<think>\nTwo cities, two calls.\n</think>\n\nLet me check both.\n{_call('Paris')}\n{_call('Rome')}",
         [_tool("sunny"), _tool("rain")]),
        ("<think>\nOne more look at Paris.\n</think>\n\n" + _call("Paris"), [_tool("still sunny")]),
    ])
    expected = _template_text(tokenizer, conversation)
    assert tokenizer.decode(ids) == expected
    # The model's ids here are the canonical tokenization of their text, so the whole is too.
    assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_a_user_turn_after_an_answer(tokenizer):
    renderer = TurnRenderer(tokenizer, TOOLS)
    ids, conversation = _rollout(renderer, parse_hermes, "<|im_end|>", [
        (_call("Paris"), [_tool("sunny")]),
        ("Paris is sunny.", [{"role": "user", "content": "And Rome?"}]),
    ])
    assert tokenizer.decode(ids) == _template_text(tokenizer, conversation)


def test_parallel_tool_results_share_one_user_turn(tokenizer):
    renderer = TurnRenderer(tokenizer, TOOLS)
    model_ids = tokenizer(_call("Paris") + "<|im_end|>", add_special_tokens=False)["input_ids"]
    env = renderer.env_ids([_tool("sunny"), _tool("rain")], model_ids)
    assert tokenizer.decode(env) == ("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
                                     "<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_the_environment_closes_a_turn_the_model_did_not_end(tokenizer):
    renderer = TurnRenderer(tokenizer, TOOLS)
    stopped = tokenizer(_call("Paris"), add_special_tokens=False)["input_ids"]  # stopped on the `</tool_call>` string
    assert tokenizer.decode(renderer.env_ids([_tool("sunny")], stopped)).startswith("<|im_end|>\n<|im_start|>user")
    # A plain "<" the model wrote is content, not the start of <|im_end|>: the environment still writes the end token.
    lt = tokenizer("a", add_special_tokens=False)["input_ids"] + tokenizer("<", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(renderer.env_ids([_tool("sunny")], lt)).startswith("<|im_end|>\n")
    assert tokenizer.decode(renderer.env_ids([_tool("sunny")], [])).startswith("<|im_end|>\n")


def test_sampled_ids_survive_where_decode_and_encode_would_not(tokenizer):
    renderer = TurnRenderer(tokenizer, TOOLS)
    first = tokenizer(_call("Paris") + "<|im_end|>", add_special_tokens=False)["input_ids"]
    env = renderer.env_ids([_tool("sunny")], first)  # ends with the header's "\n"
    # The model opened its next turn with a newline of its own and split " hello" as " hel" + "lo".
    second = (tokenizer("\n", add_special_tokens=False)["input_ids"] + tokenizer(" hel", add_special_tokens=False)[
        "input_ids"] + tokenizer("lo", add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(
            "<|im_end|>")])
    prompt = renderer.prompt_ids(PROMPT)
    trajectory = prompt + first + env + second
    assert trajectory[len(prompt) + len(first):][:len(env)] == env and trajectory[-len(second):] == second
    retokenized = tokenizer(tokenizer.decode(trajectory), add_special_tokens=False)["input_ids"]
    assert retokenized != trajectory
    # The header's "\n" and the model's "\n" merge into one "\n\n" token; " hel" + "lo" merge into " hello".
    assert len(retokenized) == len(trajectory) - 2
    assert tokenizer.convert_tokens_to_ids("ĊĊ") in retokenized[len(prompt) + len(first):]


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_enable_thinking_reaches_every_header(tokenizer, enable_thinking):
    renderer = TurnRenderer(tokenizer, TOOLS, {"enable_thinking": enable_thinking})
    empty_think = "<think>\n\n</think>\n\n"
    header = "<|im_start|>assistant\n" + ("" if enable_thinking else empty_think)
    assert tokenizer.decode(renderer.prompt_ids(PROMPT)).endswith(header)
    think = "<think>\nChecking.\n</think>\n\n" if enable_thinking else ""  # with thinking off, the header holds it
    ids, conversation = _rollout(renderer, parse_hermes, "<|im_end|>", [
        (think + _call("Paris"), [_tool("sunny")]),
        (think + _call("Rome"), [_tool("rain")]),
    ])
    text = tokenizer.decode(ids)
    assert text.endswith("</tool_response><|im_end|>\n" + header)
    expected = _template_text(tokenizer, conversation, enable_thinking=enable_thinking)
    if enable_thinking:
        assert text == expected
    else:
        # Qwen3's template leaves the empty think block out of past assistant turns, but the model sampled each of
        # them after one: the trajectory keeps them, and is the template's text with those blocks put back.
        past = "<|im_start|>assistant\n<tool_call>"
        assert expected.count(past) == 2 and text == expected.replace(past, header + "<tool_call>")


# A Llama 3.1-style template: header ids around each role, <|eot_id|> ending each turn, tool results in the
# "ipython" role (string content written as JSON, as Llama 3.1's template does), tools in the first user turn.
LLAMA_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date_string + '\n\n' + system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message.role == 'user' and loop.first and tools %}
        {{- '<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON '
            'for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the '
            'format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use '
            'variables.\n\n' }}
        {%- for tool in tools %}{{- tool | tojson(indent=4) + '\n\n' }}{%- endfor %}
        {{- message.content | trim + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {%- if message.tool_calls | length != 1 %}{{- raise_exception('only one tool call at once') }}{%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + call.name + '", "parameters": ' }}
        {{- call.arguments | tojson + '}<|eot_id|>' }}
    {%- elif message.role in ['tool', 'ipython'] %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}
        {%- else %}{{- message.content }}{%- endif %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""


def test_a_llama3_template_reads_as_its_rendering():
    from transformers import AutoTokenizer

    llama = AutoTokenizer.from_pretrained(TOKENIZER)  # Qwen3's vocabulary, Llama 3.1's turn format
    llama.add_special_tokens({"bos_token": "<|begin_of_text|>",
                              "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    llama.chat_template = LLAMA_TEMPLATE
    renderer = TurnRenderer(llama, TOOLS)
    ids, conversation = _rollout(renderer, parse_llama3_json, "<|eot_id|>", [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [_tool("sunny")]),
        ("Paris is sunny.", [{"role": "user", "content": "And Rome?"}]),
        ('{"name": "get_weather", "parameters": {"city": "Rome"}}', [_tool("rain")]),
    ])
    expected = _template_text(llama, conversation)
    assert llama.decode(ids) == expected
    assert expected.startswith("<|begin_of_text|><|start_header_id|>system")
    assert expected.endswith('ipython<|end_header_id|>\n\n"rain"<|eot_id|>'
                             '<|start_header_id|>assistant<|end_header_id|>\n\n')


def test_env_ids_refuse_other_roles(tokenizer):
    renderer = TurnRenderer(tokenizer, TOOLS)
    for role in ("assistant", "system"):
        with pytest.raises(ValueError, match=f"^env_ids: message role '{role}' is not an environment turn"):
            renderer.env_ids([_tool("sunny"), {"role": role, "content": "x"}], [])
    with pytest.raises(ValueError, match="^env_ids: no new messages"):
        renderer.env_ids([], [])


def test_templates_the_marker_cannot_cut_are_refused(tokenizer):
    from transformers import AutoTokenizer

    odd = AutoTokenizer.from_pretrained(TOKENIZER)
    odd.chat_template = "{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match=f"^tokenizer {TOKENIZER}: .* exactly once .*2 times"):
        TurnRenderer(odd)
    odd.chat_template = "{{ messages | length }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match=f"^tokenizer {TOKENIZER}: .* depending on the turns after it"):
        TurnRenderer(odd)
    with pytest.raises(ValueError, match="^data.apply_chat_template_kwargs.add_generation_prompt: set by shardrl"):
        TurnRenderer(tokenizer, TOOLS, {"add_generation_prompt": False})
