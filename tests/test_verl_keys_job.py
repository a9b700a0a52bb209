"""verl 0.9 command lines with the keys shardrl added for RL-maths parity run the default job (tiny model, built-in
task) for 2 steps, and their terms show in the logged metrics."""

import math

import pytest
from test_default_job import run_job


@pytest.mark.parametrize("overrides, present", [
    (["actor_rollout_ref.actor.loss_agg_mode=token-sum", "actor_rollout_ref.actor.use_kl_loss=true",
      "actor_rollout_ref.actor.kl_loss_type=k3+", "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=abs+"],
     ["actor/kl_loss", "actor/reward_kl_penalty"]),
    (["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
      "actor_rollout_ref.actor.loss_scale_factor=2", "critic.loss_scale_factor=2",
      "algorithm.norm_adv_by_std_in_grpo=false", "actor_rollout_ref.actor.use_kl_loss=true",
      "actor_rollout_ref.actor.kl_loss_type=low_var_kl+", "algorithm.use_kl_in_reward=true",
      "algorithm.kl_penalty=k1+"], ["actor/kl_loss", "critic/vf_loss"]),
], ids=["token-sum+k3+", "dr-grpo-norm+gae"])
def test_default_job_runs_verl_09_keys(tmp_path, overrides, present):
    rows = run_job(tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=-1",
                   "trainer.val_before_train=false", *overrides)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in present:
            assert key in row and math.isfinite(row[key]), (key, sorted(row))
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
