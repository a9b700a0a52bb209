"""The tool contract, verl's: a tool class built from a tool-config entry (`config` dict, `tool_schema` in OpenAI
function format) that serves many trajectories at once through per-trajectory instances.

Lifecycle per trajectory and call (what `ToolAgentLoop` does, as verl's tool agent loop): `create` an instance (with
the sample's `extra_info.tools_kwargs[<tool name>].create_kwargs`), `execute` it on the call's parsed arguments ->
(response, step reward, metrics), `release` it. `calc_reward` is the tool's own view of the instance's reward, for
tools that call it from `execute`. Every method is a coroutine: a slow tool awaits (a subprocess, a socket, a sleep)
while the engine keeps decoding the other trajectories; a tool that blocks the thread instead stalls them all.

A verl tool class runs here after its imports change from `verl.tools.base_tool` / `verl.tools.schemas` to
`shardrl.agents.tools`: the schema classes keep pydantic's `model_validate` / `model_dump` names and the attributes
tools read (`tool_schema.function.name`, ...), without pydantic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any
from uuid import uuid4

from shardrl.errors import UserError


class ToolSchemaError(UserError, ValueError):
    """A tool schema that is not an OpenAI function schema; the message names the field."""


@dataclass
class OpenAIFunctionPropertySchema:
    type: str
    description: str | None = None
    enum: list[str] | None = None


@dataclass
class OpenAIFunctionParametersSchema:
    type: str = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = field(default_factory=dict)
    required: list[str] = field(default_factory=list)


@dataclass
class OpenAIFunctionSchema:
    name: str
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool = False


@dataclass
class OpenAIFunctionToolSchema:
    """`{"type": "function", "function": {"name", "description", "parameters": {...}}}`, what the chat template
    renders into the prompt (`apply_chat_template(tools=[schema.model_dump()])`)."""

    type: str
    function: OpenAIFunctionSchema

    @classmethod
    def model_validate(cls, data: dict[str, Any]) -> OpenAIFunctionToolSchema:
        """Build from a plain dict (a tool config's `tool_schema`), naming the first field that is wrong."""
        if not isinstance(data, dict) or data.get("type") != "function" or not isinstance(data.get("function"), dict):
            raise ToolSchemaError(f"tool_schema must be {{type: function, function: {{name, ...}}}}, got {data!r}")
        function = data["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolSchemaError(f"tool_schema.function.name must be a non-empty string, got {function.get('name')!r}")
        params = function.get("parameters") or {}
        if not isinstance(params, dict) or not isinstance(params.get("properties", {}), dict):
            raise ToolSchemaError(f"tool_schema.function.parameters of {function['name']!r} must be a JSON-schema "
                                  f"object with `properties`, got {params!r}")
        properties = {}
        for name, prop in params.get("properties", {}).items():
            if not isinstance(prop, dict) or not isinstance(prop.get("type"), str):
                raise ToolSchemaError(f"tool_schema.function.parameters.properties.{name} of {function['name']!r} "
                                      f"needs a `type`, got {prop!r}")
            properties[name] = OpenAIFunctionPropertySchema(prop["type"], prop.get("description"), prop.get("enum"))
        parameters = OpenAIFunctionParametersSchema(params.get("type", "object"), properties,
                                                    list(params.get("required", [])))
        return cls(data["type"], OpenAIFunctionSchema(function["name"], function.get("description", ""), parameters,
                                                      bool(function.get("strict", False))))

    def model_dump(self, exclude_unset: bool = False, exclude_none: bool = True) -> dict[str, Any]:
        """The schema as a plain dict (None fields left out, as pydantic's `exclude_none`)."""
        del exclude_unset  # every field here was set or defaulted: nothing to tell apart
        return _without_none(asdict(self)) if exclude_none else asdict(self)


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


@dataclass
class ToolResponse:
    """What a tool call returns to the model: text (images and video are refused by the text-only agent loop)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video


class BaseTool:
    """A tool; subclasses override `execute` (and `create` / `release` when instances hold state)."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None) -> None:
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ToolSchemaError(f"{type(self).__name__}: no tool_schema in its tool config and none from "
                                  f"get_openai_tool_schema(); give one")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """A new instance for one trajectory's call (`create_kwargs` among `kwargs`)."""
        return (str(uuid4()) if instance_id is None else instance_id), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse | str, float, dict[str, Any]]:
        """Run the call -> (response, step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance."""

