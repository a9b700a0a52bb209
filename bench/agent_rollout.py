"""Multi-turn agent rollouts against single-turn ones: the same model tokens, the same engine, the same run.

Default (one GPU): the 494M Qwen2 shape (bench/rollout_throughput.py's, random bf16 weights), 256 trajectories of
256 random prompt tokens. Each trajectory has 4 model turns of random lengths (16-112 tokens, EOS ignored); between
turns a simulated tool waits 100 ms (`asyncio.sleep`, as a real tool's subprocess or socket would) and answers 16
environment tokens. The single-turn baseline generates each trajectory's total model tokens in one turn, through the
same agent runner (and, for reference, through `Engine.generate` directly).

Prints model tokens per second of each and the ratio (issue 21 asks >= 0.8x; the median of `--repeats` pairs), the prefill tokens per continuation
turn against its new tokens (the environment's plus the model's last, whose keys a parked slot may lack: issue 21
asks <= new tokens + one cache block), cached prefix tokens per turn, parked slots lent out, and the decode steps
that ran while some trajectory waited on its tool.

    python bench/agent_rollout.py           # the GPU benchmark
    python bench/agent_rollout.py --quick   # tiny shape, few trajectories: a smoke test that runs on CPU
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import torch
from rollout_throughput import QWEN2_0_5B, TINY
from transformers import Qwen2Config

from shardrl.agents import driver
from shardrl.agents.driver import AgentRunner
from shardrl.agents.loop import (AgentContext, AgentLoop, AgentSample, Episode, SingleTurnAgentLoop, ToolBox,
                                 TurnLimits)
from shardrl.agents.trajectory import Source
from shardrl.models.config import ModelConfig
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine, EngineConfig, EngineStats
from shardrl.rollout.request import SamplingParams


class ScriptedToolLoop(AgentLoop):
    """Model turns of the lengths in the sample's `extra_info["turns"]`, each but the last followed by a tool that
    waits `extra_info["latency"]` seconds and answers `extra_info["env"]` tokens."""

    async def run(self, episode: Episode) -> None:
        info = episode.sample.extra_info
        for i, length in enumerate(info["turns"]):
            episode.sample.params = SamplingParams(max_tokens=length, ignore_eos=True, seed=info["seed"])
            await episode.generate()
            if i + 1 < len(info["turns"]):
                await asyncio.sleep(info["latency"])
                episode.append(info["env"], Source.TOOL)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 trajectories of short turns")
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="decode rows (EngineConfig.max_num_seqs; default: one per trajectory). Fewer rows than "
                             "trajectories, as RL batches usually have, let queued ones take the rows of those "
                             "waiting on a tool")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--min-turn", type=int, default=16)
    parser.add_argument("--max-turn", type=int, default=112)
    parser.add_argument("--env-tokens", type=int, default=16)
    parser.add_argument("--latency", type=float, default=0.1, help="seconds per simulated tool call")
    parser.add_argument("--no-compile", action="store_true", help="no EngineConfig.compile_decode on GPU")
    parser.add_argument("--repeats", type=int, default=3, help="timed single/multi pairs (the median ratio counts)")
    parser.add_argument("--turn-chunk", type=int, default=driver.TURN_CHUNK,
                        help="queued turns enter the engine once 1/N of the running sequences wait (driver.py)")
    parser.add_argument("--max-turn-wait", type=int, default=driver.MAX_TURN_WAIT_STEPS,
                        help="... or once the oldest waited this many decode steps")
    parser.add_argument("--max-fed-tokens", type=int, default=EngineConfig.max_fed_tokens,
                        help="continuations of at most this many new tokens are fed through decode rows (0: never)")
    parser.add_argument("--no-spare-rows", action="store_true",
                        help="no EngineConfig.spare_cache_rows: a lent slot's prefix is dropped, not kept")
    args = parser.parse_args()
    if args.quick:
        args.trajectories, args.prompt_len, args.turns, args.min_turn, args.max_turn = 8, 16, 3, 4, 12
    return args


def build_engine(args: argparse.Namespace, device: torch.device) -> Engine:
    shape = TINY if args.quick else QWEN2_0_5B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_len = args.prompt_len + args.turns * (args.max_turn + args.env_tokens) + 8
    rows = args.max_num_seqs or args.trajectories
    config = EngineConfig(max_num_seqs=rows, max_num_batched_tokens=max(16384, max_len),
                          max_model_len=max_len, cpu_kv_cache_tokens=args.trajectories * max_len, dtype=dtype,
                          compile_decode=device.type == "cuda" and not args.no_compile,
                          max_fed_tokens=args.max_fed_tokens, spare_cache_rows=not args.no_spare_rows)
    torch.manual_seed(0)
    return Engine(ModelConfig.from_dict(Qwen2Config(**shape, architectures=["Qwen2ForCausalLM"]).to_dict()), Layout.single(device), config)


def runner_for(engine: Engine, response_length: int) -> AgentRunner:
    limits = TurnLimits(response_length=response_length)
    context = AgentContext(None, None, ToolBox([], limits), {}, limits)  # scripted loops parse and render nothing
    loops = {"scripted": ScriptedToolLoop(context), "single_turn_agent": SingleTurnAgentLoop(context)}
    return AgentRunner(engine, context, loops, "scripted", lambda ids: "")


def run(runner: AgentRunner, samples: list[tuple[int, AgentSample, str]], device: torch.device) -> float:
    runner.engine.stats, runner.stats = EngineStats(), type(runner.stats)()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    runner.start(samples)
    done = runner.drive(None)
    assert len(done) == len(samples)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    driver.TURN_CHUNK, driver.MAX_TURN_WAIT_STEPS = args.turn_chunk, args.max_turn_wait
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engine = build_engine(args, device)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.trajectories)]
    turns = [[rng.randint(args.min_turn, args.max_turn) for _ in range(args.turns)] for _ in prompts]
    env = [rng.randrange(vocab) for _ in range(args.env_tokens)]
    response_length = args.turns * (args.max_turn + args.env_tokens)
    runner = runner_for(engine, response_length)

    def multi(key: int) -> list[tuple[int, AgentSample, str]]:
        return [(key * 10**6 + i, AgentSample([], p, {"turns": t, "env": env, "latency": args.latency, "seed": i},
                                               SamplingParams()), "scripted")
                for i, (p, t) in enumerate(zip(prompts, turns))]

    def single(key: int) -> list[tuple[int, AgentSample, str]]:
        return [(key * 10**6 + i, AgentSample([], p, {}, SamplingParams(max_tokens=sum(t), ignore_eos=True, seed=i)),
                 "single_turn_agent") for i, (p, t) in enumerate(zip(prompts, turns))]

    prefills = time_prefills(engine, device)
    model_tokens = sum(sum(t) for t in turns)
    # Warm-up at full size: kernels, a graph capture (and with compile_decode a compile) per decode-rows bucket,
    # which the timed runs meet. A smaller warm-up left the single-turn run, timed first, to capture the larger
    # buckets' graphs inside its time (before 2026-12-02 evening: ratios without --compile read high).
    run(runner, multi(0), device)
    run(runner, single(1), device)
    pairs = []  # (single seconds, multi seconds, seconds the engine idled while every trajectory waited)
    for repeat in range(args.repeats):
        single_s = run(runner, single(2 + 2 * repeat), device)
        prefills.clear()
        multi_s = run(runner, multi(3 + 2 * repeat), device)
        pairs.append((single_s, multi_s, runner.stats.tool_idle_seconds))
    single_s, multi_s, _ = sorted(pairs, key=lambda p: p[0] / p[1])[len(pairs) // 2]
    stats, tool_steps = engine.stats, runner.stats.decode_steps_during_tools  # the last multi-turn run's
    continuations = args.trajectories * (args.turns - 1)
    fresh_prefill = args.trajectories * args.prompt_len
    per_turn = (stats.prefill_tokens + stats.fed_tokens - fresh_prefill) / continuations
    engine.stats = EngineStats()
    start = time.perf_counter()
    engine.generate(prompts, [SamplingParams(max_tokens=sum(t), ignore_eos=True, seed=i) for i, t in enumerate(turns)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    generate_s = time.perf_counter() - start
    print(f"turn chunk 1/{args.turn_chunk} of the running, at most {args.max_turn_wait} steps' wait")
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"{args.trajectories} trajectories x {args.turns} turns ({model_tokens} model tokens), "
          f"tool latency {args.latency * 1e3:.0f} ms, {args.env_tokens} env tokens per tool turn")
    print(f"single turn (Engine.generate): {model_tokens / generate_s:10.0f} tok/s  {generate_s:.2f} s")
    print(f"single turn (agent runner):    {model_tokens / single_s:10.0f} tok/s  {single_s:.2f} s")
    print(f"multi turn  (agent runner):    {model_tokens / multi_s:10.0f} tok/s  {multi_s:.2f} s")
    print(f"ratio multi / single (runner): {single_s / multi_s:.3f} (median of {len(pairs)})   multi / "
          f"Engine.generate: {generate_s / multi_s:.3f}")
    print("  each pair: " + "; ".join(f"{s:.2f} s / {m:.2f} s = {s / m:.3f} (engine idle {idle:.2f} s)"
                                      for s, m, idle in pairs))
    print(f"prefilled or fed tokens per continuation turn: {per_turn:.2f} (new tokens: {args.env_tokens} env + 1 model); "
          f"cached prefix tokens per turn: {stats.cached_prefill_tokens / continuations:.1f}; "
          f"parked slots lent out (all runs): {engine.scheduler.spared_prefixes} prefixes kept in spare rows "
          f"({engine.runner.cache.num_slots - engine.runner.num_decode_slots} rows, {stats.prefix_moves} moves), "
          f"{engine.scheduler.evictions} dropped; decode steps during tool waits: {tool_steps} "
          f"of {stats.decode_steps}")
    print(f"multi turn engine: {stats.prefill_steps} prefill steps ({stats.prefill_seconds:.2f} s), "
          f"{stats.fed_tokens} continuation tokens fed through decode rows, "
          f"{stats.decode_steps} decode steps ({stats.decode_seconds:.2f} s, {stats.decode_host_launches} launched "
          f"from the host), {stats.decode_tokens / max(stats.decode_steps, 1):.0f} rows per decode step")
    for kind in ("fresh", "continuation"):
        steps = [p for p in prefills if p[0] == kind]
        if steps:
            print(f"  {kind} prefill steps: {len(steps)}, {sum(p[1] for p in steps) / len(steps):.1f} sequences and "
                  f"{sum(p[2] for p in steps) / len(steps):.0f} tokens each, "
                  f"{sum(p[3] for p in steps) * 1e3 / len(steps):.2f} ms each")
    runner.close()


def time_prefills(engine: Engine, device: torch.device) -> list[tuple[str, int, int, float]]:
    """Record (kind, sequences, tokens run, seconds) of every prefill forward from now on."""
    records: list[tuple[str, int, int, float]] = []
    forward = engine.runner.prefill_logits

    def timed(requests):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = forward(requests)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        records.append(("continuation" if requests[0].cached else "fresh", len(requests), out[1],
                        time.perf_counter() - start))
        return out

    engine.runner.prefill_logits = timed
    return records


if __name__ == "__main__":
    main()
