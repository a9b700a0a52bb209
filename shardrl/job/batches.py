"""Layouts and batch sizes: each training role's layout over the trainer pool, the rollout's over its pool, the
step's prompts and how every phase's batch is cut into micro batches per DP rank (verl's megatron normalisation),
and the keys several options need, read once (`SharedKeys`)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shardrl.job.errors import ConfigError
from shardrl.job.options import AsyncOptions, ForwardBatching
from shardrl.job.schema import (
    LoRAModelConfig,
    PolicyModelConfig,
    PPOConfig,
    Schedule,
    TeacherInferenceConfig,
    TeacherSpec,
)
from shardrl.parallel.layout_spec import LayoutError, LayoutSpec, rank_tables
from shardrl.parallel.lora import ALL_LINEAR, EXPERT_PARAMETERS, LINEAR_NAMES, PEFT_WEIGHTS, LoRASettings


@dataclass(frozen=True)
class MicroBatching:
    """How one DP rank cuts its share of a batch."""

    samples_per_rank: int
    micro_batch_size: int | None  # samples per micro batch; None with dynamic batch size
    num_micro_batches: int | None  # None with dynamic batch size (depends on the lengths)
    max_token_len: int | None  # token budget of one micro batch (dynamic batch size only)
    derived: bool = False  # the micro batch keys were null: `micro_batch_size` was derived from the token budget

    def describe(self) -> str:
        if self.micro_batch_size is None:
            return f"{self.samples_per_rank} samples/rank in micro batches of <= {self.max_token_len} tokens"
        how = " (derived: its keys are null)" if self.derived else ""
        return (f"{self.samples_per_rank} samples/rank, micro batch {self.micro_batch_size}{how} "
                f"-> {self.num_micro_batches} micro batches")

    def forward(self) -> ForwardBatching:
        return ForwardBatching(self.micro_batch_size, self.max_token_len)


@dataclass(frozen=True)
class RolePlan:
    name: Literal["actor", "ref", "teacher", "critic", "rollout"]
    spec: LayoutSpec
    ranks: list[int]
    tables: dict[str, list[list[int]]]
    batches: dict[str, MicroBatching] = field(default_factory=dict)  # "update", "log_prob", "values"


@dataclass(frozen=True)
class SharedKeys:
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
    distillation: bool  # distillation.enabled: the teacher role
    # MoE routing replay: actor.router_replay.mode, ref.router_replay.mode, rollout.enable_rollout_routing_replay
    router_replay: str
    ref_router_replay: str
    record_routing: bool
    bitwise: bool  # rollout.bitwise_logprobs: the rollout engine and the actor run batch-invariant kernels
    lora: LoRASettings | None  # model.lora_rank > 0: adapters on the actor and the rollout, the reference the base
    fused_logprobs: bool  # model.use_fused_kernels: the actor's and the reference's log-probs from the LM head fused

    @property
    def use_reference_policy(self) -> bool:
        return self.use_kl_loss or self.use_kl_in_reward


def read_shared(config: PPOConfig) -> SharedKeys:
    arr, algo = config.actor_rollout_ref, config.algorithm
    rollout = arr.rollout
    adv, enable = algo.adv_estimator, config.critic.enable
    return SharedKeys(seed=config.trainer.seed, samples_per_prompt=rollout.n, prompt_length=rollout.prompt_length,
                   response_length=rollout.response_length, temperature=rollout.temperature,
                   override_config=dict(arr.model.override_config), decoupled=algo.rollout_correction.decoupled,
                   adv_estimator=adv, use_critic=enable if enable is not None else adv == "gae",
                   use_kl_loss=arr.actor.use_kl_loss, use_kl_in_reward=algo.use_kl_in_reward,
                      distillation=config.distillation.enabled, router_replay=arr.actor.router_replay.mode,
                      ref_router_replay=arr.ref.router_replay.mode,
                      record_routing=rollout.enable_rollout_routing_replay, bitwise=rollout.bitwise_logprobs,
                      lora=lora_settings(arr.model, config.trainer.seed),
                      fused_logprobs=arr.model.use_fused_kernels)


def lora_settings(model: PolicyModelConfig, seed: int) -> LoRASettings | None:
    """verl's LoRA keys; the names must be the projections shardrl's model families have. With
    `lora_adapter_path`, as in verl, the PEFT adapter's own rank, alpha and targets hold."""
    if model.lora_adapter_path is not None:
        return _adapter_settings(model, seed)
    return named_lora_settings(model, seed, "actor_rollout_ref.model")


def named_lora_settings(model: LoRAModelConfig, seed: int, prefix: str) -> LoRASettings | None:
    """The adapters a model's `lora_rank`, `lora_alpha`, `target_modules`, `exclude_modules` and
    `target_parameters` name (`prefix`: where the keys are, for errors); None at rank 0."""
    if model.lora_rank == 0:
        return None
    targets = model.target_modules
    if isinstance(targets, str) and targets != ALL_LINEAR:
        raise ConfigError(f"{prefix}.target_modules", f"{targets!r}: use all-linear or a list of module names from "
                          f"{', '.join(LINEAR_NAMES)}")
    for key, names in (("target_modules", [] if isinstance(targets, str) else targets),
                       ("exclude_modules", model.exclude_modules or [])):
        if unknown := sorted(set(names) - set(LINEAR_NAMES)):
            raise ConfigError(f"{prefix}.{key}", f"{unknown} are not linears of shardrl's models; name some of "
                              f"{', '.join(LINEAR_NAMES)}")
    return LoRASettings(model.lora_rank, model.lora_alpha, targets if isinstance(targets, str) else tuple(targets),
                        tuple(model.exclude_modules or ()), seed=seed,
                        target_parameters=_expert_targets(model.target_parameters or [],
                                                          f"{prefix}.target_parameters"))


def _expert_targets(names: list[str], key: str) -> tuple[str, ...]:
    """PEFT's `target_parameters`: the MoE experts' stacked weights, in PEFT's order (its wrapping order)."""
    if unknown := sorted(set(names) - set(EXPERT_PARAMETERS)):
        raise ConfigError(key, f"{unknown}: shardrl adapts the MoE experts' {' and '.join(EXPERT_PARAMETERS)}")
    if len(set(names)) != len(names):
        raise ConfigError(key, f"{names} names a weight twice")
    return tuple(names)


# PEFT adapter settings shardrl's adapters have: each key's accepted values (the first is PEFT's default).
PLAIN_LORA = {"use_dora": (False,), "use_rslora": (False,), "bias": ("none",), "modules_to_save": (None, []),
              "fan_in_fan_out": (False,)}


def _adapter_settings(model: PolicyModelConfig, seed: int) -> LoRASettings:
    """The settings of the PEFT LoRA adapter at `lora_adapter_path` (its adapter_config.json), checked for what
    shardrl's adapters are."""
    key, path = "actor_rollout_ref.model.lora_adapter_path", Path(model.lora_adapter_path)
    try:
        adapter = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(key, f"{path}: no readable adapter_config.json ({type(err).__name__}); point it at a "
                               f"PEFT LoRA adapter directory") from None
    if adapter.get("peft_type") != "LORA" or not (path / PEFT_WEIGHTS).is_file():
        raise ConfigError(key, f"{path}: not a PEFT LoRA adapter (peft_type {adapter.get('peft_type')!r}, "
                               f"{PEFT_WEIGHTS} {'present' if (path / PEFT_WEIGHTS).is_file() else 'missing'})")
    unsupported = [f"{flag}={adapter[flag]!r}" for flag, plain in PLAIN_LORA.items()
                   if adapter.get(flag, plain[0]) not in plain]
    targets = adapter.get("target_modules")  # None or []: the experts alone (target_parameters)
    names = [] if targets in (ALL_LINEAR, None) else targets if isinstance(targets, list) else None
    if names is None or sorted(set(names) - set(LINEAR_NAMES)):
        unsupported.append(f"target_modules={targets!r}")
    if unsupported:
        raise ConfigError(key, f"{path}: {', '.join(unsupported)}: shardrl's adapters are plain LoRA on "
                               f"{', '.join(LINEAR_NAMES)}")
    if model.lora_rank not in (0, adapter["r"]):
        raise ConfigError("actor_rollout_ref.model.lora_rank", f"{model.lora_rank}, but the adapter at {path} has "
                                                              f"rank {adapter['r']}; set it to 0 or {adapter['r']}")
    experts = _expert_targets(adapter.get("target_parameters") or [], f"{key} ({path}/adapter_config.json "
                                                                      f"target_parameters)")
    modules = ALL_LINEAR if targets == ALL_LINEAR else tuple(names)
    return LoRASettings(adapter["r"], float(adapter["lora_alpha"]), modules,
                        tuple(adapter.get("exclude_modules") or ()), seed=seed, initial=str(path),
                        target_parameters=experts)


@dataclass(frozen=True)
class StepSize:
    """A training step's prompts and the mini batches that must divide it."""

    prompts: int
    mini_batches: int  # the actor's, per step
    key: str  # the key that sets `prompts`
    actor_mini: int
    critic_mini: int | None
    train_batch_size: int


def plan_step(config: PPOConfig, shared: SharedKeys, mode: Schedule, async_training: AsyncOptions | None) -> StepSize:
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
    size = StepSize(step, step // actor_mini, step_key, actor_mini, critic_mini, train_batch_size)
    for key, mini in minis:
        if mini > step:
            raise ConfigError(key, f"{mini} prompts is larger than the {step} prompts of a step ({step_key}); "
                                   f"set {key}={step}")
        if step % mini:
            raise ConfigError(step_key, f"a step of {step} prompts is not a multiple of {key}={mini}; "
                                        f"{_fitting_step(size, 1)}")
    return size


def _fitting_step(step: StepSize, multiple: int) -> str:
    """`set <step key>=<value>`: the nearest step up from `step` that every mini batch divides and whose prompts are
    a multiple of `multiple`."""
    minis = [m for m in (step.actor_mini, step.critic_mini) if m]
    if step.key == "data.train_batch_size":
        return f"set {step.key}={_round_up(step.prompts, math.lcm(multiple, *minis))}"
    # fully async: the step is async_training.require_batches actor mini batches
    unit = math.lcm(*(m // math.gcd(m, step.actor_mini) for m in (multiple, *minis)))
    return f"set {step.key}={_round_up(step.mini_batches, unit)}"


@dataclass(frozen=True)
class _BatchKeys:
    """Where one batch's sizes live in the config: `prompts` (global) and the micro-batch keys of `group`."""

    prompts: int
    prompts_key: str
    group: str  # dotted config group holding the micro-batch keys
    micro: str  # `<micro>` (global, deprecated) and `<micro>_per_gpu`
    dynamic: str
    tokens: str


def _batches_of(shared: SharedKeys, role: str, step: StepSize) -> dict[str, _BatchKeys]:
    def log_prob(group: str) -> _BatchKeys:
        return _BatchKeys(step.prompts, step.key, group, "log_prob_micro_batch_size", "log_prob_use_dynamic_bsz",
                          "log_prob_max_token_len_per_gpu")

    if role == "ref":
        return {"log_prob": log_prob("actor_rollout_ref.ref")}
    if role == "teacher":
        return {"log_prob": log_prob("distillation.teacher_model")}
    if role == "reward_model":
        return {"forward": _BatchKeys(step.prompts, step.key, "reward_model", "micro_batch_size", "use_dynamic_bsz",
                                      "forward_max_token_len_per_gpu")}
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


def train_role(config: PPOConfig, shared: SharedKeys, role: str, key: str, ranks: list[int],
               step: StepSize) -> RolePlan:
    try:
        spec = config.at(key).layout(len(ranks))
    except LayoutError as err:
        raise ConfigError(key, f"{err} (the trainer pool trainer.nnodes x trainer.n_gpus_per_node has "
                               f"{len(ranks)} ranks)") from None
    return _role_on(config, shared, role, spec, ranks, step)


def _role_on(config: PPOConfig, shared: SharedKeys, role: str, spec: LayoutSpec, ranks: list[int],
             step: StepSize) -> RolePlan:
    """A role laid out by `spec` over `ranks`, with its phases' micro batches."""
    seq_len = math.ceil((shared.prompt_length + shared.response_length) / spec.cp)  # tokens per CP rank
    batches = {phase: normalize_batch(config, batch, shared.samples_per_prompt, spec.dp, seq_len, step, spec.cp)
               for phase, batch in _batches_of(shared, role, step).items()}
    return RolePlan(role, spec, ranks, rank_tables(spec, ranks), batches)


def normalize_batch(config: PPOConfig, batch: _BatchKeys, n: int, dp: int, seq_len: int,
                    step: StepSize, cp: int = 1) -> MicroBatching:
    """`batch.prompts` (global) x n samples -> per DP rank -> micro batches (verl's megatron normalisation; the
    deprecated global micro batch is divided by DP). Both micro batch keys null (verl requires one): the fewest
    equal micro batches that each hold at most the token budget `batch.tokens` of full-length sequences, so that
    the default works for any rollout.n and DP. `seq_len`: a full sequence's tokens per CP rank; the token
    budgets are per GPU, so with `cp` ranks sharing a micro batch it holds `cp` times the budget (as verl's)."""
    node = config.at(batch.group)
    samples = batch.prompts * n
    if samples % dp:
        split = f"{samples // dp} per rank" if samples < dp else "an uneven split"
        raise ConfigError(batch.prompts_key, f"{batch.prompts} prompts x rollout.n {n} = {samples} samples do not "
                                             f"split evenly over DP={dp} ({split}); {_even_split(batch, n, dp, step)}")
    per_rank = samples // dp
    if getattr(node, batch.dynamic):
        max_tokens = getattr(node, batch.tokens)
        if max_tokens < seq_len:
            raise ConfigError(f"{batch.group}.{batch.tokens}", f"{max_tokens} tokens cannot hold one full sequence "
                                                               f"of {seq_len} tokens (prompt + response per CP rank)")
        return MicroBatching(per_rank, None, None, max_tokens * cp)
    total, per_gpu = getattr(node, batch.micro), getattr(node, f"{batch.micro}_per_gpu")
    key = f"{batch.group}.{batch.micro}"
    if total is None and per_gpu is None:
        per_gpu = divisor_at_most(per_rank, getattr(node, batch.tokens) // seq_len)
        return MicroBatching(per_rank, per_gpu, per_rank // per_gpu, None, derived=True)
    if per_gpu is None:
        if total % dp or per_rank % (total // dp):
            fits = dp * divisor_at_most(per_rank, total // dp)
            raise ConfigError(key, f"global micro batch {total} / DP={dp} does not cut the {per_rank} samples per "
                                   f"DP rank evenly; set {key}={fits} (or {batch.micro}_per_gpu instead)")
        per_gpu = total // dp
    elif per_rank % per_gpu:
        raise ConfigError(f"{key}_per_gpu", f"the {per_rank} samples per DP rank ({samples} samples / DP={dp}) are "
                                            f"not divisible by the micro batch {per_gpu}; set "
                                            f"{key}_per_gpu={divisor_at_most(per_rank, per_gpu)} (or null to derive "
                                            f"it from {batch.group}.{batch.tokens})")
    return MicroBatching(per_rank, per_gpu, per_rank // per_gpu, None)


def divisor_at_most(value: int, cap: int) -> int:
    """The largest divisor of `value` not above `cap` (at least 1): the size to propose (or derive) for something
    that must cut `value` evenly."""
    return max(d for d in range(1, max(1, min(value, cap)) + 1) if value % d == 0)


def _even_split(batch: _BatchKeys, n: int, dp: int, step: StepSize) -> str:
    """What to set so that `batch`'s prompts x n samples split evenly over DP (`set <key>=<value> ...`): a mini
    batch that still divides the step (changing the step too when none does), or a step the mini batches divide."""
    multiple = dp // math.gcd(n, dp)  # the prompts must be a multiple of this
    if batch.prompts_key == step.key:
        return _fitting_step(step, multiple)
    if step.key != "data.train_batch_size":  # fully async: the step follows the actor's mini batch
        return f"set {batch.prompts_key}={_round_up(batch.prompts, multiple)}"
    fitting = [d for d in range(multiple, step.prompts + 1, multiple) if step.prompts % d == 0]
    if fitting:
        return f"set {batch.prompts_key}={min(fitting, key=lambda d: (abs(d - batch.prompts), d))}"
    other = step.critic_mini if batch.prompts_key.startswith("actor_rollout_ref.") else step.actor_mini
    return (f"set {batch.prompts_key}={multiple} {step.key}="
            f"{_round_up(step.prompts, math.lcm(multiple, other or 1))}")


def _round_up(value: int, unit: int) -> int:
    return math.ceil(value / unit) * unit


def rollout_role(config: PPOConfig, ranks: list[int]) -> RolePlan:
    """The rollout is laid out over its own pool only, never by the trainer's TP x PP x EP."""
    rollout = config.actor_rollout_ref.rollout
    pool = ("the trainer pool (colocated)" if config.rollout is None
            else "the rollout pool rollout.nnodes x rollout.n_gpus_per_node")
    world, tp = len(ranks), rollout.tensor_model_parallel_size
    if world % tp:
        key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
        raise ConfigError(key, f"TP {tp} does not divide {pool} of {world} ranks; set {key}={divisor_at_most(world, tp)}")
    try:
        spec = rollout.layout(world)
    except LayoutError as err:
        raise ConfigError("actor_rollout_ref.rollout.expert_parallel_size", f"{err} ({pool})") from None
    if rollout.data_parallel_size not in (None, spec.dp):
        raise ConfigError("actor_rollout_ref.rollout.data_parallel_size",
                          f"{rollout.data_parallel_size} != {world} ranks / TP {tp} = {spec.dp}; leave it null")
    return RolePlan("rollout", spec, ranks, rank_tables(spec, ranks))


def judge_role(config: PPOConfig, ranks: list[int]) -> RolePlan:
    """The generative judge's engine over the trainer pool: TP inside a replica, replicas = pool / TP."""
    tp = config.reward_model.judge.tensor_model_parallel_size
    if len(ranks) % tp:
        key = "reward_model.judge.tensor_model_parallel_size"
        raise ConfigError(key, f"TP {tp} does not divide the trainer pool of {len(ranks)} ranks; set "
                               f"{key}={divisor_at_most(len(ranks), tp)}")
    spec = LayoutSpec(world_size=len(ranks), tp=tp)
    return RolePlan("judge", spec, ranks, rank_tables(spec, ranks))


DEFAULT_TEACHER = "teacher_model"  # verl's packaged entry of `distillation.teacher_models`
LONE_TEACHER_KEY = "default"  # verl's routing key of a lone teacher (it scores every sample)
# A teacher's `inference` keys that lay it out on the teachers' own pool (with its share of each GPU's memory).
POOL_INFERENCE_KEYS = ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size",
                       "expert_parallel_size", "gpu_memory_utilization")


@dataclass(frozen=True)
class Teacher:
    """A resolved distillation teacher: its entry `name`, directory, the role (`RolePlan`) it runs as, and on the
    teachers' own pool its layout and memory share."""

    name: str
    model_path: str
    role: str  # `teacher` (the trainer pool's) or `teacher/<name>` (its share of the teachers' pool)
    pool_layout: tuple[int, int, int, int] | None = None  # (TP, PP, EP, replicas x data_parallel_size)
    memory_fraction: float | None = None


def distillation_teachers(config: PPOConfig, pool_size: int) -> dict[str, Teacher]:
    """The teachers by routing key, as verl 0.8+ resolves `distillation.teacher_models`. A lone `teacher_model`
    entry scores every sample (key `default`). Next to other entries verl drops it without a word; here it must then
    be unset. Every named teacher needs `key` and `model_path`, and keys differ. On the teachers' own pool
    (`pool_size` ranks: distillation.nnodes x n_gpus_per_node; 0: none) each takes num_replicas x TP x DP x PP ranks of its
    `inference` sizes, and they fill the pool exactly (verl's rule; a lone teacher's replicas fill it)."""
    distillation = config.distillation
    entries = distillation.teacher_models
    if DEFAULT_TEACHER not in entries:
        raise ConfigError(f"distillation.teacher_models.{DEFAULT_TEACHER}", "is missing; keep the packaged entry "
                                                                            "(add others with +distillation.teacher_"
                                                                            "models.<name>.*)")
    named = {name: spec for name, spec in entries.items() if name != DEFAULT_TEACHER}
    lone = entries[DEFAULT_TEACHER]
    if named and (lone.model_path is not None or lone.key is not None):
        field_name = "model_path" if lone.model_path is not None else "key"
        raise ConfigError(f"distillation.teacher_models.{DEFAULT_TEACHER}.{field_name}", f"is set beside the "
                          f"teachers {sorted(named)}, and verl drops this entry when others are named; give it a "
                          f"name of its own (+distillation.teacher_models.<name>.{field_name}=...)")
    on_pool = pool_size > 0
    teachers: dict[str, Teacher] = {}
    for name, spec in (named or {DEFAULT_TEACHER: lone}).items():
        group = f"distillation.teacher_models.{name}"
        if spec.model_path is None:
            raise ConfigError(f"{group}.model_path", "must be set when distillation.enabled=true (an HF model "
                                                     "directory with the student's tokenizer)")
        if named and spec.key is None:
            raise ConfigError(f"{group}.key", f"must be set with several teachers: the value of the samples' "
                                              f"{distillation.teacher_key!r} field (distillation.teacher_key) this "
                                              "teacher scores")
        key = spec.key if named else LONE_TEACHER_KEY
        if key in teachers:
            raise ConfigError(f"{group}.key", f"{key!r} is also teacher {teachers[key].name!r}'s; each teacher needs "
                                              "a key of its own")
        _check_teacher_serving(spec, group, config, on_pool)
        if not on_pool:
            teachers[key] = Teacher(name, spec.model_path, "teacher")
            continue
        inference = spec.inference
        per_replica = (inference.tensor_model_parallel_size * inference.data_parallel_size *
                       inference.pipeline_model_parallel_size)
        replicas = spec.num_replicas if named else pool_size // per_replica
        if not named and pool_size % per_replica:
            raise ConfigError(f"{group}.inference.tensor_model_parallel_size", f"a replica of TP x DP x PP = "
                              f"{per_replica} ranks does not divide the teacher pool's {pool_size} "
                              "(distillation.nnodes x n_gpus_per_node)")
        if not named and spec.num_replicas not in (0, replicas):  # verl overwrites it without a word
            raise ConfigError(f"{group}.num_replicas", f"{spec.num_replicas}: a lone teacher's replicas fill the "
                              f"teacher pool ({replicas} of {per_replica} ranks each); leave it 0 or {replicas}")
        if replicas == 0:
            raise ConfigError(f"{group}.num_replicas", "is 0: on the teacher pool (distillation.n_gpus_per_node) "
                                                      "each teacher needs at least one replica")
        teachers[key] = Teacher(name, spec.model_path, f"teacher/{name}",
                                (inference.tensor_model_parallel_size, inference.pipeline_model_parallel_size,
                                 inference.expert_parallel_size, replicas * inference.data_parallel_size),
                                inference.gpu_memory_utilization)
    if on_pool:
        used = sum(math.prod(t.pool_layout[:2]) * t.pool_layout[3] for t in teachers.values())
        if used != pool_size:
            raise ConfigError("distillation.n_gpus_per_node", f"the teachers take {used} ranks (num_replicas x "
                              f"inference TP x DP x PP each) and the teacher pool has {pool_size} "
                              "(distillation.nnodes x n_gpus_per_node); make them equal (verl's rule)")
    return teachers


def _check_teacher_serving(spec: TeacherSpec, group: str, config: PPOConfig, on_pool: bool) -> None:
    """A teacher's verl serving keys. shardrl scores with one forward pass per micro batch, with no KV cache or
    graphs to configure, so the engine settings keep verl's defaults; on the teachers' own pool the parallel sizes
    and memory share (`POOL_INFERENCE_KEYS`) lay it out, and on the trainer pool they and `num_replicas` keep their
    defaults too. Temperature stays 1 (the teacher's own distribution, as verl scores it); `max_model_len` is
    checked as verl checks it."""
    if spec.num_replicas and not on_pool:
        raise ConfigError(f"{group}.num_replicas", f"{spec.num_replicas}: with no teacher pool "
                                                   "(distillation.n_gpus_per_node=0) the teachers score on the "
                                                   "trainer pool, laid out by distillation.teacher_model.megatron.*; "
                                                   "set 0, or give the teachers a pool")
    inference, default = spec.inference, TeacherInferenceConfig()
    if inference.temperature != 1.0:
        raise ConfigError(f"{group}.inference.temperature", f"{inference.temperature}: the teacher scores the "
                                                            "samples at temperature 1, its own distribution (verl "
                                                            "ignores this key as well); leave it 1.0")
    data = config.data
    if inference.max_model_len is not None and \
            data.max_prompt_length + data.max_response_length + 1 > inference.max_model_len:
        raise ConfigError(f"{group}.inference.max_model_len", f"{inference.max_model_len} < data.max_prompt_length + "
                          f"data.max_response_length + 1 = {data.max_prompt_length + data.max_response_length + 1}: "
                          "the teacher reads each whole sample; raise it or leave it null")
    for name in (f.name for f in dataclasses.fields(TeacherInferenceConfig)):
        if name in ("temperature", "max_model_len") or (on_pool and name in POOL_INFERENCE_KEYS):
            continue
        value, packaged = getattr(inference, name), getattr(default, name)
        if value != packaged:
            where = ("only its parallel sizes and gpu_memory_utilization lay it out on the teacher pool" if on_pool
                     else "with no teacher pool (distillation.n_gpus_per_node=0) shardrl scores on the trainer pool, "
                          "laid out by distillation.teacher_model.megatron.*")
            raise ConfigError(f"{group}.inference.{name}", f"{value!r} configures verl's serving engine for this "
                                                           f"teacher; {where}: leave it {packaged!r}")


def teacher_pool_roles(config: PPOConfig, shared: SharedKeys, step: StepSize, teachers: dict[str, Teacher],
                       first: int) -> dict[str, RolePlan]:
    """Each teacher's role on the teachers' own pool, whose ranks start at `first`: consecutive shares in entry
    order, each laid out by its `inference` sizes (TP, PP, EP; DP = replicas x data_parallel_size)."""
    roles = {}
    for teacher in teachers.values():
        tp, pp, ep, dp = teacher.pool_layout
        ranks = list(range(first, first + tp * pp * dp))
        first += len(ranks)
        try:
            spec = LayoutSpec(world_size=len(ranks), tp=tp, pp=pp, ep=ep, etp=tp)
        except LayoutError as err:
            raise ConfigError(f"distillation.teacher_models.{teacher.name}.inference.expert_parallel_size",
                              f"{err} (the teacher's {len(ranks)} ranks)") from None
        roles[teacher.role] = _role_on(config, shared, "teacher", spec, ranks, step)
    return roles
