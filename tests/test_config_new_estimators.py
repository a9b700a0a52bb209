"""The keys of GPG, Pass@k GRPO, GDPO, CISPO, SAPO, GMPO, DPPO, DRO, Clip-Cov, KL-Cov, the vectorised GRPO / RLOO, the
optimal token baselines and the Dr. GRPO preset (issue "RL maths"): verl's spellings reach their options, invalid combinations are refused before any worker starts naming the key, and each runs the
default job (tiny model, CPU) for 2 steps from a verl command line."""

import math

import pytest
import torch

from shardrl.algos import ClipRange
from shardrl.data.batch import Batch
from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.trainer import batch_ops
from test_algos_new_estimators import _gdpo_reference
from test_default_job import run_job

ACTOR = "actor_rollout_ref.actor"


def plan(*overrides):
    return plan_job(compose("ppo_trainer", list(overrides)))


def test_defaults_leave_the_options_as_they_were():
    options = plan()
    assert options.actor.loss.clip == ClipRange(0.2, 0.2, 0.2, 3.0)
    assert options.algorithm.gdpo_reward_keys is None and options.algorithm.gdpo_reward_weights is None


def test_verl_spellings_reach_the_options():
    cispo = plan(f"{ACTOR}.policy_loss.loss_mode=cispo", f"{ACTOR}.clip_ratio_low=10", f"{ACTOR}.clip_ratio_high=0.2")
    assert cispo.actor.loss.loss_mode == "cispo"
    assert cispo.actor.loss.clip == ClipRange(0.2, 10.0, 0.2, 3.0, weight_clip=True)
    sapo = plan(f"{ACTOR}.policy_loss.loss_mode=sapo", f"{ACTOR}.policy_loss.tau_pos=1.5",
                f"{ACTOR}.policy_loss.tau_neg=2.5")
    assert (sapo.actor.loss.loss_mode, sapo.actor.loss.clip.tau_pos, sapo.actor.loss.clip.tau_neg) == ("sapo", 1.5, 2.5)
    gdpo = plan("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[format,accuracy]",
                "algorithm.gdpo_reward_weights=[1,0.5]")
    assert gdpo.algorithm.adv_estimator == "gdpo" and "critic" not in gdpo.roles
    assert (gdpo.algorithm.gdpo_reward_keys, gdpo.algorithm.gdpo_reward_weights) == (("format", "accuracy"), (1.0, 0.5))
    for estimator in ("gpg", "grpo_passk", "grpo_vectorized", "rloo_vectorized"):
        assert plan(f"algorithm.adv_estimator={estimator}").algorithm.adv_estimator == estimator
    otb = plan("algorithm.adv_estimator=optimal_token_baseline", f"{ACTOR}.calculate_sum_pi_squared=true")
    assert otb.algorithm.adv_estimator == "optimal_token_baseline" and otb.actor.sum_pi_squared
    tir = plan("algorithm.adv_estimator=tir_optimal_token_baseline", f"{ACTOR}.calculate_sum_pi_squared=true")
    assert tir.algorithm.adv_estimator == "tir_optimal_token_baseline" and tir.actor.sum_pi_squared
    assert not plan().actor.sum_pi_squared
    dro = plan(f"{ACTOR}.policy_loss.loss_mode=dro", f"{ACTOR}.policy_loss.dro_beta=0.05")
    assert (dro.actor.loss.loss_mode, dro.actor.loss.clip.dro_beta) == ("dro", 0.05)
    for mode in ("geo_mean", "dppo_tv", "dppo_kl"):
        options = plan(f"{ACTOR}.policy_loss.loss_mode={mode}", f"{ACTOR}.clip_ratio_c=20")
        assert options.actor.loss.loss_mode == mode and options.actor.loss.clip.clip_ratio_c == 20.0


@pytest.mark.parametrize("overrides, key, reason", [
    (["algorithm.adv_estimator=gdpo"], "algorithm.gdpo_reward_keys", "needs distinct names"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,a]"], "algorithm.gdpo_reward_keys",
     "needs distinct names"),
    (["algorithm.gdpo_reward_keys=[a]"], "algorithm.gdpo_reward_keys", "is read by adv_estimator=gdpo only"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,uid]"], "algorithm.gdpo_reward_keys",
     "'uid' is a column every sample already has"),
    (["algorithm.gdpo_reward_weights=[1]"], "algorithm.gdpo_reward_weights", "is read by adv_estimator=gdpo only"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1]"],
     "algorithm.gdpo_reward_weights", "1 weights for 2 gdpo_reward_keys"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a]", "algorithm.norm_adv_by_std_in_grpo=false"],
     "algorithm.norm_adv_by_std_in_grpo", "false is not read by adv_estimator=gdpo"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a]", "algorithm.use_kl_in_reward=true"],
     "algorithm.use_kl_in_reward", "true has no effect with adv_estimator=gdpo"),
    (["algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n",
     "grpo_passk needs >= 2 samples"),
    ([f"{ACTOR}.clip_ratio_low=10"], f"{ACTOR}.clip_ratio_low", "only policy_loss.loss_mode=cispo allows"),
    ([f"{ACTOR}.clip_ratio_low=null", f"{ACTOR}.clip_ratio=1.0", f"{ACTOR}.policy_loss.loss_mode=sapo"],
     f"{ACTOR}.clip_ratio", "only policy_loss.loss_mode=cispo allows"),
    ([f"{ACTOR}.policy_loss.tau_neg=0"], f"{ACTOR}.policy_loss.tau_neg", ""),
    ([f"{ACTOR}.policy_loss.loss_mode=dro"], f"{ACTOR}.policy_loss.dro_beta", "loss_mode=dro needs dro_beta > 0"),
    (["algorithm.adv_estimator=optimal_token_baseline"], f"{ACTOR}.calculate_sum_pi_squared", "needs it"),
    (["algorithm.adv_estimator=tir_optimal_token_baseline"], f"{ACTOR}.calculate_sum_pi_squared", "needs it"),
    ([f"{ACTOR}.calculate_sum_pi_squared=true"], f"{ACTOR}.calculate_sum_pi_squared",
     "read by adv_estimator=optimal_token_baseline/tir_optimal_token_baseline only"),
    (["algorithm.adv_estimator=optimal_token_baseline", f"{ACTOR}.calculate_sum_pi_squared=true",
      "algorithm.rollout_correction.bypass_mode=true"], f"{ACTOR}.calculate_sum_pi_squared",
     "this job skips that pass"),
    ([f"{ACTOR}.policy_loss.dro_beta=0.1"], f"{ACTOR}.policy_loss.dro_beta", "loss_mode=vanilla has none"),
    ([f"{ACTOR}.policy_loss.loss_mode=dro", f"{ACTOR}.policy_loss.dro_beta=0"], f"{ACTOR}.policy_loss.dro_beta", ""),
])
def test_invalid_combinations_are_refused_naming_the_key(overrides, key, reason):
    with pytest.raises(ConfigError) as err:
        plan(*overrides)
    assert err.value.key == key and reason in str(err.value) and "\n" not in str(err.value)


def test_advantages_read_gdpo_components_from_the_reward_extras():
    """The controller's advantage step takes gdpo's components from the batch's per-sample columns (verl's
    non_tensor_batch): here two extras, one of them bools, next to the prompt uids."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)
    fmt, acc = [True, False, True, True], [0.0, 1.0, 0.5, 1.0]
    batch = Batch(tensors={"token_level_rewards": torch.full((4, 3), float("nan")), "response_mask": mask},
                  non_tensors={"uid": ["u", "u", "v", "v"], "fmt": fmt, "acc": acc})
    algo = plan("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt,acc]",
                "algorithm.gdpo_reward_weights=[2,1]").algorithm
    batch_ops.advantages(batch, algo)
    expected = _gdpo_reference([[float(x) for x in fmt], acc], [2.0, 1.0], ["u", "u", "v", "v"], mask.tolist())
    torch.testing.assert_close(batch.tensors["advantages"], torch.tensor(expected, dtype=torch.float32))
    del batch.non_tensors["acc"]
    with pytest.raises(ValueError, match="'acc' is not a per-sample column of the batch"):
        batch_ops.advantages(batch, algo)


TWO_STEPS = ["trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1"]
# The surrogate that ran, by its metrics: vanilla logs both clip fractions, cispo its weights clipped, gpg and sapo
# clip nothing.
VANILLA_CLIP = {"actor/pg_clipfrac", "actor/pg_clipfrac_lower"}
CLIP_METRICS = {"gpg": set(), "cispo": {"actor/pg_clipfrac"}, "sapo": set(), "grpo_passk": VANILLA_CLIP,
                "dr_grpo": VANILLA_CLIP, "geo_mean": VANILLA_CLIP, "dppo_kl": VANILLA_CLIP, "dro": set(),
                "rloo_vectorized": VANILLA_CLIP, "optimal_token_baseline": VANILLA_CLIP,
                "tir_optimal_token_baseline": VANILLA_CLIP, "clip_cov": {"actor/pg_clipfrac"}, "kl_cov": set()}


# Each is a 2-step job (~20 s on CI): the default set runs one surrogate and one estimator (the options of the others
# are checked by test_verl_spellings_reach_the_options, their maths by the algos tests), the slow set all of them.
@pytest.mark.parametrize("name, overrides", [
    pytest.param("gpg", ["algorithm.adv_estimator=gpg", f"{ACTOR}.policy_loss.loss_mode=gpg"],
                 marks=pytest.mark.slow),
    pytest.param("cispo", [f"{ACTOR}.policy_loss.loss_mode=cispo", f"{ACTOR}.clip_ratio_low=10",
                           f"{ACTOR}.clip_ratio_high=0.2"], marks=pytest.mark.slow),
    ("sapo", [f"{ACTOR}.policy_loss.loss_mode=sapo", f"{ACTOR}.policy_loss.tau_pos=1.0",
              f"{ACTOR}.policy_loss.tau_neg=1.05", f"{ACTOR}.loss_agg_mode=seq-mean-token-mean"]),
    ("grpo_passk", ["algorithm.adv_estimator=grpo_passk"]),
    ("geo_mean", [f"{ACTOR}.policy_loss.loss_mode=geo_mean"]),
    ("optimal_token_baseline", ["algorithm.adv_estimator=optimal_token_baseline",
                                f"{ACTOR}.calculate_sum_pi_squared=true"]),
    pytest.param("tir_optimal_token_baseline", ["algorithm.adv_estimator=tir_optimal_token_baseline",
                                                f"{ACTOR}.calculate_sum_pi_squared=true"], marks=pytest.mark.slow),
    pytest.param("dppo_kl", [f"{ACTOR}.policy_loss.loss_mode=dppo_kl", f"{ACTOR}.clip_ratio_c=20"],
                 marks=pytest.mark.slow),
    pytest.param("dro", [f"{ACTOR}.policy_loss.loss_mode=dro", f"{ACTOR}.policy_loss.dro_beta=0.1"],
                 marks=pytest.mark.slow),
    pytest.param("rloo_vectorized", ["algorithm.adv_estimator=rloo_vectorized"], marks=pytest.mark.slow),
    # two mini batches a step: the second selects from its own forward pass
    pytest.param("kl_cov", [f"{ACTOR}.policy_loss.loss_mode=kl_cov", f"{ACTOR}.policy_loss.kl_cov_ratio=0.01",
                            f"{ACTOR}.ppo_mini_batch_size=4"], marks=pytest.mark.slow),
    pytest.param("clip_cov", [f"{ACTOR}.policy_loss.loss_mode=clip_cov", f"{ACTOR}.policy_loss.clip_cov_ratio=0.01",
                              f"{ACTOR}.policy_loss.clip_cov_lb=0.01"], marks=pytest.mark.slow),
    pytest.param("dr_grpo", ["algorithm.norm_adv_by_std_in_grpo=false",
                             f"{ACTOR}.loss_agg_mode=seq-mean-token-sum-norm", f"{ACTOR}.use_kl_loss=false"],
                 marks=pytest.mark.slow),
])
def test_default_job_runs_two_steps_with_verl_flags(tmp_path, name, overrides):
    rows = run_job(tmp_path, *TWO_STEPS, *overrides)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(r[key]) for key in ("actor/pg_loss", "actor/grad_norm", "critic/advantages/mean"))
        assert {key for key in r if key.startswith("actor/pg_clipfrac")} == CLIP_METRICS[name]
    if name == "grpo_passk":  # one sample per group at most is pushed up, none down
        assert all(r["critic/advantages/min"] == 0.0 for r in rows)
    if name == "dr_grpo":  # no std division: a centred 0/1 score lies in [-1, 1]
        assert all(-1.0 <= r["critic/advantages/min"] <= r["critic/advantages/max"] <= 1.0 for r in rows)


REWARD_WITH_COMPONENTS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = 1.0 if solution_str.strip().startswith(str(ground_truth)) else 0.0
    return {"score": correct, "correct": correct, "brief": len(solution_str.strip()) <= 1}
'''


def test_default_job_runs_gdpo_on_the_reward_extras(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_WITH_COMPONENTS)
    rows = run_job(tmp_path, *TWO_STEPS, f"custom_reward_function.path={reward}",
                   "custom_reward_function.name=compute_score", "algorithm.adv_estimator=gdpo",
                   "algorithm.gdpo_reward_keys=[correct,brief]", "algorithm.gdpo_reward_weights=[1.0,0.5]")
    assert [r["step"] for r in rows] == [1, 2]
