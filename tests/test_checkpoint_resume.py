"""Distributed checkpoints are layout-invariant: training saved at one layout and resumed at another (model,
AdamW master weights and moments, LR schedule, trainer state, RNG) takes the same next step as a single-process run
that never stopped. The steps go through the real actor path (`update_policy`: packing, pipeline schedule,
vocab-parallel logprobs, PPO loss, gradient finalisation, AdamW)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardrl.job.options import EngineOptions, OptimOptions, UpdateOptions
from shardrl.models.checkpoint import load_checkpoint, save_checkpoint
from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import export_hf_weights
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.workers.actor import update_policy
from shardrl.workers.engine import ModelEngine
from test_parity_matrix import BATCH, LOSS, make_batch

SAVED_AT = 1  # steps trained before the checkpoint; the step after it is compared
# Cosine decay, so the step after a resume uses the wrong lr unless the schedule position is restored (and the wrong
# update unless Adam's moments and step count are); eps=1e-3 for the reason given in test_parity_matrix.
OPTIM = dict(lr=1e-2, eps=1e-3, weight_decay=0.1, clip_grad=0.5, total_steps=4, warmup_steps=0,
             decay_style="cosine", min_lr_ratio=0.1)


def ppo_step(engine: ModelEngine, step: int) -> float:
    """One PPO optimizer step on batch `step` (this rank's data-parallel share); the mini-batch loss."""
    layout = engine.layout
    dp, rank = layout.dp_size, layout.dp_rank
    share = make_batch(seed=step).take(list(range(rank * BATCH // dp, (rank + 1) * BATCH // dp)))
    metrics = update_policy(engine, share, LOSS, UpdateOptions(mini_batch_size=len(share), micro_batch_size=2))
    return metrics["pg_loss"][0]


def session(hf: str, sizes: dict, distributed_optimizer: bool, load: str | None, first_steps: int,
            save: str | None, more_steps: int, registry: GroupRegistry | None = None) -> dict | None:
    """Build an engine at `sizes` (from `hf`, or uninitialised and then filled from checkpoint `load`), train
    `first_steps`, save to `save`, train `more_steps`. Returns losses, the final HF weights, the trainer state read
    and the first random numbers drawn after the load or save, from the first rank. A process running several
    sessions passes them one `registry`."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    layout = Layout.create(LayoutSpec(world_size=world, **sizes), registry=registry)
    options = EngineOptions(optim=OptimOptions(**OPTIM, distributed=distributed_optimizer))
    engine = ModelEngine(ModelConfig.from_pretrained(hf), layout, options, hf_path=None if load else hf)
    result: dict = {"losses": [], "trainer": None, "draw": None}
    torch.manual_seed((2000 if load else 1000) + layout.local_rank)  # the draws match only if RNG is restored
    step = 0  # the next step to train
    if load:
        result["trainer"] = load_checkpoint(load, engine.chunks, layout, optimizer=engine.optimizer,
                                            scheduler=engine.scheduler)
        step = result["trainer"]["step"]
        result["draw"] = torch.rand(4)
    for _ in range(first_steps):
        result["losses"].append(ppo_step(engine, step))
        step += 1
    if save:
        save_checkpoint(save, engine.chunks, layout, optimizer=engine.optimizer, scheduler=engine.scheduler,
                        trainer_state={"step": step, "data_position": 3 * step}, hf_dir=hf)
        result["draw"] = torch.rand(4)
    for _ in range(more_steps):
        result["losses"].append(ppo_step(engine, step))
        step += 1
    result["params"] = {name: t.cpu().clone() for name, t in export_hf_weights(engine.chunks, layout)}
    return result if layout.local_rank == 0 else None


def assert_same_step(resumed: dict, reference: dict, what: str) -> None:
    loss, expected = resumed["losses"][0], reference["losses"][SAVED_AT]
    assert abs(loss - expected) <= 1e-5 * abs(expected), f"{what}: next-step loss {loss} vs {expected}"
    assert resumed["params"].keys() == reference["params"].keys()
    for name, p in reference["params"].items():
        err = (resumed["params"][name] - p).abs().max() / p.abs().max().clamp_min(1e-6)
        assert err <= 1e-5, f"{what}: {name} after the resumed step: max error {err:.2e} relative to max |ref|"
    assert resumed["trainer"] == {"step": SAVED_AT, "data_position": 3 * SAVED_AT}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint("qwen3_moe", Path(tmp_path_factory.mktemp("hf")) / "qwen3_moe",
                                    num_hidden_layers=4))  # 4 layers for PP2 x VPP2


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict:
    """The run that never stops: all steps in one process. It saves a checkpoint on the way (`saved`), which must not
    change its course."""
    saved = str(tmp_path_factory.mktemp("single") / "ckpt")
    return session(model, {}, False, None, SAVED_AT, saved, 1) | {"saved": saved}


def resume_at_pp2_vpp2(hf: str, saved: str) -> dict | None:
    return session(hf, dict(pp=2, vpp=2), False, saved, 0, None, 1)


def test_tp2_ep2_checkpoint_resumes_at_pp2_vpp2(model, reference, tmp_path):
    saved = run_distributed(4, session, model, dict(tp=2, ep=2), False, None, SAVED_AT, str(tmp_path / "ckpt"), 0)[0]
    for a, b in zip(saved["losses"], reference["losses"][:SAVED_AT], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), f"TP2xEP2 before the save: {a} vs {b}"
    resumed = run_distributed(2, resume_at_pp2_vpp2, model, str(tmp_path / "ckpt"))[0]
    assert_same_step(resumed, reference, "TP2xEP2 -> PP2xVPP2")
    assert torch.equal(resumed["draw"], saved["draw"]), "rank 0's RNG state was not restored"


def test_cp2_ep2_distributed_optimizer_checkpoint_resumes_in_one_process(model, reference, tmp_path):
    """Context parallelism shards nothing persistent: a CP2 x EP2 run (distributed optimizer: its AdamW state is
    cut over DP x CP) trains the reference's steps, and its checkpoint resumes in one process to the same step."""
    saved = run_distributed(4, session, model, dict(cp=2, ep=2), True, None, SAVED_AT, str(tmp_path / "ckpt"), 0)[0]
    for a, b in zip(saved["losses"], reference["losses"][:SAVED_AT], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), f"CP2xEP2 before the save: {a} vs {b}"
    assert_same_step(session(model, {}, False, str(tmp_path / "ckpt"), 0, None, 1), reference, "CP2xEP2 -> 1")
