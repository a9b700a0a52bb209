#!/usr/bin/env bash
# GRPO on GSM8K with the sandboxed Python tool (verl's gsm8k multi-turn recipe shape): examples/gsm8k's command line
# plus the multi-turn keys. Data from `examples/data_preprocess/gsm8k.py --tool`. See README.md in this folder.
#
#   MODEL_PATH=~/models/Qwen2.5-0.5B-Instruct DATA_DIR=~/data/gsm8k_tool bash examples/gsm8k_tool/run_gsm8k_tool_grpo.sh
#
# Settings are environment variables (these and those of examples/gsm8k/run_gsm8k_grpo.sh); anything else is a Hydra
# override appended to the command line.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
TOOL_CONFIG=${TOOL_CONFIG:-$HERE/tool_config.yaml}
MAX_TURNS=${MAX_TURNS:-5}                    # model turns per trajectory
export RUN_DIR=${RUN_DIR:-checkpoints/shardrl_gsm8k/grpo_tool}
export MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-1024}   # the tool's schema is in every prompt
export MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-1024}  # model and tool tokens together

exec bash "$REPO/examples/gsm8k/run_gsm8k_grpo.sh" \
    actor_rollout_ref.rollout.multi_turn.enable=true \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$TOOL_CONFIG" \
    actor_rollout_ref.rollout.multi_turn.format=hermes \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns="$MAX_TURNS" \
    actor_rollout_ref.rollout.multi_turn.max_parallel_calls=1 \
    actor_rollout_ref.rollout.multi_turn.max_tool_response_length=512 \
    actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent \
    data.return_raw_chat=true \
    "$@"
