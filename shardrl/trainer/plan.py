"""The dry-run planner: where every role runs, how it is split, and how batches are cut — from the config alone.

`build_plan(config)` is also what the trainer uses at start, so the printed plan and the running job cannot disagree:
workers read their layout and micro-batching from `plan.roles[...]`, colocated and detached alike (one code path
for batch-size normalisation, as verl's megatron workers do it):

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

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from shardrl.parallel.layout import LayoutError, LayoutSpec, rank_tables
from shardrl.trainer.config import Mode, PPOConfig
from shardrl.trainer.model_check import check_model
from shardrl.trainer.schema import ConfigError


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


@dataclass(frozen=True)
class RolePlan:
    name: Literal["actor", "ref", "critic", "rollout"]
    spec: LayoutSpec
    ranks: list[int]
    tables: dict[str, list[list[int]]]
    batches: dict[str, MicroBatching] = field(default_factory=dict)  # "update", "log_prob", "values"


@dataclass(frozen=True)
class Plan:
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


def resolve_device(device: str) -> Literal["cpu", "cuda"]:
    """`auto` is cuda when a GPU is visible. On cpu, n_gpus_per_node counts CPU processes (gloo ranks)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device  # type: ignore[return-value]


def build_plan(config: PPOConfig) -> Plan:
    """Check layouts and batch sizes against the pools and return the plan; raises ConfigError."""
    trainer = config.trainer
    trainer_ranks = list(range(trainer.nnodes * trainer.n_gpus_per_node))
    if config.rollout is None:
        rollout_ranks = trainer_ranks
    else:
        start = len(trainer_ranks)
        rollout_ranks = list(range(start, start + config.rollout.nnodes * config.rollout.n_gpus_per_node))
    step_prompts, mini_batches = _step(config)
    arr = config.actor_rollout_ref
    roles = {"actor": _train_role(config, "actor", "actor_rollout_ref.actor.megatron", trainer_ranks, step_prompts)}
    skipped = {}
    if config.use_reference_policy:
        roles["ref"] = _train_role(config, "ref", "actor_rollout_ref.ref.megatron", trainer_ranks, step_prompts)
    else:
        skipped["ref"] = "actor.use_kl_loss and algorithm.use_kl_in_reward are both false"
    if config.use_critic:
        roles["critic"] = _train_role(config, "critic", "critic.megatron", trainer_ranks, step_prompts)
    else:
        skipped["critic"] = f"adv_estimator={config.algorithm.adv_estimator} needs no values"
    roles["rollout"] = _rollout_role(config, rollout_ranks)
    return Plan(
        mode=config.mode,
        placement="colocated" if config.rollout is None else "detached",
        device=resolve_device(trainer.device),
        trainer_ranks=trainer_ranks,
        rollout_ranks=rollout_ranks,
        step_prompts=step_prompts,
        samples_per_prompt=arr.rollout.n,
        mini_batches_per_step=mini_batches,
        roles=roles,
        skipped=skipped,
        model_notes=check_model(config, roles),
    )


def _step_key(config: PPOConfig) -> str:
    """The key that sets the prompts of one training step."""
    return "async_training.require_batches" if config.mode == "fully_async" else "data.train_batch_size"


def _step(config: PPOConfig) -> tuple[int, int]:
    """Prompts per training step and actor mini batches per step; every mini batch size must divide the step."""
    actor_mini = config.actor_rollout_ref.actor.ppo_mini_batch_size
    minis = [("actor_rollout_ref.actor.ppo_mini_batch_size", actor_mini)]
    if config.use_critic:
        minis.append(("critic.ppo_mini_batch_size", config.critic.ppo_mini_batch_size))
    step_key = _step_key(config)
    if config.mode == "fully_async":
        step = config.async_training.require_batches * actor_mini
    else:
        step = config.data.train_batch_size
    for key, mini in minis:
        if mini > step:
            raise ConfigError(key, f"{mini} prompts is larger than the {step} prompts of a step ({step_key})")
        if step % mini:
            raise ConfigError(step_key, f"a step of {step} prompts is not a multiple of {key}={mini}")
    return step, step // actor_mini


@dataclass(frozen=True)
class _Batch:
    """Where one batch's sizes live in the config: `prompts` (global) and the micro-batch keys of `group`."""

    prompts: int
    prompts_key: str
    group: str  # dotted config group holding the micro-batch keys
    micro: str  # `<micro>` (global, deprecated) and `<micro>_per_gpu`
    dynamic: str
    tokens: str


def _batches_of(config: PPOConfig, role: str, step_prompts: int) -> dict[str, _Batch]:
    step_key = _step_key(config)

    def log_prob(group: str) -> _Batch:
        return _Batch(step_prompts, step_key, group, "log_prob_micro_batch_size", "log_prob_use_dynamic_bsz",
                      "log_prob_max_token_len_per_gpu")

    if role == "ref":
        return {"log_prob": log_prob("actor_rollout_ref.ref")}
    if role == "critic":
        critic = config.critic
        return {"update": _Batch(critic.ppo_mini_batch_size, "critic.ppo_mini_batch_size", "critic",
                                 "ppo_micro_batch_size", "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
                "values": _Batch(step_prompts, step_key, "critic", "forward_micro_batch_size", "use_dynamic_bsz",
                                 "forward_max_token_len_per_gpu")}
    actor = config.actor_rollout_ref.actor
    batches = {"update": _Batch(actor.ppo_mini_batch_size, "actor_rollout_ref.actor.ppo_mini_batch_size",
                                "actor_rollout_ref.actor", "ppo_micro_batch_size", "use_dynamic_bsz",
                                "ppo_max_token_len_per_gpu")}
    if config.recompute_old_log_probs:
        batches["log_prob"] = log_prob("actor_rollout_ref.rollout")  # old logprobs; verl's keys for it live there
    return batches


def _train_role(config: PPOConfig, role: str, key: str, ranks: list[int], step_prompts: int) -> RolePlan:
    try:
        spec = config.at(key).layout(len(ranks))
    except LayoutError as err:
        raise ConfigError(key, f"{err} (the trainer pool trainer.nnodes x trainer.n_gpus_per_node has "
                               f"{len(ranks)} ranks)") from None
    rollout = config.actor_rollout_ref.rollout
    seq_len = math.ceil((rollout.prompt_length + rollout.response_length) / spec.cp)  # tokens per CP rank
    batches = {phase: normalize_batch(config, batch, rollout.n, spec.dp, seq_len)
               for phase, batch in _batches_of(config, role, step_prompts).items()}
    return RolePlan(role, spec, ranks, rank_tables(spec, ranks), batches)


def normalize_batch(config: PPOConfig, batch: _Batch, n: int, dp: int, seq_len: int) -> MicroBatching:
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


def format_plan(plan: Plan, config: PPOConfig) -> str:
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
