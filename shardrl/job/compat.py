"""verl keys shardrl accepts for compatibility but does not act on: the one list of them.

A verl command line runs with only the module path changed, so every verl key has a place in the schema. The keys
below have no effect in shardrl beyond what is written here: each either keeps the one value that describes what
shardrl does (any other value is refused before a worker starts: `error: <key>: not supported by shardrl (...)`),
or is folded into another key or checked against other keys by a rule. Every other leaf of the schema is read by
the planner (options.py / plan.py); tests/test_config_keys.py checks that the two cover every leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardrl.job.errors import ConfigError
from shardrl.job.load import FSDP_OFFLOAD_POLICY, FSDP_SPELLINGS, VERL_SPELLINGS
from shardrl.job.schema import PPOConfig


@dataclass(frozen=True)
class Refused:
    """`key` keeps `supported(value)`; any other value (`example` is one) is refused with `why` (what to use
    instead)."""

    key: str
    supported: Callable[[Any], bool]
    example: Any
    why: str
    applies: Callable[[PPOConfig], bool] | None = None  # the configs the refusal holds in (None: all; else the
    # key has an effect in the others, compiled by the planner)


@dataclass(frozen=True)
class Accepted:
    """`key` is accepted with any value its type allows; `why` says where it goes (folded, or a rule's input)."""

    key: str
    why: str


def _is(expected: Any) -> Callable[[Any], bool]:
    return lambda value: value == expected


def _detached(config: PPOConfig) -> bool:
    return config.rollout is not None


_MODEL_GROUPS = ("actor_rollout_ref.model", "critic.model")
# verl's FSDP engine groups: what they set that has a counterpart is folded by load.py (FSDP_SPELLINGS)
_FSDP_GROUPS = ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.fsdp")
_NO_SHARDING = ("shardrl's engine does not shard parameters (ZeRO-3) as FSDP does: the distributed optimizer shards "
                "optimizer state over DP, and parameters are whole per TP/PP share, so FSDP's")
_OPTIM_GROUPS = ("actor_rollout_ref.actor.optim", "critic.optim")
_MEGATRON_GROUPS = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model",
                    "distillation.teacher_model")

REFUSED: tuple[Refused, ...] = (
    *(Refused(f"actor_rollout_ref.{role}.router_replay.{file}", _is(None), "/tmp/routes.pt", "shardrl carries "
              "routing in the batch from the pass that records it to the one that replays it; leave it null")
      for role in ("actor", "ref") for file in ("record_file", "replay_file")),
    Refused("data.return_raw_input_ids", _is(False), True, "no reward model re-tokenises responses; rewards read the "
            "policy's own ids"),
    Refused("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", _is(False), True,
            "trajectories are the engine's sampled ids plus the environment's, never re-rendered: re-rendering "
            "with the template would re-tokenize what the model sampled; remove the key"),
    Refused("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", _is(None), 2,
            "samples per prompt are actor_rollout_ref.rollout.n; set that instead"),
    Refused("data.use_shm", _is(False), True, "the data files are read once, at start, in the driver; there is no "
            "copy to shared memory to make; set false"),
    Refused("data.return_full_prompt", _is(False), True, "batches carry the prompt's ids and its messages "
            "(raw_prompt), not its rendered text; set false"),
    *(Refused(f"data.custom_cls.{field}", _is(None), "my_dataset.py", "a dataset class of your own is not loaded; "
              "rows come from parquet or jsonl files in verl's RL format (data.train_files); leave it null")
      for field in ("path", "name")),
    Refused("data.continuous_token.enable", _is(False), True, "prompts are token ids rendered by the chat template; "
            "set false"),
    Refused("data.mm_processor_kwargs", lambda v: not v, {"max_pixels": 1}, "multimodal prompts are not supported "
            "(shardrl's models are text models); leave it empty"),
    Refused("data.dataloader_num_workers", _is(0), 8, "prompts are tokenised once at start and batched in memory; "
            "there are no loader workers; remove the key"),
    *(Refused(f"{group}.external_lib", _is(None), "my_models", "shardrl builds its model families natively; a "
              "library that registers models with transformers is never used; remove the key")
      for group in _MODEL_GROUPS),
    *(Refused(f"{group}.megatron.use_mbridge", _is(True), False, "shardrl loads HF checkpoints at any layout with "
              "its own bridge (models/hf_bridge.py), as mbridge does; verl's per-model converters are not here; set "
              "true or remove the key") for group in _MEGATRON_GROUPS),
    *(Refused(f"{group}.use_remove_padding", _is(True), False, "shardrl always packs sequences (no padding tokens are "
              "computed); set true or remove the key")
      for group in (*_MODEL_GROUPS, *(f"{g}.megatron" for g in _MEGATRON_GROUPS))),
    *(Refused(f"{group}.megatron.router_replay.{file}", _is(None), "/tmp/routes.pt", "shardrl carries routing in the "
              "batch from the pass that records it to the one that replays it; leave it null")
      for group in _MEGATRON_GROUPS for file in ("record_file", "replay_file")),
    *(Refused(f"{group}.megatron.router_replay.mode", _is("disabled"), "R3", "routing replay is the policy's and "
              "the reference's (actor_rollout_ref.{actor,ref}.router_replay.mode); this role replays nothing")
      for group in ("critic", "reward_model", "distillation.teacher_model")),
    *(Refused(f"{group}.mtp.{switch}", _is(False), True, "none of shardrl's model families (llama, qwen2, qwen3, "
              "mixtral, qwen2_moe, qwen3_moe) has multi-token-prediction layers; set false")
      for group in _MODEL_GROUPS for switch in ("enable", "enable_train", "enable_rollout")),
    Refused("actor_rollout_ref.rollout.mode", _is("sync"), "async", "the native engine is driven by the trainer's "
            "schedule (the async modes are --config-name=one_step_off_ppo_trainer / fully_async_ppo_trainer); set "
            "sync"),
    Refused("actor_rollout_ref.rollout.load_format", _is("dummy"), "safetensors", "the rollout engine always "
            "receives the actor's weights by weight sync before it generates; nothing is loaded from disk; set dummy"),
    Refused("actor_rollout_ref.rollout.enable_chunked_prefill", _is(False), True, "the native engine prefills whole "
            "prompts (up to max_num_batched_tokens per step); set false"),
    Refused("actor_rollout_ref.rollout.engine_kwargs", lambda v: not any(v.values()), {"vllm": {"swap_space": 4}},
            "engine_kwargs configure vllm and sglang; the native engine's settings are actor_rollout_ref.rollout.* "
            "keys"),
    Refused("actor_rollout_ref.rollout.skip_tokenizer_init", _is(True), False, "the native engine takes and returns "
            "token ids and holds no tokenizer (the trainer decodes); set true"),
    *(Refused(f"actor_rollout_ref.rollout.{key}", _is(None), example, "the native engine runs the actor's weights in "
              "rollout.dtype (bfloat16, float16 or float32); weight quantization is not built; leave it null")
      for key, example in (("quantization", "fp8"), ("quantization_config_file", "torchao_config.json"))),
    Refused("actor_rollout_ref.rollout.calculate_log_probs", _is(True), False, "the native engine always records each "
            "token's behaviour logprob (the off-policy contract); set true"),
    Refused("actor_rollout_ref.rollout.free_cache_engine", _is(False), True, "the detached rollout pool keeps its "
            "KV cache (it never shares its GPUs with training); set false", applies=_detached),
    *(Refused(f"{group}.megatron.{state}_offload", _is(False), True, f"the {role} never trains: it has no "
              f"{state} state to offload (param_offload keeps its weights in host memory); set false")
      for group, role in (("actor_rollout_ref.ref", "reference policy"), ("distillation.teacher_model", "teacher"))
      for state in ("grad", "optimizer")),
    Refused("actor_rollout_ref.ref.megatron.use_distributed_optimizer", _is(False), True, "the reference policy "
            "never trains: it has no optimizer to distribute; set false"),
    *(Refused(f"distillation.{group}enable_resource_pool", _is(False), True, "the teachers get a pool of their own "
              "when distillation.nnodes x n_gpus_per_node > 0 (verl 0.8+'s keys); set false") for group in
      ("", "teacher_model.")),
    *(Refused(f"distillation.teacher_model.{size}", _is(0), 8, "the teachers' own pool is distillation.nnodes x "
              "distillation.n_gpus_per_node (verl 0.8+'s); leave it 0") for size in ("n_gpus_per_node", "nnodes")),
    Refused("distillation.teacher_model.megatron.use_distributed_optimizer", _is(False), True, "the teacher never "
            "trains: it has no optimizer to distribute; set false"),
    *(Refused(f"reward_model.megatron.{state}_offload", _is(False), True, f"the reward model never trains: it has no "
              f"{state} state to offload (param_offload keeps its weights in host memory); set false")
      for state in ("grad", "optimizer")),
    Refused("reward_model.megatron.use_distributed_optimizer", _is(False), True, "the reward model never trains: it "
            "has no optimizer to distribute; set false"),
    Refused("trainer.v1.sync", lambda v: not v, {"x": 1}, "verl's sync trainer has no settings; leave it empty"),
    Refused("trainer.v1.sampler.sync_refill_failed_groups", _is(False), True, "a failed agent trajectory is kept "
            "and trained on as written (finish_reason error, counted), verl's default; replacing its group with "
            "fresh prompts is not built; set false"),
    *(Refused(f"trainer.v1.sampler.custom_sampler.{field}", _is(None), "my_sampler.py", "a replay-buffer class of "
              "your own is not loaded; prompts come in data.* order and algorithm.filter_groups drops groups; leave "
              "it null") for field in ("path", "name")),
    Refused("trainer.v1.sampler.sampler_kwargs", lambda v: not v, {"x": 1}, "they are a custom sampler's arguments, "
            "and custom samplers are not loaded; leave it empty"),
    *(Refused(f"actor_rollout_ref.rollout.agent.custom_async_server.{field}", _is(None), "my_server.py", "agent "
              "loops talk to shardrl's native engine in process, and external agent programs to its OpenAI-compatible "
              "endpoint (rollout.agent.endpoint.*); a serving-engine class of your own is not loaded; leave it null")
      for field in ("path", "name")),
    *(Refused(f"{group}.model_dtype", lambda v: v in ("fp32", "float32"), "bf16", "FSDP's dtype of the stored "
              "parameters; shardrl keeps fp32 master weights in its optimizer and computes in megatron.dtype (the "
              "FSDP group's dtype folds into it): leave fp32") for group in _FSDP_GROUPS),
    *(Refused(f"{group}.full_determinism", _is(False), True, "deterministic kernels of verl's FSDP engine; "
              "shardrl's is bitwise mode (actor_rollout_ref.rollout.bitwise_logprobs, GPU): leave false")
      for group in _FSDP_GROUPS),
    *(Refused(f"{group}.pad_to_length", _is(False), True, "padding packed micro batches to fixed lengths is not "
              "built (shardrl packs exactly); leave false") for group in _FSDP_GROUPS),
    *(Refused(f"{group}.qat.enable", _is(False), True, "quantization-aware training is not built; leave false")
      for group in _FSDP_GROUPS),
    *(Refused(f"{group}.mixed_precision", lambda v: not v, {"reduce_dtype": "fp32"}, "FSDP's mixed-precision "
              "policy; shardrl computes in megatron.dtype with fp32 master weights and gradient reduction: leave it "
              "empty") for group in _FSDP_GROUPS),
    Refused("actor_rollout_ref.ref.fsdp_config.optimizer_offload", _is(False), True, "the reference policy never "
            "trains: it has no optimizer state (param_offload keeps its weights in host memory); set false"),
    *(Refused(f"critic.fsdp.{key}", _is(default), value, why) for key, default, value, why in (
        ("entropy_from_logits_with_chunking", False, True, "the critic computes no entropy; leave false"),
        ("entropy_checkpointing", False, True, "the critic computes no entropy; leave false"),
        ("use_torch_compile", None, True, "compiled elementwise chains are the actor's and the reference's "
                                          "(actor_rollout_ref.actor.use_torch_compile); leave null"))),
    *(Refused(f"{group}.num_cycles", _is(0.5), 1.0, "the cosine schedule decays over half a cycle, from lr to "
              "min_lr; leave 0.5") for group in _OPTIM_GROUPS),
    *(Refused(f"{group}.optimizer", _is("AdamW"), "SGD", "the optimizer is AdamW (Megatron's distributed "
              "optimizer when use_distributed_optimizer); leave AdamW") for group in _OPTIM_GROUPS),
    *(Refused(f"{group}.optimizer_impl", _is("torch.optim"), "bitsandbytes.optim", "shardrl's AdamW is its own "
              "(parallel/optimizer.py), torch's maths; leave torch.optim") for group in _OPTIM_GROUPS),
    *(Refused(f"{group}.zero_indexed_step", _is(True), False, "the schedule's first step is step 0, as verl's "
              "default; leave true") for group in _OPTIM_GROUPS),
    Refused("model_engine", lambda v: v in ("dp", "megatron"), "veomni", "verl 0.9's choice of training engine picks "
            "which actor/ref/critic keys it reads; shardrl reads verl's FSDP and Megatron spellings alike and trains "
            "with its own Megatron-style engine, so dp and megatron run the same; other engines (veomni, mindspeed, "
            "megatron_lite, ...) are not built: use dp or megatron"),
    Refused("reward_model.load_weight", _is(True), False, "a reward model is loaded from reward_model.model.path, "
            "never randomly initialised; set true"),
)

ACCEPTED: tuple[Accepted, ...] = (
    Accepted("data.return_raw_chat", "the chat messages are always kept (`raw_prompt`): agent loops and "
             "interactions read them"),
    Accepted("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", "nothing to check: trajectories "
             "are token-exact by construction (no turn is re-tokenized), whatever the mode"),
    *(Accepted(f"{role}.strategy", "verl's choice of training engine: fsdp, fsdp2 and megatron all train with "
               "shardrl's one Megatron-style engine, which reads the keys of both spellings")
      for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")),
    Accepted("actor_rollout_ref.rollout.layered_summon", "verl's FSDP LoRA sync gathers the sharded model one layer "
             "at a time to save memory; shardrl's weight sync never gathers the whole model (it streams buckets of "
             "each rank's shards; with LoRA it moves the adapters alone), so either value syncs the same way"),
    Accepted("actor_rollout_ref.hybrid_engine", "must agree with the mode (rules.py): true in sync mode"),
    Accepted("async_training.use_rollout_log_probs", "must agree with algorithm.rollout_correction.decoupled "
             "(rules.py)"),
    Accepted("distillation.distillation_loss.policy_loss_mode", "vanilla is the only one (verl's too; the type "
             "allows no other value)"),
    Accepted("distillation.teacher_model.megatron.seed", "must equal the actor's (rules.py): the teacher loads its "
             "weights, so nothing of it is random"),
    Accepted("actor_rollout_ref.ref.megatron.seed", "must equal the actor's (rules.py): the reference policy loads "
             "the actor's initial weights, so nothing of it is random"),
    Accepted("reward_model.megatron.seed", "must equal the actor's (rules.py): the reward model loads its weights, "
             "so nothing of it is random"),
    *(Accepted(f"critic.model.{key}", "must equal actor_rollout_ref.model's (rules.py): the critic reads the actor's "
               "token ids") for key in ("tokenizer_path", "trust_remote_code")),
    Accepted("reward_model.reward_kwargs", "folded into reward_model.overlong_buffer by load.py"),
    Accepted("algorithm.rollout_correction.bypass_mode", "folded into algorithm.rollout_correction.decoupled"),
    *(Accepted(key, f"verl's spelling of {target}, folded into it by load.py")
      for key, target in VERL_SPELLINGS.items()),
    *(Accepted(key, f"verl's FSDP spelling of {target}, folded into it by load.py")
      for key, target in FSDP_SPELLINGS.items()),
    *(Accepted(key, f"FSDP2's CPU offload policy: true sets {', '.join(targets)} (load.py)")
      for key, targets in FSDP_OFFLOAD_POLICY.items()),
    *(Accepted(f"{group}.{key}", f"{_NO_SHARDING} {why}")
      for group in _FSDP_GROUPS for key, why in (
          ("wrap_policy.min_num_params", "wrapping of modules into sharded units has no counterpart"),
          ("reshard_after_forward", "re-sharding after the forward has nothing to re-shard"),
          ("fsdp_size", "sharding-group size has nothing to size (DP is what is left of the world after TP, PP "
                        "and CP)"),
          ("forward_prefetch", "prefetch of the next unit's parameters has nothing to gather"),
          ("use_orig_params", "flat-parameter view is not used"))),
    *(Accepted(f"{group}.{key}", why) for group in _FSDP_GROUPS for key, why in (
        ("forward_only", "verl's internal marker of a frozen role; shardrl knows which roles train"),
        ("strategy", "verl's choice between FSDP versions; shardrl's one engine trains either way"),
        ("entropy_from_logits_chunk_size", "the chunk size of verl's chunked entropy; shardrl's fused path "
                                           "(model.use_fused_kernels, which chunked entropy folds into) picks its "
                                           "own chunks"),
        ("pad_to_length_bucket", "read only with pad_to_length, which is refused"),
        *((f"qat.{key}", "read only with qat.enable, which is refused")
          for key in ("mode", "group_size", "ignore_patterns", "activation_observer", "quantization_config_path")))),
    Accepted("data.trust_remote_code", "checked against actor_rollout_ref.model.trust_remote_code, which loads the "
             "tokenizer (rules.py)"),
    Accepted("critic.model.use_fused_kernels", "a value head has no vocabulary: nothing to fuse (it follows the "
             "actor's key by default)"),
    *(Accepted(f"{group}.megatron.vanilla_mbridge", "verl's choice between two HF<->Megatron bridge libraries; "
               "shardrl loads HF checkpoints at any layout with its own bridge (models/hf_bridge.py, checked against "
               "transformers), whichever is named") for group in _MEGATRON_GROUPS),
    *(Accepted(f"reward.{key}", "refused by load.py when given (no counterpart: a user reward-manager class, the "
               "reward model's serving engine, a sandbox service)")
      for key in ("reward_manager.source", "reward_manager.module.path", "reward_manager.module.name",
                  "reward_model.rollout", "sandbox_fusion")),
    *(Accepted(f"{group}.mtp.{key}", "describes the MTP draft, read only with mtp.enable, which is refused (none of "
               "shardrl's families has MTP layers)")
      for group in _MODEL_GROUPS for key in ("detach_encoder", "mtp_loss_scaling_factor", "speculative_algorithm",
                                             "speculative_num_steps", "speculative_eagle_topk",
                                             "speculative_num_draft_tokens", "method", "num_speculative_tokens")),
    *(Accepted(f"{group}.optim.min_lr", f"folded into {group}.optim.min_lr_ratio (= min_lr / lr) by load.py")
      for group in ("actor_rollout_ref.actor", "critic")),
    Accepted("trainer.use_v1", "verl's choice between its legacy and v1 trainers; shardrl's trainer runs the "
             "synchronous step whichever is named (with algorithm.filter_groups, the legacy trainer's whole-batch "
             "selection: docs/config.md)"),
    *(Accepted(f"trainer.v1.separate_async.{key}", "read only by verl's separate_async trainer, which is refused "
               "(rules.py)") for key in ("num_warmup_batches", "parameter_sync_step")),
    Accepted("trainer.v1.sampler.max_off_policy_strategy", "drop, the only one built, is what colocate_async does; "
             "wait is refused there (rules.py)"),
    *(Accepted(f"data.{key}", "read only for multimodal rows, which the dataset refuses (data.image_key)")
      for key in ("image_patch_size", "return_multi_modal_inputs")),
    Accepted("data.continuous_token.model_family", "read only with continuous_token.enable, which is refused"),
    Accepted("algorithm.rollout_correction.use_policy_gradient", "folded into algorithm.rollout_correction."
             "loss_type"),
)


def refuse_unsupported(config: PPOConfig) -> None:
    """Raise ConfigError for the first key of REFUSED set to a value shardrl cannot honour."""
    for entry in REFUSED:
        if entry.applies is not None and not entry.applies(config):
            continue
        value = config.at(entry.key)
        if not entry.supported(value):
            raise ConfigError(entry.key, f"{value!r} is not supported by shardrl ({entry.why})")
