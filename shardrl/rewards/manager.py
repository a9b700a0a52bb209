"""Batched scoring: decode each response, score it, shape it (DAPO's overlong penalty, when asked), and place the
score on its last response token.

Batch keys read (verl's names): tensors `responses` `[B, T]` (response token ids), `attention_mask` (its last T
columns: the response's tokens, model and environment ones, which the scorer decodes) and `response_mask` `[B, T]`
(1 on tokens the policy generated, which place the score); non-tensors `data_source`, `reward_model` (dict with `ground_truth`), `extra_info`.
The column that names each sample's source, and so its reward function, is `data_source` unless `data_source_key`
(verl's `data.reward_fn_key`) names another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from shardrl.data.batch import Batch
from shardrl.rewards.outcomes import RewardFunctionError
from shardrl.rewards.registry import ScoreFn


@dataclass(frozen=True)
class OverlongShaping:
    """DAPO's overlong reward shaping (see overlong_penalty); `log` adds the penalty to the per-sample extras."""

    max_length: int  # tokens: the longest response the rollout generates
    buffer_length: int  # tokens
    penalty_factor: float
    log: bool


@dataclass(frozen=True)
class RewardModelScoring:
    """How a reward model's scores (`rm_scores`) become rewards: times `weight`, the reward (`replace`, verl's: the
    reward function is not called) or added to the reward function's (`add`)."""

    combine: Literal["replace", "add"] = "replace"
    weight: float = 1.0


@dataclass(frozen=True)
class JudgeScoring:
    """How a generative judge's scores (`judge_scores` [B], NaN where its verdict had no score) become rewards
    (`reward_model.judge`): the reward (`replace`: the reward function is not called) or added to the reward
    function's (`add`), times `weight`; a verdict with no score fails the run or scores `parse_failure_score`."""

    model_path: str  # names the judge in errors
    combine: Literal["replace", "add"]
    weight: float
    on_parse_failure: Literal["score", "fail"]
    parse_failure_score: float


@dataclass(frozen=True)
class SampleScores:
    """A batch's rewards: the token-level scores trained on and what the reward function said per sample."""

    token_level: torch.Tensor  # [B, T] each (shaped) score on its response's last token
    scores: torch.Tensor  # [B] the reward function's scores, before shaping
    # Other entries of its dict results (None where a sample had none); with shaping logged, verl's DAPO names
    # `overlong_reward` (the penalty) and `overlong` (whether it applied).
    extras: dict[str, list[Any]]


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor,
                        failed: torch.Tensor | None = None) -> torch.Tensor:
    """Token-level scores `[B, T]`: zero everywhere except `scores[b]` on row b's last valid response token.

    "Last valid" is the last position whose mask is 1 (not `mask.sum() - 1`), so masks with holes (multi-turn
    responses with tool output masked out) still put the reward on the final generated token. A row without any
    valid token has nowhere to hold its score and is refused rather than dropped silently, unless it is a `failed`
    `[B]` row (an agent episode that failed before the model wrote a token): that row scores 0, trains nothing,
    and still counts in its group.
    """
    mask = response_mask.bool()  # [B, T]
    empty_rows = ~mask.any(dim=1)  # [B]
    if failed is not None:
        empty_rows &= ~failed.bool()
    empty = empty_rows.nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"place_on_last_token: rows {empty} have an all-zero response_mask; their scores would be lost"
        )
    num_tokens = mask.shape[1]
    last = num_tokens - 1 - mask.flip(1).int().argmax(dim=1)  # [B]
    token_scores = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # [B, T]
    token_scores[torch.arange(mask.shape[0], device=mask.device), last] = scores.to(token_scores) * mask.any(dim=1)
    return token_scores


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to each response's score `[B]`.

    Responses of up to `max_length - buffer_length` tokens get 0; past that, the penalty grows linearly with the
    tokens spent in the buffer, reaching `-penalty_factor` at `max_length` (the longest the rollout generates). It
    tells the policy that running into truncation is bad without punishing a correct long answer as hard as a
    truncated one would be by a reward of 0.
    """
    into_buffer = (lengths - (max_length - buffer_length)).clamp_min(0)  # [B] tokens past the free length
    return -penalty_factor * into_buffer.float() / buffer_length


def score_responses(
    batch: Batch, tokenizer: PreTrainedTokenizerBase, score_fn: ScoreFn, *, data_source_key: str = "data_source"
) -> tuple[torch.Tensor, dict[str, list[Any]]]:
    """Sequence scores `[B]` and per-sample extras (other keys of dict results, None where a sample had none).
    `score_fn` gets each sample's `data_source_key` column as its data source; one with a `score_batch` method
    (`GuardedScoreFn`) gets them all at once, and its failed samples (with `on_error="zero"`) are the extra
    `reward_failed`."""
    if data_source_key not in batch.non_tensors:
        raise ValueError(f"data.reward_fn_key={data_source_key!r}: the batch has no such column; it has "
                         f"{sorted(batch.non_tensors)}")
    sources = batch.non_tensors[data_source_key]
    # The whole response as the model saw it (verl's): a multi-turn one with its tool results and user turns.
    responses = batch.tensors["responses"]  # [B, T]
    mask = batch.tensors["attention_mask"][:, -responses.shape[1]:].bool()
    texts = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(responses, mask)], skip_special_tokens=True)
    infos = batch.non_tensors["extra_info"]
    # An external agent's episode is scored by its agent function; every other sample by `score_fn`.
    agent_rewards = [(info or {}).get("agent_reward") for info in infos]
    scored = [i for i, reward in enumerate(agent_rewards) if reward is None]
    samples = [(sources[i], texts[i], batch.non_tensors["reward_model"][i]["ground_truth"], infos[i]) for i in scored]
    extras: dict[str, list[Any]] = {}
    score_batch = getattr(score_fn, "score_batch", None)  # a GuardedScoreFn scores the batch in its processes
    if score_batch is not None:
        outcome = score_batch(samples)
        results = dict(zip(scored, outcome.scores))
        extras["reward_failed"] = [None] * len(texts)
        for i, error in zip(scored, outcome.errors):
            extras["reward_failed"][i] = float(error is not None)
    else:
        results = {i: score_fn(*sample) for i, sample in zip(scored, samples)}
    scores: list[float] = []
    for i in range(len(texts)):
        if i not in results:
            scores.append(float(agent_rewards[i]))
            continue
        result = results[i]
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


def judge_scores(batch: Batch, judge: JudgeScoring) -> tuple[torch.Tensor, dict[str, list[Any]]]:
    """The judge's part of each sample's score `[B]` (times `weight`, `parse_failure_score` where its verdict had
    none) and the extras `judge_score` and `judge_parse_failed`. With `on_parse_failure="fail"` a verdict without
    a score is a RewardFunctionError naming the sample and quoting the verdict (failed agent episodes excepted:
    they score 0 whatever the judge says)."""
    raw = batch.tensors["judge_scores"]  # [B], NaN: no score in the verdict
    unparsed = torch.isnan(raw)
    if "agent_loop_errors" in batch.tensors.keys():
        unparsed &= ~batch.tensors["agent_loop_errors"].bool()
    if judge.on_parse_failure == "fail" and bool(unparsed.any()):
        row = int(unparsed.nonzero()[0])
        verdict = " ".join(str(batch.non_tensors["judge_verdicts"][row]).split())[:200]
        raise RewardFunctionError(f"judge {judge.model_path}: no score in its verdict on sample {row} ({verdict!r}); "
                                  f"fix reward_model.judge.score_pattern or set on_parse_failure=score")
    parsed = torch.where(torch.isnan(raw), torch.full_like(raw, judge.parse_failure_score), raw)
    return judge.weight * parsed, {"judge_score": parsed.tolist(), "judge_parse_failed": unparsed.float().tolist()}


def compute_token_level_scores(
    batch: Batch, tokenizer: PreTrainedTokenizerBase, score_fn: ScoreFn, overlong: OverlongShaping | None = None,
    *, data_source_key: str = "data_source", judge: JudgeScoring | None = None,
    reward_model: RewardModelScoring = RewardModelScoring(),
) -> SampleScores:
    """Score every response, add the overlong penalty when shaping, and place the result on the last token.

    A response's length is its count of generated tokens (`response_mask`), the count the rollout stops at
    `max_length`. `data_source_key`: see `score_responses`. A batch with `rm_scores` `[B, T]` (a reward model's, on
    each response's last token) is scored by them, instead of `score_fn` or added to it as `reward_model` says; one
    with `judge_scores` by the judge, instead of `score_fn` or added to it as `judge` says (`judge_scores`).
    """
    if "rm_scores" in batch.tensors.keys():
        learned = reward_model.weight * batch.tensors["rm_scores"].sum(-1)  # [B]
        if reward_model.combine == "replace":  # verl's: the reward function is not called
            scores, extras = learned, {}
        else:
            scores, extras = score_responses(batch, tokenizer, score_fn, data_source_key=data_source_key)
            scores = scores + learned
    elif judge is not None and judge.combine == "replace":
        scores, extras = judge_scores(batch, judge)
    else:
        scores, extras = score_responses(batch, tokenizer, score_fn, data_source_key=data_source_key)  # [B]
        if judge is not None:
            judged, judge_extras = judge_scores(batch, judge)
            scores, extras = scores + judged, extras | judge_extras
    mask = batch.tensors["response_mask"]  # [B, T]
    shaped = scores
    if overlong is not None:
        penalty = overlong_penalty(mask.sum(-1), overlong.max_length, overlong.buffer_length,
                                   overlong.penalty_factor)  # [B]
        shaped = scores + penalty
        if overlong.log:
            extras |= {"overlong_reward": penalty.tolist(), "overlong": (penalty < 0).tolist()}
    failed = batch.tensors["agent_loop_errors"] if "agent_loop_errors" in batch.tensors.keys() else None
    return SampleScores(place_on_last_token(shaped, mask, failed), scores, extras)
