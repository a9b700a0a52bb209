#!/usr/bin/env bash
# Two GRPO steps of the GSM8K example on CPU: real GSM8K rows, the real Qwen3 tokenizer, a tiny random Qwen3 model.
# It checks that data, chat template, rollout, reward and update work together through run_gsm8k_grpo.sh; a random
# model scores 0. About a minute on two cores.
#
#   bash examples/gsm8k/run_gsm8k_smoke_cpu.sh [extra Hydra overrides]
#
# Every setting is an environment variable (defaults below, and those of run_gsm8k_grpo.sh).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
source "$(dirname "${BASH_SOURCE[0]}")/../python_env.sh"  # PYTHON: the repository's .venv unless set
SHARED_DATA=${SHARED_DATA:-$REPO/../shared/data}        # gsm8k/*.jsonl and tokenizers/qwen3
WORK_DIR=${WORK_DIR:-$(mktemp -d /tmp/shardrl_gsm8k_smoke.XXXXXX)}
LIMIT=${LIMIT:-64}                                      # GSM8K rows per split

"$PYTHON" "$REPO/examples/data_preprocess/gsm8k.py" --input_dir "$SHARED_DATA/gsm8k" --output_dir "$WORK_DIR/data" \
    --limit "$LIMIT"
"$PYTHON" "$HERE/make_tiny_qwen3.py" --tokenizer "$SHARED_DATA/tokenizers/qwen3" --output_dir "$WORK_DIR/model"

export MODEL_PATH=${MODEL_PATH:-$WORK_DIR/model}
export DATA_DIR=${DATA_DIR:-$WORK_DIR/data}
export RUN_DIR=${RUN_DIR:-$WORK_DIR/run}
export DEVICE=${DEVICE:-cpu}
export DTYPE=${DTYPE:-float32}
export MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-256}       # longer GSM8K prompts are dropped (filter_overlong_prompts)
export MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-16}
export TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-2}
export PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-2}
export ROLLOUT_N=${ROLLOUT_N:-2}
export MAX_TOKEN_LEN_PER_GPU=${MAX_TOKEN_LEN_PER_GPU:-1024}
export VAL_MAX_SAMPLES=${VAL_MAX_SAMPLES:-2}
export TOTAL_TRAINING_STEPS=${TOTAL_TRAINING_STEPS:-2}
export TEST_FREQ=${TEST_FREQ:--1}                       # validate once, before training
echo "smoke run directory: $RUN_DIR"
exec bash "$HERE/run_gsm8k_grpo.sh" "$@"
