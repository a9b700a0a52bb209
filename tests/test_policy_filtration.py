"""PF-PPO (verl's `algorithm.use_pf_ppo`): the draw weights of each reweight method as verl's formulas give them,
draws in proportion to them, the controller's resampled batch (seeded per step, advantages carried with their
rows), the keys and their refusals, and a 2-step GAE job."""

import math

import pytest
import torch

from shardrl.algos.policy_filtration import PolicyFiltration, filtration_weights, resampled_rows
from shardrl.data.batch import Batch
from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.trainer import batch_ops
from test_default_job import run_job


def test_each_method_weighs_as_verls():
    scores = torch.tensor([0.0, 1.0, -2.0, 3.0, 3.0], dtype=torch.float64)
    assert filtration_weights(scores, PolicyFiltration("pow", 2.0)).tolist() == pytest.approx(
        [1e-8, 1 + 1e-8, 4 + 1e-8, 9 + 1e-8, 9 + 1e-8], rel=1e-12)
    assert filtration_weights(scores, PolicyFiltration("pow", 0.5)).tolist() == pytest.approx(
        [1e-8, 1.0, math.sqrt(2), math.sqrt(3), math.sqrt(3)])
    assert filtration_weights(scores, PolicyFiltration("max_min")).tolist() == pytest.approx(
        [1e-8, 1e-8, 1.0, 1.0, 1.0])  # the lowest (-2) and both highest (3)
    assert filtration_weights(scores, PolicyFiltration("max_random")).tolist() == pytest.approx(
        [0.1, 0.1, 0.1, 0.4, 0.4])
    with pytest.raises(ValueError, match="reweight_method"):
        PolicyFiltration("median")


def test_draws_follow_the_weights():
    """40,000 draws over four score classes: each class's share is its weight's (0, 1, 4, 9 of 14) within 1%."""
    scores = torch.tensor([0.0, 1.0, -2.0, 3.0]).repeat(10_000)
    rows = resampled_rows(scores, PolicyFiltration("pow", 2.0), torch.Generator().manual_seed(0))
    assert rows.shape == (40_000,)
    shares = torch.bincount(rows % 4, minlength=4).double() / rows.numel()
    assert shares.tolist() == pytest.approx([0.0, 1 / 14, 4 / 14, 9 / 14], abs=0.01)
    again = resampled_rows(scores, PolicyFiltration("pow", 2.0), torch.Generator().manual_seed(0))
    assert torch.equal(rows, again)


def test_the_controller_trains_on_the_drawn_rows():
    scores = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, -1.0], [0.0, 0.0]])
    batch = Batch({"token_level_scores": scores, "advantages": torch.arange(8.0).view(4, 2)},
                  non_tensors={"uid": ["a", "b", "c", "d"]})
    algo = plan("algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true").algorithm
    drawn, metrics = batch_ops.policy_filtration(batch, algo, seed=1, step=3)
    uids = list(drawn.non_tensors["uid"])
    assert len(drawn) == 4 and set(uids) <= {"a", "c"}  # scores 0 weigh 1e-8 against 1
    for uid, advantages in zip(uids, drawn.tensors["advantages"]):
        assert torch.equal(advantages, batch.tensors["advantages"]["abcd".index(uid)])  # rows move whole
    assert metrics["pf_ppo/unique_fraction"] == len(set(uids)) / 4
    same, _ = batch_ops.policy_filtration(batch, algo, seed=1, step=3)
    assert list(same.non_tensors["uid"]) == uids  # seeded by (seed, step): a resumed run draws the same
    steps = {tuple(batch_ops.policy_filtration(batch, algo, seed=1, step=s)[0].non_tensors["uid"]) for s in range(8)}
    assert len(steps) > 1


def plan(*overrides):
    return plan_job(compose("ppo_trainer", list(overrides)))


def test_the_keys_reach_the_options():
    algo = plan("algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min",
                "algorithm.pf_ppo.weight_pow=3").algorithm
    assert algo.policy_filtration == PolicyFiltration("max_min", 3.0)
    assert plan("algorithm.adv_estimator=gae").algorithm.policy_filtration is None


@pytest.mark.parametrize("overrides, key, reason", [
    (["algorithm.use_pf_ppo=true"], "algorithm.use_pf_ppo", "adv_estimator=grpo has none"),
    (["algorithm.pf_ppo.weight_pow=3"], "algorithm.pf_ppo.weight_pow", "use_pf_ppo=true only"),
    (["algorithm.adv_estimator=gae", "algorithm.pf_ppo.reweight_method=max_random"],
     "algorithm.pf_ppo.reweight_method", "use_pf_ppo=true only"),
    (["algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=median"],
     "algorithm.pf_ppo.reweight_method", ""),
])
def test_invalid_keys_are_refused_naming_them(overrides, key, reason):
    with pytest.raises(ConfigError) as err:
        plan(*overrides)
    assert err.value.key == key and reason in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_a_gae_job_runs_two_steps_on_the_drawn_batch(tmp_path):
    rows = run_job(tmp_path, "trainer.total_training_steps=2", "trainer.val_before_train=false",
                   "trainer.test_freq=-1", "algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["pf_ppo/unique_fraction"] <= 1 and math.isfinite(r["critic/vf_loss"])
