"""verl-format tool and interaction configs load user classes written as a verl user writes them (only the imports
changed), by file path and by dotted module; their lifecycles run; every bad config is refused in one line that
names the file and the entry."""

import asyncio
import sys
import textwrap
from pathlib import Path

import pytest

from shardrl.agents.interactions import BaseInteraction
from shardrl.agents.registry import ToolConfigError, load_interactions, load_tools, tool_schemas_of
from shardrl.agents.tools import BaseTool, ToolResponse

# verl's gsm8k tool, imports changed: the schema comes from the tool config.
USER_TOOLS = '''
from typing import Any, Optional
from uuid import uuid4

from shardrl.agents.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse


class AnswerTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = str(parameters.get("answer", ""))
        self._instance_dict[instance_id]["response"] = answer
        reward = await self.calc_reward(instance_id)
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return self.config["score"] if state["response"] == state["ground_truth"] else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
'''

# A tool that gives its own schema; in a package on sys.path, named by a dotted class_name.
DOTTED_TOOL = '''
from shardrl.agents.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse

SCHEMA = {"type": "function", "function": {"name": "echo", "description": "Say it back.",
          "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


class EchoTool(BaseTool):
    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate(SCHEMA)

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=self.config.get("prefix", "") + parameters["text"]), 0.0, {"calls": 1}
'''

# verl's gsm8k interaction, imports changed (verl.utils.reward_score.gsm8k -> shardrl.rewards.gsm8k).
USER_INTERACTIONS = '''
from typing import Any, Optional
from uuid import uuid4

from shardrl.agents.interactions import BaseInteraction
from shardrl.rewards import gsm8k


class Gsm8kInteraction(BaseInteraction):
    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                                **kwargs) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict]:
        content = ""
        for item in reversed(messages):
            if item.get("role") == "assistant":
                content = item.get("content")
                break
        self._instance_dict[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="strict", format_score=0.0,
                                   score=1.0)

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]


class Judge(BaseInteraction):
    pass
'''

# Classes that must be refused, one reason each.
BAD_CLASSES = '''
from shardrl.agents.interactions import BaseInteraction
from shardrl.agents.tools import BaseTool, ToolResponse

NOT_A_CLASS = 3


class NotATool:
    async def create(self, instance_id=None, **kwargs): ...
    async def execute(self, instance_id, parameters, **kwargs): ...
    async def release(self, instance_id, **kwargs): ...


class SyncTool(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="blocks the loop"), 0.0, {}


class BrokenTool(BaseTool):
    def __init__(self, config, tool_schema):
        raise RuntimeError("needs a sandbox url\\nset config.url")


class NoSuperTool(BaseTool):
    def __init__(self, config, tool_schema):
        self.config = config


class BrokenInteraction(BaseInteraction):
    def __init__(self, config):
        raise KeyError("judge_url")
'''

# The schema of verl's gsm8k tool config, as the last key of a `tools:` entry.
ANSWER_SCHEMA = """\
    tool_schema:
      type: function
      function:
        name: calc_gsm8k_reward
        description: A tool for calculating the reward of gsm8k.
        parameters:
          type: object
          properties:
            answer: {type: string, description: The model's answer in digits}
          required: [answer]
"""


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """tmp_path with the user files; `shardrl_test_agent_pkg.echo` importable; the package forgotten afterwards."""
    write(tmp_path / "user_tools.py", USER_TOOLS)
    write(tmp_path / "user_interactions.py", USER_INTERACTIONS)
    write(tmp_path / "bad_classes.py", BAD_CLASSES)
    write(tmp_path / "verl_tool.py", "from verl.tools.base_tool import BaseTool\n\n\nclass VerlTool(BaseTool):\n"
                                     "    pass\n")
    package = tmp_path / "shardrl_test_agent_pkg"
    package.mkdir()
    write(package / "__init__.py", "")
    write(package / "echo.py", DOTTED_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [name for name in sys.modules if name.startswith("shardrl_test_agent_pkg")]:
        del sys.modules[name]


def test_tools_by_file_and_by_module_run_their_lifecycle(user_dir):
    config = write(user_dir / "tool_config.yaml", f"""\
tools:
  - class_name: user_tools.py:AnswerTool
    config: {{type: native, score: 1.0}}
{ANSWER_SCHEMA}
  - class_name: shardrl_test_agent_pkg.echo.EchoTool
    config: {{type: native, prefix: "> "}}
""")
    answer, echo = load_tools(config)
    assert isinstance(answer, BaseTool) and type(answer).__name__ == "AnswerTool"
    assert answer.name == "calc_gsm8k_reward" and answer.config == {"type": "native", "score": 1.0}
    assert echo.name == "echo" and type(echo).__module__ == "shardrl_test_agent_pkg.echo"

    async def lifecycle():
        right, _ = await answer.create(ground_truth="72")
        wrong, _ = await answer.create("fixed-id", ground_truth="72")
        assert wrong == "fixed-id"
        assert await answer.execute(right, {"answer": "72"}) == (
            ToolResponse(text="Current parsed answer='72' reward=1.0"), 1.0, {})
        _, reward, _ = await answer.execute(wrong, {"answer": "71"})
        assert reward == 0.0
        await answer.release(right)
        await answer.release(wrong)
        assert answer._instance_dict == {}
        said, _ = await echo.create()
        assert await echo.execute(said, {"text": "hi"}) == (ToolResponse(text="> hi"), 0.0, {"calls": 1})
        await echo.release(said)

    asyncio.run(lifecycle())


def test_absolute_file_path_and_one_module_per_file(user_dir, tmp_path_factory):
    """An absolute path works from any folder; two entries naming one file share its module (and its classes)."""
    entry = f"""
          - class_name: {user_dir / "user_tools.py"}:AnswerTool
            config: {{type: native, score: 1.0}}
            tool_schema: {{type: function, function: {{name: NAME}}}}"""
    config = write(tmp_path_factory.mktemp("elsewhere") / "tools.yaml",
                   "tools:" + entry.replace("NAME", "first") + entry.replace("NAME", "second"))
    first, second = load_tools(config)
    assert (first.name, second.name) == ("first", "second") and type(first) is type(second)


def test_tool_schemas_are_read_without_importing(user_dir):
    """A schema in the file is read as is (the class is not imported); one the class gives needs the class built."""
    config = write(user_dir / "tools.yaml", f"""\
tools:
  - class_name: only_on_the_rollout_workers.AnswerTool
    config: {{type: native}}
{ANSWER_SCHEMA}
  - class_name: shardrl_test_agent_pkg.echo.EchoTool
    config: {{type: native}}
""")
    answer, echo = tool_schemas_of(config)
    assert answer == {"type": "function", "function": {
        "name": "calc_gsm8k_reward", "description": "A tool for calculating the reward of gsm8k.", "strict": False,
        "parameters": {"type": "object", "required": ["answer"],
                       "properties": {"answer": {"type": "string", "description": "The model's answer in digits"}}}}}
    assert echo["function"]["name"] == "echo" and echo["function"]["parameters"]["required"] == ["text"]
    assert "only_on_the_rollout_workers" not in sys.modules
    with pytest.raises(ToolConfigError, match="no module only_on_the_rollout_workers on sys.path"):
        load_tools(config)


def test_interactions_load_and_run(user_dir):
    config = write(user_dir / "interaction_config.yaml", """
        interaction:
          - name: math
            class_name: user_interactions.py:Gsm8kInteraction
            config: {strict: true}
          - class_name: user_interactions.py:Gsm8kInteraction
          - class_name: user_interactions.py:Judge
            config: {}
    """)
    interactions = load_interactions(config)
    assert list(interactions) == ["math", "gsm8k", "judge"]
    math = interactions["math"]
    assert math.name == "math" and math.config == {"strict": True, "name": "math"}
    assert interactions["gsm8k"].config == {"name": "gsm8k"}

    async def conversation():
        instance = await math.start_interaction("traj-0", name="math", ground_truth="72")
        assert instance == "traj-0"
        wrong = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "#### 71"}]
        assert await math.generate_response(instance, wrong, name="math") == (
            False, "Your response is incorrect! You need to reflect on your answer and try again.", 0.0, {})
        right = wrong + [{"role": "user", "content": "Try again."}, {"role": "assistant", "content": "#### 72"}]
        assert await math.generate_response(instance, right) == (True, "Your response is correct!", 1.0, {})
        await math.finalize_interaction(instance)
        assert math._instance_dict == {}

    asyncio.run(conversation())


def test_base_interaction_defaults():
    """verl's base behaviour: a fresh id when none is given, a placeholder reply that goes on, no score."""
    base = BaseInteraction({})
    assert base.name == "interaction_agent"

    async def run():
        assert await base.start_interaction("given") == "given"
        assert len(await base.start_interaction()) == 36
        assert await base.generate_response("given", []) == (False, "Your current result seems acceptable.", 0.8, {})
        assert await base.calculate_score() == 0.0 and await base.calculate_score("given") == 0.0
        assert await base.finalize_interaction("given") is None

    asyncio.run(run())


NATIVE = "config: {type: native}"
SCHEMA = "tool_schema: {type: function, function: {name: calc}}"

# (tool config text, what the one-line error must name besides the file)
TOOL_ERRORS = [
    ("tools: [", ["not a readable yaml file"]),
    ("- class_name: a.B", ["top-level `tools:` list"]),
    ("interaction: []", ["top-level `tools:` list", "interaction"]),
    ("tools: []\nextra: 1", ["unknown top-level keys", "extra"]),
    ("tools: {class_name: a.B}", ["tools: must be a list"]),
    ("tools: [a.B]", ["tools[0]: must be a mapping"]),
    (f"tools:\n- {NATIVE}", ["tools[0].class_name", "missing"]),
    (f"tools:\n- class_name: a.B\n  {NATIVE}\n  tools_schema: {{}}", ["tools[0]", "unknown keys", "tools_schema"]),
    ("tools:\n- class_name: user_tools.py:AnswerTool", ["tools[0].config", "type: native"]),
    ("tools:\n- class_name: a.B\n  config: {type: mcp}", ["tools[0].config.type", "mcp", "not supported yet"]),
    ("tools:\n- class_name: a.B\n  config: {type: sandbox}", ["tools[0].config.type", "sandbox"]),
    ("tools:\n- class_name: a.B\n  config: {}", ["tools[0].config.type", "None"]),
    (f"tools:\n- class_name: AnswerTool\n  {NATIVE}", ["tools[0] (AnswerTool)", "pkg.module.Class"]),
    (f"tools:\n- class_name: no_such_module.Tool\n  {NATIVE}", ["tools[0]", "no module no_such_module", "PYTHONPATH"]),
    (f"tools:\n- class_name: shardrl_test_agent_pkg.nope.Tool\n  {NATIVE}", ["no module shardrl_test_agent_pkg.nope"]),
    (f"tools:\n- class_name: missing.py:Tool\n  {NATIVE}", ["tools[0]", "missing.py", "config file's folder"]),
    (f"tools:\n- class_name: user_tools.py:NoSuchTool\n  {NATIVE}", ["defines no `NoSuchTool`", "['AnswerTool']"]),
    (f"tools:\n- class_name: bad_classes.py:NOT_A_CLASS\n  {NATIVE}", ["`NOT_A_CLASS`", "not a class but a int"]),
    (f"tools:\n- class_name: bad_classes.py:NotATool\n  {NATIVE}",
     ["NotATool is not a subclass", "shardrl.agents.tools.BaseTool"]),
    (f"tools:\n- class_name: bad_classes.py:SyncTool\n  {NATIVE}", ["SyncTool.execute must be `async def`"]),
    (f"tools:\n- class_name: bad_classes.py:BrokenTool\n  {NATIVE}\n  {SCHEMA}",
     ["tools[0] (bad_classes.py:BrokenTool): constructing it failed: RuntimeError: needs a sandbox url set config."]),
    (f"tools:\n- class_name: bad_classes.py:NoSuperTool\n  {NATIVE}\n  {SCHEMA}", ["no `name`", "super().__init__"]),
    (f"tools:\n- class_name: user_tools.py:AnswerTool\n  {NATIVE}", ["constructing it failed", "no tool_schema"]),
    (f"tools:\n- class_name: verl_tool.py:VerlTool\n  {NATIVE}", ["No module named 'verl'", "shardrl.agents.tools"]),
    (f"tools:\n- class_name: verl.tools.gsm8k_tool.Gsm8kTool\n  {NATIVE}", ["verl's own classes", "copy the class"]),
    ("tools:\n- class_name: user_tools.py:AnswerTool\n  config: {type: native}\n  tool_schema: {type: function}",
     ["tools[0]", "tool_schema must be"]),
    ("tools:\n- class_name: a.B\n  config: {type: native}\n  tool_schema: {type: function, function: {name: ''}}",
     ["tools[0]", "tool_schema.function.name"]),
    (f"tools:\n- class_name: user_tools.py:AnswerTool\n  config: {{type: native, score: 1}}\n  {SCHEMA}\n"
     f"- class_name: shardrl_test_agent_pkg.echo.EchoTool\n  {NATIVE}\n  {SCHEMA}",
     ["tools[1] (shardrl_test_agent_pkg.echo.EchoTool)", "name 'calc' is already taken by tools[0]"]),
]


@pytest.mark.parametrize("text, named", TOOL_ERRORS)
def test_tool_config_errors_are_one_line(user_dir, text, named):
    config = write(user_dir / "tools.yaml", text)
    with pytest.raises(ToolConfigError) as err:
        load_tools(config)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{config}: ")
    for part in named:
        assert part in message


# Errors in the file itself, which the planner sees before any tool code is imported.
FILE_ERRORS = [
    ("tools: [", "not a readable yaml file"),
    ("tools:\n- class_name: a.B\n  config: {type: mcp}", "tools[0].config.type: mcp tools are not supported yet"),
    ("tools:\n- class_name: a.B\n  config: {type: native}\n  tool_schema: {type: function}", "tool_schema must be"),
    (f"tools:\n- class_name: a.B\n  {NATIVE}\n  {SCHEMA}\n- class_name: c.D\n  {NATIVE}\n  {SCHEMA}",
     "tools[1] (c.D): name 'calc' is already taken by tools[0]"),
]


@pytest.mark.parametrize("text, named", FILE_ERRORS)
def test_tool_schemas_of_refuses_file_errors(user_dir, text, named):
    config = write(user_dir / "tools.yaml", text)
    with pytest.raises(ToolConfigError) as err:
        tool_schemas_of(config)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"{config}: ") and named in str(err.value)


def test_missing_tool_config_file(tmp_path):
    with pytest.raises(ToolConfigError, match=r"tools config file not found") as err:
        load_tools(tmp_path / "nope.yaml")
    assert str(tmp_path / "nope.yaml") in str(err.value)


INTERACTION_ERRORS = [
    ("interaction:\n- config: {}", ["interaction[0].class_name"]),
    ("interaction:\n- class_name: user_interactions.py:Gsm8kInteraction\n  name: ''", ["interaction[0].name"]),
    ("interaction:\n- class_name: user_interactions.py:Gsm8kInteraction\n  config: [1]", ["interaction[0].config"]),
    ("interaction:\n- class_name: user_interactions.py:Gsm8kInteraction\n  config: []", ["interaction[0].config"]),
    ("interaction:\n- class_name: user_interactions.py:Gsm8kInteraction\n  kwargs: {}", ["interaction[0]", "kwargs"]),
    ("interaction:\n- class_name: user_interactions.py:Gsm8kInteraction\n"
     "- {class_name: user_interactions.py:Judge, name: gsm8k}",
     ["interaction[1] (user_interactions.py:Judge)", "name 'gsm8k' is already taken by interaction[0]"]),
    ("interaction:\n- class_name: bad_classes.py:SyncTool", ["SyncTool is not a subclass", "BaseInteraction"]),
    ("interaction:\n- class_name: bad_classes.py:BrokenInteraction",
     ["interaction[0] (bad_classes.py:BrokenInteraction): constructing it failed: KeyError: 'judge_url'"]),
]


@pytest.mark.parametrize("text, named", INTERACTION_ERRORS)
def test_interaction_config_errors_are_one_line(user_dir, text, named):
    config = write(user_dir / "interactions.yaml", text)
    with pytest.raises(ToolConfigError) as err:
        load_interactions(config)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{config}: ")
    for part in named:
        assert part in message
