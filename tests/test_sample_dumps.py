"""verl's `trainer.rollout_data_dir`, `trainer.validation_data_dir` and `trainer.val_only` on the default job: the
files, their rows and fields against the run's own metrics, and a validation-only run that trains nothing."""

import json
import math

import pytest

from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from test_default_job import run_job

FIELDS = {"input", "output", "gts", "score", "step"}


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_hold_verls_fields_and_the_reward_extras_and_files_appear_whole(tmp_path):
    """One hand-made scored batch: decoded prompt and response (padding and special tokens left out), ground truth,
    summed score, step, each reward extra kept as a column; the file is written under a temporary name."""
    import numpy as np
    import torch

    from shardrl.data.batch import Batch
    from shardrl.trainer.batch_ops import sample_records, write_records

    class Digits:
        def batch_decode(self, rows, skip_special_tokens):
            assert skip_special_tokens
            return [" ".join(map(str, r)) for r in rows]

    attention = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    batch = Batch({"prompts": torch.tensor([[0, 5, 6], [7, 8, 9]]), "responses": torch.tensor([[1, 0], [2, 3]]),
                   "attention_mask": attention,
                   "token_level_scores": torch.tensor([[0.0, 0.0], [0.25, 0.5]])},
                  {"reward_model": [{"ground_truth": "56"}, {"ground_truth": "7"}],
                   "reward_extra/acc": np.array([1.0, np.float64(0.0)], dtype=object)})
    records = sample_records(batch, Digits(), step=4)
    assert records == [{"input": "5 6", "output": "1", "gts": "56", "score": 0.0, "step": 4, "acc": 1.0},
                       {"input": "7 8 9", "output": "2 3", "gts": "7", "score": 0.75, "step": 4, "acc": 0.0}]
    path = write_records(str(tmp_path / "dumps"), 4, records)
    assert path.name == "4.jsonl" and _rows(path) == records and not list(path.parent.glob(".*"))


@pytest.mark.slow
def test_each_step_and_validation_dumps_its_samples(tmp_path):
    rollouts, validations = tmp_path / "rollouts", tmp_path / "validations"
    metrics = run_job(tmp_path / "run", "trainer.total_training_steps=2", "trainer.test_freq=1",
                      f"trainer.rollout_data_dir={rollouts}", f"trainer.validation_data_dir={validations}")
    assert sorted(p.name for p in rollouts.iterdir()) == ["1.jsonl", "2.jsonl"]
    assert sorted(p.name for p in validations.iterdir()) == ["0.jsonl", "1.jsonl", "2.jsonl"]
    config = compose("ppo_trainer", [])
    samples = config.data.train_batch_size * config.actor_rollout_ref.rollout.n
    by_step = {r["step"]: r for r in metrics}
    for step in (1, 2):
        rows = _rows(rollouts / f"{step}.jsonl")
        assert len(rows) == samples and all(FIELDS <= set(r) and r["step"] == step for r in rows)
        assert all(isinstance(r["output"], str) and r["gts"] is not None for r in rows)
        mean = sum(r["score"] for r in rows) / len(rows)
        assert mean == pytest.approx(by_step[step]["critic/score/mean"], abs=1e-6)  # the scores trained on
    for step in (0, 1, 2):
        rows = _rows(validations / f"{step}.jsonl")
        assert rows and all(r["step"] == step for r in rows)
        mean = sum(r["score"] for r in rows) / len(rows)
        validated = next(r for r in metrics if r["step"] == step and "val-core/reward/mean" in r)
        assert mean == pytest.approx(validated["val-core/reward/mean"], abs=1e-6)
    assert not list(rollouts.glob(".*.tmp")) and not list(validations.glob(".*.tmp"))


def test_val_only_needs_the_validation_before_training():
    assert compose("ppo_trainer", ["trainer.val_only=true"]).trainer.val_only
    with pytest.raises(ConfigError) as err:
        compose("ppo_trainer", ["trainer.val_only=true", "trainer.val_before_train=false"])
    assert err.value.key == "trainer.val_only"


@pytest.mark.slow
def test_val_only_validates_then_stops(tmp_path):
    metrics = run_job(tmp_path, "trainer.val_only=true")
    assert [r["step"] for r in metrics] == [0] and math.isfinite(metrics[0]["val-core/reward/mean"])
    assert not (tmp_path / "hf_export").exists() and not list(tmp_path.glob("global_step_*"))
