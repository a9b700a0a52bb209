"""A checkpoint saved by training at TP2xPP2 converts with dist-to-hf into the trained weights, which transformers
loads and runs to the same logits as shardrl; it also loads for inference at PP2 (tied LM-head copy on the last
stage, here at PP2xDP2) and in one process (`load_model_from_dist`).

A second step resumed from the checkpoint at TP2xDP2 with the distributed optimizer equals the continued run's.
The model covers the awkward cases: a vocabulary of 131 rows (padded to 132 at TP2: only real rows are saved), one
KV head (replicated over TP2: written once), tied embeddings (a copy on the last pipeline stage)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardrl.models.checkpoint import load_checkpoint, load_model_from_dist, save_checkpoint
from shardrl.models.config import ModelConfig
from shardrl.models.convert import dist_to_hf
from shardrl.models.hf_bridge import export_hf_weights
from shardrl.models.tiny import hf_logits, make_tiny_checkpoint, packed_batch
from shardrl.models.transformer import Transformer
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.workers.actor import compute_log_prob
from shardrl.job.options import EngineOptions, ForwardBatching, OptimOptions
from shardrl.workers.engine import ModelEngine
from test_checkpoint_resume import ppo_step
from test_convert import assert_bitwise_equal, hf_tensors
from test_parity_matrix import make_batch

VOCAB = 131


def inference_log_probs(hf: str, ckpt: str, pp: int, registry: GroupRegistry | None = None) -> torch.Tensor:
    """Log-probs of the parity batch from an inference engine at PP `pp` (DP the rest) filled by
    `load_model_from_dist`."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    layout = Layout.create(LayoutSpec(world_size=world, pp=pp), registry=registry)
    engine = ModelEngine(ModelConfig.from_pretrained(hf), layout, EngineOptions(), hf_path=None)
    load_model_from_dist(engine.chunks, layout, ckpt)
    return compute_log_prob(engine, make_batch(), ForwardBatching(micro_batch_size=2, max_token_len=None))[0]


def _engine(hf: str, layout: Layout, distributed_optimizer: bool, load: bool) -> ModelEngine:
    optim = OptimOptions(lr=1e-2, eps=1e-3, total_steps=3, decay_style="linear", distributed=distributed_optimizer)
    return ModelEngine(ModelConfig.from_pretrained(hf), layout, EngineOptions(optim=optim),
                       hf_path=None if load else hf)


def _weights(engine: ModelEngine) -> dict[str, torch.Tensor]:
    return {name: t.cpu().clone() for name, t in export_hf_weights(engine.chunks, engine.layout)}


def train_save_and_reload(hf: str, out: str) -> dict | None:
    """One PPO step at TP2xPP2, a full training checkpoint, then a second step three ways: continuing, resumed at
    TP2xDP2 with the distributed optimizer, and (log-probs only) an inference engine loaded at PP2xDP2."""
    layout = Layout.create(LayoutSpec(world_size=4, tp=2, pp=2))  # its registry serves the two later layouts too
    engine = _engine(hf, layout, distributed_optimizer=False, load=False)
    ppo_step(engine, step=0)
    save_checkpoint(out, engine.chunks, layout, optimizer=engine.optimizer, scheduler=engine.scheduler,
                    trainer_state={"step": 1}, hf_dir=hf)
    result = dict(weights=_weights(engine), pp2_log_probs=inference_log_probs(hf, out, 2, layout.registry))
    result.update(continued_loss=ppo_step(engine, step=1), continued=_weights(engine))
    resumed = _engine(hf, Layout.create(LayoutSpec(world_size=4, tp=2), registry=layout.registry),
                      distributed_optimizer=True, load=True)
    load_checkpoint(out, resumed.chunks, resumed.layout, optimizer=resumed.optimizer, scheduler=resumed.scheduler)
    result.update(resumed_loss=ppo_step(resumed, step=1), resumed=_weights(resumed))
    return result if layout.local_rank == 0 else None


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = Path(tmp_path_factory.mktemp("trained"))
    hf = str(make_tiny_checkpoint("qwen3", root / "hf", vocab_size=VOCAB, num_key_value_heads=1))
    result = run_distributed(4, train_save_and_reload, hf, str(root / "ckpt"))[0]
    return dict(hf=hf, ckpt=str(root / "ckpt"), root=root, **result)


def test_dist_to_hf_gives_the_trained_weights_and_transformers_logits(trained):
    out = trained["root"] / "exported"
    dist_to_hf(trained["ckpt"], out)
    exported = hf_tensors(out)
    assert_bitwise_equal(exported, trained["weights"])
    original = hf_tensors(Path(trained["hf"]))
    assert not torch.equal(exported["model.embed_tokens.weight"], original["model.embed_tokens.weight"])

    config = ModelConfig.from_pretrained(out)
    model = Transformer(config, Layout.single())
    load_model_from_dist([model], Layout.single(), trained["ckpt"])
    input_ids, position_ids, cu_seqlens = packed_batch([5, 9, 3], VOCAB)
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, position_ids, cu_seqlens), input_ids.shape[0])  # [T, V]
    torch.testing.assert_close(logits, hf_logits(out, input_ids, cu_seqlens), rtol=1e-4, atol=1e-4)


def test_pp2_inference_matches_one_process(trained):
    single = inference_log_probs(trained["hf"], trained["ckpt"], pp=1)
    torch.testing.assert_close(trained["pp2_log_probs"], single, rtol=1e-5, atol=1e-5)


def test_resume_at_tp2_with_the_distributed_optimizer_continues_the_run(trained):
    # Padded vocab rows, the replicated KV head and the tied copy all carry optimizer state across the move.
    assert abs(trained["resumed_loss"] - trained["continued_loss"]) <= 1e-5 * abs(trained["continued_loss"])
    for name, expected in trained["continued"].items():
        torch.testing.assert_close(trained["resumed"][name], expected, rtol=1e-5, atol=1e-6, msg=name)
