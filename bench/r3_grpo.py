"""A short GRPO run on one GPU, MoE shape in bf16, with routing replay off and R3: the per-step rollout-vs-trainer
mismatch (`rollout_corr/mismatch_k3_kl`, `rollout_corr/mismatch_kl`) and the routing mismatch, side by side.

Both runs are the default job (the built-in digit task, GRPO, 8 samples per prompt) with a random Qwen3-MoE policy
of the task's vocabulary (32 experts, top 4), the same seeds, rollout and trainer in bf16, every response generated
to 256 tokens (EOS ignored: the task's answers are a few tokens, too few to show a mismatch); the R3 run adds
`actor.router_replay.mode=R3` and `rollout.enable_rollout_routing_replay=true`; the other one records the rollout's
routing too (`enable_rollout_routing_replay` alone), so both report how often the trainer's own routing differs.
The R3 run also sets `router_replay.measure_unreplayed=true`: each step's old-logprob pass runs once more routing
itself, so the mismatch with and without replay are compared on the same weights and samples (the two runs train
apart after step 1).
Prints each step's numbers and the mean ratio R3 / off of the k3 mismatch. `--modes off R3 bitwise` adds a third
run in bitwise mode (`rollout.bitwise_logprobs=true`, replay off): its mismatch must read exactly 0 at every step.

    python bench/r3_grpo.py [--steps 8]          # on the GPU
    python bench/r3_grpo.py --device cpu --steps 3 --response 16   # fp32 on CPU: the two runs must agree
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from shardrl.data import builtin_task
from shardrl.models.tiny import make_tiny_checkpoint

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128,
             norm_topk_prob=True)
METRICS = ("rollout_corr/mismatch_k3_kl", "rollout_corr/unreplayed/mismatch_k3_kl", "rollout_corr/mismatch_kl",
           "routing/rollout_mismatch", "actor/entropy", "actor/pg_loss", "actor/grad_norm")
UNREPLAYED = "rollout_corr/unreplayed/mismatch_k3_kl"


MODES = {"off": [], "R3": ["actor_rollout_ref.actor.router_replay.mode=R3",
                           "actor_rollout_ref.actor.router_replay.measure_unreplayed=true"],
         "bitwise": ["actor_rollout_ref.rollout.bitwise_logprobs=true"]}


def job(root: Path, task: dict, model: Path, steps: int, mode: str, device: str, seed: int,
        response: int) -> list[dict]:
    run = root / f"{mode}-{seed}"
    overrides = [f"actor_rollout_ref.model.path={model}", f"data.tokenizer={task['model']}",
                 f"data.train_files={task['train_files']}", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 f"trainer.total_training_steps={steps}", f"trainer.device={device}", "trainer.n_gpus_per_node=1",
                 "actor_rollout_ref.rollout.enable_rollout_routing_replay=true", f"trainer.default_local_dir={run}",
                 "trainer.logger=[file]", f"data.max_response_length={response}",
                 "actor_rollout_ref.rollout.ignore_eos=true", f"trainer.seed={seed}"]
    if device == "cuda":
        overrides += ["actor_rollout_ref.actor.megatron.dtype=bfloat16", "actor_rollout_ref.rollout.dtype=bfloat16"]
    overrides += MODES[mode]
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", *overrides, "--config-name=ppo_trainer"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{mode} run failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cpu: an fp32 smoke test")
    parser.add_argument("--response", type=int, default=256, help="tokens generated per response")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="trainer.seed of each pair of runs")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["off", "R3"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        task = builtin_task.prepare(root / "task")
        config = json.loads((Path(task["model"]) / "config.json").read_text())
        model = make_tiny_checkpoint("qwen3_moe", root / "moe", seed=1, noise_std=0.05, vocab_size=config["vocab_size"],
                                     eos_token_id=config["eos_token_id"], pad_token_id=0, bos_token_id=None, **SHAPE)
        for seed in args.seeds:
            runs = {mode: job(root, task, model, args.steps, mode, args.device, seed, args.response)
                    for mode in args.modes}
            report(runs, seed)


def report(runs: dict[str, list[dict]], seed: int) -> None:
    print(f"trainer.seed={seed}")
    print("step | " + " | ".join(f"{name} {'unreplayed_k3' if m == UNREPLAYED else m.split('/')[-1]}"
                                 for name in runs for m in METRICS))
    for rows in zip(*runs.values()):
        print(f"{rows[0]['step']:4} | " + " | ".join(f"{r.get(m, float('nan')):.3g}" for r in rows for m in METRICS))
    means = {name: sum(r[METRICS[0]] for r in rows) / len(rows) for name, rows in runs.items()}
    print("mean k3 mismatch: " + ", ".join(f"{name} {mean:.4g}" for name, mean in means.items()))
    if means.get("off") and "R3" in means:
        print(f"ratio R3/off {means['R3'] / means['off']:.3f}")
    if "R3" in runs:  # like for like: the R3 run's old-logprob pass with and without replay, same weights and samples
        pairs = [(r[METRICS[0]], r[UNREPLAYED]) for r in runs["R3"]]
        below = sum(replayed < unreplayed for replayed, unreplayed in pairs)
        print(f"R3 run, same batches: replayed k3 below unreplayed at {below} of {len(pairs)} steps; mean "
              f"{sum(p[0] for p in pairs) / len(pairs):.4g} vs {sum(p[1] for p in pairs) / len(pairs):.4g}")


if __name__ == "__main__":
    main()
