"""The planner: where every role runs, how it is split, how batches are cut, and each role's compiled options — from
the config alone, before any worker starts.

`plan_job(config)` is what the dry run prints and what the trainer launches, so the two cannot disagree. Workers
receive their role's options from `JobPlan` (options.py), colocated and detached alike (one code path for batch-size
normalisation, as verl's megatron workers do it):

* a step takes `step_prompts` prompts (data.train_batch_size; fully_async: require_batches x ppo_mini_batch_size)
  and generates `rollout.n` samples for each;
* a mini batch is `ppo_mini_batch_size` prompts (global), i.e. `ppo_mini_batch_size * n / DP` samples per DP rank,
  cut into micro batches of `ppo_micro_batch_size_per_gpu` samples (or, with dynamic batch size, of at most
  `ppo_max_token_len_per_gpu` tokens);
* log-prob and value passes split the whole step's samples over DP the same way.

Placement: in sync mode all roles share the trainer pool (colocated). In the async modes actor/ref/critic use the
trainer pool and the rollout gets its own pool after it, laid out by its own TP/EP only.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from shardrl.job.compat import refuse_unsupported
from shardrl.job.errors import ConfigError
from shardrl.job.model_check import check_model
from shardrl.job.options import (
    ActorOptions,
    AlgorithmOptions,
    AsyncOptions,
    CheckpointOptions,
    ClusterOptions,
    CriticOptions,
    DataOptions,
    FilterGroupsOptions,
    ForwardBatching,
    KLInRewardOptions,
    LoopOptions,
    RefOptions,
    RewardOptions,
    RolloutOptions,
    TrackingOptions,
    UpdateOptions,
    WeightSyncOptions,
    DTYPES,
    correction_options,
    model_options,
    optim_options,
    policy_loss_options,
    sampling_options,
)
from shardrl.job.schema import CheckpointConfig, Mode, PPOConfig
from shardrl.parallel.layout import LayoutError, LayoutSpec, rank_tables
from shardrl.rewards.manager import OverlongShaping
from shardrl.rollout.runner import EngineConfig


@dataclass(frozen=True)
class MicroBatching:
    """How one DP rank cuts its share of a batch."""

    samples_per_rank: int
    micro_batch_size: int | None  # samples per micro batch; None with dynamic batch size
    num_micro_batches: int | None  # None with dynamic batch size (depends on the lengths)
    max_token_len: int | None  # token budget of one micro batch (dynamic batch size only)

    def describe(self) -> str:
        if self.micro_batch_size is None:
            return f"{self.samples_per_rank} samples/rank in micro batches of <= {self.max_token_len} tokens"
        return (f"{self.samples_per_rank} samples/rank, micro batch {self.micro_batch_size} "
                f"-> {self.num_micro_batches} micro batches")

    def forward(self) -> ForwardBatching:
        return ForwardBatching(self.micro_batch_size, self.max_token_len)


@dataclass(frozen=True)
class RolePlan:
    name: Literal["actor", "ref", "critic", "rollout"]
    spec: LayoutSpec
    ranks: list[int]
    tables: dict[str, list[list[int]]]
    batches: dict[str, MicroBatching] = field(default_factory=dict)  # "update", "log_prob", "values"


@dataclass(frozen=True)
class JobPlan:
    """The placement and layouts (for the printout) and the compiled options every part of the run takes."""

    mode: Mode
    placement: Literal["colocated", "detached"]
    device: Literal["cpu", "cuda"]
    trainer_ranks: list[int]
    rollout_ranks: list[int]
    step_prompts: int
    samples_per_prompt: int
    mini_batches_per_step: int
    roles: dict[str, RolePlan]
    skipped: dict[str, str]  # role -> why it is not used
    model_notes: list[str]
    dry_run: bool  # validate and print the plan only
    model_path: str | None  # the actor's (and reference's) initial weights; None: the built-in task's model
    critic_model_path: str | None
    actor: ActorOptions
    ref: RefOptions | None
    critic: CriticOptions | None
    rollout: RolloutOptions
    data: DataOptions
    reward: RewardOptions
    algorithm: AlgorithmOptions
    loop: LoopOptions
    cluster: ClusterOptions
    tracking: TrackingOptions
    async_training: AsyncOptions | None

    def with_total_steps(self, total_steps: int) -> JobPlan:
        """The plan once the data is read: the loop's length, and each optimizer's schedule where the config left
        it to the trainer (optim.total_training_steps=-1)."""

        def bind(options):
            optim = options.model.engine.optim
            if optim.total_steps is not None:
                return options
            engine = dataclasses.replace(options.model.engine, optim=dataclasses.replace(optim,
                                                                                        total_steps=total_steps))
            return dataclasses.replace(options, model=dataclasses.replace(options.model, engine=engine))

        return dataclasses.replace(self, loop=dataclasses.replace(self.loop, total_steps=total_steps),
                                   actor=bind(self.actor), critic=bind(self.critic) if self.critic else None)


def resolve_device(device: str) -> Literal["cpu", "cuda"]:
    """`auto` is cuda when a GPU is visible. On cpu, n_gpus_per_node counts CPU processes (gloo ranks)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device  # type: ignore[return-value]


@dataclass(frozen=True)
class _Shared:
    """The keys several parts of the plan need, each read once, here (tests/test_config_keys.py checks that every
    key has exactly one reader in the planner)."""

    seed: int  # trainer.seed: sampling seeds, shuffles, the rollout engine's torch seed
    samples_per_prompt: int  # rollout.n
    prompt_length: int
    response_length: int
    temperature: float  # the rollout's: sampling, and the trainer's logprobs
    override_config: dict[str, Any]  # actor_rollout_ref.model.override_config: actor, reference and rollout
    decoupled: bool
    adv_estimator: str
    use_critic: bool
    use_kl_loss: bool
    use_kl_in_reward: bool

    @property
    def use_reference_policy(self) -> bool:
        return self.use_kl_loss or self.use_kl_in_reward


def _shared(config: PPOConfig) -> _Shared:
    arr, algo = config.actor_rollout_ref, config.algorithm
    rollout = arr.rollout
    adv, enable = algo.adv_estimator, config.critic.enable
    return _Shared(seed=config.trainer.seed, samples_per_prompt=rollout.n, prompt_length=rollout.prompt_length,
                   response_length=rollout.response_length, temperature=rollout.temperature,
                   override_config=dict(arr.model.override_config), decoupled=algo.rollout_correction.decoupled,
                   adv_estimator=adv, use_critic=enable if enable is not None else adv == "gae",
                   use_kl_loss=arr.actor.use_kl_loss, use_kl_in_reward=algo.use_kl_in_reward)


@dataclass(frozen=True)
class _Step:
    """A training step's prompts and the mini batches that must divide it."""

    prompts: int
    mini_batches: int  # the actor's, per step
    key: str  # the key that sets `prompts`
    actor_mini: int
    critic_mini: int | None
    train_batch_size: int


def plan_job(config: PPOConfig) -> JobPlan:
    """Check layouts and batch sizes against the pools, refuse what shardrl does not support, and compile every
    role's options; raises ConfigError."""
    refuse_unsupported(config)
    shared, cluster = _shared(config), _cluster_options(config)
    trainer_ranks = list(range(cluster.trainer_nodes * cluster.trainer_gpus_per_node))
    detached = cluster.rollout_nodes is not None
    rollout_ranks = (list(range(len(trainer_ranks), len(trainer_ranks) + cluster.rollout_nodes *
                                cluster.rollout_gpus_per_node)) if detached else trainer_ranks)
    mode, async_training = config.mode, _async_options(config)
    step = _step(config, shared, mode, async_training)
    roles = {"actor": _train_role(config, shared, "actor", "actor_rollout_ref.actor.megatron", trainer_ranks, step)}
    skipped = {}
    if shared.use_reference_policy:
        roles["ref"] = _train_role(config, shared, "ref", "actor_rollout_ref.ref.megatron", trainer_ranks, step)
    else:
        skipped["ref"] = "actor.use_kl_loss and algorithm.use_kl_in_reward are both false"
    if shared.use_critic:
        roles["critic"] = _train_role(config, shared, "critic", "critic.megatron", trainer_ranks, step)
    else:
        skipped["critic"] = f"adv_estimator={shared.adv_estimator} needs no values"
    roles["rollout"] = _rollout_role(config, rollout_ranks)
    sync_ranks = trainer_ranks + rollout_ranks if detached else trainer_ranks
    actor = _actor_options(config, shared, roles["actor"])
    trainer = config.trainer
    return JobPlan(
        mode=mode,
        placement="detached" if detached else "colocated",
        device=resolve_device(trainer.device),
        trainer_ranks=trainer_ranks,
        rollout_ranks=rollout_ranks,
        step_prompts=step.prompts,
        samples_per_prompt=shared.samples_per_prompt,
        mini_batches_per_step=step.mini_batches,
        roles=roles,
        skipped=skipped,
        model_notes=check_model(config, {name: role.spec for name, role in roles.items()}),
        dry_run=trainer.dry_run,
        model_path=config.actor_rollout_ref.model.path,
        critic_model_path=config.critic.model.path,
        actor=actor,
        ref=_ref_options(config, shared, roles["ref"]) if "ref" in roles else None,
        critic=_critic_options(config, shared, roles["critic"]) if "critic" in roles else None,
        rollout=_rollout_options(config, shared, roles["rollout"], sync_ranks),
        data=_data_options(config),
        reward=_reward_options(config),
        algorithm=_algorithm_options(config, shared),
        loop=_loop_options(config, shared, step, save_hf="hf_model" in actor.checkpoint.save_contents),
        cluster=cluster,
        tracking=TrackingOptions(list(trainer.logger), trainer.project_name, trainer.experiment_name,
                                 dataclasses.asdict(config)),
        async_training=async_training,
    )


def _checkpoint_options(checkpoint: CheckpointConfig) -> CheckpointOptions:
    return CheckpointOptions(tuple(checkpoint.save_contents), tuple(checkpoint.load_contents))


def _update_options(batching: MicroBatching, epochs: int, shuffle: bool, seed: int) -> UpdateOptions:
    """`batching`: the "update" normalisation (per-rank mini batch = ppo_mini_batch_size * n / DP)."""
    return UpdateOptions(mini_batch_size=batching.samples_per_rank, micro_batch_size=batching.micro_batch_size,
                         max_token_len=batching.max_token_len, ppo_epochs=epochs, shuffle=shuffle, seed=seed)


def _actor_options(config: PPOConfig, shared: _Shared, role: RolePlan) -> ActorOptions:
    arr = config.actor_rollout_ref
    actor = arr.actor
    optim = optim_options(actor.optim, actor.clip_grad_norm, actor.megatron.use_distributed_optimizer)
    model = model_options(actor.megatron, role.spec, role.ranks, arr.model.enable_gradient_checkpointing, optim,
                          shared.override_config, actor.load_weight)
    log_prob = role.batches.get("log_prob")
    return ActorOptions(
        seed=actor.megatron.seed, model=model,
        update=_update_options(role.batches["update"], actor.ppo_epochs, actor.shuffle, shared.seed),
        loss=policy_loss_options(config, shared.decoupled, shared.use_kl_loss, shared.response_length),
        log_prob=log_prob.forward() if log_prob else None, temperature=shared.temperature or 1.0,
        checkpoint=_checkpoint_options(actor.checkpoint))


def _ref_options(config: PPOConfig, shared: _Shared, role: RolePlan) -> RefOptions:
    # The reference policy loads the actor's initial weights; it never trains, so it has no optimizer.
    model = model_options(config.actor_rollout_ref.ref.megatron, role.spec, role.ranks, False, None,
                          shared.override_config, load_weight=True)
    return RefOptions(model, role.batches["log_prob"].forward())


def _critic_options(config: PPOConfig, shared: _Shared, role: RolePlan) -> CriticOptions:
    critic = config.critic
    optim = optim_options(critic.optim, critic.clip_grad_norm, critic.megatron.use_distributed_optimizer)
    model = model_options(critic.megatron, role.spec, role.ranks, critic.model.enable_gradient_checkpointing, optim,
                          critic.model.override_config, critic.load_weight, value_head=True)
    return CriticOptions(
        seed=critic.megatron.seed, model=model,
        update=_update_options(role.batches["update"], critic.ppo_epochs, critic.shuffle, shared.seed),
        values=role.batches["values"].forward(), loss_agg_mode=critic.loss_agg_mode,
        cliprange_value=critic.cliprange_value, max_response_length=shared.response_length,
        checkpoint=_checkpoint_options(critic.checkpoint))


def _rollout_options(config: PPOConfig, shared: _Shared, role: RolePlan, sync_ranks: list[int]) -> RolloutOptions:
    rollout = config.actor_rollout_ref.rollout
    engine = EngineConfig(
        max_num_seqs=rollout.max_num_seqs, max_num_batched_tokens=rollout.max_num_batched_tokens,
        max_model_len=rollout.max_model_len or shared.prompt_length + shared.response_length,
        gpu_memory_utilization=rollout.gpu_memory_utilization, dtype=DTYPES[rollout.dtype],
        enforce_eager=rollout.enforce_eager, seed=rollout.seed, share_prefill=rollout.enable_prefix_caching)
    sync, val, length = rollout.weight_sync, rollout.val_kwargs, shared.response_length
    ignore_eos = rollout.ignore_eos
    return RolloutOptions(
        engine_name=rollout.name, seed=shared.seed, spec=role.spec, ranks=role.ranks, engine=engine,
        train=sampling_options(rollout.do_sample, shared.temperature, rollout.top_k, rollout.top_p, length,
                               ignore_eos),
        validate=sampling_options(val.do_sample, val.temperature, val.top_k, val.top_p, length, ignore_eos),
        response_length=length, free_cache_engine=rollout.free_cache_engine, override_config=shared.override_config,
        weight_sync=WeightSyncOptions(sync.bucket_size_mb << 20, sync.verify, sync_ranks))


def _as_list(files: str | list[str] | None) -> list[str] | None:
    return [files] if isinstance(files, str) else None if files is None else list(files)


def _data_options(config: PPOConfig) -> DataOptions:
    data, model = config.data, config.actor_rollout_ref.model
    return DataOptions(
        train_files=_as_list(data.train_files), val_files=_as_list(data.val_files),
        tokenizer=model.tokenizer_path or data.tokenizer, trust_remote_code=model.trust_remote_code,
        prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length, truncation=data.truncation,
        filter_overlong_prompts=data.filter_overlong_prompts,
        apply_chat_template_kwargs=dict(data.apply_chat_template_kwargs), train_max_samples=data.train_max_samples,
        val_max_samples=data.val_max_samples, gen_batch_size=data.gen_batch_size, val_batch_size=data.val_batch_size,
        shuffle=data.shuffle, validation_shuffle=data.validation_shuffle, seed=data.seed)


def _reward_options(config: PPOConfig) -> RewardOptions:
    overlong, custom = config.reward_model.overlong_buffer, config.custom_reward_function
    shaping = OverlongShaping(config.data.max_response_length, overlong.len, overlong.penalty_factor,
                              overlong.log) if overlong.enable else None
    return RewardOptions(custom.path, custom.name, config.data.reward_fn_key, shaping)


def _algorithm_options(config: PPOConfig, shared: _Shared) -> AlgorithmOptions:
    algo = config.algorithm
    ctrl, groups = algo.kl_ctrl, algo.filter_groups
    kl = KLInRewardOptions(algo.kl_penalty, ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
    return AlgorithmOptions(
        adv_estimator=shared.adv_estimator, gamma=algo.gamma, lam=algo.lam,
        norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, kl_in_reward=kl if shared.use_kl_in_reward else None,
        correction=correction_options(algo.rollout_correction, shared.decoupled),
        filter_groups=FilterGroupsOptions(groups.metric, groups.max_num_gen_batches) if groups.enable else None)


def _loop_options(config: PPOConfig, shared: _Shared, step: _Step, save_hf: bool) -> LoopOptions:
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
        critic_mini_batch_size=step.critic_mini, log_val_generations=trainer.log_val_generations)


def _cluster_options(config: PPOConfig) -> ClusterOptions:
    trainer, pool = config.trainer, config.rollout
    return ClusterOptions(
        ray_init=dict(config.ray_kwargs.ray_init), trainer_nodes=trainer.nnodes,
        trainer_gpus_per_node=trainer.n_gpus_per_node, rollout_nodes=pool.nnodes if pool else None,
        rollout_gpus_per_node=pool.n_gpus_per_node if pool else None,
        collective_timeout=datetime.timedelta(seconds=trainer.collective_timeout_s))


def _async_options(config: PPOConfig) -> AsyncOptions | None:
    a = config.async_training
    if a is None:
        return None
    return AsyncOptions(partial_rollout=bool(a.partial_rollout), staleness_threshold=a.staleness_threshold,
                        trigger_parameter_sync_step=a.trigger_parameter_sync_step, require_batches=a.require_batches)


def _step(config: PPOConfig, shared: _Shared, mode: Mode, async_training: AsyncOptions | None) -> _Step:
    """Prompts per training step and actor mini batches per step; every mini batch size must divide the step."""
    actor_mini = config.actor_rollout_ref.actor.ppo_mini_batch_size
    critic_mini = config.critic.ppo_mini_batch_size if shared.use_critic else None
    minis = [("actor_rollout_ref.actor.ppo_mini_batch_size", actor_mini)]
    if critic_mini is not None:
        minis.append(("critic.ppo_mini_batch_size", critic_mini))
    train_batch_size = config.data.train_batch_size
    if mode == "fully_async":
        step_key, step = "async_training.require_batches", async_training.require_batches * actor_mini
    else:
        step_key, step = "data.train_batch_size", train_batch_size
    for key, mini in minis:
        if mini > step:
            raise ConfigError(key, f"{mini} prompts is larger than the {step} prompts of a step ({step_key})")
        if step % mini:
            raise ConfigError(step_key, f"a step of {step} prompts is not a multiple of {key}={mini}")
    return _Step(step, step // actor_mini, step_key, actor_mini, critic_mini, train_batch_size)


@dataclass(frozen=True)
class _BatchKeys:
    """Where one batch's sizes live in the config: `prompts` (global) and the micro-batch keys of `group`."""

    prompts: int
    prompts_key: str
    group: str  # dotted config group holding the micro-batch keys
    micro: str  # `<micro>` (global, deprecated) and `<micro>_per_gpu`
    dynamic: str
    tokens: str


def _batches_of(shared: _Shared, role: str, step: _Step) -> dict[str, _BatchKeys]:
    def log_prob(group: str) -> _BatchKeys:
        return _BatchKeys(step.prompts, step.key, group, "log_prob_micro_batch_size", "log_prob_use_dynamic_bsz",
                          "log_prob_max_token_len_per_gpu")

    if role == "ref":
        return {"log_prob": log_prob("actor_rollout_ref.ref")}
    if role == "critic":
        return {"update": _BatchKeys(step.critic_mini, "critic.ppo_mini_batch_size", "critic",
                                     "ppo_micro_batch_size", "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
                "values": _BatchKeys(step.prompts, step.key, "critic", "forward_micro_batch_size", "use_dynamic_bsz",
                                     "forward_max_token_len_per_gpu")}
    batches = {"update": _BatchKeys(step.actor_mini, "actor_rollout_ref.actor.ppo_mini_batch_size",
                                    "actor_rollout_ref.actor", "ppo_micro_batch_size", "use_dynamic_bsz",
                                    "ppo_max_token_len_per_gpu")}
    if shared.decoupled:
        batches["log_prob"] = log_prob("actor_rollout_ref.rollout")  # old logprobs; verl's keys for it live there
    return batches


def _train_role(config: PPOConfig, shared: _Shared, role: str, key: str, ranks: list[int], step: _Step) -> RolePlan:
    try:
        spec = config.at(key).layout(len(ranks))
    except LayoutError as err:
        raise ConfigError(key, f"{err} (the trainer pool trainer.nnodes x trainer.n_gpus_per_node has "
                               f"{len(ranks)} ranks)") from None
    seq_len = math.ceil((shared.prompt_length + shared.response_length) / spec.cp)  # tokens per CP rank
    batches = {phase: normalize_batch(config, batch, shared.samples_per_prompt, spec.dp, seq_len)
               for phase, batch in _batches_of(shared, role, step).items()}
    return RolePlan(role, spec, ranks, rank_tables(spec, ranks), batches)


def normalize_batch(config: PPOConfig, batch: _BatchKeys, n: int, dp: int, seq_len: int) -> MicroBatching:
    """`batch.prompts` (global) x n samples -> per DP rank -> micro batches (verl's megatron normalisation; the
    deprecated global micro batch is divided by DP)."""
    node = config.at(batch.group)
    samples = batch.prompts * n
    if samples % dp:
        split = f"{samples // dp} per rank" if samples < dp else "an uneven split"
        raise ConfigError(batch.prompts_key, f"{batch.prompts} prompts x rollout.n {n} = {samples} samples do not "
                                             f"split evenly over DP={dp} ({split})")
    per_rank = samples // dp
    if getattr(node, batch.dynamic):
        max_tokens = getattr(node, batch.tokens)
        if max_tokens < seq_len:
            raise ConfigError(f"{batch.group}.{batch.tokens}", f"{max_tokens} tokens cannot hold one full sequence "
                                                               f"of {seq_len} tokens (prompt + response per CP rank)")
        return MicroBatching(per_rank, None, None, max_tokens)
    total, per_gpu = getattr(node, batch.micro), getattr(node, f"{batch.micro}_per_gpu")
    key = f"{batch.group}.{batch.micro}"
    if total is None and per_gpu is None:
        raise ConfigError(f"{key}_per_gpu", f"must be set (samples per micro batch on one rank), or enable "
                                            f"{batch.group}.{batch.dynamic}")
    if per_gpu is None:
        if total % dp:
            raise ConfigError(key, f"global micro batch {total} does not split over DP={dp}; set "
                                   f"{batch.micro}_per_gpu instead")
        per_gpu = total // dp
    else:
        key = f"{key}_per_gpu"
    if per_rank % per_gpu:
        raise ConfigError(key, f"the {per_rank} samples per DP rank ({samples} samples / DP={dp}) are not divisible "
                               f"by the micro batch {per_gpu}")
    return MicroBatching(per_rank, per_gpu, per_rank // per_gpu, None)


def _rollout_role(config: PPOConfig, ranks: list[int]) -> RolePlan:
    """The rollout is laid out over its own pool only, never by the trainer's TP x PP x EP."""
    rollout = config.actor_rollout_ref.rollout
    pool = ("the trainer pool (colocated)" if config.rollout is None
            else "the rollout pool rollout.nnodes x rollout.n_gpus_per_node")
    world, tp = len(ranks), rollout.tensor_model_parallel_size
    if world % tp:
        raise ConfigError("actor_rollout_ref.rollout.tensor_model_parallel_size",
                          f"TP {tp} does not divide {pool} of {world} ranks")
    try:
        spec = rollout.layout(world)
    except LayoutError as err:
        raise ConfigError("actor_rollout_ref.rollout.expert_parallel_size", f"{err} ({pool})") from None
    if rollout.data_parallel_size not in (None, spec.dp):
        raise ConfigError("actor_rollout_ref.rollout.data_parallel_size",
                          f"{rollout.data_parallel_size} != {world} ranks / TP {tp} = {spec.dp}; leave it null")
    return RolePlan("rollout", spec, ranks, rank_tables(spec, ranks))


TRAIN_TABLES = ("tp", "cp", "dp", "pp", "dp_cp", "mp", "etp", "ep", "edp", "ep_etp", "embedding")
ROLLOUT_TABLES = ("tp", "dp", "ep", "etp")


def _groups(table: list[list[int]], limit: int = 8) -> str:
    if all(len(g) == 1 for g in table):
        return "size 1 (no communication)"
    shown = ",".join("[" + ",".join(map(str, g)) + "]" for g in table[:limit])
    more = f",... {len(table)} groups" if len(table) > limit else ""
    return f"[{shown}{more}]"


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def format_plan(plan: JobPlan, config: PPOConfig) -> str:
    """The human-readable dry-run printout."""
    unit = "GPUs"  # the config's unit; on cpu each one is a CPU process (the header says so)
    trainer, n = config.trainer, plan.samples_per_prompt
    device = f"device {plan.device}" + (f" (trainer.device={trainer.device})" if trainer.device != plan.device else "")
    if plan.device == "cpu":
        device += ": each GPU below is one CPU process (gloo rank)"
    lines = [f"shardrl plan: {plan.mode} mode, {plan.placement} placement, {device}",
             f"trainer pool: ranks {_span(plan.trainer_ranks)} ({trainer.nnodes} node(s) x {trainer.n_gpus_per_node} "
             f"{unit}); actor, ref and critic share it"]
    if plan.placement == "detached":
        pool = config.rollout
        lines.append(f"rollout pool: ranks {_span(plan.rollout_ranks)} ({pool.nnodes} node(s) x "
                     f"{pool.n_gpus_per_node} {unit}), detached")
    else:
        lines.append("rollout: colocated on the trainer pool (hybrid engine)")
    lines.append(f"step: {plan.step_prompts} prompts x rollout.n {n} = {plan.step_prompts * n} samples; "
                 f"{plan.mini_batches_per_step} actor mini batch(es) x ppo_epochs "
                 f"{config.actor_rollout_ref.actor.ppo_epochs}")
    if config.async_training is not None:
        settings = ", ".join(f"{k}={v}" for k, v in vars(config.async_training).items() if v is not None)
        lines.append(f"async_training: {settings}")
    for name in ("actor", "ref", "critic", "rollout"):
        if name in plan.skipped:
            lines.append(f"{name}: skipped ({plan.skipped[name]})")
            continue
        role = plan.roles[name]
        s, world = role.spec, len(role.ranks)
        if name == "rollout":
            lines.append(f"rollout: TP{s.tp}, {s.dp} replica(s), EP{s.ep} ETP{s.etp} on {world} {unit} "
                         f"(ranks {_span(role.ranks)}), engine {config.actor_rollout_ref.rollout.name}")
        else:
            lines.append(f"{name}: TP{s.tp} PP{s.pp} DP{s.dp}, EP{s.ep} ETP{s.etp} expert-DP{s.edp} on {world} {unit} "
                         f"(VPP{s.vpp} CP{s.cp}, ranks {_span(role.ranks)})")
        for table in ROLLOUT_TABLES if name == "rollout" else TRAIN_TABLES:
            lines.append(f"  {table:<9} {_groups(role.tables[table])}")
        lines.extend(f"  {phase + ':':<9} {batching.describe()}" for phase, batching in role.batches.items())
    lines.extend(f"model: {note}" for note in plan.model_notes)
    lines.append("dry run: no workers started; launch checks (data files, optional packages, device) not run")
    return "\n".join(lines)
