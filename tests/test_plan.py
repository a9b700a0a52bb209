"""Dry-run planner: layouts, rank tables, normalised batch sizes and model-config checks, against hand-computed
values; every invalid layout or batch size fails with one line naming the dotted key."""

import itertools
import json

import pytest
from hydra import compose as hydra_compose, initialize_config_dir
from omegaconf import OmegaConf

from shardrl.job.load import CONFIG_DIR, compose, load_config
from shardrl.job.batches import MicroBatching
from shardrl.job.plan import format_plan, plan_job
from shardrl.job.errors import ConfigError
from example_command import example_overrides


# The batch sizes these hand-computed expectations were written for (the yaml defaults are tuned for the default
# job); the tests' own overrides come after and win.
BASE = ("data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4")


def plan_of(overrides=(), name="ppo_trainer"):
    return plan_job(compose(name, [*BASE, *overrides]))


def error_of(overrides, name="ppo_trainer"):
    with pytest.raises(ConfigError) as info:
        plan_of(overrides, name)
    assert "\n" not in str(info.value)
    return info.value


def test_issue_example_plan_hand_computed():
    config = compose("ppo_megatron_trainer", example_overrides())
    plan = plan_job(config)
    actor = plan.roles["actor"]
    s = actor.spec
    assert (s.world_size, s.tp, s.pp, s.vpp, s.cp, s.dp, s.ep, s.etp, s.edp) == (8, 4, 2, 1, 1, 1, 4, 1, 1)
    assert actor.tables["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert actor.tables["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert actor.tables["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert actor.tables["edp"] == [[r] for r in range(8)]
    # 32 prompts x n=1 / DP 1 = 32 samples per rank, micro 1 -> 32; old logprobs: 128 samples, micro 2 -> 64
    assert actor.batches == {"update": MicroBatching(32, 1, 32, None), "log_prob": MicroBatching(128, 2, 64, None)}
    assert plan.roles["critic"].batches == {"update": MicroBatching(32, 1, 32, None),
                                            "values": MicroBatching(128, 1, 128, None)}
    assert "ref" not in plan.roles and "ref" in plan.skipped
    rollout = plan.roles["rollout"]
    assert (rollout.spec.tp, rollout.spec.dp, rollout.ranks) == (4, 2, list(range(8)))
    assert (plan.placement, plan.step_prompts, plan.mini_batches_per_step) == ("colocated", 128, 4)
    text = format_plan(plan, config)
    assert "actor: TP4 PP2 DP1, EP4 ETP1 expert-DP1 on 8 GPUs" in text
    assert "  tp        [[0,1,2,3],[4,5,6,7]]" in text


def test_default_config_plans_on_cpu_with_ranks_as_gpus():
    plan = plan_of(["trainer.device=cpu", "trainer.n_gpus_per_node=2"])
    assert plan.device == "cpu" and plan.roles["actor"].spec.dp == 2
    # mini 8 prompts x n 4 = 32 samples / DP 2 = 16 per rank, micro 8 -> 2; step 16 x 4 = 64 / 2 = 32, micro 16 -> 2
    assert plan.roles["actor"].batches == {"update": MicroBatching(16, 8, 2, None),
                                           "log_prob": MicroBatching(32, 16, 2, None)}
    assert set(plan.skipped) == {"ref", "teacher", "reward_model", "critic", "judge"}


def test_reference_policy_planned_when_kl_is_used():
    plan = plan_of(["actor_rollout_ref.actor.use_kl_loss=true"])
    assert plan.roles["ref"].batches == {"log_prob": MicroBatching(64, 16, 4, None)}


def test_world_not_divisible_by_tp_pp_cp():
    err = error_of(["trainer.n_gpus_per_node=6", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"])
    assert err.key == "actor_rollout_ref.actor.megatron"
    assert "world size 6 is not divisible by TP*CP*PP = 4*1*1" in err.reason


def test_ep_etp_not_dividing_world_over_pp():
    err = error_of(["algorithm.adv_estimator=gae", "trainer.n_gpus_per_node=2",
                    "critic.megatron.pipeline_model_parallel_size=2", "critic.megatron.expert_model_parallel_size=2"])
    assert err.key == "critic.megatron" and "EP*ETP = 2*1 does not divide world/PP = 2/2" in err.reason


def test_normalised_mini_batch_is_zero():
    err = error_of(["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n=2",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
    assert err.key == "actor_rollout_ref.actor.ppo_mini_batch_size"
    assert "1 prompts x rollout.n 2 = 2 samples do not split evenly over DP=4 (0 per rank)" in err.reason


def test_normalised_mini_batch_uneven_over_dp():
    err = error_of(["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n=3", "data.train_batch_size=6",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
    assert err.key == "actor_rollout_ref.actor.ppo_mini_batch_size"


def test_normalised_mini_batch_not_divisible_by_micro_batch():
    err = error_of(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])
    assert err.key == "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    assert "32 samples per DP rank" in err.reason and "micro batch 3" in err.reason


def test_train_batch_smaller_than_mini_batch():
    err = error_of(["data.train_batch_size=4"])
    assert err.key == "actor_rollout_ref.actor.ppo_mini_batch_size"
    assert "8 prompts is larger than the 4 prompts of a step" in err.reason


def test_train_batch_not_a_multiple_of_mini_batch():
    assert error_of(["data.train_batch_size=12"]).key == "data.train_batch_size"


def test_no_micro_batch_key_set_derives_the_largest_that_fits_the_token_budget():
    # 32 samples per rank of 66 tokens (64 prompt + 2 response); 1000 tokens hold 15: the largest divisor is 8
    plan = plan_of(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000"])
    update = plan.roles["actor"].batches["update"]
    assert update == MicroBatching(32, 8, 4, None, derived=True)
    assert "micro batch 8 (derived: its keys are null) -> 4 micro batches" in update.describe()
    tiny = plan_of(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10"])  # not one sequence: one a micro batch
    assert tiny.roles["actor"].batches["update"] == MicroBatching(32, 1, 32, None, derived=True)


def test_default_job_plans_for_every_group_size():
    """The yaml defaults alone (no BASE): any rollout.n from 1 to 8, on one or two ranks (one composition, the
    keys set on its tree: Hydra's composition costs more than the plan)."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        default = hydra_compose(config_name="ppo_trainer")
    for dp, n in itertools.product((1, 2), range(1, 9)):
        tree = OmegaConf.merge(default, {"actor_rollout_ref": {"rollout": {"n": n}},
                                         "trainer": {"n_gpus_per_node": dp, "device": "cpu"}})
        update = plan_job(load_config(tree)).roles["actor"].batches["update"]
        assert update.samples_per_rank == 16 * n // dp and update.derived
    assert plan_job(load_config(default)).roles["actor"].batches["update"] == MicroBatching(128, 64, 2, None, True)


# Every divisibility error proposes `set key=value ...`; applying the proposal must plan.
PROPOSALS = {
    "micro": ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
    "global_micro": ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size=3",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"],
    "log_prob_micro": ["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n=3",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"],
    "mini_over_dp": ["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n=3", "data.train_batch_size=24",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
    "mini_and_step_over_dp": ["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=6",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"],
    "step_over_dp": ["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=6",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"],
    "step_not_multiple": ["data.train_batch_size=12"],
    "mini_over_step": ["data.train_batch_size=4"],
    "critic_step": ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=6"],
    "async_critic_step": ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=12",
                          "async_training.require_batches=1"],
    "rollout_tp": ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
    "judge_tp": ["trainer.n_gpus_per_node=2", "reward_model.judge.enable=true",
                 "reward_model.judge.model_path=/nonexistent/judge",
                 "reward_model.judge.tensor_model_parallel_size=4"],
}


def proposed(reason: str) -> list[str]:
    """The `key=value` overrides after the error's `set`."""
    _, _, fix = reason.partition("; set ")
    return [word.rstrip(",;)") for word in fix.split() if "=" in word]


@pytest.mark.parametrize("case", sorted(PROPOSALS))
def test_divisibility_error_proposes_a_value_that_plans(case):
    """Following the proposals (a later check may propose a value of its own) reaches a plan; no check fails twice."""
    name = "fully_async_ppo_trainer" if case.startswith("async") else "ppo_trainer"
    overrides, failed = list(PROPOSALS[case]), []
    for _ in range(5):
        try:
            plan_of(overrides, name)
            return
        except ConfigError as err:
            fix = proposed(err.reason)
            assert fix and any(f.startswith(f"{err.key}=") for f in fix) and err.reason not in failed, err
            overrides, failed = overrides + fix, failed + [err.reason]
    pytest.fail(f"still failing after {failed}")


def test_deprecated_global_micro_batch_is_divided_by_dp():
    plan = plan_of(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size=8",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"])
    assert plan.roles["actor"].batches["update"] == MicroBatching(16, 4, 4, None)  # 8/2 = 4 per rank; 16/4 = 4
    err = error_of(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size=3",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"])
    assert err.key == "actor_rollout_ref.actor.ppo_micro_batch_size"


def test_dynamic_batch_size_uses_token_budget():
    plan = plan_of(["actor_rollout_ref.actor.use_dynamic_bsz=true"])
    assert plan.roles["actor"].batches["update"] == MicroBatching(32, None, None, 8192)
    assert plan.roles["actor"].batches["log_prob"] == MicroBatching(64, None, None, 8192)  # interpolated keys follow
    err = error_of(["actor_rollout_ref.actor.use_dynamic_bsz=true",
                    "data.max_response_length=32", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=95"])
    assert err.key == "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"  # 64 prompt + 32 response = 96 tokens


def test_rollout_tp_not_dividing_colocated_pool():
    err = error_of(["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"])
    assert err.key == "actor_rollout_ref.rollout.tensor_model_parallel_size"


def test_rollout_tp_not_dividing_detached_rollout_pool():
    err = error_of(["rollout.n_gpus_per_node=3", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
                   "one_step_off_ppo_trainer")
    assert err.key == "actor_rollout_ref.rollout.tensor_model_parallel_size" and "rollout pool" in err.reason


def test_detached_rollout_pool_ignores_the_trainer_layout():
    # trainer: 2 ranks at TP2; rollout: 3 ranks at TP1 -- TP2 would not divide 3, and must not matter
    plan = plan_of(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "rollout.n_gpus_per_node=3"],
                   "one_step_off_ppo_trainer")
    assert plan.placement == "detached"
    assert plan.trainer_ranks == [0, 1] and plan.rollout_ranks == [2, 3, 4]
    assert plan.roles["actor"].tables["tp"] == [[0, 1]]
    rollout = plan.roles["rollout"]
    assert (rollout.spec.world_size, rollout.spec.tp, rollout.spec.dp) == (3, 1, 3)
    assert rollout.tables["dp"] == [[2, 3, 4]]


def test_fully_async_step_is_require_batches_mini_batches():
    plan = plan_of(["async_training.require_batches=2"], "fully_async_ppo_trainer")
    assert (plan.step_prompts, plan.mini_batches_per_step) == (16, 2)
    assert set(plan.roles["actor"].batches) == {"update"}  # use_rollout_log_probs: no old-logprob pass


def test_rollout_data_parallel_size_must_match_pool():
    err = error_of(["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                    "actor_rollout_ref.rollout.data_parallel_size=4"])
    assert err.key == "actor_rollout_ref.rollout.data_parallel_size"


@pytest.fixture
def model_dir(tmp_path):
    hf = {"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 6, "vocab_size": 1001,
          "num_experts": 6}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def test_model_config_fits(model_dir):
    plan = plan_of([f"actor_rollout_ref.model.path={model_dir}", "trainer.n_gpus_per_node=4",
                    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1"])
    # KV heads 2 < TP 4: replicated (TP divisible by them); vocab 1001 padded to a multiple of TP 4 = 1004
    assert plan.model_notes[0] == ("actor: 8 heads / 2 KV heads over TP4, 6 layers over PP1, 6 experts over EP2, "
                                   "vocab 1001 padded to 1004 - fits")


@pytest.mark.parametrize("overrides, key", [
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=4"],
     "actor_rollout_ref.actor.megatron.expert_model_parallel_size"),
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4"],
     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"),
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
      "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"],
     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"),  # 6 layers over 2 x 2 chunks
    (["+actor_rollout_ref.model.override_config.num_attention_heads=6", "trainer.n_gpus_per_node=4",
      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"],
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"),
    (["+actor_rollout_ref.model.override_config.num_key_value_heads=3", "trainer.n_gpus_per_node=2",
      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"),
    (["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
      "data.train_batch_size=24", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
      "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
     "actor_rollout_ref.rollout.tensor_model_parallel_size"),  # 8 heads over rollout TP3
])
def test_model_config_mismatch_names_the_key(model_dir, overrides, key):
    err = error_of([f"actor_rollout_ref.model.path={model_dir}", *overrides])
    assert err.key == key and str(model_dir / "config.json") in err.reason


def test_critic_model_checked_against_critic_layout(model_dir, tmp_path_factory):
    critic_dir = tmp_path_factory.mktemp("critic")
    (critic_dir / "config.json").write_text(json.dumps({"num_attention_heads": 6, "num_hidden_layers": 2}))
    err = error_of([f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={critic_dir}",
                    "algorithm.adv_estimator=gae", "trainer.n_gpus_per_node=4",
                    "critic.megatron.tensor_model_parallel_size=4"])
    assert err.key == "critic.megatron.tensor_model_parallel_size"


def test_the_builtin_model_is_checked_in_the_dry_run():
    """No model path: the built-in task's model, made at launch, is checked like a directory's: its layout fit and
    `model.override_config` (a misspelt field used to pass the dry run and fail only once workers started)."""
    assert plan_of([]).model_notes[0] == ("actor: 4 heads / 2 KV heads over TP1, 2 layers over PP1, vocab 14 padded "
                                          "to 14 - fits")
    err = error_of(["+actor_rollout_ref.model.override_config.num_hiden_layers=4"])
    assert err.key == "actor_rollout_ref.model.override_config.num_hiden_layers"
    assert "did you mean 'num_hidden_layers'?" in err.reason
    err = error_of(["+actor_rollout_ref.model.override_config.num_hidden_layers=3",
                    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=2"])
    assert err.key == "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"


def test_missing_model_dir_skips_checks():
    plan = plan_of(["actor_rollout_ref.model.path=/nonexistent/model"])
    assert plan.model_notes == ["actor/rollout model: /nonexistent/model: no local config.json; model checks skipped"]


def test_old_logprob_pass_only_when_recomputed():
    assert "log_prob" in plan_of([]).roles["actor"].batches  # decoupled=true: the actor recomputes old logprobs
    assert "log_prob" not in plan_of(["algorithm.rollout_correction.decoupled=false"]).roles["actor"].batches


def test_joining_a_cluster_reserves_whole_cores_and_other_ray_init_entries_are_refused():
    """On a cluster of the user's own a CPU rank takes a whole core, so pools spread over its nodes as GPU ranks do
    (the two-node run: tests/test_multi_node.py); a private local instance packs slivers of its cores."""
    assert plan_job(compose("ppo_trainer", ["+ray_kwargs.ray_init.address=10.0.0.1:6379"])).cluster.whole_cpu_cores
    assert not plan_job(compose("ppo_trainer", ["+ray_kwargs.ray_init.num_cpus=2"])).cluster.whole_cpu_cores
    with pytest.raises(ConfigError, match=r"^ray_kwargs\.ray_init\.runtime_env: not supported; shardrl passes "
                                          r"address, num_cpus to ray\.init$"):
        plan_job(compose("ppo_trainer", ["+ray_kwargs.ray_init.runtime_env={}"]))
