"""The staleness bound each mode's flags imply (hand-computed) and the per-step lag metrics of a hand-made batch."""

import pytest
import torch

from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.trainer.staleness import describe, lag_metrics, max_staleness


@pytest.mark.parametrize("name, overrides, bound", [
    ("ppo_trainer", [], 0),
    ("one_step_off_ppo_trainer", [], 1),
    # defaults: trigger 4, 1 x 16 prompts per step, window 64, extra floor(0.1 * 64) = 6: 3 + ceil(6 / 16) = 4
    ("fully_async_ppo_trainer", [], 4),
    ("fully_async_ppo_trainer",
     ["async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1"], 0),
    ("fully_async_ppo_trainer", ["async_training.staleness_threshold=0"], 3),  # a window of 4 steps, no run-ahead
    # window 2 x 2 x 8 = 32 prompts, extra 64: 1 + ceil(64 / 16) = 5
    ("fully_async_ppo_trainer", ["async_training.staleness_threshold=2", "async_training.trigger_parameter_sync_step=2",
                                 "async_training.require_batches=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8"],
     5),
])
def test_max_staleness(name, overrides, bound):
    plan = plan_job(compose(name, overrides))
    assert max_staleness(plan) == bound
    assert f"samples may be up to {bound} version" in describe(plan)


def test_lag_metrics_of_a_hand_made_batch():
    versions = torch.tensor([[3, 3, -1], [2, 3, 3], [1, -1, -1]])  # -1: padding
    mask = (versions >= 0).float()
    metrics = lag_metrics(versions, mask, version=3, bound=2)
    # token lags 0 0 | 1 0 0 | 2; samples' oldest tokens 0, 1, 2; one sample spans two versions
    assert metrics == {
        "async/staleness_mean": 0.5, "async/staleness_max": 2.0, "async/sample_staleness_mean": 1.0,
        "async/mixed_version_frac": pytest.approx(1 / 3), "async/staleness_hist": pytest.approx([4 / 6, 1 / 6, 1 / 6]),
        "async/lag_0_frac": pytest.approx(4 / 6), "async/lag_1_frac": pytest.approx(1 / 6),
        "async/lag_2_frac": pytest.approx(1 / 6)}
    with pytest.raises(ValueError, match="policy_versions up to 3 are newer than the trainer's version 2"):
        lag_metrics(versions, mask, version=2, bound=2)
