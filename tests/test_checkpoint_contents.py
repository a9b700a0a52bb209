"""verl's `checkpoint.save_contents` / `load_contents` (which parts a checkpoint holds, which a resume restores) and
per-role retention (`max_actor_ckpt_to_keep` beside `max_critic_ckpt_to_keep`), in one process."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from shardrl.models.checkpoint import (
    META_FILE,
    checkpoint_dir,
    find_latest,
    load_checkpoint,
    mark_latest,
    save_checkpoint,
    saved_model_tensors,
)
from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import CheckpointError, load_hf_weights
from shardrl.models.tiny import make_tiny_checkpoint, packed_batch
from shardrl.models.transformer import Transformer
from shardrl.parallel.layout import Layout
from shardrl.parallel.optimizer import AdamW, LRScheduler

SINGLE = Layout.single()


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("qwen3", Path(tmp_path_factory.mktemp("hf")) / "qwen3")


class Run:
    """A qwen3 with its optimizer and cosine schedule, built on the HF weights, on `weights`, or (`fresh`) on the
    zeros a resume fills."""

    def __init__(self, hf: Path, fresh: bool = False, weights: dict[str, torch.Tensor] | None = None) -> None:
        self.model = Transformer(ModelConfig.from_pretrained(hf), SINGLE)
        if weights is not None:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(weights[name])
        elif not fresh:
            load_hf_weights(self.model, hf)
        self.optimizer = AdamW(self.model.parameters(), SINGLE, lr=1e-2, weight_decay=0.1)
        self.scheduler = LRScheduler(self.optimizer, total_steps=10, warmup_steps=0, style="cosine")

    def step(self) -> None:
        input_ids, position_ids, cu_seqlens = packed_batch([5, 7], vocab_size=128)
        self.model(input_ids, position_ids, cu_seqlens).float().pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def save(self, path: Path, **kwargs) -> Path:
        return save_checkpoint(path, [self.model], SINGLE, optimizer=self.optimizer, scheduler=self.scheduler,
                               trainer_state={"step": self.scheduler.num_steps}, **kwargs)

    def load(self, path: Path, **kwargs) -> dict | None:
        return load_checkpoint(path, [self.model], SINGLE, optimizer=self.optimizer, scheduler=self.scheduler,
                               **kwargs)


def _keys(path: Path) -> set[str]:
    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def _contents(path: Path) -> list[str]:
    return json.loads((path / META_FILE).read_text())["contents"]


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


# ---------------------------------------------------------------------------------------------- save_contents
def test_default_contents_are_everything(hf, tmp_path):
    run = Run(hf)
    run.step()
    default, explicit = run.save(tmp_path / "default"), run.save(tmp_path / "explicit",
                                                                 contents=["model", "optimizer", "extra", "hf_model"])
    assert _contents(default) == _contents(explicit) == ["model", "rng", "optimizer", "scheduler", "trainer"]
    assert _keys(default) == _keys(explicit)
    assert json.loads((default / META_FILE).read_text()) == json.loads((explicit / META_FILE).read_text())


def test_saving_without_optimizer_writes_no_optimizer_state(hf, tmp_path):
    run = Run(hf)
    run.step()
    saved = run.save(tmp_path / "ckpt", contents=["model", "extra"])
    assert _contents(saved) == ["model", "rng", "scheduler", "trainer"]
    assert not [k for k in _keys(saved) if k.startswith("optim") or k == "optimizer"]
    assert json.loads((saved / META_FILE).read_text())["distributed_optimizer"] is None
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        Run(hf, fresh=True).load(saved)
    resumed = Run(hf, fresh=True)
    assert resumed.load(saved, contents=["model", "extra"]) == {"step": 1}
    _assert_equal(resumed.weights(), run.weights())
    assert resumed.scheduler.num_steps == 1 and resumed.optimizer.lr == run.optimizer.lr


def test_saving_without_extra_writes_no_scheduler_or_rng(hf, tmp_path):
    run = Run(hf)
    run.step()
    saved = run.save(tmp_path / "ckpt", contents=["model", "optimizer"])
    assert _contents(saved) == ["model", "optimizer", "trainer"]
    assert not [k for k in _keys(saved) if k.startswith("rng/") or k == "scheduler"]
    with pytest.raises(CheckpointError, match=f"^{saved}: holds no LR scheduler state, part 'extra' "
                                              r"\(contents: model, optimizer, trainer\); load it without 'extra'"):
        Run(hf, fresh=True).load(saved)
    resumed = Run(hf, fresh=True)
    resumed.load(saved, contents=["model", "optimizer"])
    assert resumed.scheduler.num_steps == 0 and resumed.optimizer.num_steps == 1


def test_a_checkpoint_without_weights_cannot_be_resumed(hf, tmp_path):
    run = Run(hf)
    saved = run.save(tmp_path / "ckpt", contents=["optimizer", "extra"])
    assert saved_model_tensors(saved) == {}
    with pytest.raises(CheckpointError, match=f"^{saved}: holds no model weights"):
        Run(hf, fresh=True).load(saved)


# ---------------------------------------------------------------------------------------------- load_contents
def test_loading_only_the_model_leaves_optimizer_schedule_and_rng_alone(hf, tmp_path):
    run = Run(hf)
    for _ in range(2):
        run.step()
    saved = run.save(tmp_path / "ckpt")
    trained = run.weights()

    resumed = Run(hf, fresh=True)
    random.seed(7)
    torch.manual_seed(7)
    draws = random.random(), torch.rand(3)
    random.seed(7)
    torch.manual_seed(7)
    assert resumed.load(saved, contents=["model"]) == {"step": 2}
    _assert_equal(resumed.weights(), trained)
    assert (random.random(), torch.rand(3).tolist()) == (draws[0], draws[1].tolist())  # RNG not restored
    assert resumed.optimizer.num_steps == 0 and resumed.scheduler.num_steps == 0
    assert all(not s.exp_avg.any() and not s.exp_avg_sq.any() for s in resumed.optimizer.states)

    # The optimizer continues from the loaded weights (not from the zeros it was built on), exactly as a new
    # optimizer over the trained weights does.
    reference = Run(hf, weights=trained)
    resumed.step()
    reference.step()
    _assert_equal(resumed.weights(), reference.weights())


def test_full_load_restores_the_optimizer(hf, tmp_path):
    run = Run(hf)
    run.step()
    saved = run.save(tmp_path / "ckpt")
    resumed = Run(hf, fresh=True)
    resumed.load(saved, contents=["model", "optimizer", "extra", "hf_model"])
    run.step()
    resumed.step()
    _assert_equal(resumed.weights(), run.weights())


def test_load_contents_must_name_the_model_and_known_parts(hf, tmp_path):
    saved = Run(hf).save(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"load_contents=\['extra', 'optimizer'\]: must include 'model'"):
        Run(hf, fresh=True).load(saved, contents=["optimizer", "extra"])
    with pytest.raises(ValueError, match="load_contents: unknown part 'weights'"):
        Run(hf, fresh=True).load(saved, contents=["model", "weights"])
    with pytest.raises(ValueError, match="save_contents: unknown part 'rng'"):
        Run(hf).save(tmp_path / "other", contents=["model", "rng"])


# ---------------------------------------------------------------------------------------------- retention
def _fake_steps(root: Path, steps: list[int], roles: tuple[str, ...] = ("actor", "critic", "actor_hf")) -> None:
    for step in steps:
        for role in roles:
            (checkpoint_dir(root, step) / role).mkdir(parents=True)
            (checkpoint_dir(root, step) / role / "data").write_text(str(step))


def _layout(root: Path) -> dict[str, list[str]]:
    return {d.name: sorted(p.name for p in d.iterdir()) for d in sorted(root.iterdir()) if d.is_dir()}


def test_each_role_keeps_its_own_count(tmp_path):
    _fake_steps(tmp_path, [1, 2, 3, 4])
    mark_latest(tmp_path, 4, {"actor": 3, "critic": 1})
    assert find_latest(tmp_path) == checkpoint_dir(tmp_path, 4)
    assert _layout(tmp_path) == {"global_step_2": ["actor", "actor_hf"], "global_step_3": ["actor", "actor_hf"],
                                 "global_step_4": ["actor", "actor_hf", "critic"]}
    mark_latest(tmp_path, 4, {"actor": 1, "critic": 2})  # fewer actors now: step 2 and 3 lose every role
    assert _layout(tmp_path) == {"global_step_4": ["actor", "actor_hf", "critic"]}


def test_retention_of_roles_keeps_the_newest_step_and_drops_diverged_steps(tmp_path):
    _fake_steps(tmp_path, [1, 2, 3, 9])  # 9: left by a run this one diverged from
    _fake_steps(tmp_path, [5], roles=("actor",))  # a run without a critic
    mark_latest(tmp_path, 5, {"actor": 2, "critic": 2})
    assert _layout(tmp_path) == {"global_step_2": ["critic"], "global_step_3": ["actor", "actor_hf", "critic"],
                                 "global_step_5": ["actor"]}
    mark_latest(tmp_path, 5, {"actor": 1, "critic": None})  # None: every critic checkpoint stays
    assert _layout(tmp_path) == {"global_step_2": ["critic"], "global_step_3": ["critic"],
                                 "global_step_5": ["actor"]}


def test_retention_counts_are_checked(tmp_path):
    _fake_steps(tmp_path, [1])
    with pytest.raises(ValueError, match="max_critic_ckpt_to_keep=0: keep at least 1 checkpoint"):
        mark_latest(tmp_path, 1, {"actor": 1, "critic": 0})
    mark_latest(tmp_path, 1, 1)  # an int still prunes whole step directories
    assert _layout(tmp_path) == {"global_step_1": ["actor", "actor_hf", "critic"]}
