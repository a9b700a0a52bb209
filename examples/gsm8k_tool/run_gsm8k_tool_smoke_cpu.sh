#!/usr/bin/env bash
# Two GRPO steps of the GSM8K tool recipe on CPU: real GSM8K rows with the tool system prompt, the real Qwen3
# tokenizer and chat template (tool schemas rendered into the prompt), a tiny random Qwen3 model, the sandboxed
# Python tool behind the Hermes parser. A random model rarely writes a well-formed call; it checks the plumbing.
#
#   bash examples/gsm8k_tool/run_gsm8k_tool_smoke_cpu.sh [extra Hydra overrides]
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
source "$(dirname "${BASH_SOURCE[0]}")/../python_env.sh"  # PYTHON: the repository's .venv unless set
SHARED_DATA=${SHARED_DATA:-$REPO/../shared/data}
WORK_DIR=${WORK_DIR:-$(mktemp -d /tmp/shardrl_gsm8k_tool_smoke.XXXXXX)}

"$PYTHON" "$REPO/examples/data_preprocess/gsm8k.py" --tool --input_dir "$SHARED_DATA/gsm8k" \
    --output_dir "$WORK_DIR/data_tool" --limit 16
export DATA_DIR=$WORK_DIR/data_tool RUN_DIR=$WORK_DIR/run WORK_DIR  # the gsm8k smoke script writes (unused) plain rows to data/
export MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-512} MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-48}
export MAX_TURNS=${MAX_TURNS:-3}
# The smoke run's settings (tiny model, CPU, small batches) come from examples/gsm8k's smoke script, which then runs
# run_gsm8k_grpo.sh; here it is pointed at the tool recipe's data and keys instead.
exec bash "$REPO/examples/gsm8k/run_gsm8k_smoke_cpu.sh" \
    actor_rollout_ref.rollout.multi_turn.enable=true \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$HERE/tool_config.yaml" \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns="$MAX_TURNS" \
    actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent \
    "$@"
