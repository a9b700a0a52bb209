"""verl 0.9's function tools (`multi_turn.function_tool_path`, `shardrl.agents.function_tools`): the decorator's three
forms, schemas as transformers' `get_json_schema` infers them, return values read as verl reads them, calls through
the agent loop's tool box in processes of their own (a crash, an exception or a hang fails that call only), the file's
errors and name clashes in one line, and the key's reach."""

import asyncio
import textwrap

import pytest
from transformers.utils import get_json_schema

from shardrl.agents.function_tools import FunctionToolError, function_tool, function_tool_schemas, load_function_tools
from shardrl.agents.loop import AgentData, ToolBox, TurnLimits
from shardrl.agents.parsers import FunctionCall
from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.trainer.launch import agent_tool_schemas

TOOLS = '''
import asyncio, os, time
from shardrl.agents.function_tools import function_tool
from shardrl.agents.tools import ToolResponse


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@function_tool("lookup", schema={"type": "function", "function": {"name": "anything", "description": "find a key",
                                 "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}})
def find(key):
    return {"key": key, "value": 7}, 0.5, {"hits": 1}


@function_tool
async def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: what to shout
    """
    await asyncio.sleep(0)
    return ToolResponse(text=text.upper()), None


@function_tool
def fail(reason: str) -> str:
    """Raise.

    Args:
        reason: the message
    """
    raise ValueError(reason)


@function_tool
def crash() -> str:
    """Exit the process at once."""
    os._exit(3)


@function_tool
def hang() -> str:
    """Sleep far past any timeout."""
    time.sleep(60)


def helper():  # not a tool
    return 1
'''


@pytest.fixture(scope="module")
def tool_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("function_tools") / "tools.py"
    path.write_text(TOOLS)
    return path


def test_the_decorator_marks_and_returns_the_function_unchanged():
    def plain(x: int) -> int:
        """Identity.

        Args:
            x: a number
        """
        return x

    assert function_tool(plain) is plain and function_tool("renamed")(plain) is plain and plain(3) == 3


def test_schemas_are_transformers_inference_or_the_given_one_under_the_tools_name(tool_file):
    schemas = {s["function"]["name"]: s for s in function_tool_schemas(tool_file)}
    assert list(schemas) == ["add", "lookup", "shout", "fail", "crash", "hang"]  # definition order, helper left out
    namespace: dict = {}
    exec(compile(TOOLS.replace("from shardrl.agents.function_tools import function_tool",
                               "function_tool = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))"),
                 "tools", "exec"), namespace)
    expected = get_json_schema(namespace["add"])["function"]
    assert schemas["add"]["function"]["description"] == expected["description"] == "Add two integers."
    assert schemas["add"]["function"]["parameters"]["properties"] == expected["parameters"]["properties"]
    assert schemas["add"]["function"]["parameters"]["required"] == ["a", "b"]
    assert schemas["lookup"]["function"]["description"] == "find a key"  # the given schema, renamed to the tool


def _calls(tool_file, calls, timeout=2.0):
    tools = load_function_tools(tool_file, timeout=timeout, concurrency=4)
    box = ToolBox(tools, TurnLimits(response_length=8, tool_timeout=timeout))
    try:
        async def run():
            return [await box.call(FunctionCall(name, arguments), AgentData([], "r", {})) for name, arguments in calls]
        return asyncio.run(run())
    finally:
        tools[0].pool.close()


def test_calls_run_in_tool_processes_and_return_as_verl_reads_them(tool_file):
    results = _calls(tool_file, [("add", {"a": 2, "b": 3}), ("lookup", {"key": "x"}), ("shout", {"text": "hi"}),
                                 ("fail", {"reason": "no such key"}), ("crash", {}), ("add", {"a": 1, "b": 1}),
                                 ("hang", {}), ("add", {"a": 5, "b": 5})], timeout=1.0)
    add, lookup, shout, fail, crash, after_crash, hang, after_hang = results
    assert (add.text, add.reward, add.error) == ("5", 0.0, False)
    assert (lookup.text, lookup.reward) == ('{"key": "x", "value": 7}', 0.5)  # a dict as JSON, the tuple's reward
    assert (shout.text, shout.reward) == ("HI", 0.0)  # async; ToolResponse; a None reward is 0
    assert fail.error and "ValueError: no such key" in fail.text
    assert crash.error and "died" in crash.text and after_crash.text == "2"  # the process was replaced
    assert hang.error and "timed out" in hang.text and after_hang.text == "10"


@pytest.mark.parametrize("source, reason", [
    ("x = 1\n", "declares no @function_tool"),
    ("from shardrl.agents.function_tools import function_tool\n\n@function_tool\ndef f(a):\n    return a\n",
     "Args: block"),
    ("from shardrl.agents.function_tools import function_tool\n\n@function_tool\ndef f(*a: int) -> int:\n"
     "    '''F.\n\n    Args:\n        a: x\n    '''\n    return 1\n", "*args / **kwargs"),
    ("import not_a_module_anywhere\n", "ModuleNotFoundError"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, source, reason):
    path = tmp_path / "bad.py"
    path.write_text(source)
    with pytest.raises(FunctionToolError) as err:
        function_tool_schemas(path)
    assert str(path) in str(err.value) and reason in str(err.value) and "\n" not in str(err.value)


def test_a_name_the_tool_config_also_declares_is_refused(tool_file, tmp_path):
    config = tmp_path / "tools.yaml"
    config.write_text(textwrap.dedent("""
        tools:
          - class_name: shardrl.agents.builtin_tools.CalculatorTool
            config: {type: native}
            tool_schema: {type: function, function: {name: add, description: d, parameters: {type: object,
                          properties: {expression: {type: string}}}}}
        """))
    with pytest.raises(ConfigError) as err:
        agent_tool_schemas(str(config), str(tool_file))
    assert err.value.key == "actor_rollout_ref.rollout.multi_turn.function_tool_path" and "'add'" in str(err.value)
    assert [s["function"]["name"] for s in agent_tool_schemas(None, str(tool_file))][:2] == ["add", "lookup"]


def test_the_key_reaches_the_agent_settings_as_an_absolute_path(tool_file, monkeypatch):
    monkeypatch.chdir(tool_file.parent)
    multi_turn = "actor_rollout_ref.rollout.multi_turn"
    plan = plan_job(compose("ppo_trainer", [f"{multi_turn}.enable=true", f"{multi_turn}.function_tool_path=tools.py"]))
    assert plan.rollout.agent.function_tool_path == str(tool_file)
    with pytest.raises(ConfigError) as err:
        plan_job(compose("ppo_trainer", [f"{multi_turn}.enable=true", f"{multi_turn}.function_tool_path=nope.py"]))
    assert err.value.key == f"{multi_turn}.function_tool_path"


@pytest.mark.slow
def test_a_multi_turn_job_renders_and_serves_the_function_tools(tmp_path):
    """The built-in multi-turn task (its `lookup` tool from its tool config) plus a file's `add`: the rollout
    workers start their tool processes and the job trains 2 steps; a file that also declares `lookup` is refused
    before workers start."""
    from test_default_job import run_job

    extra = tmp_path / "extra.py"
    extra.write_text(TOOLS.split("@function_tool(\"lookup\"")[0])
    rows = run_job(tmp_path / "run", "trainer.total_training_steps=2", "trainer.val_before_train=false",
                   "trainer.test_freq=-1", "actor_rollout_ref.rollout.multi_turn.enable=true",
                   f"actor_rollout_ref.rollout.multi_turn.function_tool_path={extra}")
    assert [r["step"] for r in rows] == [1, 2]
