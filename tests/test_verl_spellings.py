"""verl's other spellings of shardrl keys: verl 0.9's `reward.*` group (the newer spelling of
`custom_reward_function`, the reward model's switches and the reward manager) and verl's names for the collective
timeout and the sync bucket size. Each entry gives exactly the config its shardrl key gives, verl 0.9's DAPO command
line plans as the older one does, and what has no counterpart or contradicts the other spelling is refused in one
line naming the key."""

import dataclasses
import subprocess
import sys

import pytest

from shardrl.job.errors import ConfigError
from shardrl.job.load import VERL_SPELLINGS, compose
from shardrl.job.plan import plan_job

# A value for each folded entry (the older key's type), and for the reward model its companions.
VALUES = {"num_workers": 3, "custom_reward_function.path": "/tmp/score.py", "custom_reward_function.name": "judge",
          "reward_manager.name": "batch", "reward_model.enable": True, "reward_model.enable_resource_pool": True,
          "reward_model.n_gpus_per_node": 1, "reward_model.nnodes": 1, "reward_model.model_path": "/tmp/rm"}
NEEDS = {"reward_model.enable": ["reward_model.model.path=/tmp/rm"],
         "reward_model.enable_resource_pool": ["reward_model.enable=true", "reward_model.model.path=/tmp/rm",
                                               "reward_model.n_gpus_per_node=1", "reward_model.nnodes=1"],
         "reward_model.n_gpus_per_node": ["reward_model.nnodes=1"], "reward_model.nnodes": []}


def without_reward_group(config):
    return dataclasses.replace(config, reward=None)


@pytest.mark.parametrize("source", sorted(VALUES))
def test_each_entry_is_its_older_key(source):
    value = VALUES[source]
    target = VERL_SPELLINGS[f"reward.{source}"]
    extra = NEEDS.get(source, [])
    if source == "reward_model.nnodes":
        extra = ["reward_model.n_gpus_per_node=1"]
    newer = compose("ppo_trainer", [f"reward.{source}={value}", *extra])
    older = compose("ppo_trainer", [f"{target}={value}", *extra])
    assert newer.at(target) == value
    assert without_reward_group(newer) == without_reward_group(older)


DAPO_OLDER = ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
              "+reward_model.reward_kwargs.overlong_buffer_cfg.len=1",
              "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
              "+reward_model.reward_kwargs.overlong_buffer_cfg.log=True",
              "+reward_model.reward_kwargs.max_resp_len=${data.max_response_length}"]


def test_verl_09s_dapo_command_line_plans_as_the_older_one():
    newer = [key.replace("reward_model.reward_manager", "reward.reward_manager.name")
             .replace("reward_model.reward_kwargs", "reward.reward_kwargs") for key in DAPO_OLDER]
    new_plan, old_plan = (plan_job(compose("ppo_trainer", overrides)) for overrides in (newer, DAPO_OLDER))
    assert new_plan.reward == old_plan.reward and new_plan.reward.overlong.penalty_factor == 0.5


@pytest.mark.parametrize("overrides, key, reason", [
    (["reward.custom_reward_function.name=f", "custom_reward_function.name=g"], "reward.custom_reward_function.name",
     "set one"),
    (["reward.reward_model.model_path=/a", "reward_model.model.path=/b"], "reward.reward_model.model_path",
     "set one"),
    (["reward.reward_kwargs.x=1"], "reward.reward_kwargs", ""),  # not in the yaml: needs +, Hydra says so
    (["+reward.reward_kwargs.top_k=1"], "reward_model.reward_kwargs.top_k", "not a reward-manager argument"),
    (["reward.reward_manager.source=importlib"], "reward.reward_manager.source", "custom_reward_function"),
    (["reward.reward_manager.module.path=/my/manager.py"], "reward.reward_manager.module.path", "of your own"),
    (["reward.reward_model.rollout.tensor_model_parallel_size=2"],
     "reward.reward_model.rollout.tensor_model_parallel_size", "reward_model.megatron"),
    (["+reward.reward_model.rollout.swap_space=4"], "reward.reward_model.rollout.swap_space", "no counterpart"),
    (["reward.sandbox_fusion.url=http://sandbox:8080"], "reward.sandbox_fusion.url", "code_interpreter"),
    (["reward.reward_manager.name=prime"], "reward.reward_manager.name", ""),
])
def test_what_has_no_counterpart_or_contradicts_is_refused(overrides, key, reason):
    if key == "reward.reward_kwargs":
        with pytest.raises(Exception, match="reward.reward_kwargs.x"):
            compose("ppo_trainer", overrides)
        return
    with pytest.raises(ConfigError) as err:
        compose("ppo_trainer", overrides)
    assert err.value.key == key and reason in str(err.value) and "\n" not in str(err.value)


def test_the_same_value_in_both_spellings_is_accepted():
    config = compose("ppo_trainer", ["reward.custom_reward_function.path=/s.py", "custom_reward_function.path=/s.py"])
    assert config.custom_reward_function.path == "/s.py"


def test_a_dry_run_refuses_in_one_line_with_exit_code_2():
    done = subprocess.run([sys.executable, "-m", "shardrl.trainer.main_ppo", "trainer.dry_run=true",
                           "reward.sandbox_fusion.url=http://sandbox:8080"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert done.stderr.startswith("error: reward.sandbox_fusion.url: has no counterpart")


class Digits:
    def batch_decode(self, rows: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return [" ".join(map(str, ids)) for ids in rows]


def _by_experiment(data_source, solution_str, ground_truth, extra_info):
    run = (extra_info or {}).get("experiment_name")
    return {"score": float(run == "exp-7"), "run": run}


@pytest.mark.parametrize("spelling", ["reward_model.reward_manager=gdpo", "reward.reward_manager.name=gdpo"])
def test_verls_gdpo_manager_hands_the_function_the_experiment_name(spelling):
    """verl's gdpo manager puts trainer.experiment_name into each sample's extra_info; naive does not."""
    import torch

    from shardrl.data.batch import Batch
    from shardrl.trainer import batch_ops

    def scored(*overrides):
        reward = plan_job(compose("ppo_trainer", ["trainer.experiment_name=exp-7", *overrides])).reward
        mask = torch.tensor([[1, 1], [1, 0]])
        batch = Batch({"responses": torch.tensor([[1, 2], [3, 0]]), "response_mask": mask, "attention_mask": mask},
                      {"data_source": ["x", "x"], "reward_model": [{"ground_truth": ""}] * 2,
                       "extra_info": [{"split": "train"}, None]})
        _, scores = batch_ops.score(batch, Digits(), _by_experiment, reward)
        return scores, batch

    scores, batch = scored(spelling)
    assert scores.scores.tolist() == [1.0, 1.0] and scores.extras["run"] == ["exp-7", "exp-7"]
    assert batch.non_tensors["extra_info"][0] == {"split": "train", "experiment_name": "exp-7"}
    naive, _ = scored()
    assert naive.scores.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("source, value", [("actor_rollout_ref.nccl_timeout", 1200),
                                           ("actor_rollout_ref.rollout.checkpoint_engine."
                                            "update_weights_bucket_megabytes", 4096)])
def test_verls_names_for_the_timeout_and_the_sync_bucket(source, value):
    target = VERL_SPELLINGS[source]
    newer, older = (plan_job(compose("ppo_trainer", [f"{key}={value}"])) for key in (source, target))
    assert compose("ppo_trainer", [f"{source}={value}"]).at(target) == value
    assert newer.rollout.weight_sync == older.rollout.weight_sync and newer.cluster == older.cluster
    assert (newer.rollout.weight_sync.bucket_bytes == 4096 << 20) == (value == 4096)
    assert (newer.cluster.collective_timeout.total_seconds() == 1200) == (value == 1200)
    with pytest.raises(ConfigError, match="set one") as err:
        compose("ppo_trainer", [f"{source}={value}", f"{target}={value + 1}"])
    assert err.value.key == source


@pytest.mark.parametrize("entry, value, accepted", [
    ("optimizer_cpu_offload", "False", True), ("use_precision_aware_optimizer", "False", True),
    ("optimizer_offload_fraction", "0", True), ("decoupled_weight_decay", "True", True),
    ("optimizer_cpu_offload", "True", False), ("optimizer_offload_fraction", "1", False),
    ("use_precision_aware_optimizer", "True", False), ("decoupled_weight_decay", "False", False),
    ("adam_eps", "1e-6", False),
])
def test_megatron_optimizer_overrides_pass_only_where_they_describe_shardrls_adamw(entry, value, accepted):
    key = f"actor_rollout_ref.actor.optim.override_optimizer_config.{entry}"
    config = compose("ppo_trainer", [f"+{key}={value}"])
    if accepted:
        assert plan_job(config).actor.model.engine.optim is not None
        return
    with pytest.raises(ConfigError) as err:
        plan_job(config)
    assert err.value.key == key and "not supported" in str(err.value) and "\n" not in str(err.value)


def test_data_trust_remote_code_needs_the_models():
    with pytest.raises(ConfigError) as err:
        compose("ppo_trainer", ["data.trust_remote_code=true"])
    assert err.value.key == "data.trust_remote_code" and "actor_rollout_ref.model.trust_remote_code" in str(err.value)
    compose("ppo_trainer", ["data.trust_remote_code=true", "actor_rollout_ref.model.trust_remote_code=true"])


@pytest.mark.parametrize("role", ["actor", "ref"])
def test_verl_09s_engine_level_routing_replay_is_the_roles_router_replay(role):
    engine = f"actor_rollout_ref.{role}.megatron.router_replay.mode"
    config = compose("ppo_trainer", [f"{engine}=R3"])
    assert config.at(f"actor_rollout_ref.{role}.router_replay.mode") == "R3"
    assert dataclasses.replace(config, actor_rollout_ref=compose("ppo_trainer", [
        f"actor_rollout_ref.{role}.router_replay.mode=R3"]).actor_rollout_ref).actor_rollout_ref.actor.router_replay \
        == config.actor_rollout_ref.actor.router_replay
    with pytest.raises(ConfigError, match="set one") as err:
        compose("ppo_trainer", [f"{engine}=R3", f"actor_rollout_ref.{role}.router_replay.mode=R2"])
    assert err.value.key == engine


@pytest.mark.parametrize("override, key, reason", [
    ("critic.megatron.router_replay.mode=R2", "critic.megatron.router_replay.mode", "policy's"),
    ("actor_rollout_ref.actor.megatron.router_replay.record_file=/tmp/r.pt",
     "actor_rollout_ref.actor.megatron.router_replay.record_file", "in the batch"),
    ("actor_rollout_ref.actor.megatron.use_remove_padding=false", "actor_rollout_ref.actor.megatron.use_remove_padding",
     "always packs"),
    ("critic.megatron.use_remove_padding=false", "critic.megatron.use_remove_padding", "always packs"),
    ("actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable", "multi-token-prediction"),
    ("actor_rollout_ref.model.mtp.enable_train=true", "actor_rollout_ref.model.mtp.enable_train", "qwen3_moe"),
])
def test_verl_09s_engine_and_mtp_keys_refused_where_shardrl_cannot_honour_them(override, key, reason):
    with pytest.raises(ConfigError) as err:
        plan_job(compose("ppo_trainer", [override]))
    assert err.value.key == key and reason in str(err.value) and "\n" not in str(err.value)


def test_verl_09s_megatron_script_keys_at_their_values_plan():
    plan_job(compose("ppo_trainer", ["actor_rollout_ref.actor.megatron.use_remove_padding=true",
                                     "actor_rollout_ref.model.mtp.enable=false",
                                     "actor_rollout_ref.model.mtp.mtp_loss_scaling_factor=0.2"]))


def _final_lr(overrides):
    from types import SimpleNamespace

    from shardrl.parallel.optimizer import LRScheduler

    optim = plan_job(compose("ppo_trainer", ["actor_rollout_ref.actor.optim.lr_decay_style=cosine",
                                             *overrides])).actor.model.engine.optim
    scheduler = LRScheduler(SimpleNamespace(lr=optim.lr), total_steps=10, style=optim.decay_style,
                            min_lr_ratio=optim.min_lr_ratio)
    return scheduler.lr_at(0), scheduler.lr_at(10)


def test_verls_megatron_min_lr_is_the_final_learning_rate():
    peak, final = _final_lr(["actor_rollout_ref.actor.optim.lr=2e-6", "actor_rollout_ref.actor.optim.min_lr=5e-7"])
    assert peak == pytest.approx(2e-6) and final == pytest.approx(5e-7)
    assert _final_lr(["actor_rollout_ref.actor.optim.lr=2e-6", "actor_rollout_ref.actor.optim.min_lr_ratio=0.25"]) \
        == pytest.approx((peak, final))
    compose("ppo_trainer", ["actor_rollout_ref.actor.optim.lr=2e-6", "actor_rollout_ref.actor.optim.min_lr=5e-7",
                            "actor_rollout_ref.actor.optim.min_lr_ratio=0.25"])  # the same rate twice
    for overrides, reason in ((["actor_rollout_ref.actor.optim.lr=2e-6",
                                "actor_rollout_ref.actor.optim.min_lr=1e-5"], "above"),
                              (["actor_rollout_ref.actor.optim.min_lr=1e-7",
                                "actor_rollout_ref.actor.optim.min_lr_ratio=0.5"], "set one")):
        with pytest.raises(ConfigError, match=reason) as err:
            compose("ppo_trainer", overrides)
        assert err.value.key == "actor_rollout_ref.actor.optim.min_lr"


def test_rollout_logprobs_mode_reaches_the_engine_and_the_logits_modes_are_refused():
    key = "actor_rollout_ref.rollout.logprobs_mode"
    assert plan_job(compose("ppo_trainer", [f"{key}=raw_logprobs"])).rollout.engine.logprobs_mode == "raw_logprobs"
    assert plan_job(compose("ppo_trainer")).rollout.engine.logprobs_mode == "processed_logprobs"
    with pytest.raises(ConfigError, match="not logits") as err:
        plan_job(compose("ppo_trainer", [f"{key}=raw_logits"]))
    assert err.value.key == key and "\n" not in str(err.value)


def test_verl_09s_trainer_switches_run_shardrls_synchronous_trainer():
    """use_v1 either way, and v1's sync mode, plan exactly the default run."""
    def planned(*overrides):  # what runs (the logged config dump names the keys as given)
        return dataclasses.replace(plan_job(compose("ppo_trainer", list(overrides))), tracking=None)

    default = planned()
    assert planned("trainer.use_v1=false") == default
    assert planned("trainer.v1.trainer_mode=sync", "trainer.v1.sampler.max_off_policy_threshold=2") == default


def test_verl_09s_colocated_async_trainer_plans_its_schedule():
    plan = plan_job(compose("ppo_trainer", ["trainer.v1.trainer_mode=colocate_async",
                                            "trainer.v1.colocate_async.num_warmup_batches=2",
                                            "trainer.v1.sampler.max_off_policy_threshold=3"]))
    from shardrl.trainer import staleness

    assert plan.mode == "colocate_async" and plan.placement == "colocated"
    assert staleness.budget(plan) == staleness.Budget(32, 1, 32, 64) and staleness.max_staleness(plan) == 2


@pytest.mark.parametrize("config_name, overrides, key, reason", [
    ("ppo_trainer", ["trainer.v1.trainer_mode=separate_async"], "trainer.v1.trainer_mode", "fully_async_ppo_trainer"),
    ("fully_async_ppo_trainer", ["trainer.v1.trainer_mode=colocate_async"], "trainer.v1.trainer_mode",
     "a pool of its own"),
    ("ppo_trainer", ["trainer.v1.trainer_mode=colocate_async", "trainer.v1.sampler.max_off_policy_strategy=wait"],
     "trainer.v1.sampler.max_off_policy_strategy", "use drop"),
])
def test_verl_09s_trainer_modes_shardrl_cannot_run_are_refused(config_name, overrides, key, reason):
    with pytest.raises(ConfigError, match=reason) as err:
        plan_job(compose(config_name, overrides))
    assert err.value.key == key and "\n" not in str(err.value)


@pytest.mark.parametrize("key", ["tool_config_path", "function_tool_path"])
def test_verls_data_side_tool_paths_are_the_rollouts(key):
    target = f"actor_rollout_ref.rollout.multi_turn.{key}"
    assert compose("ppo_trainer", [f"data.{key}=/tmp/tools"]).at(target) == "/tmp/tools"
    assert compose("ppo_trainer", [f"{target}=/tmp/tools"]).at(f"data.{key}") == "/tmp/tools"  # verl's interpolation
    with pytest.raises(ConfigError, match="set one") as err:
        compose("ppo_trainer", [f"data.{key}=/tmp/a", f"{target}=/tmp/b"])
    assert err.value.key == f"data.{key}"
