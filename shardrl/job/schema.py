"""The config schema: typed, frozen dataclasses mirroring the Hydra yaml in `shardrl/job/config/`.

Users write verl's key names (yaml or command line); `shardrl.job.load.load_config` turns the composed OmegaConf tree
into a `PPOConfig`, checking every value's type, choice and range (`build.build`) and then the rules that tie keys
together (`rules.validate`). Parallel layouts and batch-size normalisation need world sizes and are checked by
`shardrl.job.plan.plan_job`, which also compiles the config into each role's options: nothing outside `shardrl.job`
reads a `PPOConfig`. Meaning, default and unit of every key: docs/config.md (a test keeps the yaml, these dataclasses
and the doc in step; another that every key is consumed or refused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from shardrl.algos.policy_filtration import ReweightMethod
from shardrl.algos.policy_loss import PolicyLossMode
from shardrl.algos.rejection import RejectionSampling, parse_rejection
from shardrl.job.build import Fraction, Max, Min, NonNegFloat, NonNegInt, PosFloat, PosInt
from shardrl.parallel.layout_spec import LayoutSpec

AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo",
                       "gpg", "grpo_passk", "gdpo", "grpo_vectorized", "rloo_vectorized", "optimal_token_baseline",
                       "tir_optimal_token_baseline"]
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+"]
DType = Literal["float32", "bfloat16", "float16"]
LrDecayStyle = Literal["constant", "linear", "cosine"]
CheckpointContent = Literal["model", "optimizer", "extra", "hf_model"]
Logger = Literal["console", "wandb", "tensorboard", "mlflow", "file"]
Mode = Literal["sync", "one_step_off", "fully_async"]  # async_training.mode
# The trainer's schedule: `Mode`, or verl 0.9's colocated asynchronous trainer (trainer.v1.trainer_mode)
Schedule = Literal["sync", "one_step_off", "fully_async", "colocate_async"]
# What dynamic sampling compares within a prompt group (see shardrl.trainer.dynamic_sampling.metric_values).
FilterMetric = Literal["acc", "score", "seq_reward", "seq_final_reward"]
AtLeastMinusOne = Annotated[int, Min(-1)]  # -1 means "off" / "derive it"
UnitInterval = Annotated[float, Min(0), Max(1)]  # [0, 1]


@dataclass(frozen=True)
class EngineRouterReplayConfig:
    """verl 0.9's engine-level spelling of a role's routing replay (`<role>.megatron.router_replay`). The policy's
    and the reference's fold into their `router_replay` group (load.py); the other roles keep `disabled`."""

    mode: Literal["disabled", "R2", "R3"]
    record_file: str | None
    replay_file: str | None


@dataclass(frozen=True)
class MegatronConfig:
    """Parallel layout, offload and precision of one role (actor, ref or critic)."""

    tensor_model_parallel_size: PosInt
    pipeline_model_parallel_size: PosInt
    virtual_pipeline_model_parallel_size: PosInt | None  # null: no interleaving
    context_parallel_size: PosInt
    sequence_parallel: bool  # only matters when TP > 1
    expert_model_parallel_size: PosInt
    expert_tensor_parallel_size: PosInt | None  # null: same as TP (Megatron's default)
    param_offload: bool
    grad_offload: bool
    optimizer_offload: bool
    use_distributed_optimizer: bool
    use_dist_checkpointing: bool  # load initial weights from dist_checkpointing_path instead of HF
    dist_checkpointing_path: str | None
    use_mbridge: bool  # verl's: load the HF checkpoint through a bridge at any layout (shardrl's own): only true
    vanilla_mbridge: bool  # verl's choice between two bridge libraries; shardrl has one of its own: any value
    use_remove_padding: bool  # verl's engine-level spelling of model.use_remove_padding: only true (always packed)
    dtype: DType
    seed: int
    override_transformer_config: dict[str, Any]
    router_replay: EngineRouterReplayConfig

    def layout(self, world_size: int) -> LayoutSpec:
        """This role's layout over `world_size` ranks (raises LayoutError when the sizes do not fit)."""
        return LayoutSpec(
            world_size=world_size,
            tp=self.tensor_model_parallel_size,
            pp=self.pipeline_model_parallel_size,
            vpp=self.virtual_pipeline_model_parallel_size or 1,
            cp=self.context_parallel_size,
            ep=self.expert_model_parallel_size,
            etp=self.expert_tensor_parallel_size or self.tensor_model_parallel_size,
        )


@dataclass(frozen=True)
class FSDPWrapPolicy:
    min_num_params: NonNegInt = 0


@dataclass(frozen=True)
class QATConfig:
    """verl's quantization-aware training of its FSDP engine: only off (load.py / compat.py)."""

    enable: bool = False
    mode: str = "w4a16"
    group_size: PosInt = 16
    ignore_patterns: list[str] = field(default_factory=lambda: ["lm_head", "embed_tokens", "re:.*mlp.gate$"])
    activation_observer: str = "static_minmax"
    quantization_config_path: str | None = None


@dataclass(frozen=True)
class FSDPEngineConfig:
    """verl's FSDP engine group (`actor.fsdp_config`, `ref.fsdp_config`, `critic.fsdp`), so that verl's FSDP command
    lines run: what has a counterpart is folded into the role's Megatron-style keys (load.py: offloads, Ulysses
    sequence parallelism as context parallelism, dtype, seed, compile, chunked entropy), what concerns FSDP's
    parameter sharding only is accepted, the rest keeps verl's default (compat.py). Null: not given."""

    wrap_policy: FSDPWrapPolicy = field(default_factory=FSDPWrapPolicy)
    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1
    forward_prefetch: bool = False
    model_dtype: str = "fp32"
    use_orig_params: bool = False
    seed: int | None = None
    full_determinism: bool = False
    ulysses_sequence_parallel_size: PosInt = 1
    entropy_from_logits_with_chunking: bool = False
    entropy_from_logits_chunk_size: PosInt = 2048
    use_torch_compile: bool | None = None
    entropy_checkpointing: bool = False
    pad_to_length: bool = False
    pad_to_length_bucket: PosInt = 1024
    forward_only: bool = False
    strategy: Literal["fsdp", "fsdp2"] = "fsdp"
    dtype: DType | None = None
    qat: QATConfig = field(default_factory=QATConfig)
    mixed_precision: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimConfig:
    """Adam with warmup then a decay schedule; lr in absolute units, steps are optimizer steps."""

    lr: NonNegFloat
    lr_warmup_steps: AtLeastMinusOne  # -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: UnitInterval
    lr_decay_style: LrDecayStyle
    lr_decay_steps: PosInt | None  # the step the decay ends at (warmup included); null: total steps
    min_lr_ratio: UnitInterval  # final lr = lr * min_lr_ratio
    min_lr: NonNegFloat | None  # verl's Megatron spelling of the final lr, absolute (null: min_lr_ratio's)
    weight_decay: NonNegFloat
    betas: list[float]
    clip_grad: PosFloat  # max global grad norm
    total_training_steps: AtLeastMinusOne  # -1: filled in by the trainer
    # verl's FSDP optimizer spellings (load.py folds the schedule into lr_decay_style; compat.py keeps the rest)
    lr_scheduler_type: LrDecayStyle | None
    warmup_style: LrDecayStyle | None  # verl's older name of lr_scheduler_type
    num_cycles: float
    optimizer: str
    optimizer_impl: str
    zero_indexed_step: bool
    # verl's Megatron OptimizerConfig overrides: an entry is accepted only where it names what shardrl's AdamW does
    override_optimizer_config: dict[str, Any]


@dataclass(frozen=True)
class CheckpointConfig:
    """What a role's checkpoints hold and what a resume restores."""

    save_contents: list[CheckpointContent]
    load_contents: list[CheckpointContent]
    # verl's export validation: true refuses, before workers start, a starting HF checkpoint holding tensors the
    # model does not carry (its exports would lack them); false trains and exports without them
    strict: bool


@dataclass(frozen=True)
class ModelSourceConfig:
    """A HF model directory (config.json, tokenizer, safetensors); path null: the built-in tiny model."""

    path: str | None
    tokenizer_path: str | None
    trust_remote_code: bool
    external_lib: str | None
    override_config: dict[str, Any]  # overrides of config.json fields
    enable_gradient_checkpointing: bool
    use_remove_padding: bool
    use_fused_kernels: bool  # log-probs from the LM head one token chunk of logits at a time (verl's fused kernels)


@dataclass(frozen=True)
class MtpConfig:
    """verl's multi-token-prediction group. None of shardrl's families (llama, qwen2, qwen3, mixtral, qwen2_moe,
    qwen3_moe) has MTP layers, so `enable` stays false; the other keys describe a draft setup that is then unused,
    as in verl with MTP off."""

    enable: bool
    enable_train: bool
    enable_rollout: bool
    detach_encoder: bool
    mtp_loss_scaling_factor: NonNegFloat
    speculative_algorithm: str
    speculative_num_steps: PosInt
    speculative_eagle_topk: PosInt
    speculative_num_draft_tokens: PosInt
    method: str
    num_speculative_tokens: PosInt


@dataclass(frozen=True)
class LoRAModelConfig(ModelSourceConfig):
    """A trained model with verl's LoRA keys (the critic's `critic.model`): lora_rank 0 trains every weight; > 0
    trains adapters of that rank on `target_modules` (names or all-linear) less `exclude_modules`, and on the MoE
    experts' stacked weights named by `target_parameters` (PEFT's key; verl has none). A critic's value head then
    trains whole."""

    lora_rank: NonNegInt
    lora_alpha: PosFloat
    target_modules: str | list[str]
    exclude_modules: list[str] | None
    target_parameters: list[str] | None
    mtp: MtpConfig


@dataclass(frozen=True)
class PolicyModelConfig(LoRAModelConfig):
    """The policy's model (`actor_rollout_ref.model`): its LoRA keys, and a PEFT adapter to start from."""

    lora_adapter_path: str | None  # a PEFT LoRA adapter to start from (its rank, alpha and targets)


@dataclass(frozen=True)
class PolicyLossConfig:
    """verl's `actor.policy_loss` group: which clipped surrogate the actor minimises (see shardrl.algos.policy_loss).

    vanilla: PPO's per-token ratio with clip-higher and dual clip. gspo: GSPO's per-sequence geometric-mean ratio
    (Zheng et al. 2025), clipped with clip_ratio_low/high (the paper uses 3e-4 / 4e-4 and seq-mean-token-mean);
    clip_ratio_c is ignored. gpg: -A log pi (GPG). cispo: -sg(clip(r)) A log pi (MiniMax-M1's CISPO). sapo: SAPO's
    soft gate with temperatures tau_pos / tau_neg instead of the hard clip. geo_mean: GMPO's geometric mean of the
    clipped token ratios. dppo_tv / dppo_kl: DPPO's trust region on the token's probability (clip_ratio_low/high
    are its divergence bounds, clip_ratio_c the truncated-IS bound). dro: -(A log pi - dro_beta / 2 log^2 r).
    clip_cov / kl_cov (arXiv 2505.22617): PPO without the gradient of, or the unclipped ratio plus a |log r| penalty
    on, a small fraction of each mini batch's tokens, those whose log-prob and advantage covary most.
    A key only one mode reads must keep its default under any other mode (else it is refused).
    """

    loss_mode: PolicyLossMode
    tau_pos: PosFloat  # SAPO's gate temperature for A > 0
    tau_neg: PosFloat  # SAPO's gate temperature for A <= 0
    dro_beta: PosFloat | None  # DRO's quadratic log-ratio penalty; required by loss_mode=dro, refused otherwise
    clip_cov_ratio: Fraction  # Clip-Cov: the fraction of the mini batch's tokens whose gradient it drops
    clip_cov_lb: float  # Clip-Cov: it draws them among the tokens with covariance in (clip_cov_lb, clip_cov_ub)
    clip_cov_ub: float
    kl_cov_ratio: Fraction  # KL-Cov: the fraction of the mini batch's tokens (largest covariance) it penalises
    ppo_kl_coef: NonNegFloat  # KL-Cov: the weight of the |log r| penalty on them


@dataclass(frozen=True)
class RouterReplayConfig:
    """verl's MoE routing replay: `R2` replays in the update the experts the old-logprob pass chose; `R3` replays
    the rollout engine's (actor: in the old-logprob pass and the update; ref: in the reference pass). shardrl
    carries routing in the batch, never in files."""

    mode: Literal["disabled", "R2", "R3"]
    record_file: str | None
    replay_file: str | None
    # shardrl's (actor, R3): the old-logprob pass also runs routing itself, for the mismatch replay removed
    measure_unreplayed: bool


@dataclass(frozen=True)
class ActorConfig:
    """The policy being trained: PPO loss, mini/micro batching, optimizer, layout."""

    strategy: Literal["megatron", "fsdp", "fsdp2"]  # verl's engine choice; one engine here (compat.py)
    ppo_mini_batch_size: PosInt  # prompts per mini batch (global)
    ppo_micro_batch_size: PosInt | None  # deprecated global form of the per-GPU size
    ppo_micro_batch_size_per_gpu: PosInt | None  # samples per micro batch on one rank
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: PosInt
    ppo_epochs: PosInt
    shuffle: bool
    clip_ratio: PosFloat  # the clip range only where clip_ratio_low / high are null (their defaults are 0.2, as verl's)
    clip_ratio_low: PosFloat | None
    clip_ratio_high: PosFloat | None
    clip_ratio_c: Annotated[float, Min(1, strict=True)]
    loss_agg_mode: LossAggMode
    loss_scale_factor: PosInt | None  # divisor of seq-mean-token-sum-norm; null: rollout.response_length
    policy_loss: PolicyLossConfig
    entropy_coeff: float
    # the old-logprob pass also gives sum over the vocabulary of pi^2 per token (the optimal token baselines)
    calculate_sum_pi_squared: bool
    use_kl_loss: bool
    kl_loss_coef: NonNegFloat
    kl_loss_type: KLEstimator
    grad_clip: PosFloat | None  # verl's FSDP spelling; when set it replaces optim.clip_grad
    use_torch_compile: bool  # torch.compile the model's elementwise chains (FastPaths.compile)
    # verl's FSDP actor keys (folded by load.py: CP, model.use_fused_kernels)
    ulysses_sequence_parallel_size: PosInt
    entropy_from_logits_with_chunking: bool
    entropy_checkpointing: bool
    load_weight: bool
    optim: OptimConfig
    megatron: MegatronConfig
    fsdp_config: FSDPEngineConfig
    checkpoint: CheckpointConfig
    router_replay: RouterReplayConfig

    @property
    def clip_grad_norm(self) -> float:
        return self.grad_clip if self.grad_clip is not None else self.optim.clip_grad


@dataclass(frozen=True)
class RefConfig:
    """The frozen reference policy (only used with a KL term): its log-prob pass and layout."""

    strategy: Literal["megatron", "fsdp", "fsdp2"]  # verl's engine choice; one engine here (compat.py)
    log_prob_micro_batch_size: PosInt | None
    log_prob_micro_batch_size_per_gpu: PosInt | None
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: PosInt
    use_torch_compile: bool  # as the actor's; verl's default is the actor's value
    ulysses_sequence_parallel_size: PosInt  # verl's FSDP spelling of CP (load.py)
    megatron: MegatronConfig
    fsdp_config: FSDPEngineConfig
    router_replay: RouterReplayConfig


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings of validation rollouts."""

    temperature: NonNegFloat
    top_k: AtLeastMinusOne  # -1 or 0: off
    top_p: Fraction
    do_sample: bool
    n: PosInt


@dataclass(frozen=True)
class CheckpointEngineSpelling:
    """verl's `rollout.checkpoint_engine`: its bucket size is folded into `weight_sync.bucket_size_mb`."""

    update_weights_bucket_megabytes: PosInt | None  # null: not given


@dataclass(frozen=True)
class WeightSyncConfig:
    """Trainer -> rollout weight transfer (shardrl's keys)."""

    bucket_size_mb: PosInt
    verify: Literal["checksum", "full"]


@dataclass(frozen=True)
class MultiTurnConfig:
    """verl's `rollout.multi_turn`: tool-calling, multi-turn trajectories (`shardrl.agents`)."""

    enable: bool
    max_assistant_turns: PosInt | None  # null: no limit but the response length
    max_user_turns: PosInt | None
    tool_config_path: str | None
    function_tool_path: str | None  # verl 0.9's: a Python file of @function_tool functions, more tools
    interaction_config_path: str | None
    max_parallel_calls: PosInt
    max_tool_response_length: PosInt  # characters
    tool_response_truncate_side: Literal["left", "middle", "right"]
    format: str  # tool-call syntax: hermes, llama3_json
    tool_timeout: PosFloat  # seconds per tool call (shardrl)
    max_concurrent_tool_calls: PosInt  # per rollout worker (shardrl)
    use_inference_chat_template: bool
    tokenization_sanity_check_mode: Literal["disable", "strict", "ignore_strippable"]
    num_repeat_rollouts: PosInt | None


@dataclass(frozen=True)
class AgentEndpointConfig:
    """shardrl's `rollout.agent.endpoint`: the OpenAI-compatible endpoint agent functions talk to
    (`shardrl.agents.endpoint`), one per rollout worker."""

    served_model_name: str  # the `model` requests must name
    host: str  # 127.0.0.1: reachable from this machine only
    port: NonNegInt  # 0: a free port
    api_key: str | None  # required as `Authorization: Bearer <key>` when set
    max_body_mb: PosInt
    max_concurrent_requests: PosInt  # in flight per endpoint; more get 429
    episode_timeout: PosFloat  # seconds per episode of an agent function
    memory_limit_mb: PosInt | None  # address-space limit of each agent process
    max_episodes_per_process: PosInt


@dataclass(frozen=True)
class UserCode:
    """User code named verl's way, by the file it is in and its name (null: not given): verl 0.9's
    `reward.custom_reward_function` (folded into the key of that name) and the classes of your own that shardrl does
    not load (reward manager, dataset, sampler, serving engine: refused when given)."""

    path: str | None
    name: str | None


@dataclass(frozen=True)
class AgentLoopConfig:
    """verl's `rollout.agent`: which agent loop runs a sample, user loops, and the agent processes (`num_workers`)
    that run agent functions."""

    num_workers: PosInt
    default_agent_loop: str
    agent_loop_config_path: str | None
    endpoint: AgentEndpointConfig
    custom_async_server: UserCode  # verl's serving-engine class of your own (path, name): only null


@dataclass(frozen=True)
class RolloutConfig:
    """The generation engine (colocated with the actor, or on its own pool in the async modes)."""

    name: Literal["native", "vllm", "sglang"]
    mode: Literal["sync", "async"]
    temperature: NonNegFloat
    top_k: AtLeastMinusOne
    top_p: Fraction
    do_sample: bool
    n: PosInt  # responses per prompt
    prompt_length: PosInt
    response_length: PosInt
    dtype: DType
    gpu_memory_utilization: Fraction
    ignore_eos: bool
    enforce_eager: bool
    free_cache_engine: bool
    load_format: Literal["dummy", "auto", "hf", "safetensors"]
    layered_summon: bool  # verl's FSDP LoRA sync gathering one layer at a time; shardrl never gathers the model
    tensor_model_parallel_size: PosInt
    data_parallel_size: PosInt | None  # null: pool / TP
    expert_parallel_size: PosInt
    max_num_seqs: PosInt
    max_num_batched_tokens: PosInt | None  # null: the longest sequence, at least 8192
    max_model_len: PosInt | None  # null: prompt_length + response_length
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    skip_tokenizer_init: bool  # verl's (token in, token out): the native engine has no tokenizer; only true
    quantization: str | None  # verl's vLLM weight quantization (fp8, torchao): only null
    quantization_config_file: str | None  # its config file: only null
    # which logprob each sampled token reports (vLLM's logprobs_mode; the logits modes are refused)
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits"]
    # verl's: the rollout engine records every token's MoE experts into the batch (`routed_experts`), for R3 to
    # replay; the old-logprob pass reports how often its own routing differs (`routing/rollout_mismatch`)
    enable_rollout_routing_replay: bool
    # shardrl's (verl has no such key): batch-invariant kernels in the rollout engine and the actor, so the rollout's
    # sampled-token log-probs equal the old-logprob pass's bit for bit (GPU, bf16/fp16, TP 1; docs/moe_routing.md)
    bitwise_logprobs: bool
    log_prob_micro_batch_size: PosInt | None  # old-logprob pass of the actor (global, deprecated)
    log_prob_micro_batch_size_per_gpu: PosInt | None
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: PosInt
    calculate_log_probs: bool
    seed: int
    engine_kwargs: dict[str, Any]
    val_kwargs: SamplingConfig
    weight_sync: WeightSyncConfig
    checkpoint_engine: CheckpointEngineSpelling  # verl's spelling of weight_sync.bucket_size_mb
    multi_turn: MultiTurnConfig
    agent: AgentLoopConfig

    def layout(self, world_size: int) -> LayoutSpec:
        """The rollout's layout over its own pool: TP inside an engine replica, replicas = world / TP. Experts are
        split over EP ranks when EP > 1 and tensor-split like dense layers otherwise."""
        tp, ep = self.tensor_model_parallel_size, self.expert_parallel_size
        return LayoutSpec(world_size=world_size, tp=tp, ep=ep, etp=1 if ep > 1 else tp)


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    """verl's `actor_rollout_ref` group: the policy model and its three roles."""

    hybrid_engine: bool  # actor and rollout share processes (sync mode)
    nccl_timeout: PosInt | None  # verl's spelling of trainer.collective_timeout_s, folded into it; null: not given
    model: PolicyModelConfig
    actor: ActorConfig
    ref: RefConfig
    rollout: RolloutConfig


@dataclass(frozen=True)
class CriticConfig:
    """The value model (used with adv_estimator=gae): loss, batching, optimizer, layout."""

    strategy: Literal["megatron", "fsdp", "fsdp2"]  # verl's engine choice; one engine here (compat.py)
    enable: bool | None  # null: only when adv_estimator needs values (gae)
    model: LoRAModelConfig
    ppo_mini_batch_size: PosInt
    ppo_micro_batch_size: PosInt | None
    ppo_micro_batch_size_per_gpu: PosInt | None
    forward_micro_batch_size: PosInt | None
    forward_micro_batch_size_per_gpu: PosInt | None
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: PosInt
    forward_max_token_len_per_gpu: PosInt
    ppo_epochs: PosInt
    shuffle: bool
    cliprange_value: PosFloat
    loss_agg_mode: LossAggMode
    loss_scale_factor: PosInt | None  # divisor of seq-mean-token-sum-norm; null: rollout.response_length
    grad_clip: PosFloat | None
    load_weight: bool
    optim: OptimConfig
    ulysses_sequence_parallel_size: PosInt  # verl's FSDP spelling of CP (load.py)
    megatron: MegatronConfig
    fsdp: FSDPEngineConfig  # verl 0.9's FSDP engine group of the critic
    checkpoint: CheckpointConfig

    @property
    def clip_grad_norm(self) -> float:
        return self.grad_clip if self.grad_clip is not None else self.optim.clip_grad


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (verl's DAPO-recipe keys): a response longer than max_response_length - len
    tokens loses penalty_factor x (its tokens past that point) / len, down to -penalty_factor at the maximum."""

    enable: bool
    len: NonNegInt  # tokens; must be in [1, data.max_response_length] when enabled
    penalty_factor: NonNegFloat
    log: bool  # report the penalty as the reward extra `overlong_reward` (and `overlong`)


@dataclass(frozen=True)
class RewardModelModelConfig:
    """The reward model's checkpoint: an HF `*ForSequenceClassification` (num_labels=1)."""

    path: str | None
    input_tokenizer: str | None  # the policy's tokenizer (verl's default: the actor's path); see RewardModelConfig
    override_config: dict[str, Any]  # config.json fields of the reward model


@dataclass(frozen=True)
class JudgeConfig:
    """A generative judge (shardrl): an LLM on a native engine of its own reads each sample through
    `prompt_template` ({prompt}, {response}, {ground_truth}) and its verdict's score is the last match of
    `score_pattern`. It is the reward (`combine: replace`) or is added to the reward function's (`add`), times
    `weight`. A verdict without a score fails the run or scores `parse_failure_score` (`on_parse_failure`)."""

    enable: bool
    model_path: str | None  # an HF causal LM of a family shardrl loads
    prompt_template: str | None  # the template's text; null: `prompt_template_path`, else the built-in one
    prompt_template_path: str | None  # a text file holding it
    score_pattern: str  # a regular expression; its first group (or the whole match) is the score
    on_parse_failure: Literal["score", "fail"]
    parse_failure_score: float
    combine: Literal["replace", "add"]
    weight: float
    tensor_model_parallel_size: PosInt  # the judge engine's TP; replicas = trainer pool / TP
    response_length: PosInt  # tokens of a verdict
    temperature: NonNegFloat  # 0: greedy
    top_p: Fraction
    max_num_seqs: PosInt
    max_model_len: PosInt  # judge prompt + verdict tokens
    gpu_memory_utilization: Fraction
    dtype: DType
    free_cache_engine: bool  # free the judge's KV cache between scoring calls


@dataclass(frozen=True)
class RewardModelConfig:
    """verl's `reward_model` group: a learned reward model (`enable`) scoring every sample on the trainer pool, on a
    layout of its own (`megatron`); when its tokenizer differs from the policy's (`model.input_tokenizer`), each
    sample is decoded and re-rendered with its own chat template. Its scores are the reward (verl's: the rule
    function is not called). Also the rule-based reward's manager and DAPO's overlong shaping."""

    enable: bool
    strategy: Literal["megatron", "fsdp", "fsdp2"]  # verl's engine choice; one engine here (compat.py)
    enable_resource_pool: bool  # verl's own reward-model pool; shardrl's shares the trainer pool: false
    n_gpus_per_node: NonNegInt  # of verl's reward-model pool: 0
    nnodes: NonNegInt
    model: RewardModelModelConfig
    micro_batch_size: PosInt | None  # deprecated global size (divided by DP)
    micro_batch_size_per_gpu: PosInt | None
    max_length: PosInt | None  # tokens of a re-rendered sample; null: the samples' own width
    use_dynamic_bsz: bool
    forward_max_token_len_per_gpu: PosInt
    load_weight: bool  # only true: a reward model is loaded, never random
    megatron: MegatronConfig
    # One scoring path serves all four; `dapo` (verl's DAPO-recipe manager) is accepted so its command lines run:
    # its overlong shaping is `overlong_buffer`, which works with any manager here; `gdpo` (verl's) also hands the
    # reward function the run's experiment name in extra_info.
    reward_manager: Literal["naive", "batch", "dapo", "gdpo"]
    # verl's reward-manager arguments: only the DAPO manager's, which load_config moves into overlong_buffer.
    reward_kwargs: dict[str, Any]
    # verl's reward loop: each sample is scored as soon as its generation finishes (synchronous schedule: while the
    # others still decode); false: the whole batch after generation.
    use_reward_loop: bool
    # shardrl: the reward model's score (times `weight`) is the reward (`replace`, verl's) or is added to the reward
    # function's (`add`)
    combine: Literal["replace", "add"]
    weight: float
    overlong_buffer: OverlongBufferConfig
    judge: JudgeConfig


@dataclass(frozen=True)
class CustomRewardFunctionConfig:
    """A user scoring function loaded from a file, run in processes of its own (shardrl.rewards.guarded)."""

    path: str | None
    name: str
    num_workers: PosInt  # processes it runs in (shardrl)
    timeout: PosFloat  # seconds per sample (shardrl)
    on_error: Literal["fail", "zero"]  # a sample it fails on: fail the run, or score 0 and count it (shardrl)
    url: str | None  # a reward service instead of `path`: each sample POSTed as JSON (shardrl)
    max_concurrency: PosInt  # requests in flight to `url` (shardrl)
    retries: NonNegInt  # of a request failing with 5xx, a connection error or a timeout (shardrl)
    retry_backoff: NonNegFloat  # seconds before the first retry, doubling after (shardrl)


@dataclass(frozen=True)
class RewardManagerSpelling:
    """verl 0.9's `reward.reward_manager`: `name` folds into `reward_model.reward_manager`; `source=register` is the
    one kind shardrl has (its managers by name); `importlib` (a user class at `module.path`) is refused."""

    name: Literal["naive", "batch", "dapo", "gdpo"] | None
    source: str | None
    module: UserCode


@dataclass(frozen=True)
class RewardModelSpelling:
    """verl 0.9's `reward.reward_model`: folded into `reward_model` (`model_path` into `reward_model.model.path`).
    `rollout`, verl's serving engine for the reward model, has no counterpart (shardrl scores with its trainer-pool
    engine at `reward_model.megatron.*`, a judge with `reward_model.judge.*`): any entry is refused."""

    enable: bool | None
    enable_resource_pool: bool | None
    n_gpus_per_node: NonNegInt | None
    nnodes: NonNegInt | None
    model_path: str | None
    rollout: dict[str, Any]


@dataclass(frozen=True)
class RewardSpellingConfig:
    """verl 0.9's `reward` group, the newer spelling of `reward_model`, `custom_reward_function` and their reward
    manager's arguments: load_config folds every entry given into those keys, so a verl 0.9 command line runs
    unchanged. Null (or empty): not given. `sandbox_fusion` (verl's remote code-execution service for rewards) is
    refused when any entry is set: run code in a reward function or an agent tool instead."""

    num_workers: PosInt | None  # -> custom_reward_function.num_workers (the scoring processes)
    custom_reward_function: UserCode
    reward_manager: RewardManagerSpelling
    reward_model: RewardModelSpelling
    reward_kwargs: dict[str, Any]  # -> reward_model.reward_kwargs (DAPO's overlong shaping)
    sandbox_fusion: dict[str, Any]


@dataclass(frozen=True)
class KLControlConfig:
    """Coefficient controller of the in-reward KL penalty."""

    type: Literal["fixed", "adaptive"]
    kl_coef: NonNegFloat
    horizon: PosInt
    target_kl: PosFloat


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Off-policy correction between behaviour (rollout) and trainer logprobs (shardrl.algos.off_policy)."""

    rollout_is: Literal["token", "sequence"] | None  # truncated importance sampling level; null: off
    rollout_is_threshold: PosFloat
    rollout_is_batch_normalize: bool  # divide the importance weights by their mean over the batch
    rollout_rs: str | None  # rejection sampling criteria (shardrl.algos.rejection); null: off
    rollout_rs_threshold: float | str | None  # their bounds: a number, or verl's 'lower_upper' / comma-list specs
    rollout_rs_threshold_lower: PosFloat | None  # lower ratio bound of rollout_rs=token|sequence|geometric
    rollout_token_veto_threshold: PosFloat | None  # drop sequences holding a token ratio below this; null: off
    bypass_mode: bool | None  # verl's spelling of `not decoupled`; when set, load_config makes decoupled follow it
    loss_type: Literal["ppo_clip", "reinforce"]  # the policy loss of bypass mode (decoupled=false)
    use_policy_gradient: bool | None  # verl 0.6.1's spelling of loss_type=reinforce; when set it decides loss_type
    decoupled: bool  # true: recompute old logprobs (proximal policy); false: anchor on behaviour logprobs

    def rejection(self) -> RejectionSampling | None:
        """The rejection-sampling criteria of rollout_rs* and the veto (None: off); raises RejectionSpecError."""
        return parse_rejection(self.rollout_rs, self.rollout_rs_threshold, self.rollout_rs_threshold_lower,
                               self.rollout_token_veto_threshold)


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's DAPO-recipe keys): prompt groups whose `metric` is the same for all their
    samples are dropped and more prompt batches generated until `data.train_batch_size` groups remain."""

    enable: bool
    metric: FilterMetric
    max_num_gen_batches: NonNegInt  # generation rounds per step before giving up; 0: unlimited


@dataclass(frozen=True)
class PolicyFiltrationConfig:
    """PF-PPO's resampling (verl's `algorithm.pf_ppo`, read with `use_pf_ppo=true`): after GAE the step's batch is
    drawn again with replacement, each response weighted by its score (see shardrl.algos.policy_filtration)."""

    reweight_method: ReweightMethod  # pow: |score|^weight_pow; max_min: the best and worst only; max_random: 0.4 / 0.1
    weight_pow: NonNegFloat  # pow's exponent


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantage estimation, KL in reward, off-policy correction, dynamic sampling and policy filtration."""

    adv_estimator: AdvEstimator
    gamma: UnitInterval
    lam: UnitInterval
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool
    kl_penalty: KLEstimator
    kl_ctrl: KLControlConfig
    rollout_correction: RolloutCorrectionConfig
    filter_groups: FilterGroupsConfig
    gdpo_reward_keys: list[str] | None  # gdpo: the reward function's per-sample extras normalised one by one
    gdpo_reward_weights: list[float] | None  # gdpo: their weights; null: 1 each
    use_pf_ppo: bool  # PF-PPO: train on the batch resampled by score after GAE (adv_estimator=gae only, as verl)
    pf_ppo: PolicyFiltrationConfig


@dataclass(frozen=True)
class ContinuousTokenConfig:
    enable: bool
    model_family: str


@dataclass(frozen=True)
class DataConfig:
    """Prompt datasets in verl's RL format and how they are batched and truncated."""

    tokenizer: str | None  # null: the actor's tokenizer
    trust_remote_code: bool  # verl's: the tokenizer's code; shardrl loads it with actor_rollout_ref.model's key
    train_files: str | list[str] | None  # null: the built-in task of the default job
    val_files: str | list[str] | None
    train_max_samples: AtLeastMinusOne
    val_max_samples: AtLeastMinusOne
    prompt_key: str
    reward_fn_key: str
    max_prompt_length: PosInt
    max_response_length: PosInt
    train_batch_size: PosInt  # prompts per step
    gen_batch_size: PosInt  # prompts per loader batch (a generation round); != train_batch_size needs filter_groups
    val_batch_size: PosInt | None
    return_raw_input_ids: bool
    return_raw_chat: bool
    shuffle: bool
    validation_shuffle: bool
    seed: int
    filter_overlong_prompts: bool
    filter_overlong_prompts_workers: PosInt  # processes that render the prompts' chat template at start
    truncation: Literal["error", "left", "right"]
    dataloader_num_workers: NonNegInt
    apply_chat_template_kwargs: dict[str, Any]
    # verl's multimodal columns: shardrl trains text models, so a row with a non-empty value in one is refused
    image_key: str
    video_key: str
    audio_key: str
    image_patch_size: PosInt  # verl's: read only for images (refused)
    return_multi_modal_inputs: bool  # verl's: read only for images (refused)
    mm_processor_kwargs: dict[str, Any]  # verl's: only empty
    use_shm: bool  # verl's: copy the data files to shared memory first; only false
    return_full_prompt: bool  # verl's: the rendered prompt text in the batch; only false
    custom_cls: UserCode  # verl's dataset class of your own: only null
    continuous_token: ContinuousTokenConfig  # verl's: only enable=false
    tool_config_path: str | None  # verl's spelling of rollout.multi_turn.tool_config_path
    function_tool_path: str | None  # verl's spelling of rollout.multi_turn.function_tool_path


@dataclass(frozen=True)
class WarmupBatchesConfig:
    num_warmup_batches: NonNegInt


@dataclass(frozen=True)
class SeparateAsyncConfig(WarmupBatchesConfig):
    parameter_sync_step: PosInt


@dataclass(frozen=True)
class V1SamplerConfig:
    """verl 0.9's replay-buffer settings. The off-policy bound is read by the colocated asynchronous trainer: a
    prompt group whose generation spans more than `max_off_policy_threshold` policy versions is dropped; failed agent
    groups are kept, as verl's default keeps them."""

    max_off_policy_threshold: PosInt
    max_off_policy_strategy: Literal["drop", "wait"]
    sync_refill_failed_groups: bool
    custom_sampler: UserCode
    sampler_kwargs: dict[str, Any]


@dataclass(frozen=True)
class V1TrainerConfig:
    """verl 0.9's `trainer.v1` group: which of its v1 trainers runs. `sync` is shardrl's synchronous trainer;
    `colocate_async` its colocated asynchronous one (trainer/colocated_async.py); `separate_async` is refused
    (shardrl's trainers on a separate rollout pool are its one_step_off / fully_async configs)."""

    trainer_mode: Literal["sync", "colocate_async", "separate_async"]
    sync: dict[str, Any]
    colocate_async: WarmupBatchesConfig
    separate_async: SeparateAsyncConfig
    sampler: V1SamplerConfig


@dataclass(frozen=True)
class TrainerConfig:
    """The run: pools, device, length, validation, checkpoints, logging, seeds."""

    project_name: str
    experiment_name: str
    logger: list[Logger]
    log_val_generations: NonNegInt
    rollout_data_dir: str | None  # verl's: every training step's samples as <dir>/<step>.jsonl
    validation_data_dir: str | None  # verl's: every validation's samples as <dir>/<step>.jsonl
    nnodes: PosInt
    n_gpus_per_node: PosInt  # ranks per node (CPU processes when device is cpu)
    device: Literal["auto", "cpu", "cuda"]
    total_epochs: PosInt
    total_training_steps: PosInt | None
    save_freq: AtLeastMinusOne
    test_freq: AtLeastMinusOne
    critic_warmup: NonNegInt
    val_before_train: bool
    val_only: bool  # verl's: validate before training (val_before_train), then stop
    resume_mode: Literal["auto", "disable", "resume_path"]
    resume_from_path: str | None
    default_local_dir: str
    max_actor_ckpt_to_keep: PosInt | None
    max_critic_ckpt_to_keep: PosInt | None
    balance_batch: bool
    seed: int
    dry_run: bool
    collective_timeout_s: PosInt
    use_v1: bool  # verl 0.9's switch between its legacy and v1 trainers: shardrl runs its synchronous step either way
    v1: V1TrainerConfig


@dataclass(frozen=True)
class RayConfig:
    """verl's `ray_kwargs` group."""

    ray_init: dict[str, Any]  # passed to ray.init


@dataclass(frozen=True)
class RolloutPoolConfig:
    """The detached rollout pool of the async modes (verl's top-level `rollout` group)."""

    nnodes: PosInt
    n_gpus_per_node: PosInt
    total_rollout_steps: PosInt | None = None  # fully_async only: samples to generate in all; null: epochs x data


@dataclass(frozen=True)
class AsyncTrainingConfig:
    """The async schedules (present only in the one_step_off / fully_async configs)."""

    mode: Literal["one_step_off", "fully_async"]
    use_rollout_log_probs: bool  # train on behaviour logprobs instead of recomputing old logprobs
    # fully_async only:
    staleness_threshold: NonNegFloat | None = None
    trigger_parameter_sync_step: PosInt | None = None
    require_batches: PosInt | None = None
    # both modes (required in fully_async; one_step_off: unset means false, verl's schedule):
    partial_rollout: bool | None = None


# verl's distillation loss modes: single-sample KL estimators of the sampled token, and the forward KL over the
# teacher's top k tokens of each position.
DistillationLossMode = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "forward_kl_topk"]
DEFAULT_DISTILLATION_TOPK = 32  # verl's distillation.yaml


@dataclass(frozen=True)
class DistillationLossConfig:
    """verl's `distillation.distillation_loss`: how the teacher's per-token log-probs enter the actor's loss
    (shardrl.algos.distillation)."""

    loss_mode: DistillationLossMode  # the per-token estimator of KL(student || teacher) on the sampled token
    topk: PosInt | None  # forward_kl_topk: the teacher's top k per position; null: 32 (verl's); estimators: null
    use_task_rewards: bool  # false: the distillation loss alone trains the actor
    distillation_loss_coef: NonNegFloat  # its weight beside the task's policy loss (use_task_rewards only)
    loss_max_clamp: PosFloat | None  # per-token loss clamped to [-c, c]; null: no clamp
    log_prob_min_clamp: float | None  # student and teacher log-probs clamped below at this value; null: none
    use_policy_gradient: bool  # true: -loss as a per-token advantage of a clipped PG loss; false: backprop the loss
    policy_loss_mode: Literal["vanilla"]
    clip_ratio: PosFloat  # the PG loss's clip range where clip_ratio_low / high are null
    clip_ratio_low: PosFloat | None
    clip_ratio_high: PosFloat | None


@dataclass(frozen=True)
class TeacherModelConfig:
    """The teachers' layout and micro batches on the trainer pool, like the reference policy's (the spelling of
    verl's first on-policy distillation, before its teacher pool). `model_path` is folded into
    `teacher_models.teacher_model.model_path` (load.py)."""

    model_path: str | None
    enable_resource_pool: bool  # verl's own teacher pool; shardrl's teacher shares the trainer pool: false
    n_gpus_per_node: NonNegInt  # of verl's teacher pool: 0
    nnodes: NonNegInt
    log_prob_micro_batch_size: PosInt | None
    log_prob_micro_batch_size_per_gpu: PosInt | None
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: PosInt
    megatron: MegatronConfig


@dataclass(frozen=True)
class TeacherInferenceConfig:
    """verl 0.8+'s `distillation.teacher_models.<name>.inference`: the serving engine of a teacher on verl's teacher
    pool. shardrl scores with its teachers on the trainer pool (laid out by `distillation.teacher_model.megatron`),
    one forward pass over each sample, so these keep verl's defaults (rules.py refuses others), except
    `max_model_len`, checked as verl checks it. The defaults are verl's; a teacher added with Hydra's `+` gets them."""

    name: str = "vllm"
    dtype: str = "bfloat16"
    gpu_memory_utilization: Fraction = 0.5
    enforce_eager: bool = True
    cudagraph_capture_sizes: list[PosInt] | None = None
    free_cache_engine: bool = True
    data_parallel_size: PosInt = 1
    expert_parallel_size: PosInt = 1
    tensor_model_parallel_size: PosInt = 2
    pipeline_model_parallel_size: PosInt = 1
    max_num_batched_tokens: PosInt = 8192
    max_model_len: PosInt | None = None  # prompt + response + 1 must fit (verl's check of its teacher engine)
    max_num_seqs: PosInt = 1024
    load_format: str = "auto"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    limit_images: PosInt | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    disable_log_stats: bool = True
    skip_tokenizer_init: bool = True
    prompt_length: PosInt | None = None  # verl copies the rollout's; read only by its engine
    response_length: PosInt | None = None
    temperature: float = 1.0  # the teacher scores at temperature 1 (verl ignores other values with a warning)


@dataclass(frozen=True)
class TeacherSpec:
    """One of verl 0.8+'s `distillation.teacher_models`: a frozen teacher (`model_path`, the student's tokenizer)
    scoring the samples whose `distillation.teacher_key` field equals `key`."""

    key: str | None = None  # the routing value; a lone teacher needs none (it scores every sample)
    model_path: str | None = None
    num_replicas: NonNegInt = 0  # verl's serving replicas on the teacher pool; 0 here (no teacher pool)
    inference: TeacherInferenceConfig = field(default_factory=TeacherInferenceConfig)


@dataclass(frozen=True)
class DistillationConfig:
    """On-policy distillation (verl's `distillation` group): the student (the actor) learns from a teacher's
    log-probs of the tokens the student sampled, beside or instead of the task reward. Several teachers
    (`teacher_models`) each score the samples whose `teacher_key` field names them."""

    enabled: bool
    enable_resource_pool: bool  # verl's own teacher pool: false
    n_gpus_per_node: NonNegInt
    nnodes: NonNegInt
    teacher_model: TeacherModelConfig  # shardrl's: the teachers' layout and micro batches on the trainer pool
    teacher_models: dict[str, TeacherSpec]  # verl 0.8+'s teachers by entry name
    teacher_key: str  # the sample field routing each sample to its teacher (several teachers only)
    distillation_loss: DistillationLossConfig


@dataclass(frozen=True)
class PPOConfig:
    """The whole config (root of the Hydra tree); build it with `load_config` or `compose`."""

    data: DataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    critic: CriticConfig
    reward_model: RewardModelConfig
    custom_reward_function: CustomRewardFunctionConfig
    reward: RewardSpellingConfig  # verl 0.9's spelling of the two groups above, folded into them
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    ray_kwargs: RayConfig
    distillation: DistillationConfig
    model_engine: str  # verl 0.9's training-engine choice; dp and megatron alike (compat.py)
    rollout: RolloutPoolConfig | None = field(default=None)  # async modes only
    async_training: AsyncTrainingConfig | None = field(default=None)  # async modes only

    @property
    def mode(self) -> Schedule:
        if self.async_training is not None:
            return self.async_training.mode
        return "colocate_async" if self.trainer.v1.trainer_mode == "colocate_async" else "sync"

    def at(self, dotted: str) -> Any:
        """The group or value at a dotted key, e.g. `config.at("critic.megatron")`."""
        node: Any = self
        for part in dotted.split("."):
            node = getattr(node, part)
        return node
