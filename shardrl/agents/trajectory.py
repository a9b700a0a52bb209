"""A multi-turn trajectory as the trainer receives it: the prompt ids, then every response token in order with
where it came from. Model tokens are the engine's sampled ids with their behaviour logprobs and policy versions;
environment tokens (tool results, user turns, the template's delimiters) are ids the environment's text was
tokenised to on its own. Nothing here is ever decoded and encoded again: the trained sequence is exactly
`prompt_ids + response_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from torch import Tensor

from shardrl.rollout.engine import common_prefix


class Source(IntEnum):
    """Who wrote a response token: only MODEL tokens are trained on (`response_mask`)."""

    MODEL = 0
    TOOL = 1
    USER = 2
    REWRITTEN = 3  # history an external agent changed after the model wrote it (`agents.sessions`)


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0.0 at environment tokens
    policy_versions: list[int] = field(default_factory=list)  # -1 at environment tokens
    assistant_turns: int = 0
    user_turns: int = 0  # environment turns: tool results and simulated users
    tool_calls: int = 0
    tool_errors: int = 0  # malformed calls, unknown tools, exceptions (timeouts counted apart)
    tool_timeouts: int = 0
    tool_seconds: float = 0.0  # summed over calls
    tool_wait_seconds: float = 0.0  # wall time the trajectory waited on its tools (parallel calls overlap)
    tool_rewards: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    finish_reason: str = "stop"  # the last model turn's ("stop", "length") or why the loop ended it
    error: str | None = None  # the agent loop raised: the trajectory keeps what it had, marked
    # External agents (`agents.endpoint`): HTTP requests served, requests whose history the client had changed
    # (the changed part is in the trajectory as REWRITTEN tokens), their summed latency, and the reward the agent
    # function returned (None: the reward function scores the trajectory).
    external: bool = False  # an endpoint episode
    requests: int = 0
    divergent_requests: int = 0
    request_seconds: float = 0.0
    agent_reward: float | None = None
    # MoE routing of the latest model turn's whole sequence (engine's `routed_experts`, when it records routing) and
    # the ids it covers: a later turn continues the same sequence, so the latest covers every earlier position.
    routing: Tensor | None = None
    routing_ids: list[int] = field(default_factory=list)

    @property
    def response_mask(self) -> list[int]:
        return [int(s == Source.MODEL) for s in self.sources]

    def add_model(self, ids: list[int], logprobs: list[float], versions: list[int],
                  routing: Tensor | None = None) -> None:
        """A model turn's tokens; `routing` covers the sequence before them and them (the turn's request)."""
        if routing is not None:
            self.routing, self.routing_ids = routing, self.prompt_ids + self.response_ids + ids
        self.response_ids += ids
        self.sources += [Source.MODEL] * len(ids)
        self.logprobs += logprobs
        self.policy_versions += versions

    def truncate(self, num_response_tokens: int) -> None:
        """Drop the response tokens after the first `num_response_tokens` (a client went back in its history)."""
        for column in (self.response_ids, self.sources, self.logprobs, self.policy_versions):
            del column[num_response_tokens:]

    def recorded_routing(self) -> Tensor | None:
        """The routing of the sequence's leading positions that the latest recorded turn ran (an external agent
        may have rewritten history since: only the prefix both share counts); None when nothing was recorded."""
        if self.routing is None:
            return None
        return self.routing[:common_prefix(self.routing_ids, self.prompt_ids + self.response_ids)]

    def add_environment(self, ids: list[int], source: Source) -> None:
        self.response_ids += ids
        self.sources += [source] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.policy_versions += [-1] * len(ids)
