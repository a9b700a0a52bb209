"""`model.use_fused_kernels` (`parallel/fused_logprobs.py`): log-probs and entropies straight from the hidden states
and the vocab-parallel LM head, one token chunk of logits at a time. Checked against float64 autograd of the whole
logits (values, the hidden states' and the LM head's gradients) at TP1, TP2 and TP4 with a vocabulary that leaves
padding rows, many chunks and a temperature; through the model against the unfused path at TP2 with sequence
parallelism and with tied embeddings; its memory against the unfused path's; and the key's reach and refusal."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.models.config import ModelConfig
from shardrl.models.fast_paths import FastPaths
from shardrl.models.hf_bridge import load_hf_weights
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.models.transformer import Transformer
from shardrl.parallel.fused_logprobs import fused_vocab_parallel_logprobs
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.vocab import padded_vocab_size, vocab_parallel_logprobs
from test_sync import _peak_bytes as peak_bytes

T, H, VOCAB, TEMPERATURE = 37, 16, 203, 0.7


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, H, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, VOCAB, (T,), generator=g)
    upstream = torch.randn(2, T, generator=g, dtype=torch.float64)  # d loss / d (log-prob, entropy)
    return hidden, weight, targets, upstream


def _reference():
    hidden, weight, targets, upstream = _inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_p = (h @ w.T / TEMPERATURE).log_softmax(-1)
    log_prob = log_p.gather(-1, targets[:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    (upstream[0] * log_prob + upstream[1] * entropy).sum().backward()
    return log_prob.detach(), entropy.detach(), h.grad, w.grad


def _fused_at(tp: int) -> dict:
    """This TP rank's results (its hidden-state gradient is its block's part; the sum over ranks is the whole)."""
    layout = Layout.create(LayoutSpec(world_size=tp, tp=tp)) if tp > 1 else Layout.single()
    hidden, weight, targets, upstream = _inputs()
    rows = padded_vocab_size(VOCAB, tp) // tp
    block = F.pad(weight, (0, 0, 0, rows * tp - VOCAB)).chunk(tp)[layout.tp_rank].float().requires_grad_()
    h = hidden.float().requires_grad_()
    log_prob, entropy = fused_vocab_parallel_logprobs(h, block, targets, layout.tp_group, VOCAB, TEMPERATURE,
                                                      chunk_elements=300)  # a few tokens per chunk
    (upstream[0].float() * log_prob + upstream[1].float() * entropy).sum().backward()
    return dict(log_prob=log_prob.detach(), entropy=entropy.detach(), grad_hidden=h.grad, grad_block=block.grad,
                rank=layout.tp_rank, rows=rows)


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_values_and_both_gradients_match_float64_autograd(tp):
    log_prob, entropy, grad_h, grad_w = _reference()
    results = run_distributed(tp, _fused_at, tp) if tp > 1 else [_fused_at(1)]
    tolerance = dict(rtol=2e-5, atol=2e-5)
    for r in results:
        torch.testing.assert_close(r["log_prob"], log_prob.float(), **tolerance)
        torch.testing.assert_close(r["entropy"], entropy.float(), **tolerance)
        lo = r["rank"] * r["rows"]
        expected = F.pad(grad_w, (0, 0, 0, r["rows"] * tp - VOCAB))[lo:lo + r["rows"]]  # padding rows get 0
        torch.testing.assert_close(r["grad_block"], expected.float(), **tolerance)
    torch.testing.assert_close(sum(r["grad_hidden"] for r in results), grad_h.float(), **tolerance)


def test_an_unused_entropy_costs_no_gradient_and_a_padding_only_rank_holds_none():
    hidden, weight, targets, _ = _inputs()
    h = hidden.float().requires_grad_()
    log_prob, _ = fused_vocab_parallel_logprobs(h, weight.float(), targets, None, VOCAB)
    log_prob.sum().backward()
    reference = hidden.clone().requires_grad_()
    (reference @ weight.T).log_softmax(-1).gather(-1, targets[:, None]).sum().backward()
    torch.testing.assert_close(h.grad, reference.grad.float(), rtol=2e-5, atol=2e-5)


def _model_logprobs(ckpt: str, fused: bool, sizes: dict) -> dict:
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    layout = Layout.create(LayoutSpec(world_size=world, **sizes)) if world > 1 else Layout.single()
    model = Transformer(ModelConfig.from_pretrained(ckpt), layout, sequence_parallel=layout.tp_size > 1,
                        fast=FastPaths(fused_logprobs=fused))
    load_hf_weights([model], ckpt)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (23,), generator=g)
    cu_seqlens = torch.tensor([0, 9, 23], dtype=torch.int32)
    positions = torch.cat([torch.arange(9), torch.arange(14)])
    hidden = model(ids, positions, cu_seqlens)
    log_prob, entropy = model.compute_logprobs(hidden, torch.roll(ids, -1), temperature=0.8)
    (log_prob.sum() + 0.3 * entropy.sum()).backward()
    return dict(log_prob=log_prob.detach(), entropy=entropy.detach(),
                grads={name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})


@pytest.mark.parametrize("family, sizes", [("qwen2", dict(tp=2)), ("llama", {})], ids=["tp2_sp", "tied"])
def test_through_the_model_it_gives_the_unfused_log_probs_and_gradients(tmp_path, family, sizes):
    overrides = dict(tie_word_embeddings=True) if family == "llama" else {}
    ckpt = str(make_tiny_checkpoint(family, tmp_path / family, **overrides))
    world = max(sizes.get("tp", 1), 1)
    run = (lambda fused: run_distributed(world, _model_logprobs, ckpt, fused, sizes)) if world > 1 else (
        lambda fused: [_model_logprobs(ckpt, fused, sizes)])
    for plain, fused in zip(run(False), run(True)):
        torch.testing.assert_close(fused["log_prob"], plain["log_prob"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused["entropy"], plain["entropy"], rtol=1e-5, atol=1e-5)
        assert sorted(fused["grads"]) == sorted(plain["grads"])
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(fused["grads"][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def _logprob_peak(fused: bool) -> int:
    """Peak bytes allocated by log-probs + backward over 4,096 tokens and a 32k vocabulary (hidden 64)."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(4096, 64, generator=g).requires_grad_()
    weight = (torch.randn(32_000, 64, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, 32_000, (4096,), generator=g)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if fused:
            log_prob, entropy = fused_vocab_parallel_logprobs(hidden, weight, targets, None, 32_000,
                                                              chunk_elements=2**22)
        else:
            log_prob, entropy = vocab_parallel_logprobs(hidden @ weight.T, targets, None, 32_000)
        (log_prob.sum() + entropy.sum()).backward()
    return peak_bytes(prof)


def test_it_never_holds_the_whole_logits():
    """The unfused pass holds the [4096, 32000] fp32 logits (524 MB) and their gradient; the fused one a chunk."""
    logits_bytes = 4096 * 32_000 * 4
    plain, fused = _logprob_peak(False), _logprob_peak(True)
    assert plain > logits_bytes and fused < logits_bytes / 4, (plain, fused)


def test_the_key_reaches_actor_and_reference_and_is_refused_with_bitwise_mode():
    plan = plan_job(compose("ppo_trainer", ["actor_rollout_ref.model.use_fused_kernels=true",
                                            "actor_rollout_ref.actor.use_kl_loss=true"]))
    assert plan.actor.model.engine.fast.fused_logprobs and plan.ref.model.engine.fast.fused_logprobs
    assert not plan_job(compose("ppo_trainer", [])).actor.model.engine.fast.fused_logprobs
    with pytest.raises(ConfigError) as err:
        plan_job(compose("ppo_trainer", ["actor_rollout_ref.model.use_fused_kernels=true", "trainer.device=cuda",
                                         "actor_rollout_ref.rollout.bitwise_logprobs=true"]))
    assert err.value.key in ("actor_rollout_ref.model.use_fused_kernels", "trainer.device")


@pytest.mark.slow
def test_a_default_job_with_the_key_trains_as_without_it(tmp_path):
    """Two steps of the default job (actor and reference passes fused): the first step's update matches the unfused
    run's (same samples: generation does not read the key)."""
    from test_default_job import run_job

    steps = ["trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
             "actor_rollout_ref.actor.use_kl_loss=true"]
    plain = run_job(tmp_path / "plain", *steps)
    fused = run_job(tmp_path / "fused", *steps, "actor_rollout_ref.model.use_fused_kernels=true")
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        assert fused[0][key] == pytest.approx(plain[0][key], rel=1e-4, abs=1e-6), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_in_bf16_it_matches_the_unfused_path():
    """The CUDA path (the Triton vocab kernels per chunk) on a 151,936-token vocabulary in bf16: the unfused path's
    values and gradients on the same inputs; at 8,192 tokens the logits (2.5 GB) dominate the unfused pass's memory,
    and the fused one's peak is under half of it."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(8192, 896, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(151_936, 896, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    targets = torch.randint(0, 151_936, (8192,), device="cuda", generator=g)
    out = {}
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if fused:
            log_prob, entropy = fused_vocab_parallel_logprobs(h, w, targets, None, 151_936, 0.9)
        else:
            log_prob, entropy = vocab_parallel_logprobs(F.linear(h, w) / 0.9, targets, None, 151_936)
        (log_prob.sum() + 0.5 * entropy.sum()).backward()
        torch.cuda.synchronize()
        out[fused] = (log_prob, entropy, h.grad, w.grad, torch.cuda.max_memory_allocated() - base)
    for plain, fused in zip(out[False][:2], out[True][:2]):
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-3)
    for plain, fused in zip(out[False][2:4], out[True][2:4]):
        torch.testing.assert_close(fused.float(), plain.float(), rtol=2e-2, atol=2e-3)
    assert out[True][4] < out[False][4] / 2, (out[True][4], out[False][4])
