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


def test_val_only_validates_then_stops(tmp_path):
    metrics = run_job(tmp_path, "trainer.val_only=true")
    assert [r["step"] for r in metrics] == [0] and math.isfinite(metrics[0]["val-core/reward/mean"])
    assert not (tmp_path / "hf_export").exists() and not list(tmp_path.glob("global_step_*"))
    with pytest.raises(ConfigError) as err:
        compose("ppo_trainer", ["trainer.val_only=true", "trainer.val_before_train=false"])
    assert err.value.key == "trainer.val_only"
