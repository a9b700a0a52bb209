"""Compiling the config into the options every role and the controller take (options.py): each key that has an
effect is read here, in batches.py (layouts and batch sizes) or by `plan.plan_job`, exactly once; the keys accepted
only for verl compatibility are listed in compat.py. tests/test_config_keys.py walks every leaf of the schema and
checks this."""

from __future__ import annotations

import datetime
import ipaddress
import re
import string
from pathlib import Path
from typing import Any

import torch

from shardrl.agents.driver import AgentSettings
from shardrl.agents.endpoint import EndpointSettings
from shardrl.agents.loop import TurnLimits
from shardrl.agents.parsers import get_parser
from shardrl.algos import ClipRange
from shardrl.algos.covariance import CovarianceSelection
from shardrl.algos.distillation import DistillationSettings
from shardrl.algos.policy_filtration import PolicyFiltration
from shardrl.job.errors import ConfigError
from shardrl.job.batches import MicroBatching, RolePlan, SharedKeys, StepSize, Teacher, named_lora_settings
from shardrl.job.options import (
    ActorOptions,
    AlgorithmOptions,
    AsyncOptions,
    CheckpointOptions,
    ClusterOptions,
    CorrectionOptions,
    CriticOptions,
    DEFAULT_JUDGE_TEMPLATE,
    JUDGE_TEMPLATE_FIELDS,
    DataOptions,
    EngineOptions,
    FilterGroupsOptions,
    JudgeOptions,
    KLInRewardOptions,
    LoopOptions,
    ModelOptions,
    OffloadOptions,
    OptimOptions,
    PolicyLossOptions,
    RefOptions,
    RewardModelOptions,
    RewardOptions,
    RolloutOptions,
    SamplingOptions,
    TeacherOptions,
    TeacherSet,
    UpdateOptions,
    WeightSyncOptions,
)
from shardrl.job.schema import (
    AgentLoopConfig,
    JudgeConfig,
    MultiTurnConfig,
    CheckpointConfig,
    DEFAULT_DISTILLATION_TOPK,
    MegatronConfig,
    Schedule,
    OptimConfig,
    PPOConfig,
    RolloutCorrectionConfig,
)
from shardrl.job.transformer_overrides import read_transformer_overrides
from shardrl.models.fast_paths import FastPaths
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.lora import LoRASettings
from shardrl.rewards.manager import JudgeScoring, OverlongShaping, RewardModelScoring
from shardrl.rollout.runner import EngineConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _checkpoint_options(checkpoint: CheckpointConfig) -> CheckpointOptions:
    return CheckpointOptions(tuple(checkpoint.save_contents), tuple(checkpoint.load_contents), checkpoint.strict)


def _update_options(batching: MicroBatching, epochs: int, shuffle: bool, seed: int) -> UpdateOptions:
    """`batching`: the "update" normalisation (per-rank mini batch = ppo_mini_batch_size * n / DP)."""
    return UpdateOptions(mini_batch_size=batching.samples_per_rank, micro_batch_size=batching.micro_batch_size,
                         max_token_len=batching.max_token_len, ppo_epochs=epochs, shuffle=shuffle, seed=seed)


def actor_options(config: PPOConfig, shared: SharedKeys, role: RolePlan) -> ActorOptions:
    arr = config.actor_rollout_ref
    actor = arr.actor
    optim = optim_options(actor.optim, actor.clip_grad_norm, actor.megatron.use_distributed_optimizer,
                          "actor_rollout_ref.actor.optim")
    model = model_options(actor.megatron, "actor_rollout_ref.actor.megatron", role.spec, role.ranks,
                          arr.model.enable_gradient_checkpointing, optim, shared.override_config, actor.load_weight,
                          bitwise=shared.bitwise, lora=shared.lora, fused_logprobs=shared.fused_logprobs,
                          compile=actor.use_torch_compile)
    if shared.lora is not None and shared.bitwise:
        raise ConfigError("actor_rollout_ref.model.lora_rank", "bitwise mode has no batch-invariant LoRA GEMMs yet; "
                          "use lora_rank=0 or rollout.bitwise_logprobs=false")
    if shared.bitwise:
        _check_bitwise_layout(role.spec, actor.megatron.dtype, "actor_rollout_ref.actor.megatron")
    log_prob = role.batches.get("log_prob")
    mode = shared.router_replay
    if mode == "R3":
        _needs_rollout_routing(shared, "actor_rollout_ref.actor.router_replay.mode")
    if shared.record_routing and log_prob is None and "R3" not in (mode, shared.ref_router_replay):
        raise ConfigError("actor_rollout_ref.rollout.enable_rollout_routing_replay", "the rollout's routing would be "
                          "read by nothing: this job has no old-logprob pass to compare with it and no R3 to replay "
                          "it; set actor_rollout_ref.actor.router_replay.mode=R3 or leave it false")
    if mode == "R2" and log_prob is None:
        raise ConfigError("actor_rollout_ref.actor.router_replay.mode", "R2 replays the routing of the old-logprob "
                                                                        "pass, which this job skips (PPO anchors on "
                                                                        "the rollout's log-probs); use disabled")
    if actor.calculate_sum_pi_squared and log_prob is None:
        raise ConfigError("actor_rollout_ref.actor.calculate_sum_pi_squared", "the old-logprob pass computes it, and "
                          "this job skips that pass (PPO anchors on the rollout's log-probs); the optimal "
                          "token baselines need the recomputed old log-probs")
    measure_unreplayed = actor.router_replay.measure_unreplayed
    if measure_unreplayed and (mode != "R3" or log_prob is None):
        raise ConfigError("actor_rollout_ref.actor.router_replay.measure_unreplayed", "it compares the old-logprob "
                          "pass's R3 replay with its own routing, so it needs router_replay.mode=R3 and an old-logprob "
                          "pass (without replay, rollout_corr/mismatch_kl already measures routing itself); leave it "
                          "false")
    return ActorOptions(
        seed=actor.megatron.seed, model=model,
        update=_update_options(role.batches["update"], actor.ppo_epochs, actor.shuffle, shared.seed),
        loss=policy_loss_options(config, shared.decoupled, shared.use_kl_loss, shared.response_length),
        log_prob=log_prob.forward() if log_prob else None, temperature=shared.temperature or 1.0,
        checkpoint=_checkpoint_options(actor.checkpoint),
        distillation=distillation_settings(config) if shared.distillation else None, router_replay=mode,
        measure_unreplayed=measure_unreplayed, sum_pi_squared=actor.calculate_sum_pi_squared)


_BITWISE = "actor_rollout_ref.rollout.bitwise_logprobs"


def _check_bitwise_layout(spec: LayoutSpec, dtype: str, prefix: str) -> None:
    """Bitwise mode needs every reduction inside one rank's kernels: no tensor (or expert tensor) parallel sums,
    whose order the collective picks by message size, and a half-precision model (the kernels' dtype)."""
    for size, key in ((spec.tp, "tensor_model_parallel_size"), (spec.etp, "expert_tensor_parallel_size"),
                      (spec.cp, "context_parallel_size")):
        if size > 1:
            raise ConfigError(f"{prefix}.{key}", f"{size} with {_BITWISE}=true: partial sums across ranks are added "
                                                 f"in an order the collective picks by size; use 1")
    if dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"{prefix}.dtype", f"{dtype} with {_BITWISE}=true: the batch-invariant kernels are the "
                                             f"half-precision GPU ones; use bfloat16")


def _needs_rollout_routing(shared: SharedKeys, key: str) -> None:
    """R3 replays what the rollout engine recorded: the rollout must record it."""
    if not shared.record_routing:
        raise ConfigError(key, "R3 replays the rollout engine's routing, which it records only with "
                               "actor_rollout_ref.rollout.enable_rollout_routing_replay=true; set it (or use R2)")


def distillation_settings(config: PPOConfig) -> DistillationSettings:
    """The actor loss's distillation term (verl's distillation_loss; the teacher alone trains it without task
    rewards, at weight 1)."""
    loss = config.distillation.distillation_loss
    return DistillationSettings(
        estimator=loss.loss_mode, use_policy_gradient=loss.use_policy_gradient, use_task_rewards=loss.use_task_rewards,
        coef=loss.distillation_loss_coef if loss.use_task_rewards else 1.0, loss_max_clamp=loss.loss_max_clamp,
        log_prob_min_clamp=loss.log_prob_min_clamp,
        clip=ClipRange(loss.clip_ratio, loss.clip_ratio_low, loss.clip_ratio_high),
        topk=(loss.topk or DEFAULT_DISTILLATION_TOPK) if loss.loss_mode == "forward_kl_topk" else None)


def teacher_options(config: PPOConfig, roles: dict[str, RolePlan], teachers: dict[str, Teacher],
                    topk: int | None) -> TeacherSet:
    """Each teacher's options: its role's layout (the trainer pool's one `teacher` role, or its own on the teachers'
    pool) with the engine settings of `distillation.teacher_model.megatron`; `topk`: forward_kl_topk's k."""
    distillation = config.distillation
    megatron, group = distillation.teacher_model.megatron, "distillation.teacher_model.megatron"
    by_key = {}
    for key, teacher in teachers.items():
        role = roles[teacher.role]
        # Frozen like the reference policy, with weights of its own; the student's model overrides are not its own.
        model = model_options(megatron, group, role.spec, role.ranks, False, None, {}, load_weight=True)
        if len(teachers) > 1 and model.dist_checkpoint is not None:
            raise ConfigError(f"{group}.use_dist_checkpointing", f"one distributed checkpoint cannot hold the "
                              f"{len(teachers)} teachers' weights; load them from their HF directories (set it "
                              f"false)")
        by_key[key] = TeacherOptions(f"distillation.teacher_models.{teacher.name}.model_path", teacher.model_path,
                                     model, role.batches["log_prob"].forward(), topk, teacher.memory_fraction)
    return TeacherSet(by_key, distillation.teacher_key if len(teachers) > 1 else None)


def ref_options(config: PPOConfig, shared: SharedKeys, role: RolePlan) -> RefOptions:
    # The reference policy loads the actor's initial weights; it never trains, so it has no optimizer.
    ref = config.actor_rollout_ref.ref
    model = model_options(ref.megatron, "actor_rollout_ref.ref.megatron", role.spec, role.ranks, False, None,
                          shared.override_config, load_weight=True, fused_logprobs=shared.fused_logprobs,
                          compile=ref.use_torch_compile)
    mode = shared.ref_router_replay
    if mode == "R2":
        raise ConfigError("actor_rollout_ref.ref.router_replay.mode", "the reference pass records nothing for a later "
                          "pass to replay; use R3 (the rollout's routing) or disabled")
    if mode == "R3":
        _needs_rollout_routing(shared, "actor_rollout_ref.ref.router_replay.mode")
        if shared.router_replay == "R2":
            raise ConfigError("actor_rollout_ref.ref.router_replay.mode", "R3 replays the rollout's routing, but under "
                              "the actor's R2 the batch carries the old-logprob pass's; use R3 for both, or disabled")
    if config.actor_rollout_ref.ref.router_replay.measure_unreplayed:
        raise ConfigError("actor_rollout_ref.ref.router_replay.measure_unreplayed", "only the actor's old-logprob "
                          "pass measures the mismatch replay removes (actor_rollout_ref.actor.router_replay."
                          "measure_unreplayed); leave it false")
    return RefOptions(model, role.batches["log_prob"].forward(), replay_rollout_routing=mode == "R3",
                      on_actor=shared.lora is not None)


def reward_model_options(config: PPOConfig, role: RolePlan) -> RewardModelOptions:
    rm = config.reward_model
    # Frozen like the reference policy, with a score head; whether samples are re-rendered for its tokenizer is
    # known at launch, where both tokenizers are loaded (`input_tokenizer` is None when they are the same).
    model = model_options(rm.megatron, "reward_model.megatron", role.spec, role.ranks, False, None,
                          rm.model.override_config, load_weight=True, value_head=True)
    return RewardModelOptions(model, role.batches["forward"].forward(), rm.model.input_tokenizer, rm.max_length)


def critic_options(config: PPOConfig, shared: SharedKeys, role: RolePlan) -> CriticOptions:
    critic = config.critic
    optim = optim_options(critic.optim, critic.clip_grad_norm, critic.megatron.use_distributed_optimizer,
                          "critic.optim")
    lora = named_lora_settings(critic.model, shared.seed, "critic.model")
    model = model_options(critic.megatron, "critic.megatron", role.spec, role.ranks,
                          critic.model.enable_gradient_checkpointing, optim, critic.model.override_config,
                          critic.load_weight, value_head=True, lora=lora)
    return CriticOptions(
        seed=critic.megatron.seed, model=model,
        update=_update_options(role.batches["update"], critic.ppo_epochs, critic.shuffle, shared.seed),
        values=role.batches["values"].forward(), loss_agg_mode=critic.loss_agg_mode,
        cliprange_value=critic.cliprange_value,
        max_response_length=critic.loss_scale_factor or shared.response_length,
        checkpoint=_checkpoint_options(critic.checkpoint))


def rollout_options(config: PPOConfig, shared: SharedKeys, role: RolePlan, sync_ranks: list[int]) -> RolloutOptions:
    rollout = config.actor_rollout_ref.rollout
    length = shared.response_length
    agent = agent_settings(rollout.multi_turn, rollout.agent, shared.prompt_length, length)
    if rollout.logprobs_mode.endswith("_logits"):
        raise ConfigError("actor_rollout_ref.rollout.logprobs_mode", f"{rollout.logprobs_mode}: the trainer reads "
                                                                     "each sampled token's log-prob "
                                                                     "(rollout_log_probs), not logits; use "
                                                                     "processed_logprobs or raw_logprobs")
    max_model_len = rollout.max_model_len or shared.prompt_length + shared.response_length
    prefill_budget = rollout.max_num_batched_tokens or max(8192, max_model_len)
    if prefill_budget < max_model_len:  # vLLM would chunk the prefill; the native engine cannot
        raise ConfigError("actor_rollout_ref.rollout.max_num_batched_tokens", f"{prefill_budget} < the longest "
                          f"sequence ({max_model_len} tokens: rollout.max_model_len, or prompt + response length): "
                          f"the native engine prefills each sequence whole, in one step; raise it to at least "
                          f"{max_model_len} or leave it null")
    engine = EngineConfig(
        max_num_seqs=rollout.max_num_seqs, max_num_batched_tokens=prefill_budget,
        max_model_len=max_model_len,
        gpu_memory_utilization=rollout.gpu_memory_utilization, dtype=DTYPES[rollout.dtype],
        enforce_eager=rollout.enforce_eager, seed=rollout.seed, share_prefill=rollout.enable_prefix_caching,
        record_routing=shared.record_routing, bitwise=shared.bitwise, lora=shared.lora,
        spare_cache_rows=agent is not None, logprobs_mode=rollout.logprobs_mode)
    if shared.bitwise:
        if rollout.logprobs_mode != "processed_logprobs":
            raise ConfigError("actor_rollout_ref.rollout.logprobs_mode", f"{rollout.logprobs_mode} with {_BITWISE}: "
                                                                         "bitwise mode checks each token's logprob "
                                                                         "against the trainer's at the rollout "
                                                                         "temperature; use processed_logprobs")
        _check_bitwise_layout(role.spec, rollout.dtype, "actor_rollout_ref.rollout")
        if rollout.top_k > 0 or rollout.top_p < 1.0 or not rollout.do_sample:
            raise ConfigError(_BITWISE, f"top_k={rollout.top_k}, top_p={rollout.top_p}, do_sample={rollout.do_sample}: "
                                        f"the trainer scores the unfiltered distribution at the rollout temperature; "
                                        f"use top_k=-1, top_p=1.0, do_sample=true")
    sync, val = rollout.weight_sync, rollout.val_kwargs
    ignore_eos = rollout.ignore_eos
    return RolloutOptions(
        engine_name=rollout.name, seed=shared.seed, spec=role.spec, ranks=role.ranks, engine=engine,
        train=sampling_options(rollout.do_sample, shared.temperature, rollout.top_k, rollout.top_p, length,
                               ignore_eos),
        validate=sampling_options(val.do_sample, val.temperature, val.top_k, val.top_p, length, ignore_eos),
        response_length=length, free_cache_engine=rollout.free_cache_engine, override_config=shared.override_config,
        weight_sync=WeightSyncOptions(sync.bucket_size_mb << 20, sync.verify, sync_ranks),
        agent=agent)


def agent_settings(multi_turn: MultiTurnConfig, agent: AgentLoopConfig, prompt_length: int,
                   response_length: int) -> AgentSettings | None:
    """verl's `multi_turn.*` and `agent.*` -> the agent runner's settings (None: multi-turn off, single turn). The
    tokenizer and the chat template's arguments (the data's) are filled in at launch. Tool-call format and config files are checked here, before workers start."""
    limits = TurnLimits(
        response_length=response_length, prompt_length=prompt_length,
        max_assistant_turns=multi_turn.max_assistant_turns,
        max_user_turns=multi_turn.max_user_turns, max_parallel_calls=multi_turn.max_parallel_calls,
        max_tool_response_length=multi_turn.max_tool_response_length,
        tool_response_truncate_side=multi_turn.tool_response_truncate_side, tool_timeout=multi_turn.tool_timeout,
        max_concurrent_tool_calls=multi_turn.max_concurrent_tool_calls)
    served = agent.endpoint
    endpoint = EndpointSettings(
        served_model_name=served.served_model_name, host=served.host, port=served.port, api_key=served.api_key,
        max_body_mb=served.max_body_mb, max_concurrent_requests=served.max_concurrent_requests,
        episode_timeout=served.episode_timeout, memory_limit_mb=served.memory_limit_mb,
        num_workers=agent.num_workers, max_episodes_per_process=served.max_episodes_per_process)
    settings = AgentSettings(limits, None, multi_turn.format, multi_turn.tool_config_path,
                             # absolute: the rollout workers import it wherever they run
                             multi_turn.function_tool_path and str(Path(multi_turn.function_tool_path)
                                                                   .expanduser().resolve()),
                             multi_turn.interaction_config_path,
                             agent.agent_loop_config_path, agent.default_agent_loop, endpoint=endpoint)
    if not multi_turn.enable:
        return None
    prefix = "actor_rollout_ref.rollout"
    if served.api_key is None and not _is_loopback(served.host):
        raise ConfigError(f"{prefix}.agent.endpoint.host", f"{served.host!r} without agent.endpoint.api_key: anyone "
                                                           f"who reaches it could drive the policy; set an api_key")
    try:
        get_parser(multi_turn.format)
    except ValueError as err:
        raise ConfigError(f"{prefix}.multi_turn.format", str(err).split(": ", 1)[-1]) from None
    for key, path in (("multi_turn.tool_config_path", settings.tool_config_path),
                      ("multi_turn.function_tool_path", settings.function_tool_path),
                      ("multi_turn.interaction_config_path", settings.interaction_config_path),
                      ("agent.agent_loop_config_path", settings.agent_loop_config_path)):
        if path is not None and not Path(path).expanduser().is_file():
            raise ConfigError(f"{prefix}.{key}", f"{path}: no such file")
    return settings


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _as_list(files: str | list[str] | None) -> list[str] | None:
    return [files] if isinstance(files, str) else None if files is None else list(files)


def data_options(config: PPOConfig) -> DataOptions:
    data, model = config.data, config.actor_rollout_ref.model
    return DataOptions(
        train_files=_as_list(data.train_files), val_files=_as_list(data.val_files),
        tokenizer=model.tokenizer_path or data.tokenizer, trust_remote_code=model.trust_remote_code,
        prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length, truncation=data.truncation,
        filter_overlong_prompts=data.filter_overlong_prompts, render_workers=data.filter_overlong_prompts_workers,
        media_keys=(data.image_key, data.video_key, data.audio_key),
        apply_chat_template_kwargs=dict(data.apply_chat_template_kwargs), train_max_samples=data.train_max_samples,
        val_max_samples=data.val_max_samples, gen_batch_size=data.gen_batch_size, val_batch_size=data.val_batch_size,
        shuffle=data.shuffle, validation_shuffle=data.validation_shuffle, seed=data.seed)


def reward_options(config: PPOConfig, judge: JudgeScoring | None, experiment_name: str) -> RewardOptions:
    """`judge`: the judge's scoring (`JudgeOptions.scoring`) when there is one; `experiment_name`: trainer's, which
    verl's gdpo reward manager hands the reward function."""
    overlong, custom = config.reward_model.overlong_buffer, config.custom_reward_function
    shaping = OverlongShaping(config.data.max_response_length, overlong.len, overlong.penalty_factor,
                              overlong.log) if overlong.enable else None
    if custom.url is not None and custom.path is not None:
        raise ConfigError("custom_reward_function.url", "set either a reward function (path) or a reward service "
                                                        "(url), not both")
    rm = config.reward_model
    return RewardOptions(custom.path, custom.name, config.data.reward_fn_key, shaping, custom.num_workers,
                         custom.timeout, custom.on_error, custom.url, custom.max_concurrency, custom.retries,
                         custom.retry_backoff, rm.use_reward_loop, judge, RewardModelScoring(rm.combine, rm.weight),
                         experiment_name if rm.reward_manager == "gdpo" else None)


def judge_options(config: PPOConfig, shared: SharedKeys, role: RolePlan) -> JudgeOptions:
    """`reward_model.judge` -> the judge worker's options; its template (read from its file) and score pattern are
    checked here, before workers start."""
    judge, key = config.reward_model.judge, "reward_model.judge"
    if judge.model_path is None:
        raise ConfigError(f"{key}.model_path", "must be set when reward_model.judge.enable=true (the HF causal LM "
                                               "the judge's engine serves)")
    try:
        re.compile(judge.score_pattern)
    except re.error as err:
        raise ConfigError(f"{key}.score_pattern",
                          f"{judge.score_pattern!r} is not a regular expression ({err})") from None
    engine = EngineConfig(max_num_seqs=judge.max_num_seqs, max_num_batched_tokens=max(8192, judge.max_model_len),
                          max_model_len=judge.max_model_len, gpu_memory_utilization=judge.gpu_memory_utilization,
                          dtype=DTYPES[judge.dtype], seed=shared.seed)
    sampling = sampling_options(judge.temperature > 0, judge.temperature, -1, judge.top_p, judge.response_length,
                                ignore_eos=False)
    scoring = JudgeScoring(judge.model_path, judge.combine, judge.weight, judge.on_parse_failure,
                           judge.parse_failure_score)
    return JudgeOptions(judge.model_path, role.spec, role.ranks, engine, sampling, judge_template(judge),
                        judge.score_pattern, judge.free_cache_engine, scoring)


def judge_template(judge: JudgeConfig) -> str:
    """The judge's prompt template: `prompt_template`, the file `prompt_template_path`, or the built-in one; it may
    name only JUDGE_TEMPLATE_FIELDS."""
    key = "reward_model.judge.prompt_template"
    if judge.prompt_template is not None and judge.prompt_template_path is not None:
        raise ConfigError(key, "set either the template (prompt_template) or its file (prompt_template_path)")
    template = judge.prompt_template
    if judge.prompt_template_path is not None:
        key = "reward_model.judge.prompt_template_path"
        try:
            template = Path(judge.prompt_template_path).expanduser().read_text()
        except OSError as err:
            raise ConfigError(key, f"{judge.prompt_template_path}: cannot be read ({err.strerror})") from None
    template = DEFAULT_JUDGE_TEMPLATE if template is None else template
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ConfigError(key, f"not a str.format template ({err}); write literal braces as {{{{ and }}}}") from None
    if not fields <= set(JUDGE_TEMPLATE_FIELDS) or "response" not in fields:
        allowed = ", ".join("{" + name + "}" for name in JUDGE_TEMPLATE_FIELDS)
        raise ConfigError(key, f"may name only {allowed} and must name {{response}}; it names {sorted(fields)}")
    return template


def algorithm_options(config: PPOConfig, shared: SharedKeys) -> AlgorithmOptions:
    algo = config.algorithm
    ctrl, groups = algo.kl_ctrl, algo.filter_groups
    keys, weights = algo.gdpo_reward_keys, algo.gdpo_reward_weights
    kl = KLInRewardOptions(algo.kl_penalty, ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
    filtration = PolicyFiltration(algo.pf_ppo.reweight_method, algo.pf_ppo.weight_pow)
    return AlgorithmOptions(
        adv_estimator=shared.adv_estimator, gamma=algo.gamma, lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, kl_in_reward=kl if shared.use_kl_in_reward else None,
        correction=correction_options(algo.rollout_correction, shared.decoupled),
        filter_groups=FilterGroupsOptions(groups.metric, groups.max_num_gen_batches) if groups.enable else None,
        gdpo_reward_keys=None if keys is None else tuple(keys),
        gdpo_reward_weights=None if weights is None else tuple(weights),
        policy_filtration=filtration if algo.use_pf_ppo else None)


def loop_options(config: PPOConfig, shared: SharedKeys, step: StepSize, save_hf: bool) -> LoopOptions:
    trainer = config.trainer
    return LoopOptions(
        total_steps=None, total_training_steps=trainer.total_training_steps, total_epochs=trainer.total_epochs,
        total_rollout_steps=config.rollout.total_rollout_steps if config.rollout is not None else None,
        seed=shared.seed, samples_per_prompt=shared.samples_per_prompt,
        val_samples_per_prompt=config.actor_rollout_ref.rollout.val_kwargs.n, train_batch_size=step.train_batch_size,
        critic_warmup=trainer.critic_warmup, val_before_train=trainer.val_before_train, test_freq=trainer.test_freq,
        save_freq=trainer.save_freq, resume_mode=trainer.resume_mode, resume_from_path=trainer.resume_from_path,
        run_dir=trainer.default_local_dir,
        max_ckpt_to_keep={"actor": trainer.max_actor_ckpt_to_keep, "critic": trainer.max_critic_ckpt_to_keep},
        save_hf=save_hf, balance_batch=trainer.balance_batch, actor_mini_batch_size=step.actor_mini,
        critic_mini_batch_size=step.critic_mini, log_val_generations=trainer.log_val_generations,
        rollout_data_dir=trainer.rollout_data_dir, validation_data_dir=trainer.validation_data_dir,
        val_only=trainer.val_only)


RAY_INIT_KEYS = {"address", "num_cpus"}  # what controller.init_ray takes of ray.init's arguments


def cluster_options(config: PPOConfig) -> ClusterOptions:
    trainer, pool, rm, distillation = config.trainer, config.rollout, config.reward_model, config.distillation
    teacher_pool = distillation.nnodes * distillation.n_gpus_per_node > 0  # rules.py: only with distillation on
    own = rm.enable_resource_pool
    if own and rm.nnodes * rm.n_gpus_per_node == 0:
        raise ConfigError("reward_model.n_gpus_per_node", f"{rm.nnodes} node(s) x {rm.n_gpus_per_node} per node: "
                                                          "a reward-model pool of its own needs at least one rank")
    ray_init = dict(config.ray_kwargs.ray_init)
    unknown = sorted(set(ray_init) - RAY_INIT_KEYS)
    if unknown:
        raise ConfigError(f"ray_kwargs.ray_init.{unknown[0]}", f"not supported; shardrl passes "
                                                             f"{', '.join(sorted(RAY_INIT_KEYS))} to ray.init")
    return ClusterOptions(
        ray_init=ray_init, whole_cpu_cores=bool(ray_init.get("address")), trainer_nodes=trainer.nnodes,
        trainer_gpus_per_node=trainer.n_gpus_per_node, rollout_nodes=pool.nnodes if pool else None,
        rollout_gpus_per_node=pool.n_gpus_per_node if pool else None,
        collective_timeout=datetime.timedelta(seconds=trainer.collective_timeout_s),
        reward_model_nodes=rm.nnodes if own else None, reward_model_gpus_per_node=rm.n_gpus_per_node if own else None,
        teacher_nodes=distillation.nnodes if teacher_pool else None,
        teacher_gpus_per_node=distillation.n_gpus_per_node if teacher_pool else None)


def async_options(config: PPOConfig, mode: Schedule) -> AsyncOptions | None:
    a = config.async_training
    if mode == "colocate_async":  # verl's colocated v1 trainer: partial rollout always, span-bounded groups
        v1 = config.trainer.v1
        return AsyncOptions(partial_rollout=True, staleness_threshold=None, trigger_parameter_sync_step=None,
                            require_batches=None, warmup_batches=v1.colocate_async.num_warmup_batches,
                            max_lag=v1.sampler.max_off_policy_threshold - 1)
    if a is None:
        return None
    return AsyncOptions(partial_rollout=bool(a.partial_rollout), staleness_threshold=a.staleness_threshold,
                        trigger_parameter_sync_step=a.trigger_parameter_sync_step, require_batches=a.require_batches)


# verl's Megatron optimizer overrides that describe shardrl's AdamW at these values, and why another value is refused.
_HYBRID_CPU = ("Megatron's hybrid CPU optimizer (the Adam step on the CPU) is not in shardrl; megatron."
               "optimizer_offload=true keeps the optimizer state in host memory between steps (the step runs on the "
               "GPU)")
OPTIMIZER_OVERRIDES: dict[str, tuple[Any, str]] = {
    "optimizer_cpu_offload": (False, _HYBRID_CPU), "overlap_cpu_optimizer_d2h_h2d": (False, _HYBRID_CPU),
    "optimizer_offload_fraction": (0, _HYBRID_CPU), "offload_fraction": (0, _HYBRID_CPU),
    "use_precision_aware_optimizer": (False, "shardrl keeps fp32 master weights and fp32 Adam moments"),
    "decoupled_weight_decay": (True, "shardrl's AdamW decays the weights decoupled from the gradient"),
}


def optim_options(optim: OptimConfig, clip_grad: float, distributed: bool, key: str) -> OptimOptions:
    """`key`: the role's optim group (for errors)."""
    for name, value in optim.override_optimizer_config.items():
        accepted, why = OPTIMIZER_OVERRIDES.get(name, (None, "not a setting of shardrl's AdamW (its keys: lr, betas, "
                                                             "weight_decay, clip_grad, the lr schedule's)"))
        if name not in OPTIMIZER_OVERRIDES or value != accepted:
            raise ConfigError(f"{key}.override_optimizer_config.{name}", f"{value!r} is not supported: {why}")
    return OptimOptions(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay, clip_grad=clip_grad,
                        distributed=distributed,
                        total_steps=optim.total_training_steps if optim.total_training_steps > 0 else None,
                        warmup_steps=optim.lr_warmup_steps, warmup_ratio=optim.lr_warmup_steps_ratio,
                        decay_style=optim.lr_decay_style, decay_steps=optim.lr_decay_steps,
                        min_lr_ratio=optim.min_lr_ratio)


def model_options(megatron: MegatronConfig, key: str, spec: LayoutSpec, ranks: list[int],
                  gradient_checkpointing: bool, optim: OptimOptions | None, override_config: dict[str, Any],
                  load_weight: bool, value_head: bool = False, bitwise: bool = False,
                  lora: LoRASettings | None = None, fused_logprobs: bool = False,
                  compile: bool = False) -> ModelOptions:
    """`megatron`: the role's group at `key`; `gradient_checkpointing`: its model.enable_gradient_checkpointing
    (recompute, as Megatron's full recompute through `override_transformer_config` also asks); `bitwise`: the
    role's model runs the batch-invariant kernels (the actor in bitwise mode); `lora`: it trains adapters only (the
    actor with model.lora_rank > 0; the critic with critic.model.lora_rank > 0, and its value head); `fused_logprobs`:
    its log-probs straight from the LM head, one token chunk of logits at a time (model.use_fused_kernels)."""
    override = read_transformer_overrides(megatron.override_transformer_config, key)
    engine = EngineOptions(
        sequence_parallel=megatron.sequence_parallel, recompute=gradient_checkpointing or override.recompute,
        dtype=DTYPES[megatron.dtype], value_head=value_head, optim=optim,
        router=override.router, fast=FastPaths(bitwise=bitwise, attention=override.attention,
                                               fused_logprobs=fused_logprobs, compile=compile), lora=lora)
    if bitwise and fused_logprobs:
        raise ConfigError("actor_rollout_ref.model.use_fused_kernels", "bitwise mode computes the LM head with its "
                          "batch-invariant GEMM over the whole batch; set it false or rollout.bitwise_logprobs=false")
    if bitwise and override.router.fp32_logits:
        raise ConfigError(f"{key}.override_transformer_config.moe_router_dtype", "bitwise mode needs the rollout's "
                          "router maths, and the rollout engine computes router logits in the model dtype; remove the "
                          "key or set rollout.bitwise_logprobs=false")
    if bitwise and compile:
        raise ConfigError(f"{key.rpartition('.')[0]}.use_torch_compile", "compiled kernels round differently from "
                          "bitwise mode's batch-invariant ones; set it false or rollout.bitwise_logprobs=false")
    if bitwise and override.attention == "fa4":
        raise ConfigError(f"{key}.override_transformer_config.attention_backend", "bitwise mode runs its own "
                          "batch-invariant attention; remove the key or set rollout.bitwise_logprobs=false")
    # A frozen role (reference, teacher: no optimizer) has no gradients or optimizer state to offload: compat.py
    # refuses those keys for it.
    trains = optim is not None
    offload = OffloadOptions(megatron.param_offload, trains and megatron.grad_offload,
                             trains and megatron.optimizer_offload)
    path = megatron.dist_checkpointing_path
    dist = path if megatron.use_dist_checkpointing else None
    return ModelOptions(spec, ranks, engine, offload, dict(override_config), load_weight, dist)


def policy_loss_options(config: PPOConfig, decoupled: bool, use_kl_loss: bool,
                        response_length: int) -> PolicyLossOptions:
    """The actor loss; in bypass mode loss_type=reinforce replaces the surrogate and brings its own IS weights.
    `decoupled`, `use_kl_loss`, `response_length`: those keys' values, which the planner reads once."""
    actor, correction = config.actor_rollout_ref.actor, config.algorithm.rollout_correction
    reinforce = not decoupled and correction.loss_type == "reinforce"
    weighted = reinforce and correction.rollout_is is not None
    bypass_is = (correction.rollout_is, correction.rollout_is_threshold) if weighted else None
    surrogate = actor.policy_loss
    loss_mode = "reinforce" if reinforce else surrogate.loss_mode
    covariance = None  # clip_cov's and kl_cov's token selection (algos.covariance)
    if loss_mode == "clip_cov":
        covariance = CovarianceSelection("clip_cov", surrogate.clip_cov_ratio, surrogate.clip_cov_lb,
                                         surrogate.clip_cov_ub)
    elif loss_mode == "kl_cov":
        covariance = CovarianceSelection("kl_cov", surrogate.kl_cov_ratio)
    return PolicyLossOptions(
        loss_agg_mode=actor.loss_agg_mode, loss_mode=loss_mode,
        bypass_is=bypass_is,
        clip=ClipRange(actor.clip_ratio, actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c,
                       weight_clip=surrogate.loss_mode == "cispo", tau_pos=surrogate.tau_pos,
                       tau_neg=surrogate.tau_neg, dro_beta=surrogate.dro_beta, ppo_kl_coef=surrogate.ppo_kl_coef),
        covariance=covariance, anchor_is_actor=decoupled,
        entropy_coeff=actor.entropy_coeff, use_kl_loss=use_kl_loss, kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type, max_response_length=actor.loss_scale_factor or response_length)


def sampling_options(do_sample: bool, temperature: float, top_k: int, top_p: float, max_tokens: int,
                     ignore_eos: bool) -> SamplingOptions:
    return SamplingOptions(max_tokens=max_tokens, temperature=temperature if do_sample else 0.0, top_k=top_k,
                           top_p=top_p, ignore_eos=ignore_eos)


def correction_options(rc: RolloutCorrectionConfig, decoupled: bool) -> CorrectionOptions:
    return CorrectionOptions(rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
                             rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rejection=rc.rejection(),
                             decoupled=decoupled)
