"""Rollout engine on CUDA: the CUDA-graph decode against the eager reference (seeded and unseeded rows sampling inside
the graphs), seeded draws equal on CUDA and CPU, bf16 logprobs against the trainer's forward, weight updates under
captured graphs, sleep/wake with weight offload freeing the memory."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import load_hf_weights
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.models.transformer import Transformer
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.rollout.request import SamplingParams
from shardrl.rollout.sampler import SamplingBatch, counter_uniforms, sample, seed_keys

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Mixed prompt lengths and max_tokens: the decode batch shrinks and leaves holes, crossing row and length buckets.
PROMPTS = [[(5 * i + j) % 120 + 1 for j in range(n)] for i, n in enumerate([3, 40, 7, 70, 12, 25])]
PARAMS = [SamplingParams(max_tokens=m, temperature=0.9, seed=i, raw_logprobs=True, ignore_eos=True)
          for i, m in enumerate([30, 5, 60, 20, 45, 9])]


def _config(dtype, eager=False):
    return EngineConfig(max_model_len=160, max_num_seqs=8, max_num_batched_tokens=512, gpu_memory_utilization=0.9,
                        dtype=dtype, enforce_eager=eager)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")


def _engine(path, dtype=torch.float32, eager=False):
    return Engine.from_pretrained(path, Layout.single("cuda"), _config(dtype, eager))


def test_graph_decode_equals_eager_decode(checkpoint):
    graphed_engine = _engine(checkpoint)
    graphed = graphed_engine.generate(PROMPTS, PARAMS)
    graphs = graphed_engine.runner.graphs
    assert graphs is not None and len(graphs.graphs) > 1
    assert all(len(key) == 3 for key in graphs.graphs)  # (rows, length, sampling mode): seeded rows sample inside
    assert graphed_engine.stats.decode_host_launches < graphed_engine.stats.decode_steps
    eager = _engine(checkpoint, eager=True).generate(PROMPTS, PARAMS)
    for g, e in zip(graphed, eager):
        assert g.token_ids == e.token_ids
        assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0)


def test_seeded_draws_on_cuda_equal_cpu():
    """The counter hash is exact integer arithmetic: the same uniforms on both devices, so the same tokens from the
    same logits (the fp32 sums may differ in the last bit; a flip would need a threshold that close to a boundary)."""
    seeds = list(range(2**31 - 64, 2**31 + 64))
    counters = torch.arange(128) * 7
    keys = seed_keys(seeds)
    assert torch.equal(counter_uniforms(keys.cuda(), counters.cuda()).cpu(), counter_uniforms(keys, counters))
    logits = torch.randn(128, 64, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(temperature=0.9, top_p=0.95)] * 128
    cpu = sample(logits, SamplingBatch.build(params, seeds, 64, torch.device("cpu")), counters)
    gpu = sample(logits.cuda(), SamplingBatch.build(params, seeds, 64, torch.device("cuda")), counters.cuda())
    assert torch.equal(gpu.token_ids.cpu(), cpu.token_ids)


def _trainer_raw_logprobs(path, outputs, dtype):
    model = Transformer(ModelConfig.from_pretrained(path), Layout.single("cuda"), dtype=dtype)
    load_hf_weights(model, path)
    result = []
    with torch.no_grad():
        for out in outputs:
            ids = torch.tensor(out.prompt_ids + out.token_ids, device="cuda")
            cu_seqlens = torch.tensor([0, ids.numel()], dtype=torch.int32, device="cuda")
            logprobs, _ = model.compute_logprobs(model(ids, torch.arange(ids.numel(), device="cuda"), cu_seqlens),
                                                 ids.roll(-1))
            result.append(logprobs[len(out.prompt_ids) - 1: -1].cpu())
    return result


def test_bf16_logprobs_close_to_trainer_forward(checkpoint):
    outputs = _engine(checkpoint, torch.bfloat16).generate(PROMPTS, PARAMS)
    for out, expected in zip(outputs, _trainer_raw_logprobs(checkpoint, outputs, torch.bfloat16)):
        diff = (torch.tensor(out.raw_logprobs) - expected).abs()
        assert diff.max() < 0.1 and diff.mean() < 0.02, (diff.max(), diff.mean())


def test_moe_decodes_in_cuda_graphs_close_to_trainer_forward(tmp_path):
    """An MoE model at EP 1 in bf16 (grouped expert GEMMs, no host read in its dispatch) decodes through CUDA graphs,
    and its logprobs are the trainer's bf16 forward's within bf16 noise."""
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "moe")
    engine = _engine(path, torch.bfloat16)
    outputs = engine.generate(PROMPTS, PARAMS)
    assert engine.runner.graphs is not None and len(engine.runner.graphs.graphs) > 1
    assert engine.stats.decode_host_launches < engine.stats.decode_steps
    for out, expected in zip(outputs, _trainer_raw_logprobs(path, outputs, torch.bfloat16)):
        diff = (torch.tensor(out.raw_logprobs) - expected).abs()
        assert diff.max() < 0.1 and diff.mean() < 0.02, (diff.max(), diff.mean())


def test_unseeded_sampling_runs_inside_the_graphs(checkpoint):
    """Unseeded rows sample inside the captured step from the engine's generator: greedy rows equal the eager
    engine's, sampled rows' raw logprobs are the trainer's, and every replay draws new numbers."""
    params = [SamplingParams(max_tokens=m, temperature=t, raw_logprobs=True, ignore_eos=True)
              for m, t in zip([30, 5, 60, 20, 45, 9], [0.0, 1.0, 0.0, 0.7, 1.0, 0.0])]
    engine = _engine(checkpoint)
    outputs = engine.generate(PROMPTS, params)
    assert any(len(key) == 3 for key in engine.runner.graphs.graphs)  # (rows, length, sampling mode)
    assert engine.stats.decode_host_launches < engine.stats.decode_steps
    eager = _engine(checkpoint, eager=True).generate(PROMPTS, params)
    for p, g, e in zip(params, outputs, eager):
        if p.greedy:
            assert g.token_ids == e.token_ids
    for out, expected in zip(outputs, _trainer_raw_logprobs(checkpoint, outputs, torch.float32)):
        assert_close(torch.tensor(out.raw_logprobs), expected, atol=1e-4, rtol=0)
    again = engine.generate(PROMPTS, params)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    assert [outputs[i].token_ids for i in sampled] != [again[i].token_ids for i in sampled]


def test_compiled_decode_equals_eager_decode(checkpoint):
    params = SamplingParams(max_tokens=10, temperature=0.0, raw_logprobs=True, ignore_eos=True)
    config = replace(_config(torch.float32), compile_decode=True)
    compiled = Engine.from_pretrained(checkpoint, Layout.single("cuda"), config).generate(PROMPTS, params)
    eager = _engine(checkpoint, eager=True).generate(PROMPTS, params)
    for c, e in zip(compiled, eager):
        assert c.token_ids == e.token_ids
        assert_close(torch.tensor(c.raw_logprobs), torch.tensor(e.raw_logprobs), atol=1e-4, rtol=0)


def test_update_weights_under_captured_graphs(checkpoint, tmp_path):
    other = make_tiny_checkpoint("qwen2", tmp_path / "other", seed=1)
    engine = _engine(checkpoint)
    engine.generate(PROMPTS, PARAMS)  # captures graphs over the old weights' storage
    engine.update_weights((n, t.cuda()) for n, t in load_file(other / "model.safetensors").items())
    after = engine.generate(PROMPTS, PARAMS)
    fresh = _engine(other).generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in after] == [o.token_ids for o in fresh]


def test_sleep_frees_memory_and_wake_restores_outputs(checkpoint):
    engine = _engine(checkpoint, torch.bfloat16)
    before = engine.generate(PROMPTS, PARAMS)
    cache_bytes = engine.runner.cache.nbytes
    allocated = torch.cuda.memory_allocated()
    engine.sleep(offload_weights=True)
    assert allocated - torch.cuda.memory_allocated() >= cache_bytes
    assert all(not p.is_cuda for p in engine.model.parameters())
    engine.wake_up(kv_cache=False)
    assert all(p.is_cuda for p in engine.model.parameters()) and not engine.runner.cache.allocated
    for group in engine.model.column_groups():  # q/k/v and gate/up come back packed (one GEMM each), not one by one
        assert len({linear.weight.untyped_storage().data_ptr() for linear in group}) == 1
    engine.wake_up()
    after = engine.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
