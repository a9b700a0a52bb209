"""Prompt batches -> rollout engine -> sample batches in the trainer's padded layout.

The trainer's batch layout is verl's: `prompts [B, P]` left-padded, `responses [B, R]` right-padded,
`input_ids = cat(prompts, responses)`, `attention_mask`, `position_ids` (continuing after the prompt),
`response_mask [B, R]`, the prompt rows' `sample_seed`, plus the off-policy contract's fields: `rollout_log_probs
[B, R]` (the behaviour logprob of every sampled token) and `policy_versions [B, R]` (the policy version that
produced it; -1 on padding). An engine that records MoE routing adds `routed_experts [B, P + R, L, k]`: per
position of `input_ids` the experts each MoE layer ran it through, `routing.unknown_expert` where no step ran it
(padding, a sequence's last token, environment tokens after the last model turn), for R3 to replay.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardrl.agents.driver import AgentRunner
from shardrl.agents.loop import AgentSample
from shardrl.agents.trajectory import Trajectory
from shardrl.data.batch import Batch, as_object_array
from shardrl.data.chat import left_pad
from shardrl.workers.engine import ROUTED_EXPERTS
from shardrl.parallel.routing import unknown_expert
from shardrl.rollout.engine import Engine
from shardrl.rollout.request import RequestOutput, SamplingParams


def prompt_ids_of(prompts: Batch) -> list[list[int]]:
    """The unpadded prompt token ids of each row (left padding removed)."""
    ids, mask = prompts.tensors["input_ids"], prompts.tensors["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(ids, mask)]


def samples_batch(prompts: Batch, outputs: list[RequestOutput], response_length: int, pad_token_id: int) -> Batch:
    """Pack engine outputs (one per prompt row: the controller repeats prompts `n` times before generation) into the
    padded sample batch."""
    rows = [(out.token_ids, [1] * len(out.token_ids), out.logprobs, out.policy_versions) for out in outputs]
    samples = _padded_batch(prompts, rows, [out.finish_reason for out in outputs], response_length, pad_token_id)
    if outputs and outputs[0].routed_experts is not None:
        samples.tensors[ROUTED_EXPERTS] = routing_columns(samples, [out.routed_experts for out in outputs],
                                                          [len(out.prompt_ids) for out in outputs])
    return samples


def routing_columns(samples: Batch, routed: list[Tensor], prompt_lengths: list[int]) -> Tensor:
    """Each row's routing [N_i, L, k] (from its sequence's first position; on any device) in the batch's columns:
    a row's sequence starts where its left-padded prompt does and runs on into the response, so its routing is
    one slice of `[B, P + R, L, k]`; the rest is `unknown_expert`. One copy to the host for the whole batch."""
    width = samples.tensors["input_ids"].shape[1]
    prompt_width = samples.tensors["prompts"].shape[1]
    lengths = [min(r.shape[0], width - prompt_width + n) for r, n in zip(routed, prompt_lengths)]
    host = torch.cat([r[:n] for r, n in zip(routed, lengths)]).cpu().split(lengths)
    dtype = routed[0].dtype
    out = torch.full((len(routed), width, *routed[0].shape[1:]), unknown_expert(dtype), dtype=dtype)
    for i, (rows, n) in enumerate(zip(host, prompt_lengths)):
        start = prompt_width - n
        out[i, start:start + rows.shape[0]] = rows
    return out


ResponseRow = tuple[list[int], list[int], list[float], list[int]]  # ids, response mask, logprobs, policy versions


def _padded_batch(prompts: Batch, rows: list[ResponseRow], finish_reasons: list[str | None], response_length: int,
                  pad_token_id: int) -> Batch:
    """The sample batch of one response per prompt row: each row's tokens right-padded to `response_length`, the
    attention mask 1 on all of them (the response mask only where the row's says)."""
    num = len(rows)
    responses = torch.full((num, response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(num, response_length)
    attention = torch.zeros(num, response_length, dtype=torch.long)
    log_probs = torch.zeros(num, response_length)
    versions = torch.full((num, response_length), -1, dtype=torch.long)
    for i, (ids, mask, logprobs, row_versions) in enumerate(rows):
        length = len(ids)
        responses[i, :length] = torch.tensor(ids, dtype=torch.long)
        response_mask[i, :length] = torch.tensor(mask, dtype=torch.float32)
        attention[i, :length] = 1
        log_probs[i, :length] = torch.tensor(logprobs)
        versions[i, :length] = torch.tensor(row_versions, dtype=torch.long)
    p = prompts.tensors
    last_position = p["position_ids"][:, -1:]  # [num, 1]
    response_positions = last_position + torch.arange(1, response_length + 1)  # [num, R]
    tensors = {
        "prompts": p["input_ids"],
        "responses": responses,
        "input_ids": torch.cat([p["input_ids"], responses], dim=1),
        "attention_mask": torch.cat([p["attention_mask"], attention], dim=1),
        "position_ids": torch.cat([p["position_ids"], response_positions], dim=1),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
        "policy_versions": versions,
    }
    if "sample_seed" in p.keys():  # what generated the row: scorers seed from it, streams order by it
        tensors["sample_seed"] = p["sample_seed"]
    non_tensors = dict(prompts.non_tensors)
    non_tensors["finish_reason"] = as_object_array(finish_reasons)
    return Batch(tensors, non_tensors, dict(prompts.meta))


def generate(engine: Engine, prompts: Batch, params: list[SamplingParams], response_length: int,
             pad_token_id: int) -> Batch:
    """Sample one response per prompt row of `prompts` (this replica's share) with that row's `params`."""
    outputs = engine.generate(prompt_ids_of(prompts), params)
    return samples_batch(prompts, outputs, response_length, pad_token_id)


def agent_samples(prompts: Batch, params: list[SamplingParams]) -> list[tuple[int, AgentSample, str | None]]:
    """One agent-loop sample per row (keyed by row index): its chat messages, prompt ids, `extra_info` (tools and
    interaction kwargs) and the data's `agent_name` column where there is one (None: the default loop)."""
    nt = prompts.non_tensors
    names = nt.get("agent_name")
    return [(row, AgentSample(list(nt["raw_prompt"][row]), ids, dict(nt["extra_info"][row] or {}), params[row]),
             None if names is None else names[row])
            for row, ids in enumerate(prompt_ids_of(prompts))]


def trajectories_batch(prompts: Batch, trajectories: list[Trajectory], response_length: int,
                       pad_token_id: int) -> Batch:
    """Pack finished trajectories (one per prompt row) into the padded sample batch: the response is every token
    after the prompt, model and environment ones as they were produced; `response_mask` is 1 on model tokens only
    (the losses, KL, entropy, advantages and correction ratios read it) and `attention_mask` on all of them (the
    model sees the environment's tokens as context). `response_sources` says who wrote each token
    (`agents.trajectory.Source`, -1 on padding); per-trajectory counts go in `agent_*` columns, and the reward
    function finds `num_turns`, `turn_scores` and `tool_rewards` in `extra_info`."""
    rows = [(t.response_ids, t.response_mask, t.logprobs, t.policy_versions) for t in trajectories]
    prompts = _with_trajectory_prompts(prompts, trajectories, pad_token_id)
    samples = _padded_batch(prompts, rows, [t.finish_reason for t in trajectories], response_length, pad_token_id)
    sources = torch.full((len(trajectories), response_length), -1, dtype=torch.long)
    for i, traj in enumerate(trajectories):
        sources[i, :len(traj.sources)] = torch.tensor([int(src) for src in traj.sources], dtype=torch.long)
    counts = {"agent_turns": [t.assistant_turns + t.user_turns for t in trajectories],
              "agent_assistant_turns": [t.assistant_turns for t in trajectories],
              "agent_tool_calls": [t.tool_calls for t in trajectories],
              "agent_tool_errors": [t.tool_errors for t in trajectories],
              "agent_tool_timeouts": [t.tool_timeouts for t in trajectories],
              "agent_tool_seconds": [t.tool_seconds for t in trajectories],
              "agent_tool_wait_seconds": [t.tool_wait_seconds for t in trajectories],
              "agent_loop_errors": [float(t.error is not None) for t in trajectories],
              "agent_external": [float(t.external) for t in trajectories],
              "agent_requests": [t.requests for t in trajectories],
              "agent_divergent_requests": [t.divergent_requests for t in trajectories],
              "agent_request_seconds": [t.request_seconds for t in trajectories]}
    for key, values in counts.items():
        samples.tensors[key] = torch.tensor(values, dtype=torch.float32)
    samples.tensors["response_sources"] = sources
    routed = [t.recorded_routing() for t in trajectories]
    recorded = next((r for r in routed if r is not None), None)
    if recorded is not None:  # a trajectory that ended before its first model turn has none: all unknown
        routed = [recorded[:0] if r is None else r for r in routed]
        samples.tensors[ROUTED_EXPERTS] = routing_columns(samples, routed, [len(t.prompt_ids) for t in trajectories])
    samples.non_tensors["extra_info"] = as_object_array([
        {**(info or {}), "num_turns": t.assistant_turns + t.user_turns, "turn_scores": list(t.turn_scores),
         "tool_rewards": list(t.tool_rewards), "agent_reward": t.agent_reward}
        for info, t in zip(prompts.non_tensors["extra_info"], trajectories)])
    return samples


def _with_trajectory_prompts(prompts: Batch, trajectories: list[Trajectory], pad_token_id: int) -> Batch:
    """`prompts` with each row whose trajectory began from another prompt (an external agent renders its own
    first request) holding that one instead, left-padded to the same width (a longer one spilled into the
    response when it was recorded, `agents.sessions`)."""
    changed = [i for i, (ids, t) in enumerate(zip(prompt_ids_of(prompts), trajectories)) if ids != t.prompt_ids]
    if not changed:
        return prompts
    tensors = {key: prompts.tensors[key].clone() for key in ("input_ids", "attention_mask", "position_ids")}
    width = tensors["input_ids"].shape[1]
    for i in changed:
        row = left_pad(trajectories[i].prompt_ids, width, pad_token_id)
        for key, value in zip(("input_ids", "attention_mask", "position_ids"), row):
            tensors[key][i] = value
    return Batch({**prompts.tensors, **tensors}, dict(prompts.non_tensors), dict(prompts.meta))


def generate_trajectories(runner: AgentRunner, prompts: Batch, params: list[SamplingParams], response_length: int,
                          pad_token_id: int) -> Batch:
    """Run one agent trajectory per prompt row of `prompts` to its end (trajectories streamed meanwhile go on)."""
    tag = object()  # keys this call's trajectories apart from any other call's
    samples = [((tag, row), sample, name) for row, sample, name in agent_samples(prompts, params)]
    runner.start(samples)
    done = runner.drive(None, {key for key, _, _ in samples})
    return trajectories_batch(prompts, [done[(tag, row)] for row in range(len(prompts))], response_length,
                              pad_token_id)
