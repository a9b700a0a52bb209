"""verl's rollout-correction keys through the trainer: rejection sampling changes the mask every later step trains
and counts on (advantages, loss counts) while outcome scores, lengths and entropy keep the sampled tokens; the
default job runs verl command lines with rejection, normalised IS and bypass-mode REINFORCE."""

import json
import math
import subprocess
import sys

import pytest
import torch

from shardrl.algos import loss_counts
from shardrl.data.batch import Batch
from shardrl.trainer import batch_ops
from shardrl.job.load import compose
from shardrl.job.plan import plan_job

RC = "algorithm.rollout_correction"


def scored_batch(log_ratio: list[list[float]], mask: list[list[float]], scores: list[float]) -> Batch:
    """One prompt group (a shared uid), a 1-token prompt, each score on its response's last valid token."""
    mask_t = torch.tensor(mask, dtype=torch.float32)
    rollout = torch.full_like(mask_t, -1.0)
    last = mask_t.cumsum(-1).argmax(-1)  # [B] position of the last valid token
    token_scores = torch.zeros_like(mask_t).scatter(-1, last[:, None], torch.tensor(scores)[:, None])
    tensors = {"rollout_log_probs": rollout, "old_log_probs": rollout + torch.tensor(log_ratio),
               "response_mask": mask_t, "token_level_scores": token_scores,
               "attention_mask": torch.cat([torch.ones(len(mask), 1), mask_t], dim=1).long(),
               "entropy": torch.full_like(mask_t, 0.5)}
    return Batch(tensors, {"uid": ["p0"] * len(mask)})


def train_inputs(batch: Batch, *overrides: str) -> dict[str, float]:
    algorithm = plan_job(compose("ppo_trainer", list(overrides))).algorithm
    metrics = batch_ops.apply_rewards_and_correction(batch, algorithm, kl_ctrl=None)
    batch_ops.advantages(batch, algorithm)
    return metrics | batch_ops.data_metrics(batch)


def test_rejected_sequence_leaves_loss_counts_but_stays_in_its_group_baseline():
    # Three samples of one prompt scoring [1, 0, 1]; the third's sequence ratio exp(0.5 + 0.5) = 2.72 is above 2 and
    # rollout_rs=sequence rejects it. GRPO's group mean 2/3 and std 0.577 still include its score of 1 (verl sums the
    # whole reward row): the first sample's advantage is (1 - 2/3) / 0.57735 = 0.57735, not (1 - 1/2) / 0.7071 = 0.7071
    # as it would be with the rejected sample dropped or scored 0.
    batch = scored_batch([[0.1, 0.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.0]], [[1, 1, 0], [1, 1, 1], [1, 1, 0]],
                         [1.0, 0.0, 1.0])
    metrics = train_inputs(batch, f"{RC}.rollout_rs=sequence", f"{RC}.rollout_rs_threshold=2.0")
    t = batch.tensors
    torch.testing.assert_close(t["response_mask"], torch.tensor([[1.0, 1, 0], [1, 1, 1], [0, 0, 0]]))
    torch.testing.assert_close(t["sampled_response_mask"], torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 1, 0]]))
    std = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)
    expected = torch.tensor([[1 / 3, 1 / 3, 0], [-2 / 3, -2 / 3, -2 / 3], [0, 0, 0]]) / (std + 1e-6)
    torch.testing.assert_close(t["advantages"], expected)
    # The loss is normalised by the kept tokens and sequences only, on every micro batch and DP rank alike.
    assert loss_counts(t["response_mask"]).tolist() == [5.0, 2.0]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 7)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)
    # Lengths and entropy describe the generations as sampled; advantage statistics the trained tokens.
    assert metrics["response_length/mean"] == pytest.approx(7 / 3)
    assert metrics["critic/advantages/min"] == pytest.approx(float(expected[1, 0]))


def test_rejected_reward_token_still_scores_its_sequence():
    # rollout_rs=token rejects the second sample's last token (r = e > 2), which holds its score 1: the sequence still
    # scores 1 for the group baseline, and the kept first token gets the advantage.
    batch = scored_batch([[0.0, 0.0], [0.0, 1.0]], [[1, 1], [1, 1]], [0.0, 1.0])
    train_inputs(batch, f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=2.0")
    t = batch.tensors
    torch.testing.assert_close(t["response_mask"], torch.tensor([[1.0, 1], [1, 0]]))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(t["advantages"], torch.tensor([[-a, -a], [a, 0.0]]))


def test_without_rejection_the_batch_is_unchanged():
    batch = scored_batch([[0.0, 5.0], [0.0, 1.0]], [[1, 1], [1, 0]], [0.0, 1.0])
    train_inputs(batch, f"{RC}.rollout_is=token", f"{RC}.rollout_is_batch_normalize=true")
    assert "sampled_response_mask" not in batch.tensors.keys()
    torch.testing.assert_close(batch.tensors["response_mask"], torch.tensor([[1.0, 1], [1, 0]]))
    # Token IS weights [1, 2 (e^5 truncated), 1] over valid tokens, divided by their mean 4/3.
    torch.testing.assert_close(batch.tensors["is_weights"], torch.tensor([[0.75, 1.5], [0.75, 1.0]]))


def run_job(run_dir, *overrides):
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", f"trainer.default_local_dir={run_dir}",
           "trainer.logger=[file]", "trainer.total_training_steps=2", "trainer.val_before_train=false",
           "trainer.test_freq=-1", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_default_job_rejects_with_verl_flags(tmp_path):
    # verl 0.7's keys with bounds [1.5, 2] that no token's ratio (~1) meets: every token is rejected, so the actor
    # trains on nothing (loss and gradient exactly 0) although the samples are there.
    rows = run_job(tmp_path, f"{RC}.rollout_is=token", f"{RC}.rollout_is_batch_normalize=true",
                   f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=2.0", f"{RC}.rollout_rs_threshold_lower=1.5",
                   f"{RC}.rollout_token_veto_threshold=1e-4", f"{RC}.bypass_mode=false", f"{RC}.loss_type=ppo_clip")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout_corr/rollout_rs_masked_fraction"] == 1.0 and r["rollout_corr/rollout_is_veto_fraction"] == 0
        assert r["actor/pg_loss"] == 0.0 and r["actor/grad_norm"] == 0.0
        assert r["response_length/mean"] > 0 and "rollout_corr/rollout_is_batch_norm_factor" in r


def test_default_job_runs_bypass_reinforce_with_verl_flags(tmp_path):
    rows = run_job(tmp_path, f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=token",
                   f"{RC}.rollout_is_threshold=2.0")
    assert [r["step"] for r in rows] == [1, 2]
    # The REINFORCE loss ran (no clipping metrics) and trained on the behaviour logprobs (no old-log-prob pass).
    assert all("actor/pg_clipfrac" not in r and "actor/ppo_kl" in r and r["actor/grad_norm"] > 0 for r in rows)
    assert all("timing_s/old_log_prob" not in r for r in rows)


def test_r3s_unreplayed_log_probs_report_the_mismatch_replay_removed():
    # measure_unreplayed's pass (routing itself) beside the replayed one: the step reports both against the rollout,
    # k1 = mean(rollout - other) and k3 = mean(exp(d) - d - 1) with d = other - rollout, over the sampled tokens.
    batch = scored_batch([[0.1, 0.0, 0.0], [0.0, 0.0, 0.0]], [[1, 1, 0], [1, 1, 1]], [1.0, 0.0])
    d = torch.tensor([[0.3, -0.2, 9.0], [0.0, 0.1, 0.0]])  # the third token of row 0 is padding
    batch.tensors["unreplayed_log_probs"] = batch.tensors["rollout_log_probs"] + d
    metrics = train_inputs(batch)
    kept = [0.3, -0.2, 0.0, 0.1, 0.0]
    assert metrics["rollout_corr/unreplayed/mismatch_kl"] == pytest.approx(-sum(kept) / 5, rel=1e-5)
    assert metrics["rollout_corr/unreplayed/mismatch_k3_kl"] == pytest.approx(
        sum(math.exp(x) - x - 1 for x in kept) / 5, rel=1e-5)  # fp32 log-probs
    assert metrics["rollout_corr/mismatch_k3_kl"] == pytest.approx((math.exp(0.1) - 0.1 - 1) / 5, rel=1e-5)
