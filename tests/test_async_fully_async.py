"""Fully async PPO end to end on CPU (gloo, Ray, the default job): a trainer pool of 2 ranks at TP2 and a detached
rollout pool at TP1 learn the built-in task to >= 0.9 validation reward with samples within the printed staleness
bound, with partial rollout on and off and param offload on and off; and a run resumed from a checkpoint saved with
groups read ahead trains every prompt group of the loader's stream exactly once, with its original sampling seeds."""

import json
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from async_jobs import DETACHED, check_learned, run_job
from shardrl.models.checkpoint_shards import ShardLoadPlanner

# A step is 2 mini batches (as the default job's), a sync every 2 steps, 25% run-ahead: samples may be
# 2 - 1 + ceil(floor(0.25 * 64) / 32) = 2 versions old.
SCHEDULE = ["async_training.require_batches=2", "async_training.trigger_parameter_sync_step=2",
            "async_training.staleness_threshold=0.25", "trainer.total_training_steps=80", "trainer.test_freq=40"]


def run_fully_async(tmp_path, *overrides):
    rows, out = run_job(tmp_path, "fully_async_ppo_trainer", *DETACHED, *SCHEDULE, *overrides)
    assert "fully_async mode: samples may be up to 2 versions old" in out
    check_learned(rows, bound=2)
    return rows


@pytest.mark.slow  # 58 s; the default suite keeps fully-async equivalence, resume and partial rollout (agents)
def test_fully_async_learns_with_partial_rollout_on_two_replicas(tmp_path):
    rows = run_fully_async(tmp_path, "rollout.n_gpus_per_node=2", "async_training.partial_rollout=true")
    assert all(r["async/dropped_samples"] == 0 for r in rows if "async/dropped_samples" in r)


@pytest.mark.slow
def test_fully_async_learns_without_partial_rollout_with_param_offload(tmp_path):
    rows = run_fully_async(tmp_path, "async_training.partial_rollout=false",
                           "actor_rollout_ref.actor.megatron.param_offload=true")
    assert all(r["async/mixed_version_frac"] == 0 for r in rows if "async/mixed_version_frac" in r)  # drained



RECORDING_REWARD = """
import json

from shardrl.rewards.registry import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open({log!r}, "a") as log:
        log.write(json.dumps([extra_info["index"], solution_str]) + "\\n")
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""

LOADER_BATCH, N, PER_STEP = 32, 8, 16  # data.train_batch_size, rollout.n, require_batches x ppo_mini_batch_size
SAVED_AT, STEPS = 3, 6
# A step takes 16 groups first finished first, a sync every 2 steps, then up to 32 + 16 groups outstanding.
# Unshuffled data, so loader batch k holds prompts 32k..32k+31; lr=0 keeps the weights fixed (see the test). The
# trainer scores what it takes (no reward loop, which scores groups as they finish, taken or not): the scored log
# then lists each step's groups in step order.
RESUME_ARGS = [*DETACHED, "data.shuffle=false", "trainer.test_freq=-1", "trainer.val_before_train=false",
               "reward_model.use_reward_loop=false",
               "async_training.partial_rollout=true", "async_training.require_batches=1",
               "async_training.trigger_parameter_sync_step=2", "async_training.staleness_threshold=0.5",
               "actor_rollout_ref.actor.optim.lr=0", f"trainer.save_freq={SAVED_AT}",
               f"trainer.total_training_steps={STEPS}"]


def run_recorded(run_dir: Path, *overrides: str) -> tuple[list[dict[int, list[str]]], str]:
    """Run the job with a reward function that logs each sample's prompt index and response -> (per step, prompt
    index -> its n responses sorted; stdout). Nothing else is scored (no validation), so step s is lines 128s.."""
    run_dir.mkdir()
    log, reward = run_dir.parent / f"{run_dir.name}_scored.jsonl", run_dir.parent / f"{run_dir.name}_reward.py"
    reward.write_text(RECORDING_REWARD.format(log=str(log)))
    rows, out = run_job(run_dir, "fully_async_ppo_trainer", *RESUME_ARGS, *overrides,
                        f"custom_reward_function.path={reward}")
    assert all(r["async/dropped_samples"] == 0 for r in rows if "async/dropped_samples" in r)  # none left out
    scored = [json.loads(line) for line in log.read_text().splitlines()]
    steps = []
    for start in range(0, len(scored), PER_STEP * N):
        groups: dict[int, list[str]] = {}
        for index, response in scored[start:start + PER_STEP * N]:
            groups.setdefault(index, []).append(response)
        assert sorted(len(g) for g in groups.values()) == [N] * PER_STEP, groups  # whole groups, each once
        steps.append({index: sorted(responses) for index, responses in groups.items()})
    return steps, out


def pending_at_save(step_dir: Path) -> set[int]:
    """The prompt indices of the groups a checkpoint records as read and not yet trained."""
    state = {"trainer": None}
    dcp.load(state, storage_reader=dcp.FileSystemReader(step_dir / "actor"), planner=ShardLoadPlanner(),
             no_dist=True)
    return {k * LOADER_BATCH + row for k, row in state["trainer"]["rollouter"].feed["pending"]}


def assert_partition(*parts: set[int]) -> None:
    """Disjoint, and together every group of the loader's batches up to the last one read."""
    union = set().union(*parts)
    assert sum(map(len, parts)) == len(union), [sorted(a & b) for i, a in enumerate(parts) for b in parts[i + 1:]]
    assert union == set(range((max(union) // LOADER_BATCH + 1) * LOADER_BATCH)), sorted(union)


@pytest.mark.slow  # 97 s; the default suite resumes fully async exactly (tests/test_async_resume.py)
def test_resume_trains_every_prompt_group_once_with_its_original_seeds(tmp_path):
    """Run A trains 6 steps and saves at step 3, with groups read ahead (queued, generating, not started) in the
    rollouter; run B resumes from that save to step 6. A's first 3 steps and B's steps train disjoint groups, and
    with the groups B's final checkpoint holds pending they are every group of the loader's stream: none skipped,
    none trained twice. The weights never change (lr=0), so a group sampled with its original seeds has the same
    responses in both runs: every group A (after the save) and B both trained, those the checkpoint kept finished
    and those read ahead and generated again among them."""
    a, _ = run_recorded(tmp_path / "a")
    b, out = run_recorded(tmp_path / "b", "trainer.resume_mode=resume_path",
                          f"trainer.resume_from_path={tmp_path / 'a' / f'global_step_{SAVED_AT}'}")
    assert f"at step {SAVED_AT}" in out and len(a) == STEPS and len(b) == STEPS - SAVED_AT
    trained_before = [set(step) for step in a[:SAVED_AT]]
    in_flight = pending_at_save(tmp_path / "a" / f"global_step_{SAVED_AT}")
    assert len(in_flight) > PER_STEP  # the sync after step 2 let the rollouter read 32 groups ahead
    assert_partition(*trained_before, in_flight)
    assert_partition(*trained_before, *map(set, b), pending_at_save(tmp_path / "b" / f"global_step_{STEPS}"))
    a_after = {index: responses for step in a[SAVED_AT:] for index, responses in step.items()}
    b_all = {index: responses for step in b for index, responses in step.items()}
    both = a_after.keys() & b_all.keys()
    assert both & in_flight, (sorted(a_after), sorted(b_all))
    assert {i: b_all[i] for i in both} == {i: a_after[i] for i in both}
