"""Prompt batches -> rollout engine -> sample batches in the trainer's padded layout.

The trainer's batch layout is verl's: `prompts [B, P]` left-padded, `responses [B, R]` right-padded,
`input_ids = cat(prompts, responses)`, `attention_mask`, `position_ids` (continuing after the prompt),
`response_mask [B, R]`, plus the off-policy contract's fields: `rollout_log_probs [B, R]` (the behaviour logprob
of every sampled token) and `policy_versions [B, R]` (the policy version that produced it; -1 on padding).
"""

from __future__ import annotations

import torch

from shardrl.data.batch import Batch, as_object_array
from shardrl.rollout.engine import Engine
from shardrl.rollout.request import RequestOutput, SamplingParams


def prompt_ids_of(prompts: Batch) -> list[list[int]]:
    """The unpadded prompt token ids of each row (left padding removed)."""
    ids, mask = prompts.tensors["input_ids"], prompts.tensors["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(ids, mask)]


def samples_batch(prompts: Batch, outputs: list[RequestOutput], response_length: int, pad_token_id: int) -> Batch:
    """Pack engine outputs (one per prompt row: the controller repeats prompts `n` times before generation) into the
    padded sample batch."""
    num = len(outputs)
    responses = torch.full((num, response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(num, response_length)
    log_probs = torch.zeros(num, response_length)
    versions = torch.full((num, response_length), -1, dtype=torch.long)
    for i, out in enumerate(outputs):
        length = len(out.token_ids)
        responses[i, :length] = torch.tensor(out.token_ids, dtype=torch.long)
        response_mask[i, :length] = 1.0
        log_probs[i, :length] = torch.tensor(out.logprobs)
        versions[i, :length] = torch.tensor(out.policy_versions, dtype=torch.long)
    p = prompts.tensors
    last_position = p["position_ids"][:, -1:]  # [num, 1]
    response_positions = last_position + torch.arange(1, response_length + 1)  # [num, R]
    tensors = {
        "prompts": p["input_ids"],
        "responses": responses,
        "input_ids": torch.cat([p["input_ids"], responses], dim=1),
        "attention_mask": torch.cat([p["attention_mask"], response_mask.long()], dim=1),
        "position_ids": torch.cat([p["position_ids"], response_positions], dim=1),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
        "policy_versions": versions,
    }
    non_tensors = dict(prompts.non_tensors)
    non_tensors["finish_reason"] = as_object_array([out.finish_reason for out in outputs])
    return Batch(tensors, non_tensors, dict(prompts.meta))


def generate(engine: Engine, prompts: Batch, params: list[SamplingParams], response_length: int,
             pad_token_id: int) -> Batch:
    """Sample one response per prompt row of `prompts` (this replica's share) with that row's `params`."""
    outputs = engine.generate(prompt_ids_of(prompts), params)
    return samples_batch(prompts, outputs, response_length, pad_token_id)
