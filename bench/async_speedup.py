"""Async speedup: training steps per hour of the synchronous, one-step-off, fully async and colocated async trainers on
the same model, data, batch, engine settings and GPUs, from one run (issue 9 targets: one-step-off >= 1.35x and fully
async >= 2x the synchronous).

Workload (rollout-heavy, long-tailed): a random-weight Qwen2-shape model of ~0.3B parameters in bf16; every step
trains on 64 prompts x 8 samples (`--world 2`: 32 x 8). The model stops on any of 16 of its 8192 tokens, so with its
near-uniform random policy a response's length is geometric: P(longer than l tokens) = (1 - 16/8192)^l, mean ~512,
median ~355, p90 ~1180, capped at `--response-length` (1024 at half scale: ~14% of responses hit the cap, which is
what a synchronous step waits for while most sequences have finished). Generation is most of a synchronous step;
the script prints the distribution it measured and the share of the synchronous step spent generating.

Pools: the synchronous and the colocated async trainer (verl 0.9's `trainer.v1.trainer_mode=colocate_async`,
`--warmup-batches` batches generated ahead, groups spanning more than `--max-span` versions dropped) run colocated on
all GPUs; one-step-off and fully async on a trainer pool and a rollout pool of half the GPUs each. `--world 2` is the
HALF-SCALE run (2 colocated vs 1 + 1); `--world 1 --modes sync colocate_async` compares the colocated two on one
GPU. All three anchor PPO on the rollout's
logprobs (no old-logprob pass) so they do the same work per step, and share the engine settings (max_num_seqs twice
a step's samples: the synchronous engine never holds more than its batch, the async ones keep the next batch's
requests in flight).

    python bench/async_speedup.py                  # 4 GPUs
    python bench/async_speedup.py --world 2        # 2 GPUs, half scale
    python bench/async_speedup.py --quick          # tiny model on CPU: a smoke test of this script

On the GPU machine run it in the environment `make gpu-test` sets up (PYTHONPATH with the wheels and this
checkout, NCCL_NVLS_ENABLE=0 ...). Each mode is one `python -m shardrl.trainer.main_ppo` run; steps/hour = 3600 /
mean `timing_s/step_total` after `--warmup` steps (CUDA graph capture, allocator warm-up). A second table splits
the mean step into phases: the trainer pool waiting for samples, training, pausing the rollouter, syncing; the
rollout pool in engine steps (prefill, re-prefill after partial-rollout syncs included), in call overhead (Ray,
packing) and idle, and its mean decode batch against its slots. Run directories and a JSON summary go to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardrl.data import builtin_task

MODEL_300M = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                  num_key_value_heads=8, vocab_size=8192, max_position_embeddings=4096)
MODEL_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
MODES = ("sync", "one_step_off", "fully_async", "colocate_async")
COLOCATED = ("sync", "colocate_async")  # on all `--world` GPUs; the others on two pools of half
TRAIN_PHASES = ("reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
ROLLOUT_KEYS = ("rollout/engine_s", "rollout/prefill_s", "rollout/overhead_s", "rollout/idle_s",
                "rollout/decode_batch", "rollout/occupancy")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4,
                        help="GPUs in all: the colocated modes use all, the others half + half (then even)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the mean")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per training step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--response-length", type=int, default=2048)
    parser.add_argument("--stop-tokens", type=int, default=16, help="tokens that end a response (of the vocab)")
    parser.add_argument("--trigger", type=int, default=2, help="fully async: trigger_parameter_sync_step")
    parser.add_argument("--staleness", type=float, default=0.5, help="fully async: staleness_threshold")
    parser.add_argument("--slots", type=int, default=None,
                        help="engine max_num_seqs in every mode (default: twice a step's samples); the async modes "
                             "keep up to that many sequences in flight, the synchronous one never more than a step's")
    parser.add_argument("--warmup-batches", type=int, default=1, help="colocate_async: batches generated ahead")
    parser.add_argument("--max-span", type=int, default=4,
                        help="colocate_async: max_off_policy_threshold (versions a kept group may span)")
    parser.add_argument("--no-partial", action="store_true",
                        help="both async modes: partial_rollout=false (the one_step_off config's default)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--out", default="/tmp/shardrl_async_speedup")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per mode")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model on CPU; sizes not given default to a few short steps")
    args = parser.parse_args()
    if args.quick:  # the sizes left at their defaults take the smoke test's
        quick = dict(world=2, steps=3, warmup=1, prompts=8, n=2, response_length=16, stop_tokens=32)
        for name, value in quick.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    two_pools = [m for m in args.modes if m not in COLOCATED]
    if two_pools and (args.world < 2 or args.world % 2):
        parser.error(f"--world {args.world}: {', '.join(two_pools)} need an even number of GPUs (trainer and rollout "
                     f"pools of half each)")
    return args


def make_model(out: Path, shape: dict, stop_tokens: int, seed: int = 0) -> Path:
    """A random-weight model whose responses end on any of `stop_tokens` ids (the last ones of its vocab, plus the
    task tokenizer's <eos>): with a near-uniform policy, lengths are geometric with mean vocab / stop_tokens."""
    vocab = shape["vocab_size"]
    eos = [builtin_task.SPECIAL.index("<eos>")] + list(range(vocab - stop_tokens + 1, vocab))
    config = AutoConfig.for_model("qwen2", **shape, tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos,
                                  pad_token_id=0, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    builtin_task.make_tokenizer(out)  # the task's prompts and scorer; ids past its vocab decode to nothing
    return out


def overrides(args: argparse.Namespace, mode: str, model: Path, task: dict, run_dir: Path) -> list[str]:
    """The same job in every mode; only the pools and the schedule's keys differ."""
    half, device = args.world // 2, "cpu" if args.quick else "cuda"
    dtype = "float32" if args.quick else "bfloat16"
    common = [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={task['train_files']}",
        f"data.val_files={task['val_files']}", f"trainer.default_local_dir={run_dir}", "trainer.logger=[file]",
        f"trainer.device={device}", f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.rollout.n={args.n}",
        f"data.max_response_length={args.response_length}", "data.max_prompt_length=32",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts // 2}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max(16384, 2 * (args.response_length + 32))}",
        f"actor_rollout_ref.actor.megatron.dtype={dtype}", f"actor_rollout_ref.rollout.dtype={dtype}",
        f"actor_rollout_ref.rollout.max_num_seqs={args.slots or 2 * args.prompts * args.n}",
        # re-prefills after a partial-rollout sync go in few large steps
        f"actor_rollout_ref.rollout.max_num_batched_tokens={max(32768, args.response_length + 32)}",
        "algorithm.rollout_correction.decoupled=false",
    ]
    if mode == "sync":
        return ["--config-name=ppo_trainer", *common, f"trainer.n_gpus_per_node={args.world}"]
    if mode == "colocate_async":
        return ["--config-name=ppo_trainer", *common, f"trainer.n_gpus_per_node={args.world}",
                "trainer.v1.trainer_mode=colocate_async",
                f"trainer.v1.colocate_async.num_warmup_batches={args.warmup_batches}",
                f"trainer.v1.sampler.max_off_policy_threshold={args.max_span}"]
    pools = [f"trainer.n_gpus_per_node={half}", f"rollout.n_gpus_per_node={half}",
             "async_training.use_rollout_log_probs=true", "actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
             f"async_training.partial_rollout={str(not args.no_partial).lower()}"]
    if mode == "one_step_off":
        return ["--config-name=one_step_off_ppo_trainer", *common, *pools]
    return ["--config-name=fully_async_ppo_trainer", *common, *pools, "async_training.require_batches=2",
            f"async_training.trigger_parameter_sync_step={args.trigger}",
            f"async_training.staleness_threshold={args.staleness}"]


def run_mode(args: argparse.Namespace, mode: str, model: Path, task: dict, out: Path) -> dict | None:
    """One mode's run and its step statistics; None (and a line saying so) when it ran past `--timeout`, so the
    other modes' results still print."""
    run_dir = out / mode
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", *overrides(args, mode, model, task, run_dir)]
    print(f"[{mode}] {' '.join(cmd)}", flush=True)
    # Its own session, so a timeout can end the whole run (Ray's local processes included), not just the driver,
    # and the next mode starts on free GPUs.
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        (out / f"{mode}.log").write_text(stdout + stderr)
        print(f"[{mode}] ran past --timeout {args.timeout} s; left out (its log: {out / f'{mode}.log'})", flush=True)
        return None
    (out / f"{mode}.log").write_text(stdout + stderr)
    if process.returncode != 0:
        raise SystemExit(f"[{mode}] failed (exit {process.returncode}); see {out / f'{mode}.log'}:\n{stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "timing_s/step_total" in r][args.warmup:]
    seconds = sum(r["timing_s/step_total"] for r in timed) / len(timed)

    def mean(key: str) -> float:
        values = [r[key] for r in timed if key in r]
        return sum(values) / len(values) if values else float("nan")

    phases = {name: mean(f"timing_s/{name}") for name in ("gen", "wait_rollout", "pause_rollout", "sync")}
    train = sum(mean(f"timing_s/{name}") for name in TRAIN_PHASES if any(f"timing_s/{name}" in r for r in timed))
    return {"mode": mode, "steps_timed": len(timed), "seconds_per_step": seconds, "steps_per_hour": 3600 / seconds,
            "response_length_mean": mean("response_length/mean"),
            "response_clip_ratio": mean("response_length/clip_ratio"), "staleness_mean": mean("async/staleness_mean"),
            "rollout_overlap_s": mean("timing_s/rollout_overlap"), "train_s": train, **phases,
            **{key.split("/")[1]: mean(key) for key in ROLLOUT_KEYS}}


def print_tables(args: argparse.Namespace, results: dict[str, dict]) -> None:
    half = args.world // 2
    where = "CPU processes" if args.quick else "GPUs"
    scale = " (HALF SCALE: the issue's setting is 4)" if args.world == 2 and not args.quick else ""
    print(f"\n{args.prompts} prompts x {args.n} samples per step, responses <= {args.response_length} tokens, "
          f"{where}: sync and colocate_async on {args.world} colocated, one_step_off and fully_async on {half} "
          f"trainer + {half} rollout{scale}")
    sync = results.get("sync")
    if sync:
        print(f"responses: mean {sync['response_length_mean']:.0f} tokens, {100 * sync['response_clip_ratio']:.1f}% "
              f"at the cap; sync step: {100 * sync['gen'] / sync['seconds_per_step']:.0f}% generating")
    print(f"{'mode':<14}{'steps/hour':>12}{'s/step':>10}{'resp len':>10}{'staleness':>11}{'overlap s':>11}"
          f"{'x sync':>8}")
    base = sync["steps_per_hour"] if sync else None
    for r in results.values():
        ratio = f"{r['steps_per_hour'] / base:.2f}" if base else "-"
        print(f"{r['mode']:<14}{r['steps_per_hour']:>12.1f}{r['seconds_per_step']:>10.2f}"
              f"{r['response_length_mean']:>10.1f}{r['staleness_mean']:>11.2f}{r['rollout_overlap_s']:>11.2f}"
              f"{ratio:>8}")
    print("\nmean step, seconds. trainer pool: gen (sync: colocated generation), wait (for samples), train, pause "
          "(the rollouter), sync.\nrollout pool: engine (of which prefill), overhead (calls: Ray, packing), idle; "
          "mean decode batch (% of the engine's slots)")
    print(f"{'mode':<14}{'gen':>7}{'wait':>7}{'train':>7}{'pause':>7}{'sync':>7} |{'engine':>8}{'prefill':>8}"
          f"{'overhead':>9}{'idle':>7}{'decode batch':>14}")
    for r in results.values():
        cells = "".join(f"{_nan0(r[k]):>7.2f}" for k in ("gen", "wait_rollout", "train_s", "pause_rollout", "sync"))
        rollout = (f"{r['engine_s']:>8.2f}{r['prefill_s']:>8.2f}{r['overhead_s']:>9.2f}{r['idle_s']:>7.2f}"
                   f"{r['decode_batch']:>7.0f} ({100 * r['occupancy']:3.0f}%)"
                   if r["mode"] != "sync" else f"{'(colocated: gen)':>46}")
        print(f"{r['mode']:<14}{cells} |{rollout}")


def _nan0(value: float) -> float:
    return 0.0 if math.isnan(value) else value


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    task = builtin_task.prepare(out / "task")
    model = make_model(out / "model", MODEL_TINY if args.quick else MODEL_300M, args.stop_tokens)
    results = {}
    for mode in args.modes:
        if result := run_mode(args, mode, model, task, out):
            results[mode] = result
            # Each mode's figures as soon as it ends, so a run cut short (a caller's time limit) still leaves them.
            print(f"[{mode}] {result['steps_per_hour']:.1f} steps/hour ({result['seconds_per_step']:.2f} s/step, "
                  f"mean response {result['response_length_mean']:.0f} tokens)", flush=True)
            (out / "summary.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print_tables(args, results)
    print(f"summary: {out / 'summary.json'}")


if __name__ == "__main__":
    main()
