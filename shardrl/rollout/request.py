"""What callers hand the rollout engine (`SamplingParams`) and what they get back (`RequestOutput`), plus the
engine-internal state of one request (`Request`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

FinishReason = Literal["stop", "length"]


class SamplingParamsError(ValueError):
    """Invalid sampling settings; the message names the field and value."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (verl's rollout key names where they exist).

    `temperature=0` is greedy. `top_k` <= 0 and `top_p=1` switch those filters off. With a `seed` the uniform
    that draws each token is a hash of (seed, the token's index in the sequence), so the samples depend on nothing
    but the seed, the weights and the tokens so far: not on the rest of the batch, an abort and resume, or the
    replica (see `sampler.py`); with `n > 1` sample i uses `seed + i`. `raw_logprobs` also returns each sampled
    token's logprob under the unfiltered temperature-1 policy (what the trainer recomputes).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    raw_logprobs: bool = False

    def __post_init__(self) -> None:
        checks = {
            "max_tokens": self.max_tokens >= 1,
            "temperature": self.temperature >= 0.0,
            "top_p": 0.0 < self.top_p <= 1.0,
            "n": self.n >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise SamplingParamsError(f"SamplingParams.{name}={getattr(self, name)!r} is out of range "
                                          f"(max_tokens >= 1, temperature >= 0, 0 < top_p <= 1, n >= 1)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


@dataclass
class RequestOutput:
    """A finished request, or a snapshot of an aborted one (`finished=False`).

    `logprobs[i]` is the logprob of `token_ids[i]` under the distribution it was sampled from; `raw_logprobs[i]`
    (when asked for) under the unfiltered temperature-1 policy; `policy_versions[i]` is the engine's
    `policy_version` when token i was sampled (tokens of a request resumed after a weight update carry the new one).
    `routed_experts` [len(prompt_ids) + len(token_ids), MoE layers, k] (on the engine's device, the smallest integer
    type of the expert ids): the experts each position ran through, with the last token, which no step ran, marked
    `routing.unknown_expert`; only on finished outputs of an engine that records routing.
    """

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    raw_logprobs: list[float] | None
    policy_versions: list[int]
    finish_reason: FinishReason | None
    finished: bool
    routed_experts: Tensor | None = None


@dataclass
class Request:
    """Engine-side state of one sequence. `slot` is its KV-cache row while it runs (None while waiting)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    max_len: int  # prompt + generated tokens may not exceed this (the engine's max_model_len)
    seed: int | None = None  # its draws' seed (`SamplingParams.seed`, plus i for the i-th of n samples)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    slot: int | None = None
    # Leading positions whose keys and values are already in `slot` (a continuation of a parked sequence, see
    # `Engine.submit`): its prefill runs only the tokens after them. 0 for a sequence prefilled whole.
    cached: int = 0
    spare: int | None = None  # the spare cache row holding those positions while it has no slot (`Scheduler`)
    keep_cache: bool = False  # finished, it keeps its slot (parked) for a continuation
    # A continuation fed through decode steps instead of a prefill (`Scheduler`): the position of the prompt token
    # its next decode row feeds; None once the prompt is in (or for a request that was prefilled).
    feed: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    def next_input(self) -> tuple[int, int]:
        """(token, position) its next decode row feeds: a fed continuation's next prompt token, else its last."""
        if self.feed is not None:
            return self.prompt_ids[self.feed], self.feed
        return self.token_ids[-1], self.num_tokens - 1

    @property
    def prefill_len(self) -> int:
        """Tokens its next prefill runs through the model."""
        return self.num_tokens - self.cached

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def append(self, token: int, logprob: float, raw_logprob: float | None, version: int) -> None:
        """Record one sampled token and decide whether the request is done."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if raw_logprob is not None:
            self.raw_logprobs.append(raw_logprob)
        self.policy_versions.append(version)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.reaches_length(0):
            self.finish_reason = "length"

    def reaches_length(self, num_new: int) -> bool:
        """Whether `num_new` more tokens would bring the request to `max_tokens` or to `max_len`."""
        return len(self.token_ids) + num_new >= self.params.max_tokens or self.num_tokens + num_new >= self.max_len

    def output(self, routed_experts: Tensor | None = None) -> RequestOutput:
        return RequestOutput(
            self.request_id, list(self.prompt_ids), list(self.token_ids), list(self.logprobs),
            list(self.raw_logprobs) if self.params.raw_logprobs else None, list(self.policy_versions),
            self.finish_reason, self.finish_reason is not None, routed_experts)
