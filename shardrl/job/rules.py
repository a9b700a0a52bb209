"""Rules between config keys, checked once by `load_config` after every value's type and range: micro-batch key
pairs, the sync/async shape of the config, which logprobs anchor PPO, and DAPO's dynamic sampling and overlong
shaping. Rules that need world sizes (layouts,
batch-size normalisation, model fit) are in `shardrl.job.plan`."""

from __future__ import annotations


from shardrl.algos import ClipRange
from shardrl.algos.covariance import CovarianceSelection
from shardrl.algos.policy_filtration import PolicyFiltration
from shardrl.algos.rejection import RejectionSpecError
from shardrl.job.errors import ConfigError
from shardrl.job.schema import PolicyFiltrationConfig, PPOConfig

# The estimators that read the old-logprob pass's sum of pi^2 (actor.calculate_sum_pi_squared).
OTB_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")
_CLIP, _COVARIANCE = ClipRange(), CovarianceSelection("clip_cov")
_FILTRATION = PolicyFiltration()
PF_PPO_DEFAULTS = PolicyFiltrationConfig(_FILTRATION.reweight_method, _FILTRATION.weight_pow)
# Keys of actor.policy_loss that one loss_mode reads, with their defaults (the yaml's): under any other mode they must
# keep them.
MODE_ONLY_KEYS: dict[str, dict[str, float]] = {
    "sapo": {"tau_pos": _CLIP.tau_pos, "tau_neg": _CLIP.tau_neg},
    "clip_cov": {"clip_cov_ratio": _COVARIANCE.ratio, "clip_cov_lb": _COVARIANCE.lower,
                 "clip_cov_ub": _COVARIANCE.upper},
    "kl_cov": {"kl_cov_ratio": _COVARIANCE.ratio, "ppo_kl_coef": _CLIP.ppo_kl_coef},
}
USE_ASYNC_CONFIG = "use --config-name=one_step_off_ppo_trainer or fully_async_ppo_trainer (or a *_megatron_* one)"

# (group, stem): `<stem>` (global, deprecated) and `<stem>_per_gpu` must not both be set.
_MICRO_BATCH_PAIRS = (
    ("actor_rollout_ref.actor", "ppo_micro_batch_size"),
    ("actor_rollout_ref.ref", "log_prob_micro_batch_size"),
    ("actor_rollout_ref.rollout", "log_prob_micro_batch_size"),
    ("critic", "ppo_micro_batch_size"),
    ("critic", "forward_micro_batch_size"),
    ("reward_model", "micro_batch_size"),
)
_FULLY_ASYNC_KEYS = ("staleness_threshold", "trigger_parameter_sync_step", "require_batches")


def validate(config: PPOConfig) -> None:
    """Rules between keys that need no world size (those are in plan.plan_job)."""
    for group, stem in _MICRO_BATCH_PAIRS:
        node = config.at(group)
        total, per_gpu = getattr(node, stem), getattr(node, f"{stem}_per_gpu")
        if total is not None and per_gpu is not None:
            raise ConfigError(f"{group}.{stem}", f"set only one of {stem} (global, deprecated; ={total}) and "
                                                 f"{stem}_per_gpu (={per_gpu}); prefer {stem}_per_gpu")
    for name, betas in (("actor_rollout_ref.actor", config.actor_rollout_ref.actor.optim.betas),
                        ("critic", config.critic.optim.betas)):
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ConfigError(f"{name}.optim.betas", f"expected two numbers in [0, 1), got {betas}")
    if config.critic.enable is False and config.algorithm.adv_estimator == "gae":
        raise ConfigError("critic.enable", "adv_estimator=gae needs a critic (values); enable it or use grpo")
    _validate_shared_model_keys(config)
    _validate_distillation(config)
    _validate_reward_model(config)
    if config.trainer.resume_mode == "resume_path" and not config.trainer.resume_from_path:
        raise ConfigError("trainer.resume_from_path", "must be set when trainer.resume_mode=resume_path")
    _validate_async(config)
    _validate_behaviour_logprobs(config)
    _validate_dapo(config)
    _validate_estimators(config)


# Non-tensor columns of every sample batch (the dataset's and the rollout's); gdpo's reward components join them.
SAMPLE_COLUMNS = ("uid", "data_source", "reward_model", "extra_info", "finish_reason")


def _validate_estimators(config: PPOConfig) -> None:
    """Keys only some advantage estimators and surrogates read: gdpo's reward components (and what gdpo leaves
    out), grpo_passk's groups, and the lower clip bound that only cispo may drop."""
    algo = config.algorithm
    keys, weights = algo.gdpo_reward_keys, algo.gdpo_reward_weights
    if algo.adv_estimator != "gdpo":
        for name, value in (("gdpo_reward_keys", keys), ("gdpo_reward_weights", weights)):
            if value is not None:
                raise ConfigError(f"algorithm.{name}", f"is read by adv_estimator=gdpo only (it is "
                                                       f"{algo.adv_estimator}); remove it or set adv_estimator=gdpo")
    elif not keys or len(set(keys)) != len(keys):
        raise ConfigError("algorithm.gdpo_reward_keys", f"adv_estimator=gdpo needs distinct names of the reward "
                                                        f"components it normalises (per-sample entries of the reward "
                                                        f"function's dict result, e.g. [format,accuracy]); got {keys}")
    elif taken := sorted(set(keys) & {*SAMPLE_COLUMNS, config.data.reward_fn_key}):
        raise ConfigError("algorithm.gdpo_reward_keys", f"{taken[0]!r} is a column every sample already has; the "
                                                        "reward components become columns too: name them otherwise")
    elif weights is not None and len(weights) != len(keys):
        raise ConfigError("algorithm.gdpo_reward_weights", f"{len(weights)} weights for {len(keys)} "
                                                           "gdpo_reward_keys; give one per key, or null for 1 each")
    elif not algo.norm_adv_by_std_in_grpo:
        raise ConfigError("algorithm.norm_adv_by_std_in_grpo", "false is not read by adv_estimator=gdpo (each reward "
                                                               "component is divided by its group std, as in verl and "
                                                               "the GDPO paper); set true")
    elif algo.use_kl_in_reward:
        raise ConfigError("algorithm.use_kl_in_reward", "true has no effect with adv_estimator=gdpo (its advantages "
                                                        "come from the reward components, not the token rewards, as "
                                                        "in verl); use actor_rollout_ref.actor.use_kl_loss=true")
    otb, key = algo.adv_estimator in OTB_ESTIMATORS, "actor_rollout_ref.actor.calculate_sum_pi_squared"
    if otb and not config.actor_rollout_ref.actor.calculate_sum_pi_squared:
        raise ConfigError(key, f"adv_estimator={algo.adv_estimator} needs it (the path variance reads sum pi^2 of "
                               "every token): set true")
    if config.actor_rollout_ref.actor.calculate_sum_pi_squared and not otb:
        raise ConfigError(key, f"true is read by adv_estimator={'/'.join(OTB_ESTIMATORS)} only (it is "
                               f"{algo.adv_estimator}); leave it false")
    if algo.use_pf_ppo and algo.adv_estimator != "gae":
        raise ConfigError("algorithm.use_pf_ppo", f"PF-PPO resamples the batch after GAE's advantages (verl's GAE "
                                                  f"branch); adv_estimator={algo.adv_estimator} has none: set "
                                                  "adv_estimator=gae or use_pf_ppo=false")
    if not algo.use_pf_ppo and algo.pf_ppo != PF_PPO_DEFAULTS:
        changed = next(name for name in ("reweight_method", "weight_pow")
                       if getattr(algo.pf_ppo, name) != getattr(PF_PPO_DEFAULTS, name))
        raise ConfigError(f"algorithm.pf_ppo.{changed}", "is read with algorithm.use_pf_ppo=true only: set it, or "
                                                         "leave pf_ppo at its defaults")
    if algo.adv_estimator == "grpo_passk" and config.actor_rollout_ref.rollout.n < 2:
        raise ConfigError("actor_rollout_ref.rollout.n", "adv_estimator=grpo_passk needs >= 2 samples per prompt (it "
                                                         "rewards each group's best over its runner-up)")
    if config.data.trust_remote_code and not config.actor_rollout_ref.model.trust_remote_code:
        raise ConfigError("data.trust_remote_code", "shardrl loads the one tokenizer with actor_rollout_ref.model."
                                                    "trust_remote_code; set that true as well (it lets the model "
                                                    "repository's code run)")
    if config.trainer.val_only and not config.trainer.val_before_train:
        raise ConfigError("trainer.val_only", "it stops after the validation before training, which "
                                              "trainer.val_before_train=false skips; set that true")
    actor = config.actor_rollout_ref.actor
    name = "clip_ratio" if actor.clip_ratio_low is None else "clip_ratio_low"
    low = getattr(actor, name)
    if low >= 1 and actor.policy_loss.loss_mode != "cispo":
        raise ConfigError(f"actor_rollout_ref.actor.{name}", f"{low} >= 1 drops the lower clip bound, which only "
                                                             "policy_loss.loss_mode=cispo allows (it clips a detached "
                                                             "weight); use a value < 1")
    surrogate, key = actor.policy_loss, "actor_rollout_ref.actor.policy_loss"
    if (surrogate.loss_mode == "dro") != (surrogate.dro_beta is not None):
        raise ConfigError(f"{key}.dro_beta", "loss_mode=dro needs dro_beta > 0 (its log-ratio penalty)"
                          if surrogate.dro_beta is None else
                          f"{surrogate.dro_beta} is DRO's penalty and loss_mode={surrogate.loss_mode} has none: leave "
                          "it null")
    for mode, defaults in MODE_ONLY_KEYS.items():
        for name, default in defaults.items() if surrogate.loss_mode != mode else ():
            if getattr(surrogate, name) != default:
                raise ConfigError(f"{key}.{name}", f"{getattr(surrogate, name)} is read by loss_mode={mode} only (it "
                                                   f"is {surrogate.loss_mode}); leave it at {default} or set "
                                                   f"loss_mode={mode}")
    if surrogate.loss_mode == "clip_cov" and not surrogate.clip_cov_lb < surrogate.clip_cov_ub:
        raise ConfigError(f"{key}.clip_cov_lb", f"{surrogate.clip_cov_lb} must be below clip_cov_ub="
                                                f"{surrogate.clip_cov_ub}: Clip-Cov draws tokens whose covariance "
                                                "lies between them")


def _validate_shared_model_keys(config: PPOConfig) -> None:
    """Keys verl lets differ per role that shardrl's roles share: the reference loads the actor's initial weights
    (no seed of its own) and the critic reads the actor's token ids (its tokenizer)."""
    arr, critic = config.actor_rollout_ref, config.critic
    frozen = (("actor_rollout_ref.ref.megatron.seed", arr.ref.megatron.seed, "reference policy"),
              ("distillation.teacher_model.megatron.seed", config.distillation.teacher_model.megatron.seed, "teacher"),
              ("reward_model.megatron.seed", config.reward_model.megatron.seed, "reward model"))
    for key, seed, role in frozen:
        if seed != arr.actor.megatron.seed:
            raise ConfigError(key, f"{seed} differs from the actor's {arr.actor.megatron.seed}; the {role} loads its "
                                   "weights, so nothing of it is random: leave it unset")
    for key in ("tokenizer_path", "trust_remote_code"):
        mine, actors = getattr(critic.model, key), getattr(arr.model, key)
        if mine != actors:
            raise ConfigError(f"critic.model.{key}", f"{mine!r} differs from actor_rollout_ref.model.{key}={actors!r}; "
                                                     "the critic reads the actor's token ids, so leave it unset")


def _validate_distillation(config: PPOConfig) -> None:
    """k1's gradient ignores the teacher; a teacher pool needs distillation on, and the teachers' trainer-pool layout
    stays the reference's there (the teachers themselves are resolved by the planner, `batches.distillation_teachers`).
    `topk` is read only with forward_kl_topk; verl's own default sets it, so the estimators accept it."""
    distillation = config.distillation
    loss, key = distillation.distillation_loss, "distillation.distillation_loss"
    pool = distillation.nnodes * distillation.n_gpus_per_node
    if not distillation.enabled:
        if pool:
            raise ConfigError("distillation.n_gpus_per_node", f"a teacher pool of {pool} ranks with "
                                                              "distillation.enabled=false would stay idle; enable "
                                                              "distillation or set it 0")
        return
    if pool:  # each teacher's `inference` sizes lay it out there, not the trainer pool's teacher layout
        teacher, ref = distillation.teacher_model.megatron, config.actor_rollout_ref.ref.megatron
        for size in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size", "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size"):
            if getattr(teacher, size) != getattr(ref, size):
                raise ConfigError(f"distillation.teacher_model.megatron.{size}", f"{getattr(teacher, size)} lays "
                                  "the teachers out on the trainer pool, and they have a pool of their own "
                                  "(distillation.n_gpus_per_node): set each teacher's distillation.teacher_models."
                                  "<name>.inference sizes instead, and leave this as the reference's")
    if not loss.use_policy_gradient and loss.loss_mode in ("kl", "k1"):
        raise ConfigError(f"{key}.loss_mode", f"{loss.loss_mode} with use_policy_gradient=false: k1's gradient does "
                                              "not depend on the teacher; use k3, or use_policy_gradient=true")


def _validate_reward_model(config: PPOConfig) -> None:
    """A reward model needs its checkpoint."""
    rm = config.reward_model
    if not rm.enable:
        return
    if rm.model.path is None:
        raise ConfigError("reward_model.model.path", "must be set when reward_model.enable=true (an HF "
                                                     "*ForSequenceClassification checkpoint with num_labels=1)")


def _validate_v1_trainer(config: PPOConfig) -> None:
    """verl 0.9's v1 trainer modes: sync and colocate_async run here (colocated); separate_async is refused, and
    colocate_async cannot be combined with an async config's separate rollout pool."""
    v1, key = config.trainer.v1, "trainer.v1.trainer_mode"
    if v1.trainer_mode == "separate_async":
        raise ConfigError(key, "separate_async is not built here; shardrl's asynchronous trainers on a separate "
                               "rollout pool are --config-name=one_step_off_ppo_trainer and fully_async_ppo_trainer "
                               "(docs/async.md); colocate_async runs colocated")
    if v1.trainer_mode == "colocate_async" and config.async_training is not None:
        raise ConfigError(key, f"colocate_async runs the rollout on the trainer pool, and this config's "
                               f"async_training.mode={config.async_training.mode} puts it on a pool of its own; use "
                               f"--config-name=ppo_trainer (or ppo_megatron_trainer) with colocate_async")
    if v1.trainer_mode == "colocate_async" and v1.sampler.max_off_policy_strategy != "drop":
        raise ConfigError("trainer.v1.sampler.max_off_policy_strategy", f"{v1.sampler.max_off_policy_strategy} "
                                                                         "(wait for stale groups instead of dropping "
                                                                         "them) is not built; use drop")


def _validate_async(config: PPOConfig) -> None:
    """Sync mode colocates actor and rollout; the async modes need a rollout pool and their own keys."""
    _validate_v1_trainer(config)
    async_cfg, pool = config.async_training, config.rollout
    if (async_cfg is None) != (pool is None):
        present = "async_training" if pool is None else "rollout"
        raise ConfigError(present, f"the async modes need both the rollout pool (rollout.nnodes/n_gpus_per_node) "
                                   f"and async_training; {USE_ASYNC_CONFIG}")
    hybrid = config.actor_rollout_ref.hybrid_engine
    if async_cfg is None and not hybrid:
        raise ConfigError("actor_rollout_ref.hybrid_engine", f"false needs a separate rollout pool; {USE_ASYNC_CONFIG}")
    if async_cfg is None:
        return
    if hybrid:
        raise ConfigError("actor_rollout_ref.hybrid_engine", f"must be false in {async_cfg.mode} mode (rollout runs "
                                                             "on its own pool)")
    fully = async_cfg.mode == "fully_async"
    for key in _FULLY_ASYNC_KEYS:
        value = getattr(async_cfg, key)
        if fully and value is None:
            raise ConfigError(f"async_training.{key}", "is required in fully_async mode")
        if not fully and value is not None:
            raise ConfigError(f"async_training.{key}", "is only used in fully_async mode")
    if fully and async_cfg.partial_rollout is None:  # optional in one_step_off (default false)
        raise ConfigError("async_training.partial_rollout", "is required in fully_async mode")
    if not fully and pool.total_rollout_steps is not None:
        raise ConfigError("rollout.total_rollout_steps", "is only used in fully_async mode")


def _validate_behaviour_logprobs(config: PPOConfig) -> None:
    """The PPO anchor (see shardrl.algos.off_policy): decoupled=true recomputes old logprobs with the actor;
    decoupled=false anchors on the rollout's behaviour logprobs, which verl's async recipes call
    use_rollout_log_probs."""
    correction = config.algorithm.rollout_correction
    _rollout_correction_rules(config)
    async_cfg = config.async_training
    if async_cfg is not None and async_cfg.use_rollout_log_probs == correction.decoupled:
        wanted = "false" if async_cfg.use_rollout_log_probs else "true"
        raise ConfigError("async_training.use_rollout_log_probs",
                          f"{str(async_cfg.use_rollout_log_probs).lower()} needs algorithm.rollout_correction."
                          f"decoupled={wanted} (true: train on behaviour logprobs; false: recompute old logprobs)")


def _rollout_correction_rules(config: PPOConfig) -> None:
    """Which corrections each anchor can apply. Decoupled: IS weights (optionally batch-normalised) and rejection
    sampling, once per step against the recomputed old logprobs. Bypass: PPO-clip, or with loss_type=reinforce
    REINFORCE with IS weights of the current policy per micro batch (verl's bypass mode)."""
    correction, key = config.algorithm.rollout_correction, "algorithm.rollout_correction"
    try:
        rejection = correction.rejection()
    except RejectionSpecError as err:
        raise ConfigError(f"{key}.{err.key}", err.reason) from None
    reinforce = correction.loss_type == "reinforce"
    if correction.rollout_is_batch_normalize and correction.rollout_is is None:
        raise ConfigError(f"{key}.rollout_is_batch_normalize", "true normalises importance weights; set rollout_is "
                                                               "to token or sequence")
    if correction.decoupled:
        if reinforce:
            raise ConfigError(f"{key}.loss_type", "reinforce is bypass mode's loss (verl ignores it with "
                                                  "bypass_mode=false); set bypass_mode=true or loss_type=ppo_clip")
        return
    if correction.rollout_is is not None and not reinforce:
        raise ConfigError(f"{key}.rollout_is", "needs decoupled=true, i.e. bypass_mode=false (importance weights "
                                               "compare recomputed old logprobs with behaviour logprobs), or "
                                               "loss_type=reinforce in bypass mode")
    if rejection is not None:
        name = "rollout_rs" if rejection.criteria else "rollout_token_veto_threshold"
        raise ConfigError(f"{key}.{name}", "needs decoupled=true, i.e. bypass_mode=false: rejection compares "
                                           "recomputed old logprobs with behaviour logprobs once per step (verl's "
                                           "bypass form re-tests every micro batch against the current policy)")
    if reinforce and correction.rollout_is_batch_normalize:
        raise ConfigError(f"{key}.rollout_is_batch_normalize", "is not supported with loss_type=reinforce (verl "
                                                               "normalises per micro batch there); set it false")
    loss_mode = config.actor_rollout_ref.actor.policy_loss.loss_mode
    if reinforce and loss_mode != "vanilla":
        raise ConfigError("actor_rollout_ref.actor.policy_loss.loss_mode", f"{loss_mode} cannot be combined with "
                                                                           f"{key}.loss_type=reinforce (it replaces "
                                                                           "the PPO surrogate); use vanilla")


def _validate_dapo(config: PPOConfig) -> None:
    """Dynamic sampling (algorithm.filter_groups) runs in the synchronous step only: the async schedules take groups
    as they finish and cannot hold a step back for more prompt batches. The overlong buffer must fit the response."""
    groups, data, key = config.algorithm.filter_groups, config.data, "algorithm.filter_groups.enable"
    if groups.enable:
        if config.async_training is not None:
            raise ConfigError(key, f"true is not supported in {config.mode} mode (its schedule takes groups as they "
                                   "finish); use --config-name=ppo_trainer or ppo_megatron_trainer")
        if config.actor_rollout_ref.rollout.n < 2:
            raise ConfigError(key, "true needs actor_rollout_ref.rollout.n >= 2 (a group of one sample has no spread "
                                   "to filter on)")
        if groups.metric == "seq_final_reward" and config.algorithm.use_kl_in_reward:
            raise ConfigError("algorithm.filter_groups.metric", "seq_final_reward with algorithm.use_kl_in_reward=true "
                                                                "is not supported (the KL penalty is applied after the "
                                                                "filter, to the kept groups only); use seq_reward")
    elif data.gen_batch_size != data.train_batch_size:
        raise ConfigError("data.gen_batch_size", f"{data.gen_batch_size} differs from data.train_batch_size="
                                                 f"{data.train_batch_size}, which needs {key}=true; leave "
                                                 "gen_batch_size unset")
    overlong = config.reward_model.overlong_buffer
    if overlong.enable and not 1 <= overlong.len <= data.max_response_length:
        raise ConfigError("reward_model.overlong_buffer.len", f"{overlong.len} must be in [1, "
                                                              f"data.max_response_length={data.max_response_length}] "
                                                              "when the buffer is enabled")
