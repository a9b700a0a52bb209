"""Batched scoring: decode each response, score it, and place the score on its last response token.

Batch keys read (verl's names): tensors `responses` `[B, T]` (response token ids) and `response_mask` `[B, T]` (1
on tokens the policy generated); non-tensors `data_source`, `reward_model` (dict with `ground_truth`), `extra_info`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from shardrl.data.batch import Batch
from shardrl.rewards.registry import ScoreFn


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level scores `[B, T]`: zero everywhere except `scores[b]` on row b's last valid response token.

    "Last valid" is the last position whose mask is 1 (not `mask.sum() - 1`), so masks with holes (multi-turn
    responses with tool output masked out) still put the reward on the final generated token. A row without any
    valid token has nowhere to hold its score and is refused rather than dropped silently.
    """
    mask = response_mask.bool()  # [B, T]
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"place_on_last_token: rows {empty} have an all-zero response_mask; their scores would be lost"
        )
    num_tokens = mask.shape[1]
    last = num_tokens - 1 - mask.flip(1).int().argmax(dim=1)  # [B]
    token_scores = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # [B, T]
    token_scores[torch.arange(mask.shape[0], device=mask.device), last] = scores.to(token_scores)
    return token_scores


def score_responses(
    batch: Batch, tokenizer: PreTrainedTokenizerBase, score_fn: ScoreFn
) -> tuple[torch.Tensor, dict[str, list[Any]]]:
    """Sequence scores `[B]` and per-sample extras (other keys of dict results, None where a sample had none)."""
    responses, mask = batch.tensors["responses"], batch.tensors["response_mask"].bool()  # [B, T]
    texts = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(responses, mask)], skip_special_tokens=True)
    scores: list[float] = []
    extras: dict[str, list[Any]] = {}
    for i, text in enumerate(texts):
        result = score_fn(
            batch.non_tensors["data_source"][i],
            text,
            batch.non_tensors["reward_model"][i]["ground_truth"],
            batch.non_tensors["extra_info"][i],
        )
        if isinstance(result, dict):
            if "score" not in result:
                raise ValueError(
                    f"reward function returned a dict without 'score' (keys {sorted(result)}) for sample {i}"
                )
            for key, value in result.items():
                if key != "score":
                    extras.setdefault(key, [None] * len(texts))[i] = value
            result = result["score"]
        scores.append(float(result))
    return torch.tensor(scores, dtype=torch.float32), extras


def compute_token_level_scores(
    batch: Batch, tokenizer: PreTrainedTokenizerBase, score_fn: ScoreFn
) -> tuple[torch.Tensor, dict[str, list[Any]]]:
    """`token_level_scores` `[B, T]` for the batch (see place_on_last_token) and the per-sample extras."""
    scores, extras = score_responses(batch, tokenizer, score_fn)  # [B]
    return place_on_last_token(scores, batch.tensors["response_mask"]), extras
