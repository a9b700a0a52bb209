"""The user's example command from issue 2, verbatim (only the module path differs from verl's), shared by tests."""

import shlex

EXAMPLE_COMMAND = r"""python3 -m shardrl.trainer.main_ppo --config-path=./config --config-name='ppo_megatron_trainer'\
    algorithm.adv_estimator=gae data.train_files="$train_files" data.val_files="$test_files" \
    data.train_batch_size=128 data.max_prompt_length=1024 data.max_response_length=512 \
    data.filter_overlong_prompts=True data.truncation='error' actor_rollout_ref.model.path=$LLM \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.7 critic.optim.lr=1e-5 critic.model.path=$LLM \
    critic.model.enable_gradient_checkpointing=False critic.ppo_micro_batch_size_per_gpu=1 \
    algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=['console','wandb'] \
    trainer.project_name='verl_megatron_gsm8k_examples' trainer.experiment_name='qwen_moe_instruct_1node_ep' \
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=-1 trainer.test_freq=5 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2 actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2 critic.megatron.pipeline_model_parallel_size=2 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4 critic.megatron.tensor_model_parallel_size=4 \
    actor_rollout_ref.actor.megatron.expert_model_parallel_size=4 actor_rollout_ref.ref.megatron.expert_model_parallel_size=4 critic.megatron.expert_model_parallel_size=4 \
    actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1 actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=1 critic.megatron.expert_tensor_parallel_size=1 \
    actor_rollout_ref.actor.megatron.use_dist_checkpointing=True actor_rollout_ref.ref.megatron.use_dist_checkpointing=True critic.megatron.use_dist_checkpointing=True \
    actor_rollout_ref.actor.megatron.dist_checkpointing_path=$DIST_CKPT_PATH actor_rollout_ref.ref.megatron.dist_checkpointing_path=$DIST_CKPT_PATH critic.megatron.dist_checkpointing_path=$DIST_CKPT_PATH \
    actor_rollout_ref.actor.megatron.param_offload=True actor_rollout_ref.ref.megatron.param_offload=True critic.megatron.param_offload=True \
    trainer.total_epochs=100"""

# Placeholder values for the command's shell variables (nothing needs to exist for a dry run).
EXAMPLE_ENV = {"train_files": "/data/gsm8k/train.parquet", "test_files": "/data/gsm8k/test.parquet",
               "LLM": "/models/Qwen3-30B-A3B-Instruct", "DIST_CKPT_PATH": "/ckpt/qwen3_moe_dist"}


def example_overrides() -> list[str]:
    """The command's key=value overrides as the shell would pass them (variables expanded, quotes removed)."""
    command = EXAMPLE_COMMAND.replace("\\\n", " ")
    for name, value in EXAMPLE_ENV.items():
        command = command.replace(f"${name}", value)
    args = shlex.split(command)
    return [a for a in args[3:] if not a.startswith("--config-")]
