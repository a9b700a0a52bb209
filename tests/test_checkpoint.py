"""Distributed checkpoints in one process: the box arithmetic against hand-written boxes, crash safety (an exception
and a SIGKILL in the middle of a save), the `latest` pointer and pruning, and the one-line errors for bad inputs."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from shardrl.models.checkpoint import (
    checkpoint_dir,
    find_latest,
    load_checkpoint,
    load_model_from_dist,
    mark_latest,
    save_checkpoint,
)
from shardrl.models.checkpoint_shards import flat_boxes, spec_pieces
from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import CheckpointError, load_hf_weights
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.models.transformer import Transformer
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.optimizer import AdamW
from shardrl.parallel.spec import ShardSpec

SINGLE = Layout.single()


# ---------------------------------------------------------------------------------------------- box arithmetic
def test_flat_ranges_as_boxes_hand_written():
    assert flat_boxes(2, 11, (3, 4)) == [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    assert flat_boxes(4, 12, (3, 4)) == [((1, 0), (2, 4))]
    assert flat_boxes(5, 6, (2, 3, 4)) == [((0, 1, 1), (1, 1, 1))]
    assert flat_boxes(3, 3, (3, 4)) == []


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (4, 1, 3)])
def test_flat_boxes_cover_exactly_the_range_in_order(shape):
    numbers = torch.arange(math.prod(shape)).view(shape)
    for lo in range(numbers.numel() + 1):
        for hi in range(lo, numbers.numel() + 1):
            covered = [numbers[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                       for offsets, sizes in flat_boxes(lo, hi, shape)]
            assert torch.cat([torch.arange(0), *covered]).tolist() == list(range(lo, hi)), (shape, lo, hi)


def test_pieces_shift_to_the_shard_and_drop_vocab_padding():
    # Full [5, 2] split in 2 over padded 6 rows: shard 1 holds global rows 3, 4 and a padding row.
    spec = ShardSpec("w", (5, 2), dim=0, num_shards=2, index=1, padded_dim_size=6, group="tp")
    flat = torch.arange(10.0, 15.0)  # elements [1, 6) of the flattened [3, 2] shard
    pieces = [(name, p.offsets, p.tensor.tolist()) for name, p in spec_pieces(spec, flat, 1, 6)]
    assert pieces == [("w", (3, 1), [[10.0]]), ("w", (4, 0), [[11.0, 12.0]])]  # 13, 14 are padding


def test_pieces_split_experts_by_global_id():
    spec = ShardSpec("e.{expert}.w", (2, 3), expert_ids=(2, 3))
    flat = torch.arange(5.0)  # elements [4, 9) of the [2 experts, 2, 3] local tensor
    pieces = [(name, p.offsets, p.tensor.tolist()) for name, p in spec_pieces(spec, flat, 4, 9)]
    assert pieces == [("e.2.w", (1, 1), [[0.0, 1.0]]), ("e.3.w", (0, 0), [[2.0, 3.0, 4.0]])]


# ---------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("qwen3", Path(tmp_path_factory.mktemp("hf")) / "qwen3")


def build(hf: Path, **config_changes) -> Transformer:
    """A 1-process qwen3 from `hf` (weights loaded when the config is unchanged)."""
    raw = json.loads((hf / "config.json").read_text())
    model = Transformer(ModelConfig.from_dict({**raw, **config_changes}), SINGLE)
    if not config_changes:
        load_hf_weights(model, hf)
    return model


def weights(model: Transformer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_loads(path: Path, hf: Path, expected: dict[str, torch.Tensor]) -> None:
    fresh = build(hf)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_model_from_dist([fresh], SINGLE, path)
    for name, value in weights(fresh).items():
        assert torch.equal(value, expected[name]), name


def _crash(*args, **kwargs):
    raise RuntimeError("disk full (injected)")


# ---------------------------------------------------------------------------------------------- crash safety
def test_exception_mid_save_keeps_the_previous_checkpoint(hf, tmp_path, monkeypatch):
    model = build(hf)
    first = weights(model)
    save_checkpoint(checkpoint_dir(tmp_path, 1), [model], SINGLE)
    mark_latest(tmp_path, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with monkeypatch.context() as patch:  # data files written, then the metadata write fails
        patch.setattr(FileSystemWriter, "finish", _crash)
        with pytest.raises(CheckpointException, match="injected"):
            save_checkpoint(checkpoint_dir(tmp_path, 2), [model], SINGLE)
        with pytest.raises(CheckpointException, match="injected"):  # re-saving over an existing checkpoint
            save_checkpoint(checkpoint_dir(tmp_path, 1), [model], SINGLE)
    assert list((tmp_path / ".global_step_2.tmp").glob("*.distcp")), "the crash should come after data was written"
    assert not checkpoint_dir(tmp_path, 2).exists()
    assert find_latest(tmp_path) == checkpoint_dir(tmp_path, 1)
    assert_loads(checkpoint_dir(tmp_path, 1), hf, first)
    save_checkpoint(checkpoint_dir(tmp_path, 2), [model], SINGLE)  # the next save clears the leftover
    assert not (tmp_path / ".global_step_2.tmp").exists()
    assert_loads(checkpoint_dir(tmp_path, 2), hf, weights(model))


def save_then_get_killed(hf: Path, root: Path) -> None:
    """Save step 1, mark it latest, then die by SIGKILL in the middle of saving step 2."""
    model = build(hf)
    save_checkpoint(checkpoint_dir(root, 1), [model], SINGLE)
    mark_latest(root, 1)
    FileSystemWriter.finish = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    save_checkpoint(checkpoint_dir(root, 2), [model], SINGLE)


def test_sigkill_mid_save_keeps_the_previous_checkpoint(hf, tmp_path):
    process = multiprocessing.get_context("forkserver").Process(target=save_then_get_killed, args=(hf, tmp_path))
    process.start()
    process.join(120)
    assert process.exitcode == -signal.SIGKILL
    assert list((tmp_path / ".global_step_2.tmp").glob("*.distcp")), "the kill should come after data was written"
    assert find_latest(tmp_path) == checkpoint_dir(tmp_path, 1)
    assert not checkpoint_dir(tmp_path, 2).exists()
    assert_loads(checkpoint_dir(tmp_path, 1), hf, weights(build(hf)))


# ---------------------------------------------------------------------------------------------- latest pointer
def test_latest_pointer_and_keeping_the_most_recent(hf, tmp_path):
    model = build(hf)
    assert find_latest(tmp_path) is None
    save_checkpoint(checkpoint_dir(tmp_path, 9), [model], SINGLE)  # left by a run this one diverged from
    for step in (1, 2, 3, 4):
        save_checkpoint(checkpoint_dir(tmp_path, step), [model], SINGLE, trainer_state={"step": step})
        mark_latest(tmp_path, step, max_to_keep=2)
        assert find_latest(tmp_path) == checkpoint_dir(tmp_path, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3", "global_step_4", "latest"]
    assert load_checkpoint(find_latest(tmp_path), [model], SINGLE) == {"step": 4}


# ---------------------------------------------------------------------------------------------- one-line errors
def test_errors_name_the_path_and_key(hf, tmp_path):
    model = build(hf)
    saved = save_checkpoint(tmp_path / "model_only", [model], SINGLE, rng=False)
    llama = make_tiny_checkpoint("llama", tmp_path / "llama_hf")
    cases = [
        (lambda: load_model_from_dist([model], SINGLE, tmp_path / "missing"),
         f"{tmp_path}/missing: no shardrl checkpoint here (missing .metadata or shardrl_checkpoint.json)"),
        (lambda: load_model_from_dist([build(hf, tie_word_embeddings=False)], SINGLE, saved),
         f"{saved}: 'model/lm_head.weight' is missing from the checkpoint"),
        (lambda: load_model_from_dist([build(hf, intermediate_size=48)], SINGLE, saved),
         f"{saved}: tensor 'model/model.layers.0.mlp.gate_proj.weight' has shape (64, 32) in the checkpoint but "
         f"the model expects (48, 32)"),
        (lambda: load_model_from_dist([build(llama)], SINGLE, saved),
         f"{saved}: checkpoint of a Qwen3ForCausalLM model; this model is a LlamaForCausalLM"),
        (lambda: load_checkpoint(saved, [model], SINGLE, optimizer=AdamW(model.parameters(), SINGLE, lr=1e-3)),
         f"{saved}: holds no optimizer state (contents: model); load it without an optimizer, or with "
         f"load_model_from_dist"),
        (lambda: load_checkpoint(saved, [model], SINGLE), f"{saved}: 'rng/0' is missing from the checkpoint"),
        (lambda: mark_latest(tmp_path, 7),
         f"{tmp_path}/global_step_7: no such checkpoint directory; save it before marking it latest"),
    ]
    for call, message in cases:
        with pytest.raises(CheckpointError) as error:
            call()
        assert str(error.value) == message


def load_untied_at_pp2(hf: Path, saved: Path) -> str:
    """Only the last stage holds `lm_head.weight`, which the (tied) checkpoint lacks: both ranks must raise."""
    layout = Layout.create(LayoutSpec(world_size=2, pp=2))
    raw = json.loads((hf / "config.json").read_text())
    config = ModelConfig.from_dict({**raw, "tie_word_embeddings": False})
    stage = Transformer(config, layout, range(layout.pp_rank, layout.pp_rank + 1), layout.is_first_stage,
                        layout.is_last_stage)
    with pytest.raises(CheckpointError) as error:
        load_model_from_dist([stage], layout, saved)
    return str(error.value)


def test_an_error_found_on_one_rank_is_raised_on_all(hf, tmp_path):
    saved = save_checkpoint(tmp_path / "tied", [build(hf)], SINGLE)
    assert run_distributed(2, load_untied_at_pp2, hf, saved) == [
        f"{saved}: 'model/lm_head.weight' is missing from the checkpoint"] * 2
