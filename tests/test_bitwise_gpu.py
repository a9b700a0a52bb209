"""Bitwise mode on one GPU (bf16): the batch-invariant kernels give a row the same bits in any batch, and the rollout
engine's sampled-token log-probs equal the trainer's old log-probs exactly, dense and MoE, over > 7,000 tokens of
mixed batch compositions (prompts of 8..200 tokens, responses ending at different steps so the decode batch
shrinks across CUDA-graph buckets; the trainer packs the same sequences by count and by tokens).

The kernels are also checked against the default ones (`F.linear`, HF's RMSNorm, SDPA): equal up to bf16 rounding.
A test that cannot fail is avoided by the control: the default kernels, same samples, do not give 0.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardrl.job.options import EngineOptions, ForwardBatching
from shardrl.models.attention import reference_attention
from shardrl.models.config import ModelConfig
from shardrl.models.fast_paths import FastPaths
from shardrl.models.norm import rms_norm as reference_rms_norm
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.rollout.request import SamplingParams
from shardrl.workers.actor import compute_log_prob
from shardrl.workers.engine import ModelEngine
from shardrl.workers.samples import generate
from tests.test_logprob_mismatch_gpu import MAX_PROMPT, MODEL, MOE, NUM_PROMPTS, RESPONSE, make_checkpoint, prompt_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 2e-2) -> bool:
    return ((a.float() - b.float()).norm() / b.float().norm()).item() < rel


def test_matmul_rows_do_not_depend_on_the_batch():
    from shardrl.parallel.bitwise_kernels import GEMM_CONFIGS, expert_tiles, grouped_matmul, grouped_matmul_pair, matmul

    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(777, 896, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(1152, 896, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    b = torch.randn(1152, device="cuda", generator=g, dtype=torch.bfloat16)
    full = matmul(x, w, b)
    assert _close(full, F.linear(x, w, b))
    for rows in (slice(0, 1), slice(5, 6), slice(3, 19), slice(3, 70), slice(100, 300), slice(100, 777)):
        assert torch.equal(matmul(x[rows], w, b), full[rows])
    assert torch.equal(matmul(x, w[:896]), matmul(x, w)[:, :896])  # packed q/k/v vs q alone
    # Batches of different sizes take different tiles; the K order, hence every bit, is the same in each.
    for config in GEMM_CONFIGS:
        assert torch.equal(matmul(x, w, b, config=config), full), config
    experts = torch.randn(4, 512, 896, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    for counts in ([777, 0, 0, 0], [1, 300, 0, 476], [200, 200, 200, 177], [0, 0, 0, 777]):
        counts = torch.tensor(counts, device="cuda")
        for block_m in (None, 16, 64, 128):  # the tile height follows the rows per expert
            tiles = expert_tiles(counts, x.shape[0], block_m)
            out = grouped_matmul(x, experts, tiles)
            others = experts.flip(0)  # gate and up in one launch: each as it is alone
            assert all(map(torch.equal, grouped_matmul_pair(x, experts, others, tiles),
                           (out, grouped_matmul(x, others, tiles))))
            start = 0
            for e, n in enumerate(counts.tolist()):
                assert torch.equal(out[start:start + n], matmul(x[start:start + n], experts[e])), (counts, e)
                start += n


def test_rms_norm_and_attention_rows_do_not_depend_on_the_batch():
    from shardrl.models.attention import bitwise_attention
    from shardrl.models.norm_kernel import rms_norm

    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(300, 896, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.rand(896, device="cuda", generator=g, dtype=torch.bfloat16) + 0.5
    full = rms_norm(x, w, 1e-6)
    assert torch.equal(rms_norm(x[7:9], w, 1e-6), full[7:9])
    assert _close(full, reference_rms_norm(x, w, 1e-6), 1e-2)

    lengths = [1, 63, 64, 65, 200, 7]
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).int()
    total = int(cu[-1])
    q = torch.randn(total, 8, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(total, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(total, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    starts = cu[:-1]
    lens = cu[1:] - starts
    lse = torch.empty(8, total, device="cuda")
    packed = bitwise_attention(q, k, v, starts, lens, torch.zeros_like(starts), starts, max(lengths), 0.125, lse)
    assert _close(packed, reference_attention(q, k, v, cu, 0.125))
    # The log-sum-exp it stores for flash attention's backward: [heads, T], natural log of the scaled scores.
    scores = torch.einsum("thd,shd->hts", q.float(), k.float().repeat_interleave(4, 1)) * 0.125
    token = torch.arange(total, device="cuda")
    segment = torch.searchsorted(cu[1:], token.int(), right=True)
    visible = (segment[:, None] == segment[None, :]) & (token[None, :] <= token[:, None])
    assert torch.allclose(lse, scores.masked_fill(~visible, float("-inf")).logsumexp(-1), atol=1e-3)
    # Every query alone, as a decode step reads it: one query at its position against its sequence's keys.
    seq = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), lens.long())
    pos = (torch.arange(total, device="cuda") - cu[seq.long()]).int()
    rows = torch.arange(total, device="cuda", dtype=torch.int32)
    one_by_one = bitwise_attention(q, k, v, rows, torch.ones_like(rows), pos, cu[seq.long()].int(), 1, 0.125)
    assert torch.equal(one_by_one, packed)


def test_fast_launches_equal_tritons_own():
    """`FastKernel` (the compiled kernel's launcher called directly) gives Triton's own launch's bits, on aligned
    inputs (its direct path, after the first call) and on a misaligned one (Triton's path again)."""
    from shardrl.models import norm_kernel
    from shardrl.parallel import bitwise_kernels as bk
    from shardrl.parallel.triton_launch import FastKernel

    g = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(300, 513, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(256, 512, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    norm_w = torch.rand(512, device="cuda", generator=g, dtype=torch.bfloat16) + 0.5
    aligned, misaligned = x[:, :512].contiguous(), x[:, 1:]  # the second starts 2 bytes past an aligned address
    cases = {"matmul": lambda a: bk.matmul(a, w), "rms_norm": lambda a: norm_kernel.rms_norm(a, norm_w, 1e-6)}
    fast = {name: [fn(aligned), fn(aligned), fn(misaligned)] for name, fn in cases.items()}
    assert bk._MATMUL.compiled and norm_kernel._RMS_NORM.compiled
    direct = FastKernel.launch
    FastKernel.launch = lambda self, grid, tensors, scalars, num_warps, num_stages=3, **constexprs: \
        self.launch_through_triton(grid, tensors, scalars, num_warps, num_stages, constexprs)
    try:
        for name, fn in cases.items():
            for out, a in zip(fast[name], (aligned, aligned, misaligned)):
                assert torch.equal(out, fn(a)), name
    finally:
        FastKernel.launch = direct


def _rollout(path, bitwise: bool, temperature: float):
    engine = Engine.from_pretrained(path, Layout.single("cuda"), EngineConfig(
        max_num_seqs=NUM_PROMPTS, max_num_batched_tokens=4096, max_model_len=MAX_PROMPT + RESPONSE,
        dtype=torch.bfloat16, gpu_memory_utilization=0.9, bitwise=bitwise))
    params = [SamplingParams(max_tokens=RESPONSE - 4 * i, temperature=temperature, seed=i, ignore_eos=True)
              for i in range(NUM_PROMPTS)]
    samples = generate(engine, prompt_batch(), params, RESPONSE, pad_token_id=0)
    assert engine.runner.graphs is not None, "the decode did not run under CUDA graphs"
    del engine
    torch.cuda.empty_cache()
    return samples


def _differences(path, samples, bitwise: bool, temperature: float) -> list[torch.Tensor]:
    trainer = ModelEngine(ModelConfig.from_pretrained(path), Layout.single("cuda"),
                          EngineOptions(dtype=torch.bfloat16, fast=FastPaths(bitwise=bitwise)), hf_path=str(path))
    mask = samples.tensors["response_mask"].bool()
    rollout = samples.tensors["rollout_log_probs"].double()[mask]
    out = []
    for batching in (ForwardBatching(micro_batch_size=8, max_token_len=None),
                     ForwardBatching(micro_batch_size=None, max_token_len=3000)):
        log_probs, _ = compute_log_prob(trainer, samples, batching, temperature)
        out.append(rollout - log_probs.double()[mask])
    return out


@pytest.mark.parametrize("family, shape, temperature", [("qwen2", MODEL, 1.0), ("qwen3_moe", MOE, 0.8)],
                         ids=["dense", "moe"])
def test_bitwise_rollout_logprobs_equal_the_trainers(tmp_path, family, shape, temperature):
    path = make_checkpoint(tmp_path / family, family, shape)
    samples = _rollout(path, bitwise=True, temperature=temperature)
    mask = samples.tensors["response_mask"].bool()
    assert int(mask.sum()) >= 7000
    for d in _differences(path, samples, bitwise=True, temperature=temperature):
        assert int((d != 0).sum()) == 0, f"{int((d != 0).sum())} of {d.numel()} tokens differ, max {d.abs().max()}"
    control = _differences(path, _rollout(path, bitwise=False, temperature=temperature), False, temperature)
    print(f"\n{family}: bitwise 0 of {int(mask.sum())} tokens differ; default kernels: "
          + ", ".join(f"{int((d != 0).sum())} differ, mean |d| {d.abs().mean():.3g}" for d in control))
    assert all(int((d != 0).sum()) > 0 for d in control)


@pytest.mark.parametrize("family, shape", [("qwen2", MODEL), ("qwen3_moe", MOE)], ids=["dense", "moe"])
def test_bitwise_gradients_match_the_default_kernels(tmp_path, family, shape):
    """The bitwise forward's backward (torch's GEMMs, flash attention's from the kernel's log-sum-exp, the norm's
    Triton backward) is the gradient of the same function: every parameter's gradient is the default mode's up to
    bf16 rounding."""
    from shardrl.models.hf_bridge import load_hf_weights
    from shardrl.models.transformer import Transformer

    path = make_checkpoint(tmp_path / family, family, shape)
    config = ModelConfig.from_pretrained(path)
    ids = torch.randint(1, config.vocab_size, (1024,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    cu_seqlens = torch.tensor([0, 100, 612, 1024], device="cuda", dtype=torch.int32)
    positions = torch.cat([torch.arange(n, device="cuda") for n in (100, 512, 412)])
    grads = []
    for bitwise in (False, True):
        model = Transformer(config, Layout.single("cuda"), dtype=torch.bfloat16, fast=FastPaths(bitwise=bitwise))
        load_hf_weights(model, path)
        logprobs, _ = model.compute_logprobs(model(ids, positions, cu_seqlens), ids.roll(-1))
        logprobs.mean().backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    if family == "qwen2":
        for name, grad in grads[0].items():
            assert _close(grads[1][name], grad, 5e-2), name
    else:  # a near-tie may route a token to another expert in one mode (bf16 rounding), which moves every gradient
        names = list(grads[0])
        assert _close(torch.cat([grads[1][n].flatten() for n in names]),
                      torch.cat([grads[0][n].flatten() for n in names]), 5e-2)


def test_bitwise_multi_turn_continuations_equal_the_trainer(tmp_path):
    """Second turns prefilled against their cached first turns (several continuations in one prefill batch) and
    decoded on: every second-turn token's logprob is the trainer's over the whole sequence, bit for bit."""
    from shardrl.models.hf_bridge import load_hf_weights
    from shardrl.models.transformer import Transformer

    path = make_checkpoint(tmp_path / "qwen2")
    engine = Engine.from_pretrained(path, Layout.single("cuda"), EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=1024, dtype=torch.bfloat16,
        gpu_memory_utilization=0.5, bitwise=True))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 1000, (int(n),), generator=g).tolist() for n in (17, 64, 130, 5)]
    first = [SamplingParams(max_tokens=40 + 7 * i, seed=i, ignore_eos=True) for i in range(4)]
    ids = [engine.submit(p, params, f"a{i}", keep_cache=True)[0] for i, (p, params) in enumerate(zip(prompts, first))]
    turn1 = {out.request_id: out for out in engine.stream()}
    environment = [torch.randint(1, 1000, (int(n),), generator=g).tolist() for n in (3, 50, 9, 70)]
    seconds = []
    for i, rid in enumerate(ids):
        out = turn1[rid]
        prompt = out.prompt_ids + out.token_ids + environment[i]
        seconds.append(engine.submit(prompt, SamplingParams(max_tokens=60, seed=10 + i, ignore_eos=True), f"b{i}",
                                     continues=rid)[0])
    turn2 = {out.request_id: out for out in engine.stream()}
    assert engine.stats.cached_prefill_tokens > 0
    config = ModelConfig.from_pretrained(path)
    model = Transformer(config, Layout.single("cuda"), dtype=torch.bfloat16, fast=FastPaths(bitwise=True))
    load_hf_weights(model, path)
    sequences = [turn2[rid].prompt_ids + turn2[rid].token_ids for rid in seconds]
    flat = torch.tensor([t for s in sequences for t in s], device="cuda")
    positions = torch.tensor([p for s in sequences for p in range(len(s))], device="cuda")
    cu = torch.tensor([0, *(len(s) for s in sequences)], device="cuda").cumsum(0).int()
    with torch.no_grad():
        trainer, _ = model.compute_logprobs(model(flat, positions, cu), flat.roll(-1))
    for b, rid in enumerate(seconds):
        out = turn2[rid]
        start = int(cu[b]) + len(out.prompt_ids) - 1
        expected = trainer[start:start + len(out.token_ids)].double()
        assert torch.equal(torch.tensor(out.logprobs, dtype=torch.float64, device="cuda"), expected), rid
