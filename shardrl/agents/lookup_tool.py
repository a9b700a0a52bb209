"""The built-in multi-turn task's tool: it answers with the value its sample gave it (`tools_kwargs.lookup.
create_kwargs.value`), the only place that value is. A tool with per-trajectory state, as verl's gsm8k tool."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from shardrl.agents.tools import BaseTool, ToolResponse


class LookupTool(BaseTool):
    def __init__(self, config: dict[str, Any], tool_schema: Any) -> None:
        super().__init__(config, tool_schema)
        self._values: dict[str, str] = {}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._values[instance_id] = str(kwargs.get("create_kwargs", {}).get("value", ""))
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        return ToolResponse(text=self._values[instance_id]), 0.0, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._values.pop(instance_id, None)
