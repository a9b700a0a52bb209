"""The planner: where every role runs, how it is split, how batches are cut, and each role's compiled options — from
the config alone, before any worker starts.

`plan_job(config)` is what the dry run prints and what the trainer launches, so the two cannot disagree. Workers
receive their role's options from `JobPlan` (options.py), colocated and detached alike (one code path for batch-size
normalisation, as verl's megatron workers do it):

* a step takes `step_prompts` prompts (data.train_batch_size; fully_async: require_batches x ppo_mini_batch_size)
  and generates `rollout.n` samples for each;
* a mini batch is `ppo_mini_batch_size` prompts (global), i.e. `ppo_mini_batch_size * n / DP` samples per DP rank,
  cut into micro batches of `ppo_micro_batch_size_per_gpu` samples (or, with dynamic batch size, of at most
  `ppo_max_token_len_per_gpu` tokens; with both micro batch keys null, of the most samples that cut the rank's
  share evenly and fit that token budget);
* log-prob and value passes split the whole step's samples over DP the same way.

Placement: in sync mode all roles share the trainer pool (colocated). In the async modes actor/ref/critic use the
trainer pool and the rollout gets its own pool after it, laid out by its own TP/EP only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from shardrl.job.batches import (
    RolePlan,
    SharedKeys,
    distillation_teachers,
    judge_role,
    plan_step,
    read_shared,
    rollout_role,
    teacher_pool_roles,
    train_role,
)
from shardrl.job.compat import refuse_unsupported
from shardrl.job.errors import ConfigError
from shardrl.job.compile import (
    actor_options,
    algorithm_options,
    async_options,
    cluster_options,
    critic_options,
    judge_options,
    reward_model_options,
    data_options,
    loop_options,
    ref_options,
    reward_options,
    rollout_options,
    teacher_options,
)
from shardrl.job.model_check import check_model
from shardrl.job.options import (
    ActorOptions,
    AlgorithmOptions,
    AsyncOptions,
    ClusterOptions,
    CriticOptions,
    DataOptions,
    JudgeOptions,
    LoopOptions,
    RefOptions,
    RewardModelOptions,
    RewardOptions,
    RolloutOptions,
    TeacherSet,
    TrackingOptions,
)
from shardrl.job.schema import PPOConfig, Schedule


@dataclass(frozen=True)
class JobPlan:
    """The placement and layouts (for the printout) and the compiled options every part of the run takes."""

    mode: Schedule
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
    teacher: TeacherSet | None  # on-policy distillation's teachers
    critic: CriticOptions | None
    reward_model: RewardModelOptions | None  # a learned reward model scoring every sample
    reward_model_path: str | None
    judge: JudgeOptions | None  # a generative judge scoring every sample (reward_model.judge)
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


def reward_model_ranks(cluster: ClusterOptions, first: int) -> list[int]:
    """The reward model's own pool's ranks, numbered from `first` (after the trainer's and a detached rollout's);
    none when it shares the trainer pool."""
    if cluster.reward_model_nodes is None:
        return []
    return list(range(first, first + cluster.reward_model_nodes * cluster.reward_model_gpus_per_node))


def plan_job(config: PPOConfig) -> JobPlan:
    """Check layouts and batch sizes against the pools, refuse what shardrl does not support, and compile every
    role's options; raises ConfigError."""
    refuse_unsupported(config)
    shared, cluster = read_shared(config), cluster_options(config)
    trainer_ranks = list(range(cluster.trainer_nodes * cluster.trainer_gpus_per_node))
    detached = cluster.rollout_nodes is not None
    rollout_ranks = (list(range(len(trainer_ranks), len(trainer_ranks) + cluster.rollout_nodes *
                                cluster.rollout_gpus_per_node)) if detached else trainer_ranks)
    mode = config.mode
    async_training = async_options(config, mode)
    step = plan_step(config, shared, mode, async_training)
    roles = {"actor": train_role(config, shared, "actor", "actor_rollout_ref.actor.megatron", trainer_ranks, step)}
    skipped = {}
    if shared.use_reference_policy:
        roles["ref"] = train_role(config, shared, "ref", "actor_rollout_ref.ref.megatron", trainer_ranks, step)
        if shared.lora is not None and roles["ref"].spec != roles["actor"].spec:
            raise ConfigError("actor_rollout_ref.ref.megatron", f"with LoRA the reference is the actor's base model "
                              f"on the actor's engine (adapters off), laid out as the actor ({roles['actor'].spec}); "
                              f"leave the reference's parallel sizes as the actor's")
    else:
        skipped["ref"] = "actor.use_kl_loss and algorithm.use_kl_in_reward are both false"
    teacher_pool = (cluster.teacher_nodes or 0) * (cluster.teacher_gpus_per_node or 0)
    teachers = distillation_teachers(config, teacher_pool) if shared.distillation else {}
    if teachers and cluster.teacher_nodes is None:
        roles["teacher"] = train_role(config, shared, "teacher", "distillation.teacher_model.megatron", trainer_ranks,
                                      step)
    elif teachers:  # the teachers' own pool, its ranks after the trainer's, a detached rollout's and a reward model's
        first = len(trainer_ranks) + len(rollout_ranks) * detached + len(reward_model_ranks(cluster, 0))
        roles |= teacher_pool_roles(config, shared, step, teachers, first)
    else:
        skipped["teacher"] = "distillation.enabled is false"
    if config.reward_model.enable:
        roles["reward_model"] = train_role(config, shared, "reward_model", "reward_model.megatron",
                                           reward_model_ranks(cluster, len(trainer_ranks) + len(rollout_ranks) *
                                                              detached) or trainer_ranks, step)
    else:
        skipped["reward_model"] = "reward_model.enable is false: rewards are the reward function's"
    if shared.use_critic:
        roles["critic"] = train_role(config, shared, "critic", "critic.megatron", trainer_ranks, step)
    else:
        skipped["critic"] = f"adv_estimator={shared.adv_estimator} needs no values"
    roles["rollout"] = rollout_role(config, rollout_ranks)
    if config.reward_model.judge.enable:
        if "reward_model" in roles:
            raise ConfigError("reward_model.judge.enable", "a reward model (reward_model.enable) and a judge cannot "
                                                           "both be the learned reward; enable one of them")
        roles["judge"] = judge_role(config, trainer_ranks)
    else:
        skipped["judge"] = "reward_model.judge.enable is false"
    sync_ranks = trainer_ranks + rollout_ranks if detached else trainer_ranks
    actor = actor_options(config, shared, roles["actor"])
    topk = actor.distillation.topk if actor.distillation is not None and actor.distillation.uses_topk else None
    teacher = teacher_options(config, roles, teachers, topk) if teachers else None
    critic = critic_options(config, shared, roles["critic"]) if "critic" in roles else None
    judge = judge_options(config, shared, roles["judge"]) if "judge" in roles else None
    trainer = config.trainer
    experiment = trainer.experiment_name
    device = resolve_device(trainer.device)
    if shared.bitwise and device != "cuda":
        raise ConfigError("actor_rollout_ref.rollout.bitwise_logprobs", f"trainer.device={trainer.device} resolves to "
                                                                        f"{device}: bitwise mode's kernels are CUDA ones; "
                                                                        f"run on GPUs or set it false")
    plan = JobPlan(
        mode=mode,
        placement="detached" if detached else "colocated",
        device=device,
        trainer_ranks=trainer_ranks,
        rollout_ranks=rollout_ranks,
        step_prompts=step.prompts,
        samples_per_prompt=shared.samples_per_prompt,
        mini_batches_per_step=step.mini_batches,
        roles=roles,
        skipped=skipped,
        model_notes=check_model(config, {name: role.spec for name, role in roles.items()}, shared.lora,
                                critic.model.engine.lora if critic is not None else None,
                                [(t.path_key, t.model_path, teachers[key].role)
                                 for key, t in teacher.by_key.items()] if teacher is not None else ()),
        dry_run=trainer.dry_run,
        model_path=config.actor_rollout_ref.model.path,
        critic_model_path=config.critic.model.path,
        actor=actor,
        ref=ref_options(config, shared, roles["ref"]) if "ref" in roles else _no_ref(shared),
        teacher=teacher,
        critic=critic,
        reward_model=reward_model_options(config, roles["reward_model"]) if "reward_model" in roles else None,
        reward_model_path=config.reward_model.model.path,
        judge=judge,
        rollout=rollout_options(config, shared, roles["rollout"], sync_ranks),
        data=data_options(config),
        reward=reward_options(config, judge.scoring if judge is not None else None, experiment),
        algorithm=algorithm_options(config, shared),
        loop=loop_options(config, shared, step, save_hf="hf_model" in actor.checkpoint.save_contents),
        cluster=cluster,
        tracking=TrackingOptions(list(trainer.logger), trainer.project_name, experiment,
                                 dataclasses.asdict(config)),
        async_training=async_training,
    )
    if shared.bitwise and plan.actor.model.engine.dtype != plan.rollout.engine.dtype:
        raise ConfigError("actor_rollout_ref.rollout.dtype", f"{plan.rollout.engine.dtype} with the actor in "
                                                             f"{plan.actor.model.engine.dtype}: bitwise mode needs the "
                                                             f"rollout and the actor in one dtype")
    if plan.ref is not None and plan.ref.on_actor and plan.ref.model.engine.dtype != plan.actor.model.engine.dtype:
        raise ConfigError("actor_rollout_ref.ref.megatron.dtype", f"with LoRA the reference is the actor's base "
                          f"model on the actor's engine, in {plan.actor.model.engine.dtype}; leave it as the actor's")
    if plan.ref is not None and plan.ref.on_actor and \
            plan.ref.model.engine.fast.compile != plan.actor.model.engine.fast.compile:
        raise ConfigError("actor_rollout_ref.ref.use_torch_compile", "with LoRA the reference is the actor's base "
                          "model on the actor's engine, compiled or not as the actor's; leave it as the actor's")
    return plan



TRAIN_TABLES = ("tp", "cp", "dp", "pp", "dp_cp", "mp", "etp", "ep", "edp", "ep_etp", "embedding")
ROLLOUT_TABLES = ("tp", "dp", "ep", "etp")


def _no_ref(shared: SharedKeys) -> None:
    """A job without a reference pass (no KL): its routing-replay key would do nothing."""
    if shared.ref_router_replay != "disabled":
        raise ConfigError("actor_rollout_ref.ref.router_replay.mode", "this job has no reference pass (no KL loss or "
                          "reward penalty) to replay routing in; leave it disabled or turn KL on")


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
             f"{unit}); actor, ref, reward model, judge and critic share it"]
    if plan.placement == "detached":
        pool = config.rollout
        lines.append(f"rollout pool: ranks {_span(plan.rollout_ranks)} ({pool.nnodes} node(s) x "
                     f"{pool.n_gpus_per_node} {unit}), detached")
    else:
        lines.append("rollout: colocated on the trainer pool (hybrid engine)")
    if plan.cluster.teacher_nodes is not None and plan.teacher is not None:
        ranks = [rank for name, role in plan.roles.items() if name.startswith("teacher/") for rank in role.ranks]
        lines.append(f"teacher pool: ranks {_span(ranks)} ({config.distillation.nnodes} node(s) x "
                     f"{config.distillation.n_gpus_per_node} {unit}), the distillation teachers' own")
    if plan.cluster.reward_model_nodes is not None and plan.reward_model is not None:
        rm = config.reward_model
        lines.append(f"reward model pool: ranks {_span(plan.roles['reward_model'].ranks)} ({rm.nnodes} node(s) x "
                     f"{rm.n_gpus_per_node} {unit}), its own")
    lines.append(f"step: {plan.step_prompts} prompts x rollout.n {n} = {plan.step_prompts * n} samples; "
                 f"{plan.mini_batches_per_step} actor mini batch(es) x ppo_epochs "
                 f"{config.actor_rollout_ref.actor.ppo_epochs}")
    if config.async_training is not None:
        settings = ", ".join(f"{k}={v}" for k, v in vars(config.async_training).items() if v is not None)
        lines.append(f"async_training: {settings}")
    pool_teachers = [name for name in plan.roles if name.startswith("teacher/")]
    for name in ("actor", "ref", "teacher", *pool_teachers, "reward_model", "critic", "rollout", "judge"):
        if name == "teacher" and pool_teachers:
            continue
        if name in plan.skipped:
            lines.append(f"{name}: skipped ({plan.skipped[name]})")
            continue
        role = plan.roles[name]
        s, world = role.spec, len(role.ranks)
        if name == "rollout":
            lines.append(f"rollout: TP{s.tp}, {s.dp} replica(s), EP{s.ep} ETP{s.etp} on {world} {unit} "
                         f"(ranks {_span(role.ranks)}), engine {config.actor_rollout_ref.rollout.name}")
        elif name == "judge":
            lines.append(f"judge: TP{s.tp}, {s.dp} replica(s) on {world} {unit} (ranks {_span(role.ranks)}), "
                         f"native engine serving {plan.judge.model_path}")
        else:
            lines.append(f"{name}: TP{s.tp} PP{s.pp} DP{s.dp}, EP{s.ep} ETP{s.etp} expert-DP{s.edp} on {world} {unit} "
                         f"(VPP{s.vpp} CP{s.cp}, ranks {_span(role.ranks)})")
        for table in ROLLOUT_TABLES if name in ("rollout", "judge") else TRAIN_TABLES:
            lines.append(f"  {table:<9} {_groups(role.tables[table])}")
        if s.cp > 1:
            longest = config.data.max_prompt_length + config.data.max_response_length
            lines.append(f"  context:  every sequence in {2 * s.cp} chunks, CP rank r holds chunks r and "
                         f"{2 * s.cp - 1}-r: about 1/{s.cp} of each micro batch's tokens, <= "
                         f"{2 * -(-longest // (2 * s.cp))} of a {longest}-token sequence")
        lines.extend(f"  {phase + ':':<9} {batching.describe()}" for phase, batching in role.batches.items())
    lines.extend(f"model: {note}" for note in plan.model_notes)
    lines.append("dry run: no workers started; launch checks (data files, optional packages, device) not run")
    return "\n".join(lines)
