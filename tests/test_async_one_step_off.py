"""One-step-off PPO end to end on CPU (gloo, Ray, the default job): a trainer pool of 2 ranks at TP2 and a detached
rollout pool at TP1 learn the built-in task to >= 0.9 validation reward (slow set: 80 steps), every sample one
version old (the first batch excepted), generation overlapping training on the timeline; the default set runs the
offloaded variant for a few steps with the same schedule checks."""

from collections import Counter

import pytest

from async_jobs import DETACHED, check_learned, run_job

STEPS = ["trainer.total_training_steps=80", "trainer.test_freq=40"]


def check_one_step_off(rows, out, partial_rollout=False, steps=80):
    assert "one_step_off mode: samples may be up to 1 version old" in out
    if steps == 80:
        check_learned(rows, bound=1)
    lags = [r["async/staleness_max"] for r in rows if "async/staleness_max" in r]
    assert lags == [0.0] + [1.0] * (steps - 1)
    mixed = [r["async/mixed_version_frac"] for r in rows if "async/mixed_version_frac" in r]
    if not partial_rollout:  # verl's schedule: the sync waits for batch k+1, every sample from one version, lag 1
        assert mixed and all(m == 0 for m in mixed)
        means = [r["async/staleness_mean"] for r in rows if "async/staleness_mean" in r]
        assert means == [0.0] + [1.0] * (steps - 1)
    assert any(r.get("timing_s/rollout_overlap", 0) > 0 for r in rows)  # batch k+1 generated during step k


def test_one_step_off_with_param_offload_trains_each_batch_one_version_old(tmp_path):
    rows, out = run_job(tmp_path, "one_step_off_ppo_trainer", *DETACHED, "trainer.total_training_steps=6",
                        "trainer.test_freq=-1", "actor_rollout_ref.actor.megatron.param_offload=true")
    check_one_step_off(rows, out, steps=6)
    for name in ("timeline.png", "curves.png", "hf_export/config.json"):
        assert (tmp_path / name).exists(), name


@pytest.mark.slow
def test_one_step_off_learns_with_param_offload(tmp_path):
    rows, out = run_job(tmp_path, "one_step_off_ppo_trainer", *DETACHED, *STEPS,
                        "actor_rollout_ref.actor.megatron.param_offload=true")
    check_one_step_off(rows, out)


@pytest.mark.slow
def test_one_step_off_learns_without_offload_on_two_rollout_replicas(tmp_path):
    rows, out = run_job(tmp_path, "one_step_off_ppo_trainer", *DETACHED, *STEPS, "rollout.n_gpus_per_node=2")
    check_one_step_off(rows, out)


@pytest.mark.slow
def test_one_step_off_learns_with_partial_rollout(tmp_path):
    rows, out = run_job(tmp_path, "one_step_off_ppo_trainer", *DETACHED, *STEPS, "async_training.partial_rollout=true")
    check_one_step_off(rows, out, partial_rollout=True)


def test_resumed_run_syncs_the_checkpoint_to_the_rollout_pool(tmp_path):
    """Save at step 2 (offloaded actor), resume: the detached rollout pool gets the checkpoint's weights, so greedy
    validation before the resumed training equals the first run's validation after step 2."""
    args = [*DETACHED, "actor_rollout_ref.actor.megatron.param_offload=true", "trainer.save_freq=2",
            "trainer.test_freq=2"]
    first, _ = run_job(tmp_path, "one_step_off_ppo_trainer", *args, "trainer.total_training_steps=2")
    rows, out = run_job(tmp_path, "one_step_off_ppo_trainer", *args, "trainer.total_training_steps=3")
    assert "at step 2" in out
    # The resumed run continues the file; its validation before training lands in step 2's row (one row per step).
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[:2] == first[:2]
    val = [r["val-core/reward/mean"] for r in rows if "val-core/reward/mean" in r]
    assert len(val) == 3 and val[1] == first[2]["val-core/reward/mean"] != val[0]  # the trained weights
    # The batch generated before the save (under step 1's weights) is restored with its versions, not generated again
    assert rows[-1]["step"] == 3 and rows[-1]["async/staleness_max"] == 1


INDEX_LOGGING_REWARD = """
from shardrl.rewards.registry import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open({log!r}, "a") as log:
        log.write(f"{{extra_info['index']}}\\n")
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""


@pytest.mark.slow  # 53 s; the exact resume of tests/test_async_resume.py (fully async in the default suite) implies it
def test_resume_generates_the_prompts_that_were_in_flight_at_the_save(tmp_path):
    """Unshuffled data, so step k trains prompts 32k..32k+31 (the reward function logs each sample's prompt index).
    At the save after step 2, batch 2 is generating on the rollout pool (and more may be read): the resumed run
    trains exactly batch 2 next, not the batch after what the rollouter had read."""
    log = tmp_path / "scored.txt"
    reward = tmp_path / "index_reward.py"
    reward.write_text(INDEX_LOGGING_REWARD.format(log=str(log)))
    # The trainer scores what it takes (the reward loop would score batch 3 ahead, as it finishes generating).
    args = [*DETACHED, "data.shuffle=false", "trainer.save_freq=2", "trainer.test_freq=-1",
            "trainer.val_before_train=false", f"custom_reward_function.path={reward}",
            "reward_model.use_reward_loop=false"]
    run_job(tmp_path, "one_step_off_ppo_trainer", *args, "trainer.total_training_steps=2")
    _, out = run_job(tmp_path, "one_step_off_ppo_trainer", *args, "trainer.total_training_steps=3")
    assert "at step 2" in out
    scored = [int(line) for line in log.read_text().split()]
    per_step = len(scored) // 3
    batch = 32  # data.train_batch_size
    for step in range(3):
        trained = Counter(scored[step * per_step:(step + 1) * per_step])
        assert set(trained) == set(range(step * batch, (step + 1) * batch)), (step, sorted(trained))
        assert len(set(trained.values())) == 1  # every prompt's n samples
