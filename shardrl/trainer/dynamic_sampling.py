"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2; verl's DAPO-recipe keys `algorithm.filter_groups.*`).

A prompt group whose samples all earn the same reward (all right or all wrong) has zero GRPO advantage: it adds no
gradient, only shrinks the batch that does. The synchronous step therefore drops such groups once a generation round
is scored, generates and scores the loader's next prompt batch, and so on, until `data.train_batch_size` groups with
a spread are kept; it trains on exactly that many, the first ones generated. After `max_num_gen_batches` rounds
without enough it fails, as the DAPO reference does (0: no limit).

`algorithm.filter_groups.metric` names what is compared within a group (`metric_values`):
* `acc`: the reward function's `acc` entry, or its score when it returns a plain number (as verl's DAPO reward
  manager records `acc`);
* `score`: the reward function's score, before overlong shaping;
* `seq_reward`: the sequence's reward as trained on (the token-level scores' sum, overlong penalty included);
* `seq_final_reward`: the token-level rewards' sum; the in-reward KL penalty comes after the filter (the config
  refuses the pair), so it equals `seq_reward` here.
A group is uniform when all its values are exactly equal (a standard deviation can round to a nonzero value).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from shardrl.data.batch import Batch
from shardrl.rewards.manager import SampleScores
from shardrl.trainer.batch_ops import reward_metrics
from shardrl.job.schema import FilterMetric


def metric_values(batch: Batch, scores: SampleScores, metric: FilterMetric) -> np.ndarray:
    """The per-sample quantity `metric` names (see the module docstring) `[B]`."""
    if metric in ("seq_reward", "seq_final_reward"):
        return batch.tensors["token_level_scores"].sum(-1).numpy()
    if metric == "acc" and "acc" in scores.extras:
        values = scores.extras["acc"]
        if any(v is None for v in values):
            raise ValueError("algorithm.filter_groups.metric=acc: the reward function returned an 'acc' for some "
                             "samples only; return it for every sample or use metric=score")
        return np.asarray(values, dtype=np.float64)
    return scores.scores.numpy()


def informative_uids(uids: Sequence[str], values: np.ndarray) -> list[str]:
    """The groups (by uid, in order of first appearance) whose values are not all equal."""
    seen: dict[str, set[float]] = {}
    for uid, value in zip(uids, values):
        seen.setdefault(uid, set()).add(float(value))
    return [uid for uid, distinct in seen.items() if len(distinct) > 1]


def take_groups(batch: Batch, uids: Sequence[str]) -> Batch:
    """Every row of the groups `uids`, in the batch's order."""
    wanted = set(uids)
    return batch.take([i for i, uid in enumerate(batch.non_tensors["uid"]) if uid in wanted])


def collect(rounds: Iterator[tuple[Batch, SampleScores]], metric: FilterMetric, num_groups: int,
            max_rounds: int) -> tuple[Batch, dict[str, float]]:
    """Draw scored generation rounds until `num_groups` groups with a spread are kept (at most `max_rounds` rounds;
    0: no limit); the first `num_groups` of them in generation order, and the step's metrics: verl's
    `train/num_gen_batches` (rounds), the groups generated and kept, and the reward extras of every sample scored."""
    kept: list[Batch] = []
    extras: dict[str, list] = {}
    num_rounds = num_generated = num_kept = 0
    for batch, scores in rounds:
        num_rounds += 1
        uids = informative_uids(batch.non_tensors["uid"], metric_values(batch, scores, metric))
        if uids:
            kept.append(take_groups(batch, uids))
        num_generated += len(set(batch.non_tensors["uid"]))
        num_kept += len(uids)
        for key, values in scores.extras.items():
            extras.setdefault(key, []).extend(values)
        if num_kept >= num_groups:
            break
        if num_rounds == max_rounds:
            raise RuntimeError(
                f"algorithm.filter_groups.max_num_gen_batches={max_rounds}: after {num_rounds} generation rounds only "
                f"{num_kept} of {num_generated} prompt groups had a spread of {metric}, {num_groups} needed "
                f"(data.train_batch_size); the prompts may be too hard or too easy for the policy, or set 0 (no limit)")
    else:
        raise RuntimeError(f"dynamic sampling ran out of prompt batches with {num_kept} of {num_groups} groups kept")
    batch = Batch.concat(kept)
    batch = take_groups(batch, list(dict.fromkeys(batch.non_tensors["uid"]))[:num_groups])
    return batch, reward_metrics(extras) | {
        "train/num_gen_batches": float(num_rounds), "train/num_gen_groups": float(num_generated),
        "train/num_kept_groups": float(num_kept), "train/kept_group_ratio": num_kept / num_generated}
