"""GPU check of multi-turn continuations (bf16): a continuation's prefill over the cached prefix gives the logits a
whole prefill gives, and a greedy turn samples the same tokens, on the bench's 494M Qwen2 shape.

    python bench/continuation_check.py
"""

from __future__ import annotations

import random

import torch
from rollout_throughput import QWEN2_0_5B
from transformers import Qwen2Config

from shardrl.models.config import ModelConfig
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.rollout.request import SamplingParams


def main() -> None:
    device = torch.device("cuda")
    config = EngineConfig(max_num_seqs=64, max_model_len=1024, max_num_batched_tokens=16384, dtype=torch.bfloat16)
    torch.manual_seed(0)
    engine = Engine(ModelConfig.from_dict(Qwen2Config(**QWEN2_0_5B, architectures=["Qwen2ForCausalLM"]).to_dict()),
                    Layout.single(device), config)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(50, 300))] for _ in range(16)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, raw_logprobs=True)
    first = {}
    for i, p in enumerate(prompts):
        engine.submit(p, greedy, f"a{i}", keep_cache=True)
    first = {o.request_id: o for o in engine.stream()}
    env = [[rng.randrange(vocab) for _ in range(rng.randint(5, 40))] for _ in prompts]
    seconds = {f"a{i}": first[f"a{i}"].prompt_ids + first[f"a{i}"].token_ids + env[i] for i in range(len(prompts))}
    for rid, ids in seconds.items():
        engine.submit(ids, greedy, rid + "b", continues=rid)
    cont = {o.request_id: o for o in engine.stream()}
    fresh = engine.generate(list(seconds.values()), greedy)
    same = sum(cont[rid + "b"].token_ids == f.token_ids for rid, f in zip(seconds, fresh))
    diff = max(max(abs(a - b) for a, b in zip(cont[rid + "b"].raw_logprobs[:1], f.raw_logprobs[:1]))
               for rid, f in zip(seconds, fresh))
    print(f"continuations equal to whole prefills (greedy 16 tokens): {same}/{len(prompts)}; "
          f"max |first-token logprob diff| {diff:.4f}")


if __name__ == "__main__":
    main()
