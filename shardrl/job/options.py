"""The compiled job: typed options per role and for the controller (compile.py fills them in from the config).

Workers take their role's options (`ActorOptions`, `RefOptions`, `CriticOptions`, `RolloutOptions`) and never see
the config; the controller takes `DataOptions`, `RewardOptions`, `AlgorithmOptions`, `LoopOptions`,
`ClusterOptions`, `TrackingOptions` and `AsyncOptions`.

Some values depend on the data, which a dry run does not read: the number of training steps (`LoopOptions.
total_steps`, and each optimizer's schedule length) is None until `JobPlan.with_total_steps` fills it in at launch.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any, Literal

import torch

from shardrl.agents.driver import AgentSettings
from shardrl.algos import ClipRange
from shardrl.algos.covariance import CovarianceSelection
from shardrl.algos.distillation import DistillationSettings
from shardrl.algos.policy_filtration import PolicyFiltration
from shardrl.algos.rejection import RejectionSampling
from shardrl.job.schema import (
    AdvEstimator,
    FilterMetric,
    KLEstimator,
)
from shardrl.models.fast_paths import FastPaths
from shardrl.parallel.expert import RouterOptions
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.lora import LoRASettings
from shardrl.rewards.manager import JudgeScoring, OverlongShaping, RewardModelScoring
from shardrl.rollout.request import SamplingParams
from shardrl.rollout.runner import EngineConfig

# ---- what the workers take -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OptimOptions:
    """AdamW and its LR schedule (parallel/optimizer.py). `total_steps` None: not known until launch."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float | None = 1.0
    distributed: bool = False
    total_steps: int | None = 1
    warmup_steps: int | None = -1
    warmup_ratio: float = 0.0
    decay_style: str = "constant"
    decay_steps: int | None = None  # null: total_steps - warmup
    min_lr_ratio: float = 0.0


@dataclass(frozen=True)
class EngineOptions:
    """How one role's model is built on its ranks (workers/engine.py)."""

    sequence_parallel: bool = False
    recompute: bool = False
    dtype: torch.dtype = torch.float32
    value_head: bool = False
    router: RouterOptions = RouterOptions()  # MoE routers: loss weights, fp32 logits (override_transformer_config)
    optim: OptimOptions | None = None  # None: inference only (reference policy)
    fast: FastPaths = dataclasses.field(default_factory=FastPaths)  # TP overlap, compiled elementwise kernels
    lora: LoRASettings | None = None  # adapters on the targeted linears, the base frozen (`parallel.lora`)


@dataclass(frozen=True)
class UpdateOptions:
    """PPO epochs over one step's batch on one rank: mini batches of `mini_batch_size` samples (ppo_mini_batch_size
    x n / DP), cut into micro batches by count or (dynamic batch size) by tokens. `seed` shuffles: the controller's
    step is added per call, so every step shuffles differently and reproducibly."""

    mini_batch_size: int
    micro_batch_size: int | None = None
    max_token_len: int | None = None
    ppo_epochs: int = 1
    shuffle: bool = False
    seed: int = 0


@dataclass(frozen=True)
class ForwardBatching:
    """How a forward-only pass (log-probs, values) cuts one rank's share: by count, or (dynamic) by tokens."""

    micro_batch_size: int | None
    max_token_len: int | None


@dataclass(frozen=True)
class PolicyLossOptions:
    loss_agg_mode: str = "token-mean"
    loss_mode: str = "vanilla"  # actor.policy_loss.loss_mode, or reinforce (bypass loss_type): algos.actor_loss
    bypass_is: tuple[str, float] | None = None  # reinforce's (rollout_is, threshold) vs the current policy
    clip: ClipRange = ClipRange()
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    max_response_length: int = 1  # the divisor of seq-mean-token-sum-norm (actor.loss_scale_factor)
    # clip_cov / kl_cov: which tokens they restrain, chosen per optimizer step over the mini batch (algos.covariance)
    covariance: CovarianceSelection | None = None
    # The batch's old log-probs are the actor's own at the update's start (the old-logprob pass ran: decoupled);
    # false in bypass mode, where they are the rollout's.
    anchor_is_actor: bool = True


@dataclass(frozen=True)
class OffloadOptions:
    """What a role keeps in host memory between its calls (`shardrl.parallel.offload` keyword arguments)."""

    params: bool = False
    grads: bool = False
    optimizer_state: bool = False

    @property
    def any(self) -> bool:
        return self.params or self.grads or self.optimizer_state


@dataclass(frozen=True)
class ModelOptions:
    """One training role's model: its layout, how it is built and where its initial weights come from."""

    spec: LayoutSpec
    ranks: list[int]
    engine: EngineOptions
    offload: OffloadOptions
    override_config: dict[str, Any]  # model.override_config: config.json fields replaced before the model is built
    load_weight: bool  # false: random init (verl's load_weight)
    dist_checkpoint: str | None  # megatron.dist_checkpointing_path when use_dist_checkpointing, else None (HF)


@dataclass(frozen=True)
class CheckpointOptions:
    """What a role's checkpoints hold and what a resume restores (verl's save_contents / load_contents)."""

    save_contents: tuple[str, ...]
    load_contents: tuple[str, ...]
    strict: bool  # a starting HF checkpoint may hold only tensors the model carries (job/preflight.py)


@dataclass(frozen=True)
class TeacherOptions:
    """One on-policy distillation teacher: a frozen model of its own (any size, the student's tokenizer) scoring the
    student's samples at temperature 1 (workers/teacher.py), on the trainer pool beside the reference policy or on
    its share of the teachers' own pool."""

    path_key: str  # the config key of its directory, for errors
    model_path: str
    model: ModelOptions  # its layout (ranks) and engine
    log_prob: ForwardBatching
    topk: int | None  # forward_kl_topk: its top k of every response position; None: the sampled tokens' log-probs
    memory_fraction: float | None  # on its own pool: the share of each GPU it may allocate; None: no cap


@dataclass(frozen=True)
class TeacherSet:
    """On-policy distillation's teachers by routing key (a lone teacher's is `default`). With several, each sample
    goes to the teacher whose key its `route_field` value equals."""

    by_key: dict[str, TeacherOptions]
    route_field: str | None  # None: the lone teacher scores every sample

    @property
    def sources(self) -> list[tuple[str, str]]:
        """(config key, directory) of every teacher's weights."""
        return [(t.path_key, t.model_path) for t in self.by_key.values()]


@dataclass(frozen=True)
class ActorOptions:
    seed: int  # torch's seed before the model is built (megatron.seed: the init of weights not loaded)
    model: ModelOptions
    update: UpdateOptions
    loss: PolicyLossOptions
    log_prob: ForwardBatching | None  # the old-logprob pass; None when PPO anchors on behaviour logprobs
    temperature: float  # logprobs are taken at the rollout's sampling temperature (the teachers' at 1)
    checkpoint: CheckpointOptions
    distillation: DistillationSettings | None  # on-policy distillation's term of the actor loss; None: off
    # MoE routing replay (verl's actor.router_replay.mode): R2, the old-logprob pass records each token's experts
    # and the update replays them; R3, the old-logprob pass and the update replay the rollout engine's.
    router_replay: Literal["disabled", "R2", "R3"] = "disabled"
    # R3 only: the old-logprob pass runs once more with every MoE layer routing itself, so the batch carries the
    # log-probs replay replaced (`unreplayed_log_probs`) and the step reports their mismatch with the rollout's.
    measure_unreplayed: bool = False
    # The old-logprob pass also outputs `sum_pi_squared` [B, R], sum over the vocabulary of pi^2 (the optimal token
    # baseline's path variance; actor.calculate_sum_pi_squared).
    sum_pi_squared: bool = False


@dataclass(frozen=True)
class RefOptions:
    model: ModelOptions
    log_prob: ForwardBatching
    replay_rollout_routing: bool = False  # ref.router_replay.mode=R3: the reference pass replays the rollout's
    # LoRA (model.lora_rank > 0): the reference is the actor's base model, its adapters switched off for the pass,
    # on the actor's engine (no second copy of the weights; `model` then describes the actor's).
    on_actor: bool = False


@dataclass(frozen=True)
class CriticOptions:
    seed: int
    model: ModelOptions
    update: UpdateOptions
    values: ForwardBatching
    loss_agg_mode: str
    cliprange_value: float
    max_response_length: int
    checkpoint: CheckpointOptions


@dataclass(frozen=True)
class RewardModelOptions:
    """A frozen reward model (an HF `*ForSequenceClassification` checkpoint, num_labels=1) scoring whole samples
    (workers/reward_model.py). Its `model.engine` has `value_head=True` and no optimizer.

    `input_tokenizer`: the policy's tokenizer when it is not the reward model's (verl's
    `reward_model.model.input_tokenizer`); each sample is then decoded with it and re-rendered with the reward model's
    chat template, at most `max_length` tokens (verl's `reward_model.max_length`; None: the samples' width). None: the
    samples' own tokens are scored and `max_length` is not read."""

    model: ModelOptions
    forward: ForwardBatching
    input_tokenizer: str | None = None
    max_length: int | None = None


@dataclass(frozen=True)
class SamplingOptions:
    """One mode's sampling (training, or validation by `val_kwargs`); greedy when do_sample is false."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    ignore_eos: bool

    def params(self, seeds: torch.Tensor) -> list[SamplingParams]:
        """One request's settings per row (`seeds` [B]: the rows' `sample_seed`)."""
        return [SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                               top_p=self.top_p, ignore_eos=self.ignore_eos, seed=int(seed)) for seed in seeds]


JUDGE_TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")  # what a judge's prompt template may name
DEFAULT_JUDGE_TEMPLATE = (
    "You grade answers. Read the question, the reference answer and the answer to grade, then rate how correct "
    "the answer is from 0 (wrong) to 1 (fully correct).\n\nQuestion: {prompt}\n\nReference answer: "
    "{ground_truth}\n\nAnswer to grade: {response}\n\nEnd your reply with a line 'Score: <number>'.")


@dataclass(frozen=True)
class JudgeOptions:
    """The generative judge's worker (workers/judge.py): its model, engine and layout over the trainer pool, how it
    samples a verdict, the prompt it reads each sample through and the pattern its score is parsed with."""

    model_path: str
    spec: LayoutSpec
    ranks: list[int]
    engine: EngineConfig
    sampling: SamplingOptions
    prompt_template: str  # str.format fields among JUDGE_TEMPLATE_FIELDS
    score_pattern: str
    free_cache_engine: bool
    scoring: JudgeScoring  # the controller's side (RewardOptions.judge)


@dataclass(frozen=True)
class WeightSyncOptions:
    bucket_bytes: int
    verify: Literal["checksum", "full"]
    ranks: list[int]  # every rank of the sync group: the colocated ranks, or trainer then rollout pool


@dataclass(frozen=True)
class RolloutOptions:
    engine_name: Literal["native", "vllm", "sglang"]  # only native runs (preflight refuses the others at launch)
    seed: int
    spec: LayoutSpec  # over the rollout's own pool
    ranks: list[int]
    engine: EngineConfig
    train: SamplingOptions
    validate: SamplingOptions
    response_length: int
    free_cache_engine: bool  # colocated: free the KV cache after each generation, for training to use the memory
    override_config: dict[str, Any]
    weight_sync: WeightSyncOptions
    agent: AgentSettings | None = None  # multi-turn agent loops (rollout.multi_turn.enable); None: single turn


# ---- what the controller takes ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DataOptions:
    train_files: list[str] | None  # None: the built-in task
    val_files: list[str] | None
    tokenizer: str | None  # None: the model's
    trust_remote_code: bool
    prompt_key: str
    max_prompt_length: int
    truncation: str
    filter_overlong_prompts: bool
    render_workers: int  # data.filter_overlong_prompts_workers: processes rendering the chat template
    media_keys: tuple[str, ...]  # data.image_key / video_key / audio_key: columns whose values the dataset refuses
    apply_chat_template_kwargs: dict[str, Any]
    train_max_samples: int
    val_max_samples: int
    gen_batch_size: int
    val_batch_size: int | None
    shuffle: bool
    validation_shuffle: bool
    seed: int


@dataclass(frozen=True)
class RewardOptions:
    custom_path: str | None
    custom_name: str
    data_source_key: str  # data.reward_fn_key: the column that picks the scorer
    overlong: OverlongShaping | None
    custom_workers: int = 2  # the custom function's processes, per-sample timeout and failure policy
    custom_timeout: float = 60.0
    custom_on_error: str = "fail"
    server_url: str | None = None  # a reward service (`custom_reward_function.url`) and how it is called
    server_concurrency: int = 64
    server_retries: int = 3
    server_backoff: float = 1.0
    while_generating: bool = False  # reward_model.use_reward_loop: score each sample as its generation finishes
    judge: JudgeScoring | None = None  # reward_model.judge
    reward_model: RewardModelScoring = RewardModelScoring()  # reward_model.combine, .weight
    # reward_manager=gdpo (verl's): every sample's extra_info gets `experiment_name`, the run's trainer.experiment_name
    experiment_name: str | None = None


@dataclass(frozen=True)
class KLInRewardOptions:
    estimator: KLEstimator
    controller: Literal["fixed", "adaptive"]
    coef: float
    target_kl: float
    horizon: int


@dataclass(frozen=True)
class CorrectionOptions:
    """Off-policy correction (algos.off_policy): the IS level applied once per step (decoupled only)."""

    rollout_is: Literal["token", "sequence"] | None
    rollout_is_threshold: float
    rollout_is_batch_normalize: bool
    rejection: RejectionSampling | None
    decoupled: bool


@dataclass(frozen=True)
class FilterGroupsOptions:
    metric: FilterMetric
    max_num_gen_batches: int


@dataclass(frozen=True)
class AlgorithmOptions:
    adv_estimator: AdvEstimator
    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    kl_in_reward: KLInRewardOptions | None
    correction: CorrectionOptions
    filter_groups: FilterGroupsOptions | None  # DAPO's dynamic sampling, when enabled
    gdpo_reward_keys: tuple[str, ...] | None = None  # adv_estimator=gdpo: the reward extras it normalises one by one
    gdpo_reward_weights: tuple[float, ...] | None = None  # and their weights (None: 1 each)
    policy_filtration: PolicyFiltration | None = None  # PF-PPO's resampling after GAE (`algorithm.use_pf_ppo`)


@dataclass(frozen=True)
class LoopOptions:
    """The controller's loop: length, validation, checkpoints, sampling seeds, DP balancing."""

    total_steps: int | None  # None until launch (`JobPlan.with_total_steps`)
    total_training_steps: int | None  # trainer.total_training_steps as given
    total_epochs: int
    total_rollout_steps: int | None  # fully async: samples to generate in all
    seed: int
    samples_per_prompt: int
    val_samples_per_prompt: int
    train_batch_size: int
    critic_warmup: int
    val_before_train: bool
    test_freq: int
    save_freq: int
    resume_mode: Literal["auto", "disable", "resume_path"]
    resume_from_path: str | None
    run_dir: str
    max_ckpt_to_keep: dict[str, int | None]  # per role
    save_hf: bool  # "hf_model" in actor.checkpoint.save_contents
    balance_batch: bool
    actor_mini_batch_size: int
    critic_mini_batch_size: int | None
    log_val_generations: int
    # verl's sample dumps: <dir>/<step>.jsonl per training step / per validation (None: none)
    rollout_data_dir: str | None = None
    validation_data_dir: str | None = None
    val_only: bool = False  # validate before training, then stop


@dataclass(frozen=True)
class ClusterOptions:
    ray_init: dict[str, Any]
    # On a cluster of the user's own (ray_init.address), a CPU rank reserves a whole core, so pools fill and spread
    # over nodes as GPU ranks do; a private local instance packs slivers of its cores (ResourcePool).
    whole_cpu_cores: bool
    trainer_nodes: int
    trainer_gpus_per_node: int
    rollout_nodes: int | None
    rollout_gpus_per_node: int | None
    collective_timeout: datetime.timedelta
    # the reward model's own pool (reward_model.enable_resource_pool), its ranks after the trainer's and rollout's
    reward_model_nodes: int | None = None
    reward_model_gpus_per_node: int | None = None
    # the distillation teachers' own pool (distillation.nnodes x n_gpus_per_node), its ranks after all the others'
    teacher_nodes: int | None = None
    teacher_gpus_per_node: int | None = None


@dataclass(frozen=True)
class TrackingOptions:
    loggers: list[str]
    project: str
    experiment: str
    config: dict[str, Any]  # the whole config, for the trackers' run record


@dataclass(frozen=True)
class AsyncOptions:
    """The asynchronous schedules' settings (trainer/staleness.py reads them): `async_training.*` for one_step_off
    and fully_async; for colocate_async (verl 0.9's trainer.v1) the batches generated ahead of the step
    (`warmup_batches`) and the largest lag a trained token may have (`max_lag`, from max_off_policy_threshold)."""

    partial_rollout: bool
    staleness_threshold: float | None
    trigger_parameter_sync_step: int | None
    require_batches: int | None
    warmup_batches: int | None = None
    max_lag: int | None = None
