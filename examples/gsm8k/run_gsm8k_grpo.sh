#!/usr/bin/env bash
# GRPO on GSM8K with a real HF model on one GPU, as a verl-style command line (see README.md in this folder).
#
#   MODEL_PATH=~/models/Qwen2.5-Coder-0.5B-Instruct DATA_DIR=~/data/gsm8k bash examples/gsm8k/run_gsm8k_grpo.sh
#
# Every setting below is an environment variable with a default; anything else is a Hydra override appended to the
# command line, e.g. `bash run_gsm8k_grpo.sh trainer.total_training_steps=20 trainer.logger=[console,wandb]`.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/../python_env.sh"  # PYTHON: the repository's .venv unless set
MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen2.5-Coder-0.5B-Instruct}  # HF directory: config.json, safetensors, tokenizer
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}                         # train.parquet and test.parquet (data_preprocess)
RUN_DIR=${RUN_DIR:-checkpoints/shardrl_gsm8k/grpo}             # metrics.jsonl, plots, checkpoints, hf_export

# Placement: one GPU by default; the actor (and the ref, which follows it) may be split with TP/PP.
N_GPUS=${N_GPUS:-1}
NNODES=${NNODES:-1}
DEVICE=${DEVICE:-auto}                  # auto: cuda when a GPU is visible, else cpu (gloo ranks)
ACTOR_TP=${ACTOR_TP:-1}
ACTOR_PP=${ACTOR_PP:-1}
ROLLOUT_TP=${ROLLOUT_TP:-1}
DTYPE=${DTYPE:-bfloat16}                # actor/ref and rollout weights and compute

# Data: with a chat template GSM8K prompts are < 300 tokens and the reference solutions < 460.
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-512}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}     # prompts per step
VAL_MAX_SAMPLES=${VAL_MAX_SAMPLES:--1}        # -1: the whole test split (1,319 prompts)

# GRPO: ROLLOUT_N samples per prompt form a group; the KL to the initial policy is a loss term (not in the reward).
ROLLOUT_N=${ROLLOUT_N:-5}
TEMPERATURE=${TEMPERATURE:-1.0}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.5}
LR=${LR:-1e-6}
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-32}  # prompts per optimizer step: 4 updates per step
KL_LOSS_COEF=${KL_LOSS_COEF:-0.001}
ENTROPY_COEFF=${ENTROPY_COEFF:-0}
# Micro batches are packed by tokens (dynamic batch size); the *_MICRO_BATCH values apply when it is off.
USE_DYNAMIC_BSZ=${USE_DYNAMIC_BSZ:-true}
MAX_TOKEN_LEN_PER_GPU=${MAX_TOKEN_LEN_PER_GPU:-16384}
PPO_MICRO_BATCH_SIZE_PER_GPU=${PPO_MICRO_BATCH_SIZE_PER_GPU:-16}
LOG_PROB_MICRO_BATCH_SIZE_PER_GPU=${LOG_PROB_MICRO_BATCH_SIZE_PER_GPU:-32}

# Run length and bookkeeping.
TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
TOTAL_TRAINING_STEPS=${TOTAL_TRAINING_STEPS:-null}  # null: epochs x steps per epoch
TEST_FREQ=${TEST_FREQ:-10}
SAVE_FREQ=${SAVE_FREQ:--1}                          # checkpoint every N steps; -1: none (hf_export is
                                                    # written at the end either way)
LOGGER=${LOGGER:-[console,file]}
SEED=${SEED:-1}

exec "$PYTHON" -m shardrl.trainer.main_ppo --config-name=ppo_megatron_trainer \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=false \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/test.parquet" \
    data.val_max_samples="$VAL_MAX_SAMPLES" \
    data.max_prompt_length="$MAX_PROMPT_LENGTH" \
    data.max_response_length="$MAX_RESPONSE_LENGTH" \
    data.train_batch_size="$TRAIN_BATCH_SIZE" \
    data.filter_overlong_prompts=true \
    data.truncation=error \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    actor_rollout_ref.actor.optim.lr="$LR" \
    actor_rollout_ref.actor.ppo_mini_batch_size="$PPO_MINI_BATCH_SIZE" \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$PPO_MICRO_BATCH_SIZE_PER_GPU" \
    actor_rollout_ref.actor.use_dynamic_bsz="$USE_DYNAMIC_BSZ" \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$MAX_TOKEN_LEN_PER_GPU" \
    actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.kl_loss_coef="$KL_LOSS_COEF" \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff="$ENTROPY_COEFF" \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$ACTOR_TP" \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="$ACTOR_PP" \
    actor_rollout_ref.actor.megatron.dtype="$DTYPE" \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="$LOG_PROB_MICRO_BATCH_SIZE_PER_GPU" \
    actor_rollout_ref.rollout.name=native \
    actor_rollout_ref.rollout.n="$ROLLOUT_N" \
    actor_rollout_ref.rollout.temperature="$TEMPERATURE" \
    actor_rollout_ref.rollout.dtype="$DTYPE" \
    actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP" \
    actor_rollout_ref.rollout.gpu_memory_utilization="$GPU_MEMORY_UTILIZATION" \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$LOG_PROB_MICRO_BATCH_SIZE_PER_GPU" \
    trainer.device="$DEVICE" \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$N_GPUS" \
    trainer.total_epochs="$TOTAL_EPOCHS" \
    trainer.total_training_steps="$TOTAL_TRAINING_STEPS" \
    trainer.test_freq="$TEST_FREQ" \
    trainer.save_freq="$SAVE_FREQ" \
    trainer.logger="$LOGGER" \
    trainer.seed="$SEED" \
    trainer.project_name=shardrl_gsm8k \
    trainer.experiment_name=grpo \
    trainer.default_local_dir="$RUN_DIR" \
    "$@"
