#!/usr/bin/env bash
# GRPO on the built-in task, scored by a generative judge on a native engine of its own (CPU, a few minutes).
# The judge here is the built-in task's tiny model itself, so its verdicts are noise: the run shows the plumbing
# (judge prompts, verdicts, parse failures counted, scores on the timeline), not a good judge. For a real judge
# set JUDGE to an instruction-tuned HF model (README.md).
#
#   bash examples/judge/run_judge_builtin_cpu.sh [extra Hydra overrides]
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$(dirname "${BASH_SOURCE[0]}")/../python_env.sh"  # PYTHON: the repository's .venv unless set
WORK_DIR=${WORK_DIR:-$(mktemp -d /tmp/shardrl_judge.XXXXXX)}
if [[ -z "${JUDGE:-}" ]]; then
    JUDGE=$("$PYTHON" -c "from shardrl.data import builtin_task; print(builtin_task.prepare('$WORK_DIR/judge')['model'])")
fi

exec "$PYTHON" -m shardrl.trainer.main_ppo \
    trainer.default_local_dir="$WORK_DIR/run" \
    trainer.total_training_steps="${STEPS:-4}" trainer.test_freq=-1 \
    reward_model.judge.enable=true \
    reward_model.judge.model_path="$JUDGE" \
    reward_model.judge.prompt_template_path="$HERE/grade_digit.txt" \
    reward_model.judge.score_pattern="'([01])'" \
    reward_model.judge.response_length=8 \
    reward_model.judge.max_model_len=1024 \
    reward_model.use_reward_loop=true \
    "$@"
