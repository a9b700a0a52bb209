"""Context parallelism's pieces (the layouts' parity with one process is in tests/test_parity_matrix.py): the
load-balanced chunking against hand-computed shares, the attention mask against the block-causal one, the gather's
two backward rules, a job's refusal of what CP does not cover yet, and activation memory per rank at CP2 against
CP1 for a long sequence (the CPU allocator's bytes, as the profiler tracks them)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from shardrl.models.config import ModelConfig
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.models.transformer import Transformer
from shardrl.parallel.context import context_attention_mask, gather_tokens, shard_micro_batch, shard_positions
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.workers.packing import Packed, whole_micro_batch
from test_sync import _peak_bytes


def test_each_rank_holds_an_early_and_a_late_chunk_of_every_sequence():
    # 8 tokens in 4 chunks of 2; 3 tokens in chunks of 0, 1, 1, 1 (shorter than 2 x CP: rank 0's early chunk is empty)
    assert shard_positions([8, 3], 0, 2) == [0, 1, 6, 7, 10]
    assert shard_positions([8, 3], 1, 2) == [2, 3, 4, 5, 8, 9]
    lengths = [4096, 777, 5, 1]
    shares = [shard_positions(lengths, r, 4) for r in range(4)]
    assert sorted(p for share in shares for p in share) == list(range(sum(lengths)))
    # Causal work of a query = the keys it sees (its position in its sequence + 1): even over ranks.
    start = [0, 4096, 4096 + 777, 4096 + 777 + 5]
    work = [sum(p - max(s for s in start if s <= p) + 1 for p in share) for share in shares]
    assert max(work) / min(work) < 1.01


def test_the_mask_is_the_block_causal_mask_of_the_held_queries():
    cu_seqlens = torch.tensor([0, 8, 11], dtype=torch.int32)
    index = torch.arange(11)
    segment = torch.tensor([0] * 8 + [1] * 3)
    full = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
    local = torch.tensor(shard_positions([8, 3], 1, 2))
    assert torch.equal(context_attention_mask(cu_seqlens, local), full[local])


def _gather_both_ways() -> dict:
    rank = torch.distributed.get_rank()
    layout = Layout.create(LayoutSpec(2, cp=2))
    shard = shard_micro_batch([8, 3], rank, 2, layout.group("cp"), torch.device("cpu"))
    local = (shard.local_index.double() + 100 * rank).requires_grad_(True)
    weights = torch.arange(11, dtype=torch.float64) + 1 + rank  # differs by rank: a rank's own use of the rows
    out = {}
    for replicated in (True, False):
        full = gather_tokens(local, shard, replicated)
        (grad,) = torch.autograd.grad((full * weights).sum(), local)
        out[replicated] = (full.detach(), grad)
    return {"index": shard.local_index, **{str(k): v for k, v in out.items()}}


def test_the_gather_puts_rows_in_packed_order_and_sums_or_keeps_gradients():
    results = run_distributed(2, _gather_both_ways)
    for rank, r in enumerate(results):
        full, kept = r["True"]
        expected = torch.zeros(11, dtype=torch.float64)
        for other, o in enumerate(results):
            expected[o["index"]] = o["index"].double() + 100 * other
        assert torch.equal(full, expected)
        weights = torch.arange(11, dtype=torch.float64) + 1
        assert torch.equal(kept, (weights + rank)[r["index"]])  # replicated use: this rank's own gradient
        assert torch.equal(r["False"][1], (2 * weights + 1)[r["index"]])  # local use: summed over both ranks


SEQUENCE = 2048


def _activation_peak(checkpoint: str) -> int:
    """Peak bytes allocated during forward + backward of one long sequence (log-probs of every token), weights
    already built: this CP rank's activations."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    layout = Layout.create(LayoutSpec(world, cp=world))
    model = Transformer(ModelConfig.from_pretrained(checkpoint), layout)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    ids = torch.randint(0, 128, (SEQUENCE,), generator=torch.Generator().manual_seed(0))
    cu_seqlens = torch.tensor([0, SEQUENCE], dtype=torch.int32)
    packed = Packed(ids, torch.arange(SEQUENCE), cu_seqlens, torch.roll(ids, -1), torch.zeros(1, 1, dtype=torch.long))
    share = packed.context_share(layout)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        hidden = model(share.input_ids, share.position_ids, share.cu_seqlens, context=share.context)
        log_probs, _ = model.compute_logprobs(hidden, share.targets)
        whole_micro_batch(log_probs, share).sum().backward()
    return _peak_bytes(prof)


def test_activation_memory_per_rank_halves_at_cp2(tmp_path):
    checkpoint = str(make_tiny_checkpoint("qwen2", tmp_path / "model", hidden_size=128, intermediate_size=512,
                                          num_hidden_layers=4))
    cp1 = _activation_peak(checkpoint)
    cp2 = run_distributed(2, _activation_peak, checkpoint)
    assert all(0.4 * cp1 < peak < 0.6 * cp1 for peak in cp2), (cp1, cp2)


@pytest.mark.slow  # two 3-step jobs (~40 s); the parity matrix covers the maths in the default suite
def test_a_cp2_job_with_dynamic_batches_and_offload_logs_the_one_rank_jobs_metrics(tmp_path):
    """The default job at CP2 on 2 ranks against the same job on 1 rank, dynamic batch size and param + optimizer
    offload in both: one data-parallel replica either way, so the same mini batches, and (per-sample seeds) the same
    rollouts; every loss and reward metric of each step equal up to float reduction order."""
    import subprocess

    from resume_jobs import command, metrics_by_step

    common = ["actor_rollout_ref.actor.use_dynamic_bsz=true",
              "actor_rollout_ref.actor.megatron.param_offload=true",
              "actor_rollout_ref.actor.megatron.optimizer_offload=true", "trainer.total_training_steps=3",
              "trainer.val_before_train=false", "trainer.test_freq=-1"]
    runs = {}
    for cp in (1, 2):
        run_dir = tmp_path / f"cp{cp}"
        subprocess.run(command(run_dir, *common, f"trainer.n_gpus_per_node={cp}",
                               f"actor_rollout_ref.actor.megatron.context_parallel_size={cp}"),
                       check=True, capture_output=True, timeout=600)
        runs[cp] = metrics_by_step(run_dir)
    assert sorted(runs[2]) == [1, 2, 3]
    for step, expected in runs[1].items():
        for key in ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"):
            assert runs[2][step][key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), (step, key)
