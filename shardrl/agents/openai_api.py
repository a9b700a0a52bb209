"""OpenAI's API shapes for the endpoint (`agents.endpoint`): the request fields it reads, each checked with a 400
naming it, and the `chat.completion` / `text_completion` objects and stream chunks it answers with."""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from shardrl.agents.loop import Episode
from shardrl.agents.sessions import Reply, RequestError
from shardrl.rollout.request import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the episode's budget
# Request fields the endpoint accepts only at the value that asks for nothing (a different value is refused).
NEUTRAL = {"frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None), "logit_bias": (None, {}),
           "top_logprobs": (None, 0), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
           "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, True), "n": (None, 1)}


def refuse_unserved(body: dict[str, Any]) -> None:
    """A 400 for any field asking for what the endpoint cannot do (never ignored)."""
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise RequestError(f"{name}={body[name]!r} is not served by the training endpoint; leave it out",
                               param=name)


def read_number(body: dict[str, Any], name: str, low: float, high: float, integer: bool = False) -> float | None:
    """The field `name` (None when absent), refused unless a number (an integer if `integer`) in [low, high]."""
    value = body.get(name)
    if value is None:
        return None
    kind_ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not kind_ok or not (low <= value <= high) or not math.isfinite(value):
        kind = "an integer" if integer else "a number"
        raise RequestError(f"{name}={value!r}: must be {kind} in [{low:g}, {high:g}]", param=name)
    return value


def sampling_of(body: dict[str, Any], episode: Episode, default_max_tokens: int | None) -> SamplingParams:
    """The request's sampling settings over the run's (`rollout.temperature`, `top_p`, `top_k` where the request
    sets none). What the request sets is what is sampled from, and the behaviour log-probs are those of it: an
    agent that sets its own temperature is off-policy to the trainer's recomputation, which rollout correction
    (`algorithm.rollout_correction`) accounts for."""
    base = episode.sample.params
    temperature = read_number(body, "temperature", 0.0, 2.0)
    top_p = read_number(body, "top_p", 1e-9, 1.0)
    seed = read_number(body, "seed", -(2 ** 63), 2 ** 63 - 1, integer=True)
    limits = [read_number(body, key, 1, 2 ** 31, integer=True) for key in ("max_tokens", "max_completion_tokens")]
    chosen = [v for v in limits if v is not None]
    max_tokens = int(min(chosen)) if chosen else default_max_tokens or episode.remaining
    return replace(base, temperature=base.temperature if temperature is None else float(temperature),
                   top_p=base.top_p if top_p is None else float(top_p), seed=base.seed if seed is None else int(seed),
                   max_tokens=max(1, min(max_tokens, episode.remaining)), n=1)


def stops_of(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of up to 4 of them", param="stop")
    return stops


def tools_of(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {type: function, function: {name, parameters}}", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}",
                               param="tools")
    return tools


def prompt_of(prompt: Any) -> str | list[int]:
    """A completion's prompt: a string or token ids, or a list holding one of them (one prompt per request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return prompt
    raise RequestError("prompt must be a non-empty string or list of token ids (one prompt per request)",
                       param="prompt")


def usage_of(reply: Reply) -> dict[str, int]:
    completion = len(reply.token_ids)
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": completion,
            "total_tokens": reply.prompt_tokens + completion}


def chat_completion(reply: Reply, model: str, session_id: str, number: int, logprobs: bool,
                    tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The `chat.completion` object of a served turn (`number`: the session's request count, for unique ids)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.calls:
        message["tool_calls"] = [
            {"id": f"call_{session_id}_{number}_{i}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            for i, call in enumerate(reply.calls)]
    else:
        message["content"] = reply.content
    content_logprobs = None
    if logprobs:
        content_logprobs = {"content": [
            {"token": (piece := tokenizer.decode([t])), "logprob": lp, "bytes": list(piece.encode()),
             "top_logprobs": []} for t, lp in zip(reply.token_ids, reply.logprobs)]}
    return {"id": f"chatcmpl-{session_id}-{number}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "logprobs": content_logprobs,
                                         "finish_reason": reply.finish_reason}],
            "usage": usage_of(reply)}


async def chat_chunks(completion: dict[str, Any], usage: bool) -> AsyncIterator[dict[str, Any]]:
    """The completion as stream chunks: the whole turn (it is sampled before it is served), then its end."""
    choice = completion["choices"][0]
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    delta = dict(choice["message"])
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    yield head | {"choices": [{"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}]}
    yield head | {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]}
    if usage:
        yield head | {"choices": [], "usage": completion["usage"]}


def text_completion(reply: Reply, model: str, completion_id: str, logprobs: bool,
                    tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The `text_completion` object of a served turn (with `logprobs`: its tokens, their log-probs and offsets)."""
    token_logprobs = None
    if logprobs:
        tokens = [tokenizer.decode([t]) for t in reply.token_ids]
        offsets = list(itertools.accumulate([0, *map(len, tokens[:-1])]))
        token_logprobs = {"tokens": tokens, "token_logprobs": reply.logprobs, "top_logprobs": None,
                          "text_offset": offsets}
    return {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": reply.text, "logprobs": token_logprobs,
                         "finish_reason": "length" if reply.finish_reason == "length" else "stop"}],
            "usage": usage_of(reply)}
