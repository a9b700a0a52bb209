"""Config loading: every packaged config composes and loads; types, choices, ranges and cross-key rules fail with one
line naming the dotted key; verl's own spellings are accepted; launch-only checks stay out of the dry run."""

import dataclasses
import json
import importlib.util
import math
from unittest import mock

import pytest
import torch
from hydra.errors import ConfigCompositionException

from shardrl.algos.aggregate import LossScale, aggregate_loss
from shardrl.job.load import CONFIG_DIR, compose
from shardrl.job.plan import plan_job
from shardrl.job.preflight import check_launch
from shardrl.job.errors import ConfigError
from shardrl.parallel.expert import RouterOptions

CONFIG_NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def actor_loss_options(config):
    """The actor loss the planner compiles from `config`."""
    return plan_job(config).actor.loss


def error_key(overrides, config_name="ppo_trainer"):
    """The key the first error names, loading the config or planning it (where compat refusals fire)."""
    with pytest.raises(ConfigError) as info:
        plan_job(compose(config_name, overrides))
    assert "\n" not in str(info.value)  # one line
    return info.value.key


def test_all_six_configs_are_packaged_and_load():
    assert CONFIG_NAMES == sorted(["ppo_trainer", "ppo_megatron_trainer", "one_step_off_ppo_trainer",
                                   "one_step_off_ppo_megatron_trainer", "fully_async_ppo_trainer",
                                   "fully_async_ppo_megatron_trainer"])
    modes = {name: compose(name).mode for name in CONFIG_NAMES}
    assert modes == {"ppo_trainer": "sync", "ppo_megatron_trainer": "sync",
                     "one_step_off_ppo_trainer": "one_step_off", "one_step_off_ppo_megatron_trainer": "one_step_off",
                     "fully_async_ppo_trainer": "fully_async", "fully_async_ppo_megatron_trainer": "fully_async"}


def test_megatron_config_keeps_the_base_keys_and_changes_defaults():
    base, mega = compose("ppo_trainer"), compose("ppo_megatron_trainer")
    assert (base.data.train_batch_size, mega.data.train_batch_size) == (32, 1024)
    assert mega.algorithm.adv_estimator == "gae" and base.algorithm.adv_estimator == "grpo"
    # interpolations follow the overridden values
    assert mega.critic.ppo_mini_batch_size == 256 and mega.actor_rollout_ref.rollout.response_length == 512
    assert mega.critic.megatron.dtype == "bfloat16"


def test_interpolated_defaults_follow_the_keys_they_name():
    config = compose("ppo_trainer", ["trainer.seed=7", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
    assert config.data.seed == 7 and config.actor_rollout_ref.rollout.seed == 7
    assert config.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2


@pytest.mark.parametrize("override, key", [
    ("algorithm.adv_estimator=ppo2", "algorithm.adv_estimator"),
    ("actor_rollout_ref.actor.loss_agg_mode=seq-sum", "actor_rollout_ref.actor.loss_agg_mode"),
    ("algorithm.kl_penalty=full", "algorithm.kl_penalty"),
    ("data.truncation=middle", "data.truncation"),
    ("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.name"),
])
def test_unknown_choice_names_the_key(override, key):
    assert error_key([override]) == key


def test_unknown_choice_message_lists_the_choices():
    with pytest.raises(ConfigError, match=r"^data.truncation: 'middle' is not one of error \| left \| right$"):
        compose("ppo_trainer", ["data.truncation=middle"])


@pytest.mark.parametrize("override, key", [
    ("data.train_batch_size=0", "data.train_batch_size"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=-4", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("trainer.n_gpus_per_node=0", "trainer.n_gpus_per_node"),
    ("trainer.nnodes=-1", "trainer.nnodes"),
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=0",
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"),
    ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n"),
    ("data.max_response_length=0", "data.max_response_length"),
    ("actor_rollout_ref.rollout.weight_sync.bucket_size_mb=-512",
     "actor_rollout_ref.rollout.weight_sync.bucket_size_mb"),
])
def test_zero_or_negative_size_names_the_key(override, key):
    assert error_key([override]) == key


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"^trainer.total_epochs: expected an integer, got 'many'$"):
        compose("ppo_trainer", ["trainer.total_epochs=many"])


def test_both_micro_batch_keys_set():
    key = error_key(["actor_rollout_ref.actor.ppo_micro_batch_size=16",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    assert key == "actor_rollout_ref.actor.ppo_micro_batch_size"


def test_unknown_key_is_a_hydra_error_and_added_unknown_key_ours():
    with pytest.raises(ConfigCompositionException, match="trainer.not_a_key"):
        compose("ppo_trainer", ["trainer.not_a_key=1"])
    assert error_key(["+trainer.not_a_key=1"]) == "trainer.not_a_key"


@pytest.mark.parametrize("overrides, key", [
    (["critic.enable=false", "algorithm.adv_estimator=gae"], "critic.enable"),
    (["reward_model.enable=true"], "reward_model.model.path"),
    (["reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.megatron.grad_offload=true"],
     "reward_model.megatron.grad_offload"),
    (["trainer.resume_mode=resume_path"], "trainer.resume_from_path"),
    (["actor_rollout_ref.hybrid_engine=false"], "actor_rollout_ref.hybrid_engine"),
    (["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=false"],
     "actor_rollout_ref.rollout.calculate_log_probs"),
    (["algorithm.rollout_correction.decoupled=false", "actor_rollout_ref.rollout.calculate_log_probs=false"],
     "actor_rollout_ref.rollout.calculate_log_probs"),
    (["algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.decoupled=false"],
     "algorithm.rollout_correction.rollout_is"),
    (["actor_rollout_ref.actor.optim.betas=[0.9]"], "actor_rollout_ref.actor.optim.betas"),
])
def test_cross_key_rules(overrides, key):
    assert error_key(overrides) == key


@pytest.mark.parametrize("bypass, recompute", [("true", False), ("false", True), ("null", True)])
def test_verl_bypass_mode_decides_the_ppo_anchor(bypass, recompute):
    # verl >= 0.6.1: bypass_mode=true trains on the rollout's behaviour logprobs (no old-log-prob pass).
    config = compose("ppo_trainer", [f"algorithm.rollout_correction.bypass_mode={bypass}"])
    assert config.algorithm.rollout_correction.decoupled is recompute
    assert (plan_job(config).actor.log_prob is not None) is recompute
    assert error_key(["algorithm.rollout_correction.bypass_mode=true",
                      "algorithm.rollout_correction.rollout_is=token"]) == "algorithm.rollout_correction.rollout_is"


RC = "algorithm.rollout_correction"


def test_verl_07_rollout_correction_command_line_composes():
    # verl 0.6.1 - 0.7's rejection keys: ratio bounds per level, a lower bound, the veto; with normalised seq IS.
    config = compose("ppo_trainer", [
        f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=2.0", f"{RC}.rollout_is_batch_normalize=true",
        f"{RC}.rollout_rs=geometric", f"{RC}.rollout_rs_threshold=1.001", f"{RC}.rollout_rs_threshold_lower=0.999",
        f"{RC}.rollout_token_veto_threshold=1e-4", f"{RC}.bypass_mode=false", f"{RC}.loss_type=ppo_clip"])
    rc = config.algorithm.rollout_correction
    (criterion,) = rc.rejection().criteria
    assert (criterion.name, criterion.reduction) == ("geometric", "mean")
    assert (criterion.lower, criterion.upper) == (0.999, 1.001)
    assert rc.rejection().veto_threshold == 1e-4 and rc.rollout_is_batch_normalize and rc.decoupled


def test_verl_main_rollout_rs_command_line_composes():
    # verl after 0.7: a comma list of divergence criteria with one threshold spec each (quoted for Hydra).
    config = compose("ppo_trainer", [f"{RC}.rollout_rs='token_k1,seq_mean_k3'",
                                     f"{RC}.rollout_rs_threshold='0.5_2.0,0.01'"])
    criteria = config.algorithm.rollout_correction.rejection().criteria
    assert [(c.name, c.lower, c.upper) for c in criteria] == [
        ("token_k1", pytest.approx(math.log(0.5)), pytest.approx(math.log(2.0))), ("seq_mean_k3", None, 0.01)]
    # A single number is kept as a number: for k1 it is the upper ratio bound, the lower one its reciprocal.
    (k1,) = compose("ppo_trainer", [f"{RC}.rollout_rs=seq_sum_k1", f"{RC}.rollout_rs_threshold=2"]
                    ).algorithm.rollout_correction.rejection().criteria
    assert (k1.lower, k1.upper) == (pytest.approx(-math.log(2.0)), pytest.approx(math.log(2.0)))


@pytest.mark.parametrize("overrides, key", [
    ([f"{RC}.rollout_rs=token_k9", f"{RC}.rollout_rs_threshold=2.0"], f"{RC}.rollout_rs"),
    ([f"{RC}.rollout_rs=token"], f"{RC}.rollout_rs_threshold"),
    ([f"{RC}.rollout_rs=seq_mean_k3", f"{RC}.rollout_rs_threshold=0.1_0.2"], f"{RC}.rollout_rs_threshold"),
    ([f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=2.0", f"{RC}.rollout_rs_threshold_lower=0.5"],
     f"{RC}.rollout_rs_threshold_lower"),
    ([f"{RC}.rollout_rs_threshold=2.0"], f"{RC}.rollout_rs_threshold"),
    ([f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=true"], f"{RC}.rollout_rs_threshold"),
    ([f"{RC}.rollout_token_veto_threshold=0"], f"{RC}.rollout_token_veto_threshold"),
    ([f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=2.0", f"{RC}.bypass_mode=true"], f"{RC}.rollout_rs"),
    ([f"{RC}.rollout_token_veto_threshold=1e-4", f"{RC}.decoupled=false"], f"{RC}.rollout_token_veto_threshold"),
    ([f"{RC}.rollout_is_batch_normalize=true"], f"{RC}.rollout_is_batch_normalize"),
    ([f"{RC}.rollout_rs=token", f"{RC}.rollout_rs_threshold=2.0",
      "actor_rollout_ref.rollout.calculate_log_probs=false"], "actor_rollout_ref.rollout.calculate_log_probs"),
    ([f"{RC}.loss_type=reinforce"], f"{RC}.loss_type"),
    ([f"{RC}.loss_type=pg"], f"{RC}.loss_type"),
    ([f"{RC}.use_policy_gradient=1"], f"{RC}.use_policy_gradient"),
    ([f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=token",
      f"{RC}.rollout_is_batch_normalize=true"], f"{RC}.rollout_is_batch_normalize"),
    ([f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
     "actor_rollout_ref.actor.policy_loss.loss_mode"),
])
def test_rollout_correction_rules_name_the_key(overrides, key):
    assert error_key(overrides) == key


@pytest.mark.parametrize("overrides", [
    [f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=3"],
    [f"{RC}.bypass_mode=true", f"{RC}.use_policy_gradient=true", f"{RC}.rollout_is=token",
     f"{RC}.rollout_is_threshold=3"],  # verl 0.6.1's spelling of loss_type=reinforce
])
def test_verl_bypass_reinforce_reaches_the_actor_loss_options(overrides):
    config = compose("ppo_trainer", overrides)
    assert not config.algorithm.rollout_correction.decoupled
    assert config.algorithm.rollout_correction.loss_type == "reinforce"
    options = actor_loss_options(config)
    assert (options.loss_mode, options.bypass_is) == ("reinforce", ("token", 3.0))
    options = actor_loss_options(compose("ppo_trainer", [f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce"]))
    assert (options.loss_mode, options.bypass_is) == ("reinforce", None)
    options = actor_loss_options(compose("ppo_trainer", [f"{RC}.bypass_mode=true", f"{RC}.use_policy_gradient=false"]))
    assert (options.loss_mode, options.bypass_is) == ("vanilla", None)


def test_async_rules():
    assert error_key(["actor_rollout_ref.hybrid_engine=true"], "fully_async_ppo_trainer") == \
        "actor_rollout_ref.hybrid_engine"
    assert error_key(["+async_training.staleness_threshold=0.5"], "one_step_off_ppo_trainer") == \
        "async_training.staleness_threshold"
    assert error_key(["async_training.partial_rollout=null"], "fully_async_ppo_trainer") == \
        "async_training.partial_rollout"
    compose("one_step_off_ppo_trainer", ["async_training.partial_rollout=true"])  # optional there
    # verl's use_rollout_log_probs and our decoupled flag name the same choice and must agree
    assert error_key(["algorithm.rollout_correction.decoupled=true"], "fully_async_ppo_trainer") == \
        "async_training.use_rollout_log_probs"
    compose("fully_async_ppo_trainer", ["algorithm.rollout_correction.decoupled=true",
                                        "async_training.use_rollout_log_probs=false"])


def test_verl_spellings_are_accepted():
    config = compose("ppo_megatron_trainer", [
        "actor_rollout_ref.actor.grad_clip=0.5", "trainer.logger=['console','wandb']",
        "actor_rollout_ref.rollout.name=vllm", "data.train_files=/data/gsm8k/train.parquet",
        "+actor_rollout_ref.model.override_config.max_position_embeddings=32768",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
    ])
    assert config.actor_rollout_ref.actor.clip_grad_norm == 0.5
    assert config.critic.clip_grad_norm == 1.0
    assert config.trainer.logger == ["console", "wandb"]
    assert config.actor_rollout_ref.model.override_config == {"max_position_embeddings": 32768}
    assert config.actor_rollout_ref.ref.megatron.override_transformer_config == {"recompute_granularity": "full"}


def test_gspo_command_line_reaches_the_actor_loss_options():
    # A verl user's GSPO flags, unchanged; the default stays vanilla.
    assert actor_loss_options(compose("ppo_trainer")).loss_mode == "vanilla"
    options = actor_loss_options(compose("ppo_megatron_trainer", [
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "actor_rollout_ref.actor.clip_ratio_low=0.0003",
        "actor_rollout_ref.actor.clip_ratio_high=0.0004", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true", "critic.use_dynamic_bsz=true",
    ]))
    assert (options.loss_mode, options.loss_agg_mode) == ("gspo", "seq-mean-token-mean")
    assert (options.clip.low, options.clip.high) == (0.0003, 0.0004)


def test_clip_ratio_alone_leaves_the_clip_range_as_verl_does():
    # verl's clip_ratio_low / high default to 0.2 themselves; clip_ratio is their fallback only when they are null.
    clip = actor_loss_options(compose("ppo_trainer", ["actor_rollout_ref.actor.clip_ratio=0.3"])).clip
    assert (clip.low, clip.high) == (0.2, 0.2)
    clip = actor_loss_options(compose("ppo_trainer", ["actor_rollout_ref.actor.clip_ratio=0.3",
                                                       "actor_rollout_ref.actor.clip_ratio_low=null",
                                                       "actor_rollout_ref.actor.clip_ratio_high=0.28"])).clip
    assert (clip.low, clip.high) == (0.3, 0.28)


@pytest.mark.parametrize("alias, name", [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_verl_kl_estimator_aliases_are_accepted(alias, name):
    config = compose("ppo_trainer", [f"actor_rollout_ref.actor.kl_loss_type={alias}", f"algorithm.kl_penalty={alias}"])
    assert config.actor_rollout_ref.actor.kl_loss_type == config.algorithm.kl_penalty == alias


def test_loss_scale_factor_is_the_divisor_of_seq_mean_token_sum_norm():
    # verl's divisor of seq-mean-token-sum-norm; null falls back to the response length (2 in the default job).
    assert actor_loss_options(compose("ppo_trainer")).max_response_length == 2
    options = actor_loss_options(compose("ppo_trainer", [
        "actor_rollout_ref.actor.loss_scale_factor=4096",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
    ]))
    assert options.max_response_length == 4096
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    scale = LossScale.from_mask(mask, options.max_response_length)
    loss = aggregate_loss(per_token, mask, options.loss_agg_mode, scale)
    assert loss.item() == (1 + 2 + 4 + 5 + 6) / 2 / 4096  # the mean over the 2 sequences, over the factor


def test_unknown_policy_loss_mode_names_the_key_and_the_modes():
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.actor.policy_loss.loss_mode: 'gpo' is not one of "
                                          r"vanilla \| gspo \| gpg \| cispo \| sapo \| geo_mean \| dppo_tv \| "
                                          r"dppo_kl \| dro \| clip_cov \| kl_cov$"):
        compose("ppo_trainer", ["actor_rollout_ref.actor.policy_loss.loss_mode=gpo"])


def test_nonexistent_data_file_fails_only_at_launch(tmp_path):
    missing = tmp_path / "train.parquet"
    config = compose("ppo_trainer", [f"data.train_files={missing}"])  # loading (and the dry run) accept it
    with pytest.raises(ConfigError, match=f"^data.train_files: {missing} does not exist$"):
        check_launch(plan_job(config))
    missing.write_bytes(b"")
    check_launch(plan_job(config))


def test_val_file_list_is_checked_item_by_item(tmp_path):
    present = tmp_path / "a.parquet"
    present.write_bytes(b"")
    config = compose("ppo_trainer", [f"data.val_files=[{present},{tmp_path / 'b.parquet'}]"])
    with pytest.raises(ConfigError, match="^data.val_files: .*b.parquet does not exist$"):
        check_launch(plan_job(config))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_missing_rollout_engine_fails_at_launch_suggesting_native():
    config = compose("ppo_trainer", ["actor_rollout_ref.rollout.name=vllm"])
    with pytest.raises(ConfigError) as info:
        check_launch(plan_job(config))
    assert info.value.key == "actor_rollout_ref.rollout.name"
    assert "vllm is not installed" in str(info.value) and "actor_rollout_ref.rollout.name=native" in str(info.value)


def test_installed_rollout_engine_without_a_backend_fails_at_launch():
    """An installed vllm must not quietly run the native engine instead."""
    config = compose("ppo_trainer", ["actor_rollout_ref.rollout.name=sglang"])
    with mock.patch("shardrl.job.preflight._installed", return_value=True):
        with pytest.raises(ConfigError, match="^actor_rollout_ref.rollout.name: sglang is installed but shardrl has "
                                              "no sglang backend yet; use actor_rollout_ref.rollout.name=native"):
            check_launch(plan_job(config))


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_missing_logger_package_fails_at_launch():
    config = compose("ppo_trainer", ["trainer.logger=[console,wandb]"])
    with pytest.raises(ConfigError, match="^trainer.logger: wandb is not installed"):
        check_launch(plan_job(config))


# A verl DAPO recipe's trainer flags (recipe/dapo scripts, sizes of the 32B run), unchanged.
DAPO_FLAGS = ["data.max_prompt_length=2048", "data.max_response_length=20480", "data.truncation=left",
              "data.gen_batch_size=1536", "data.train_batch_size=512", "actor_rollout_ref.rollout.n=16",
              "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False", "algorithm.kl_ctrl.kl_coef=0.0",
              "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.kl_loss_coef=0.0",
              "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
              "actor_rollout_ref.actor.clip_ratio_c=10.0", "algorithm.filter_groups.enable=True",
              "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10",
              "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
              "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
              "reward_model.overlong_buffer.len=4096", "reward_model.overlong_buffer.penalty_factor=1.0",
              "reward_model.overlong_buffer.log=False"]


def test_verl_dapo_command_line_is_accepted_and_the_features_default_off():
    config = compose("ppo_megatron_trainer", DAPO_FLAGS)
    groups, overlong = config.algorithm.filter_groups, config.reward_model.overlong_buffer
    assert (groups.enable, groups.metric, groups.max_num_gen_batches) == (True, "acc", 10)
    assert (overlong.enable, overlong.len, overlong.penalty_factor, overlong.log) == (True, 4096, 1.0, False)
    assert (config.data.gen_batch_size, config.data.train_batch_size) == (1536, 512)
    for name in CONFIG_NAMES:
        config = compose(name)
        assert not config.algorithm.filter_groups.enable and not config.reward_model.overlong_buffer.enable
        assert config.data.gen_batch_size == config.data.train_batch_size


# verl's main trainer (verl.trainer.main_ppo, reward_manager=dapo) takes the overlong shaping as reward-manager kwargs.
MAIN_TRAINER_OVERLONG = ["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                         "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096",
                         "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                         "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
                         "+reward_model.reward_kwargs.max_resp_len=20480"]


def test_verl_main_trainer_overlong_spelling_equals_the_recipe_one():
    recipe = compose("ppo_megatron_trainer", DAPO_FLAGS)
    flags = [f for f in DAPO_FLAGS if not f.startswith("reward_model.overlong_buffer")] + MAIN_TRAINER_OVERLONG
    main_trainer = compose("ppo_megatron_trainer", flags)
    assert main_trainer.reward_model == recipe.reward_model
    assert main_trainer.reward_model.overlong_buffer.enable and main_trainer.reward_model.reward_kwargs == {}


@pytest.mark.parametrize("overrides, key", [
    (DAPO_FLAGS + MAIN_TRAINER_OVERLONG, "reward_model.reward_kwargs.overlong_buffer_cfg"),  # both spellings
    (["+reward_model.reward_kwargs.max_resp_len=4096"], "reward_model.reward_kwargs.max_resp_len"),
    (["+reward_model.reward_kwargs.overlong_buffer_cfg.size=8"], "reward_model.reward_kwargs.overlong_buffer_cfg"),
    (["+reward_model.reward_kwargs.compute_score_kwargs=1"], "reward_model.reward_kwargs.compute_score_kwargs"),
])
def test_reward_kwargs_rules(overrides, key):
    assert error_key(overrides, "ppo_megatron_trainer") == key


def test_unknown_filter_metric_names_the_key_and_the_metrics():
    with pytest.raises(ConfigError, match=r"^algorithm.filter_groups.metric: 'accuracy' is not one of acc \| score \| "
                                          r"seq_reward \| seq_final_reward$"):
        compose("ppo_trainer", ["algorithm.filter_groups.metric=accuracy"])


@pytest.mark.parametrize("overrides, key", [
    (["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=3"],  # max_response_length=2
     "reward_model.overlong_buffer.len"),
    (["reward_model.overlong_buffer.enable=true"], "reward_model.overlong_buffer.len"),  # len 0
    (["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=1"], "algorithm.filter_groups.enable"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
      "algorithm.use_kl_in_reward=true"], "algorithm.filter_groups.metric"),
    (["data.gen_batch_size=64"], "data.gen_batch_size"),
    (["algorithm.filter_groups.max_num_gen_batches=-1"], "algorithm.filter_groups.max_num_gen_batches"),
])
def test_dapo_rules(overrides, key):
    assert error_key(overrides) == key


def test_overlong_buffer_may_be_the_whole_response():
    compose("ppo_trainer", ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=2"])
    with pytest.raises(ConfigError, match=r"^reward_model.overlong_buffer.len: 3 must be in \[1, "
                                          r"data.max_response_length=2\] when the buffer is enabled$"):
        compose("ppo_trainer", ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=3"])


@pytest.mark.parametrize("name", ["one_step_off_ppo_trainer", "one_step_off_ppo_megatron_trainer",
                                  "fully_async_ppo_trainer", "fully_async_ppo_megatron_trainer"])
def test_dynamic_sampling_is_refused_in_the_async_modes(name):
    with pytest.raises(ConfigError, match=r"^algorithm.filter_groups.enable: true is not supported in "
                                          r"(one_step_off|fully_async) mode"):
        compose(name, ["algorithm.filter_groups.enable=true"])


OVERRIDES = "+actor_rollout_ref.actor.megatron.override_transformer_config"


def test_verl_full_recompute_trio_and_moe_coefficients_reach_the_model_options():
    plan = plan_job(compose("ppo_megatron_trainer", [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", "actor_rollout_ref.rollout."
        "tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1",
        f"{OVERRIDES}.recompute_granularity=full", f"{OVERRIDES}.recompute_method=uniform",
        f"{OVERRIDES}.recompute_num_layers=1", f"{OVERRIDES}.moe_aux_loss_coeff=0.01",
        f"{OVERRIDES}.moe_z_loss_coeff=0.001", f"{OVERRIDES}.moe_router_dtype=fp32",
        f"{OVERRIDES}.apply_rope_fusion=true",
        f"{OVERRIDES}.moe_grouped_gemm=true", f"{OVERRIDES}.attention_backend=flash"]))
    engine = plan.actor.model.engine
    assert engine.recompute and engine.router == RouterOptions(aux_loss_coef=0.01, z_loss_coef=0.001, fp32_logits=True)
    default = plan_job(compose("ppo_megatron_trainer", [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", "actor_rollout_ref.rollout."
        "tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1"])).actor.model.engine
    assert not default.recompute and default.router == RouterOptions()


@pytest.mark.parametrize("setting,field,words", [
    ("foo_bar=1", "foo_bar", "not a setting shardrl's model reads"),
    ("recompute_granularity=selective", "recompute_granularity", "recomputes whole layers; set full"),
    ("recompute_method=block", "recompute_method", "set uniform"),
    ("recompute_num_layers=4", "recompute_num_layers", "set 1"),
    ("recompute_method=uniform", "recompute_method", "no effect without recompute_granularity=full"),
    ("apply_rope_fusion=false", "apply_rope_fusion", "no unfused path"),
    ("attention_backend=fused", "attention_backend", "set flash, fa4 or auto"),
    ("moe_aux_loss_coeff=-1", "moe_aux_loss_coeff", "not a non-negative number"),
    ("moe_router_dtype=fp64", "moe_router_dtype", "set fp32"),
])
def test_transformer_overrides_shardrl_cannot_honour_are_refused_by_name(setting, field, words):
    with pytest.raises(ConfigError) as info:
        plan_job(compose("ppo_trainer", [f"{OVERRIDES}.{setting}"]))
    assert info.value.key == f"actor_rollout_ref.actor.megatron.override_transformer_config.{field}"
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.fixture
def head_dim_64(tmp_path) -> str:
    """A model directory (config.json only: planning reads no weights) whose head size FA4 is used for."""
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=512, vocab_size=128)))
    return str(tmp_path)


def test_attention_backend_reaches_each_roles_model_options(head_dim_64):
    """Each role reads its own (the reference follows the actor's mapping, as in verl's config); absent, it is
    Megatron's default `auto` (FA4 where it runs, resolved on the worker)."""
    overrides = ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
                 f"actor_rollout_ref.model.path={head_dim_64}", f"critic.model.path={head_dim_64}",
                 f"{OVERRIDES}.attention_backend=fa4",
                 "+critic.megatron.override_transformer_config.attention_backend=flash"]
    plan = plan_job(compose("ppo_trainer", overrides))
    assert plan.actor.model.engine.fast.attention == "fa4"
    assert plan.critic.model.engine.fast.attention == "flash"
    assert plan.ref.model.engine.fast.attention == "fa4"
    assert plan_job(compose("ppo_trainer")).actor.model.engine.fast.attention == "auto"


def test_fa4_is_refused_for_a_head_size_it_is_not_used_for():
    # The built-in model's head_dim is 16, where FA4's backward returned wrong gradients on an H200.
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.actor.megatron.override_transformer_config."
                                          r"attention_backend: fa4: FlashAttention-4 is used for head_dim in \(32, "
                                          r"64, 96, 128, 192, 256\) .* the built-in tiny model has 16; set flash or "
                                          r"auto$"):
        plan_job(compose("ppo_trainer", [f"{OVERRIDES}.attention_backend=fa4"]))


def test_fa4_is_refused_at_launch_where_it_cannot_run(head_dim_64):
    config = compose("ppo_trainer", [f"{OVERRIDES}.attention_backend=fa4", "trainer.device=cpu",
                                     f"actor_rollout_ref.model.path={head_dim_64}"])
    plan = plan_job(config)  # the dry run accepts it: the machine that launches is what cannot run it
    key = "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend"
    with mock.patch("shardrl.job.preflight.check_model_dir"), \
            mock.patch("shardrl.job.preflight.check_model_weights"):  # its config.json holds no weights to check
        with pytest.raises(ConfigError, match=f"^{key}: fa4 runs on CUDA GPUs and this run is on cpu"):
            check_launch(plan)
        cuda_plan = dataclasses.replace(plan, device="cuda")
        with mock.patch("torch.cuda.is_available", return_value=True), \
                mock.patch("shardrl.job.preflight._installed", side_effect=lambda package: package != "flash_attn"):
            with pytest.raises(ConfigError, match=f"^{key}: FlashAttention-4 is not installed "
                                                  r"\(pip install 'shardrl\[fa4\]'\); set flash or auto$"):
                check_launch(cuda_plan)


def test_fa4_is_refused_in_bitwise_mode():
    assert error_key(["actor_rollout_ref.rollout.bitwise_logprobs=true", "actor_rollout_ref.actor.megatron.dtype="
                      "bfloat16", "actor_rollout_ref.rollout.dtype=bfloat16", f"{OVERRIDES}.attention_backend=fa4"]) \
        == "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend"


def test_a_critic_override_is_refused_under_the_critics_key():
    assert error_key(["algorithm.adv_estimator=gae", "+critic.megatron.override_transformer_config.foo=1"]) == \
        "critic.megatron.override_transformer_config.foo"


def test_fp32_router_logits_are_refused_in_bitwise_mode():
    # The rollout engine computes router logits in the model dtype: the trainer's fp32 ones could not match its bits.
    assert error_key(["actor_rollout_ref.rollout.bitwise_logprobs=true", "actor_rollout_ref.actor.megatron.dtype="
                      "bfloat16", "actor_rollout_ref.rollout.dtype=bfloat16", f"{OVERRIDES}.moe_router_dtype=fp32"]) \
        == "actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype"


def _with_tensors(source, target, names):
    """A copy of the tiny checkpoint `source` at `target` whose weights file also holds `names` (zeros)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors") | {name: torch.zeros(2, 2) for name in names}
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("family, extra, overrides, dropped", [
    ("qwen2", ["mtp.eh_proj.weight", "mtp.layers.0.input_layernorm.weight"], [], "mtp.eh_proj.weight"),
    ("llama", ["lm_head.weight", "model.rotary_emb.inv_freq"], [], None),  # tied: transformers ignores both too
    ("qwen2", [], ["+actor_rollout_ref.model.override_config.num_hidden_layers=1"], "model.layers.1."),
])
def test_checkpoint_strict_refuses_a_starting_checkpoint_with_tensors_the_model_drops(tmp_path, family, extra,
                                                                                      overrides, dropped):
    from shardrl.models.tiny import make_tiny_checkpoint

    path = _with_tensors(make_tiny_checkpoint(family, tmp_path / "tiny"), tmp_path / "model", extra)
    key = "actor_rollout_ref.actor.checkpoint.strict"
    config = compose("ppo_trainer", [f"actor_rollout_ref.model.path={path}", *overrides])
    if dropped is None:
        check_launch(plan_job(config))
        return
    with pytest.raises(ConfigError) as info:
        check_launch(plan_job(config))
    assert info.value.key == key and repr(dropped).rstrip("'") in str(info.value) and "\n" not in str(info.value)
    check_launch(plan_job(compose("ppo_trainer", [f"actor_rollout_ref.model.path={path}", f"{key}=false",
                                                  *overrides])))


def test_a_critic_from_a_causal_lm_is_strict_about_all_but_its_lm_head(tmp_path):
    from shardrl.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen2", tmp_path / "tiny")  # untied: the policy carries lm_head.weight
    critic = ["algorithm.adv_estimator=gae", f"actor_rollout_ref.model.path={path}", f"critic.model.path={path}"]
    check_launch(plan_job(compose("ppo_trainer", critic)))
    with_head = _with_tensors(path, tmp_path / "rm", ["score.bias"])
    with pytest.raises(ConfigError, match="'score.bias'") as info:
        check_launch(plan_job(compose("ppo_trainer", [*critic, f"critic.model.path={with_head}"])))
    assert info.value.key == "critic.checkpoint.strict"


def test_a_checkpoint_whose_tensors_do_not_fit_the_model_is_refused_at_launch(tmp_path):
    """What the worker loading it would trip over, found from the safetensors headers before workers start: a tensor
    of another shape, tensors of layers config.json (with its overrides) adds."""
    from safetensors.torch import load_file, save_file

    from shardrl.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen2", tmp_path / "tiny")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    with pytest.raises(ConfigError, match=f"lacks .* tensor.*'model.layers.{layers}.") as info:
        check_launch(plan_job(compose("ppo_trainer", [f"actor_rollout_ref.model.path={path}",
                                                      f"+actor_rollout_ref.model.override_config.num_hidden_layers="
                                                      f"{layers + 1}"])))
    assert info.value.key == "actor_rollout_ref.model.path"
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"'model.norm.weight' has shape \(3,\), the model expects") as info:
        check_launch(plan_job(compose("ppo_trainer", [f"actor_rollout_ref.model.path={path}"])))
    assert info.value.key == "actor_rollout_ref.model.path"
