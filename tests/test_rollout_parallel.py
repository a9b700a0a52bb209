"""Rollout engine over 2 gloo ranks: TP2 (dense, replicated KV heads, MoE with ETP2 and with EP2) equals TP1."""

import torch
from torch.testing import assert_close

from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.rollout.request import SamplingParams

PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 2], [20, 21, 22]]
CONFIG = EngineConfig(max_model_len=32, cpu_kv_cache_tokens=32 * 3, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.95, seed=4, raw_logprobs=True, ignore_eos=True)


def _generate(path, layout):
    outputs = Engine.from_pretrained(path, layout, CONFIG).generate(PROMPTS, PARAMS)
    return [(o.token_ids, o.logprobs, o.raw_logprobs) for o in outputs]


def _generate_all(cases):
    return [_generate(path, Layout.create(LayoutSpec(world_size=2, **layout))) for path, layout in cases]


def test_tp2_equals_tp1(tmp_path):
    cases = [
        (make_tiny_checkpoint("qwen2", tmp_path / "qwen2"), dict(tp=2)),
        (make_tiny_checkpoint("llama", tmp_path / "llama_kv1", num_key_value_heads=1), dict(tp=2)),  # KV replicated
        (make_tiny_checkpoint("qwen2_moe", tmp_path / "qwen2_moe"), dict(tp=2, etp=2)),
        (make_tiny_checkpoint("mixtral", tmp_path / "mixtral"), dict(tp=2, ep=2)),
        (tmp_path / "qwen2", dict(tp=1)),  # two independent TP1 replicas
    ]
    ranks = run_distributed(2, _generate_all, cases)
    for case, (path, _) in enumerate(cases):
        reference = _generate(path, Layout.single())
        for rank in ranks:
            for (tokens, logprobs, raw), (ref_tokens, ref_logprobs, ref_raw) in zip(rank[case], reference):
                assert tokens == ref_tokens, (case, path)
                assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-5, rtol=0)
                assert_close(torch.tensor(raw), torch.tensor(ref_raw), atol=1e-5, rtol=0)
