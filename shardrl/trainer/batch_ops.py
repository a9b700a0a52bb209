"""Whole-batch steps the controller runs between worker calls: balancing over DP, scoring, KL in reward, off-policy
correction, advantages, and the batch's data metrics (verl's metric names)."""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardrl.agents.trajectory import Source
from shardrl.algos import (AdvantageInputs, KLController, apply_kl_penalty, compute_advantage, gdpo_reward_components,
                           mismatch_metrics, rollout_correction)
from shardrl.algos.policy_filtration import resampled_rows
from shardrl.data.balance import dp_balanced_order
from shardrl.data.batch import Batch, as_object_array
from shardrl.rewards.manager import SampleScores, compute_token_level_scores
from shardrl.job.options import AlgorithmOptions, LoopOptions, RewardOptions
from shardrl.workers.engine import ROUTING_MISMATCH, UNREPLAYED_LOG_PROBS

EXTRA_COLUMN = "reward_extra/"  # a reward extra kept as a non-tensor column (`score(extras_as_columns=True)`)
# Which validation samples `trainer.log_val_generations` shows: a fixed seed, so every validation of every run shows
# the answers to the same prompts and they can be compared.
VAL_GENERATIONS_SEED = 42


def assign_uids(prompts: Batch) -> Batch:
    """One uid per prompt: its samples share it, so group estimators (GRPO, RLOO) know the groups."""
    prompts.non_tensors["uid"] = as_object_array([uuid.uuid4().hex for _ in range(len(prompts))])
    return prompts


def with_sample_seeds(samples: Batch, seed: int, step: int, gen_round: int = 0) -> Batch:
    """A sampling seed per row from (trainer.seed, step, generation round, row): generation then depends on nothing
    but the weights and the data, so a resumed run samples exactly what the uninterrupted one did. Validation uses
    step -1. A step's extra rounds (dynamic sampling) start 2**24 seeds apart, so rounds of fewer rows than that
    share no seed."""
    base = (seed * 1_000_003 + (step + 1) * 65_537 + gen_round * 2**24) % 2**31
    samples.tensors["sample_seed"] = base + torch.arange(len(samples), dtype=torch.long)
    return samples


def balance_over_dp(batch: Batch, loop: LoopOptions, actor_dp: int,
                    critic_dp: int | None) -> tuple[Batch, dict[str, float]]:
    """`trainer.balance_batch`: reorder whole samples so each of the actor's DP ranks gets a near-equal token count
    (prompt + response, from the attention mask), keeping every optimizer step's samples (see `dp_balanced_order`).

    The unit kept together is the actor's per-rank mini batch, or the largest size dividing both the actor's and
    the critic's when the critic has the same DP (a critic with another DP gets a rough balance and its mini batches
    hold other samples than without balancing). Metrics are verl's `global_seqlen/*`: per-rank token sums of the
    contiguous split before (min, max, minmax_diff) and after (balanced_min, balanced_max) reordering.
    """
    n = loop.samples_per_prompt
    rows = loop.actor_mini_batch_size * n // actor_dp
    if critic_dp == actor_dp:
        rows = math.gcd(rows, loop.critic_mini_batch_size * n // actor_dp)
    lengths = batch.tensors["attention_mask"].sum(-1)  # [B]
    order = dp_balanced_order(lengths.tolist(), actor_dp, rows)
    before = lengths.view(actor_dp, -1).sum(-1)  # [DP]
    after = lengths[order].view(actor_dp, -1).sum(-1)  # [DP]
    metrics = {"global_seqlen/min": float(before.min()), "global_seqlen/max": float(before.max()),
               "global_seqlen/minmax_diff": float(before.max() - before.min()),
               "global_seqlen/balanced_min": float(after.min()), "global_seqlen/balanced_max": float(after.max()),
               "global_seqlen/mean": float(before.float().mean())}
    return batch.take(order), metrics


def score(batch: Batch, tokenizer, score_fn, reward: RewardOptions, keep_extras: Sequence[str] = (),
          extras_as_columns: bool = False) -> tuple[Batch, SampleScores]:
    """`token_level_scores` `[B, R]` (with `reward_model.overlong_buffer`'s shaping when enabled; validation too, as
    verl's DAPO recipe scores it) and the per-sample scores and extras. The extras named in `keep_extras` (gdpo's
    reward components) also become non-tensor columns of the batch, which later steps read; `extras_as_columns`:
    every extra does, as `reward_extra/<name>` (the sample dumps read them after dynamic sampling's filter). With verl's gdpo
    manager (`reward.experiment_name`) every sample's extra_info holds the run's experiment name first."""
    if reward.experiment_name is not None:
        batch.non_tensors["extra_info"] = as_object_array(
            [{**(info or {}), "experiment_name": reward.experiment_name} for info in batch.non_tensors["extra_info"]])
    scores = compute_token_level_scores(batch, tokenizer, score_fn, reward.overlong,
                                        data_source_key=reward.data_source_key, judge=reward.judge,
                                        reward_model=reward.reward_model)
    batch.tensors["token_level_scores"] = scores.token_level
    for key in keep_extras:
        if key not in scores.extras:
            raise ValueError(f"algorithm.gdpo_reward_keys: the reward function returned no {key!r} (its extras: "
                             f"{sorted(scores.extras)}); return it in every sample's result dict")
        batch.non_tensors[key] = as_object_array(scores.extras[key])
    if extras_as_columns:
        for key, values in scores.extras.items():
            batch.non_tensors[f"{EXTRA_COLUMN}{key}"] = as_object_array(values)
    return batch, scores


def sample_records(batch: Batch, tokenizer, step: int) -> list[dict[str, Any]]:
    """verl's sample dump rows (`trainer.rollout_data_dir` / `validation_data_dir`): per sample `input` (the decoded
    prompt), `output` (the decoded response as the model saw it, tool turns included), `gts` (the ground truth),
    `score` (its token scores summed), `step`, and each reward extra kept as a column (`reward_extra/<name>`)."""
    t = batch.tensors
    width = t["prompts"].shape[1]
    prompt_mask, response_mask = t["attention_mask"][:, :width].bool(), t["attention_mask"][:, width:].bool()
    inputs = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(t["prompts"], prompt_mask)],
                                    skip_special_tokens=True)
    outputs = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(t["responses"], response_mask)],
                                     skip_special_tokens=True)
    scores = t["token_level_scores"].sum(-1).tolist()
    truths = [(info or {}).get("ground_truth") for info in batch.non_tensors.get("reward_model", [None] * len(batch))]
    extras = {key.removeprefix(EXTRA_COLUMN): list(values) for key, values in batch.non_tensors.items()
              if key.startswith(EXTRA_COLUMN)}
    return [{"input": inputs[i], "output": outputs[i], "gts": truths[i], "score": scores[i], "step": step,
             **{key: values[i] for key, values in extras.items()}} for i in range(len(batch))]


def write_records(directory: str, step: int, records: list[dict[str, Any]]) -> Path:
    """`<directory>/<step>.jsonl`, one JSON object per line (values JSON cannot hold as str()), written under a
    temporary name and renamed: a reader never sees half a file."""
    folder = Path(directory).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    path, temporary = folder / f"{step}.jsonl", folder / f".{step}.jsonl.tmp"
    with open(temporary, "w") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False, default=_plain) + "\n")
    os.replace(temporary, path)
    return path


def _plain(value: Any) -> Any:
    """json.dumps's fallback: numpy numbers as Python ones, anything else as its str()."""
    return value.item() if isinstance(value, np.generic) else str(value)


def reward_metrics(extras: dict[str, list[Any]]) -> dict[str, float]:
    """`reward_extra/<key>/mean` over the samples with a number (or bool) for each per-sample extra."""
    metrics = {}
    for key, values in extras.items():
        numeric = [float(v) for v in values if isinstance(v, (int, float, bool))]
        if numeric:
            metrics[f"reward_extra/{key}/mean"] = float(np.mean(numeric))
    return metrics


def val_generations(batch: Batch, tokenizer, scores: np.ndarray, num: int) -> list[dict[str, Any]]:
    """`num` validation samples as {"input", "output", "score"}: sorted by input text, shuffled with a fixed seed,
    the first `num` (the choice depends on the prompts only, not on the order generation returned them in). The
    input is the question (the last user message of the row's chat), not the rendered prompt, whose end is a chat
    template's assistant header; the decoded prompt where the batch has no chat."""
    t = batch.tensors
    if "raw_prompt" in batch.non_tensors:
        inputs = [_question(chat) for chat in batch.non_tensors["raw_prompt"]]
    else:
        prompt_mask = t["attention_mask"][:, :t["prompts"].shape[1]].bool()  # [B, P]
        inputs = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(t["prompts"], prompt_mask)],
                                        skip_special_tokens=True)
    outputs = tokenizer.batch_decode([ids[m].tolist() for ids, m in zip(t["responses"], t["response_mask"].bool())],
                                     skip_special_tokens=True)
    by_input = sorted(range(len(inputs)), key=lambda i: inputs[i])
    chosen = np.random.default_rng(VAL_GENERATIONS_SEED).permutation(by_input)[:num]
    return [{"input": inputs[i], "output": outputs[i], "score": float(scores[i])} for i in chosen]


def _question(chat: str | list[dict[str, Any]]) -> str:
    """The last user message of a chat (a prompt given as plain text is its own question)."""
    if isinstance(chat, str):
        return chat
    users = [m["content"] for m in chat if m.get("role") == "user"]
    return str(users[-1] if users else chat[-1]["content"])


def apply_rewards_and_correction(batch: Batch, algo: AlgorithmOptions,
                                 kl_ctrl: KLController | None) -> dict[str, float]:
    """The off-policy anchor and importance weights (`old_log_probs`, `is_weights`) the actor loss reads, then
    token_level_rewards (scores, minus the KL penalty of the anchor policy against the reference when the KL is in
    the reward; the anchor is the recomputed policy, or the rollout's logprobs in bypass mode), then rejection
    sampling: `response_mask` becomes the kept tokens, which every later step (advantages, both losses and their
    token/sequence counts) trains on, and `sampled_response_mask` keeps the tokens as generated. As in verl, the IS
    weights and the KL penalty see the sampled tokens."""
    t, metrics = batch.tensors, {}
    rc = algo.correction
    rejection = rc.rejection
    # In bypass mode rollout_is belongs to the REINFORCE loss, which weighs each micro batch against the current policy.
    correction = rollout_correction(t["old_log_probs"] if "old_log_probs" in t.keys() else None,
                                    t["rollout_log_probs"], t["response_mask"], rc.rollout_is if rc.decoupled else None,
                                    rc.rollout_is_threshold, rc.decoupled,
                                    rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rejection=rejection)
    t["old_log_probs"] = correction.old_log_prob
    if rc.rollout_is is not None and rc.decoupled:
        t["is_weights"] = correction.is_weights
    metrics |= {f"rollout_corr/{k}": float(v) for k, v in correction.metrics.items()}
    if UNREPLAYED_LOG_PROBS in t.keys():  # R3's counterfactual: the same batch's mismatch had it routed itself
        unreplayed = mismatch_metrics(t[UNREPLAYED_LOG_PROBS], t["rollout_log_probs"], t["response_mask"])
        metrics |= {f"rollout_corr/unreplayed/{k}": float(v) for k, v in unreplayed.items()}
    if algo.kl_in_reward is not None:
        rewards, kl_metrics = apply_kl_penalty(t["token_level_scores"], t["old_log_probs"], t["ref_log_probs"],
                                               t["response_mask"], kl_ctrl.value, algo.kl_in_reward.estimator)
        kl_ctrl.update(float(kl_metrics["reward_kl_penalty"]), n_steps=len(batch))
        metrics |= {f"actor/{k}": float(v) for k, v in kl_metrics.items()}
    else:
        rewards = t["token_level_scores"]
    t["token_level_rewards"] = rewards
    if rejection is not None:
        t["sampled_response_mask"], t["response_mask"] = t["response_mask"], correction.response_mask
    return metrics


def advantages(batch: Batch, algo: AlgorithmOptions) -> None:
    """Advantages on the kept tokens; an outcome score still sums the rewards of all sampled tokens (verl sums the
    whole reward row), so rejecting a token or a sequence leaves its group's baseline as it was. gdpo's reward
    components are the batch's non-tensor columns named by `algorithm.gdpo_reward_keys` (the reward function's
    per-sample extras, as verl keeps them in its non_tensor_batch)."""
    t = batch.tensors
    keys = algo.gdpo_reward_keys
    components = (gdpo_reward_components(batch.non_tensors, keys, len(batch)).to(t["token_level_rewards"])
                  if keys is not None else None)
    inputs = AdvantageInputs(
        token_level_rewards=t["token_level_rewards"], response_mask=t["response_mask"],
        values=t["values"] if "values" in t.keys() else None, index=batch.non_tensors["uid"],
        gamma=algo.gamma, lam=algo.lam, norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        score_mask=t["sampled_response_mask"] if "sampled_response_mask" in t.keys() else None,
        reward_components=components, reward_weights=algo.gdpo_reward_weights,
        old_log_probs=t["old_log_probs"] if "old_log_probs" in t.keys() else None,
        sum_pi_squared=t["sum_pi_squared"] if "sum_pi_squared" in t.keys() else None,
        is_weights=t["is_weights"] if "is_weights" in t.keys() else None)
    t["advantages"], t["returns"] = compute_advantage(algo.adv_estimator, inputs)


def policy_filtration(batch: Batch, algo: AlgorithmOptions, seed: int, step: int) -> tuple[Batch, dict[str, float]]:
    """PF-PPO (`algorithm.use_pf_ppo`, after GAE's advantages): the batch drawn again with replacement, as many rows,
    each response weighted by its score (its token scores summed, before any KL penalty, as verl's), from a generator
    seeded by (trainer.seed, step) so a resumed run draws the same. Metric `pf_ppo/unique_fraction`: the share of
    the batch's responses drawn at least once."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**31)
    rows = resampled_rows(batch.tensors["token_level_scores"].sum(-1), algo.policy_filtration, generator)
    return batch.take(rows), {"pf_ppo/unique_fraction": len(set(rows.tolist())) / len(batch)}


def _masked_stats(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    valid = values[mask.bool()]
    if valid.numel() == 0:
        return {}
    return {f"{name}/mean": float(valid.mean()), f"{name}/max": float(valid.max()), f"{name}/min": float(valid.min())}


def agent_metrics(batch: Batch) -> dict[str, float]:
    """Multi-turn trajectories: turns, tool calls and their failures, tool time, and response tokens by who wrote
    them (means per trajectory)."""
    t = batch.tensors
    turns = t["agent_turns"]
    metrics = {"agent/num_turns/mean": float(turns.mean()), "agent/num_turns/max": float(turns.max()),
               "agent/num_turns/min": float(turns.min())}
    for key in ("assistant_turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_seconds",
                "tool_wait_seconds", "loop_errors"):
        metrics[f"agent/{key}/mean"] = float(t[f"agent_{key}"].mean())
    for source in Source:
        metrics[f"agent/tokens_{source.name.lower()}/mean"] = float((t["response_sources"] == source).sum(-1)
                                                                    .float().mean())
    external = t["agent_external"].bool()
    if external.any():
        requests = t["agent_requests"][external]
        metrics |= {"agent/endpoint/episodes": float(external.sum()),
                    "agent/endpoint/requests_per_episode": float(requests.mean()),
                    "agent/endpoint/failed_episodes": float(t["agent_loop_errors"][external].mean()),
                    "agent/endpoint/divergent_episodes": float((t["agent_divergent_requests"][external] > 0)
                                                               .float().mean()),
                    "agent/endpoint/request_latency_s": float(t["agent_request_seconds"][external].sum()
                                                              / requests.sum().clamp_min(1))}
    return metrics


def data_metrics(batch: Batch) -> dict[str, float]:
    """verl's data metrics: advantages, returns and values over the trained (kept) tokens; lengths and entropy over
    the sampled ones (they describe the generations, whatever rejection sampling kept)."""
    t = batch.tensors
    mask = t["response_mask"]
    sampled = t["sampled_response_mask"] if "sampled_response_mask" in t.keys() else mask
    lengths = sampled.sum(-1)
    seq_mask = torch.ones(len(batch), dtype=torch.bool)
    metrics = {
        **_masked_stats("critic/score", t["token_level_scores"].sum(-1), seq_mask),
        **_masked_stats("critic/rewards", t["token_level_rewards"].sum(-1), seq_mask),
        **_masked_stats("critic/advantages", t["advantages"], mask),
        **_masked_stats("critic/returns", t["returns"], mask),
        "response_length/mean": float(lengths.float().mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths == mask.shape[1]).float().mean()),
        "prompt_length/mean": float(t["attention_mask"][:, :-mask.shape[1]].sum(-1).float().mean()),
    }
    if "agent_turns" in t.keys():
        metrics |= agent_metrics(batch)
    if "rm_scores" in t.keys():  # the reward model's own scores, before any shaping
        rm = t["rm_scores"].sum(-1)
        metrics |= _masked_stats("reward_model/score", rm, seq_mask) | {"reward_model/score/std": float(rm.std())}
    if "values" in t.keys():
        metrics |= _masked_stats("critic/values", t["values"], mask)
    if ROUTING_MISMATCH in t.keys():  # the old-logprob pass's own MoE routing against the rollout's
        differs, compared = t[ROUTING_MISMATCH].sum(0).tolist()
        metrics["routing/rollout_mismatch"] = differs / max(compared, 1.0)
    if "entropy" in t.keys():
        metrics["actor/entropy"] = float((t["entropy"] * sampled).sum() / sampled.sum().clamp_min(1))
    return metrics
