"""Roll out a few GSM8K questions with the sandboxed Python tool on a chat model, no training: what the model does
with the tool before RL (do its calls parse? does the code run? does it use the answer?).

    python examples/gsm8k_tool/show_tool_rollouts.py --model ~/models/Qwen2.5-0.5B-Instruct --num 4

Prints each trajectory with its turns marked by who wrote them ([model], [tool]) and its counts. Runs on CPU or one
GPU, with the rollout engine, agent runner, Hermes parser and tool config the trainer uses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "data_preprocess"))
from gsm8k import make_row  # noqa: E402  (the data script's own row format)

from shardrl.agents.driver import AgentSettings, build_runner  # noqa: E402
from shardrl.agents.loop import AgentSample, TurnLimits  # noqa: E402
from shardrl.agents.trajectory import Source  # noqa: E402
from shardrl.parallel.layout import Layout  # noqa: E402
from shardrl.rollout.engine import Engine, EngineConfig  # noqa: E402
from shardrl.rollout.request import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF model directory with a chat template")
    parser.add_argument("--data", type=Path, default=REPO / "../shared/data/gsm8k/test.jsonl")
    parser.add_argument("--tool-config", default=str(Path(__file__).parent / "tool_config.yaml"))
    parser.add_argument("--num", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=768)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = EngineConfig(max_model_len=2048, max_num_batched_tokens=8192, max_num_seqs=args.num, dtype=dtype,
                          cpu_kv_cache_tokens=2048 * args.num)
    engine = Engine.from_pretrained(args.model, Layout.single(device), config)
    limits = TurnLimits(response_length=args.response_length, max_assistant_turns=args.max_turns,
                        max_tool_response_length=512)
    runner = build_runner(engine, AgentSettings(limits, args.model, "hermes", args.tool_config,
                                                default_agent_loop="tool_agent"))
    lines = [line for line in args.data.read_text().splitlines() if line.strip()][:args.num]
    rows = [make_row(json.loads(line), i, "test", tool=True) for i, line in enumerate(lines)]
    samples = [(i, AgentSample(row["prompt"], runner.context.renderer.prompt_ids(row["prompt"]), row["extra_info"],
                               SamplingParams(max_tokens=args.response_length, temperature=args.temperature, seed=i)),
                "tool_agent") for i, row in enumerate(rows)]
    runner.start(samples)
    done = runner.drive(None)
    for i, row in enumerate(rows):
        traj = done[i]
        print(f"===== question {i} (answer {row['reward_model']['ground_truth']}): {traj.assistant_turns} model "
              f"turns, {traj.tool_calls} tool calls, {traj.tool_errors} errors, {traj.tool_timeouts} timeouts, "
              f"finish {traj.finish_reason}")
        start = 0
        for end in range(1, len(traj.sources) + 1):
            if end == len(traj.sources) or traj.sources[end] != traj.sources[start]:
                who = "model" if traj.sources[start] == Source.MODEL else traj.sources[start].name.lower()
                print(f"[{who}] {tokenizer.decode(traj.response_ids[start:end])}")
                start = end
    runner.close()


if __name__ == "__main__":
    main()
