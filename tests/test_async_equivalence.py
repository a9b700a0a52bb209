"""Synchronous PPO is fully async PPO with staleness_threshold=0 and trigger_parameter_sync_step=1: on the same seed
(CPU, Ray, the default job) the two trainers log the same numbers at every step, validation included, although one
generates on the colocated engine in one batch and the other streams through a detached rollout pool."""

from async_jobs import assert_same_numbers, run_job

# Numbers that depend on timing or on how the weights travel (local copies colocated, a transfer detached).
NOT_COMPARED = ("timing_s/", "perf/throughput", "sync/", "async/queue_groups", "async/running_groups")


def test_fully_async_with_staleness_0_and_sync_every_step_equals_sync(tmp_path):
    steps = ["trainer.total_training_steps=4", "trainer.test_freq=2"]
    sync_rows, _ = run_job(tmp_path / "sync", "ppo_trainer", *steps)
    async_rows, out = run_job(tmp_path / "async", "fully_async_ppo_trainer", *steps,
                              "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
                              "async_training.require_batches=2", "async_training.partial_rollout=false",
                              "async_training.use_rollout_log_probs=false",
                              "algorithm.rollout_correction.decoupled=true")
    assert "samples may be up to 0 versions old" in out
    assert [r["step"] for r in sync_rows] == [0, 1, 2, 3, 4]
    assert_same_numbers(sync_rows, async_rows, NOT_COMPARED)
    assert {"actor/pg_loss", "actor/grad_norm", "critic/score/mean", "rollout_corr/mismatch_kl",
            "async/staleness_max", "val-core/reward/mean"} <= set(sync_rows[2])
