"""Fully async PPO end to end on CPU (gloo, Ray, the default job): a trainer pool of 2 ranks at TP2 and a detached
rollout pool at TP1 learn the built-in task to >= 0.9 validation reward with samples within the printed staleness
bound, with partial rollout on and off and param offload on and off."""

import pytest

from async_jobs import DETACHED, check_learned, run_job

# A step is 2 mini batches (as the default job's), a sync every 2 steps, 25% run-ahead: samples may be
# 2 - 1 + ceil(floor(0.25 * 64) / 32) = 2 versions old.
SCHEDULE = ["async_training.require_batches=2", "async_training.trigger_parameter_sync_step=2",
            "async_training.staleness_threshold=0.25", "trainer.total_training_steps=80", "trainer.test_freq=40"]


def run_fully_async(tmp_path, *overrides):
    rows, out = run_job(tmp_path, "fully_async_ppo_trainer", *DETACHED, *SCHEDULE, *overrides)
    assert "fully_async mode: samples may be up to 2 versions old" in out
    check_learned(rows, bound=2)
    return rows


def test_fully_async_learns_with_partial_rollout_on_two_replicas(tmp_path):
    rows = run_fully_async(tmp_path, "rollout.n_gpus_per_node=2", "async_training.partial_rollout=true")
    assert all(r["async/dropped_samples"] == 0 for r in rows if "async/dropped_samples" in r)


@pytest.mark.slow
def test_fully_async_learns_without_partial_rollout_with_param_offload(tmp_path):
    rows = run_fully_async(tmp_path, "async_training.partial_rollout=false",
                           "actor_rollout_ref.actor.megatron.param_offload=true")
    assert all(r["async/mixed_version_frac"] == 0 for r in rows if "async/mixed_version_frac" in r)  # drained
