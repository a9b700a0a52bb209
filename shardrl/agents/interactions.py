"""The interaction contract, verl's: a simulated user that answers the model between its turns, built from an
interaction-config entry (`config` dict, with the entry's `name` injected under "name").

Lifecycle per trajectory (what the tool agent loop does, as verl's): `start_interaction` with the sample's
`extra_info.interaction_kwargs` (its `name` picks the interaction; the rest, e.g. `ground_truth`, are the
instance's), then after each assistant turn `generate_response` on the conversation so far -> (should_terminate,
the user's reply, the turn's score, extras), and `finalize_interaction` when the trajectory ends. One object serves
every trajectory of the run at once, so per-trajectory state lives in a dict keyed by `instance_id`; every method
is a coroutine so that a slow interaction (a judge model, a sandbox) awaits while the engine decodes the others.

A verl interaction class runs here after its import changes from `verl.interactions.base` to
`shardrl.agents.interactions`.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4


class BaseInteraction:
    """An interaction; subclasses override `generate_response` (and the other methods when instances hold state)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """A new instance for one trajectory (`interaction_kwargs` among `kwargs`) -> its id."""
        return str(uuid4()) if instance_id is None else instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        """The user's reply to the conversation so far -> (should_terminate, reply text, turn score, extras).

        The base gives verl's base reply (go on, a fixed text, score 0.8) so that a config naming the base class
        itself, as verl's smoke tests do, runs as it does in verl; a real interaction overrides this.
        """
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        """The instance's score so far; subclasses call it from `generate_response` (verl's convention)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        """Forget the instance."""
