"""One run per run directory: a fresh run moves an earlier run's outputs aside (and says where), a resumed run
continues its own metrics file from the checkpoint's step with one row per step, and the console prints one line per
step when it is not a terminal."""

import json
from pathlib import Path

import pytest

from shardrl.job.errors import ConfigError
from shardrl.models.checkpoint import checkpoint_dir, mark_latest
from shardrl.trainer.plots import Pictures
from shardrl.trainer.run_dir import PREVIOUS_RUNS, start_run, summary
from shardrl.trainer.tracking import Timeline, Tracker


def steps_of(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def fake_run(run_dir: Path, steps: range, saved_at: int | None, resume_step: int | None = None) -> Tracker:
    """A run as the trainer drives the Tracker: validation at its first step, then a row per step (a checkpoint
    of `saved_at`); the run's outputs beside them."""
    tracker = Tracker(["file"], run_dir, "p", "e", {}, resume_step=resume_step)
    tracker.log(steps[0], {"val-core/reward/mean": 0.1})
    for step in steps[1:]:
        tracker.log(step, {"critic/score/mean": step / 10})
        tracker.log_generations(step, [{"input": "1 ->", "output": "2", "score": 1.0}])
        if step == saved_at:
            checkpoint_dir(run_dir, step).mkdir()
            mark_latest(run_dir, step)
    tracker.close()
    Pictures(run_dir, "p/e", Timeline()).write()
    (run_dir / "hf_export").mkdir(exist_ok=True)
    return tracker


def test_fresh_runs_never_mix_and_a_resumed_run_continues_its_own_file(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "builtin_task").mkdir(parents=True)  # an input the runs share: stays
    first = start_run(run_dir, "auto", None)
    assert (first.checkpoint, first.continue_after) == (None, None) and capsys.readouterr().out == ""
    fake_run(run_dir, range(0, 6), saved_at=3)  # logged steps 4 and 5 after its last checkpoint

    resumed = start_run(run_dir, "auto", None)
    assert (resumed.checkpoint, resumed.continue_after) == (checkpoint_dir(run_dir, 3), 3)
    tracker = fake_run(run_dir, range(3, 8), saved_at=None, resume_step=3)
    assert steps_of(run_dir / "metrics.jsonl") == list(range(8))  # 4 and 5 dropped, then continued
    row_3 = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[3])
    assert row_3["critic/score/mean"] == 0.3 and row_3["val-core/reward/mean"] == 0.1  # the validation merged in
    assert steps_of(run_dir / "val_generations.jsonl") == [1, 2, 3, 4, 5, 6, 7]
    assert tracker.latest["critic/score/mean"] == 0.7

    fresh = start_run(run_dir, "disable", None)
    assert (fresh.checkpoint, fresh.continue_after) == (None, None)
    (moved,) = (run_dir / PREVIOUS_RUNS).iterdir()
    assert capsys.readouterr().out == (f"run directory {run_dir}: a new run (trainer.resume_mode=disable); the "
                                       f"previous run's outputs are now in {moved}\n")
    assert sorted(p.name for p in run_dir.iterdir()) == ["builtin_task", PREVIOUS_RUNS]
    assert {p.name for p in moved.iterdir()} == {"metrics.jsonl", "val_generations.jsonl", "curves.png", "latest",
                                                 "global_step_3", "hf_export"}
    fake_run(run_dir, range(0, 3), saved_at=None)
    assert steps_of(run_dir / "metrics.jsonl") == [0, 1, 2]
    assert steps_of(moved / "metrics.jsonl") == list(range(8))

    text = summary(run_dir, 2, 12.3, {"critic/score/mean": 0.95}, None)
    assert f"run directory   {run_dir}" in text and f"curves.png      {run_dir / 'curves.png'}" in text
    assert "train 0.950, validation -" in text


def test_resuming_from_another_directory_starts_this_ones_files_afresh(tmp_path):
    other, run_dir = tmp_path / "other", tmp_path / "run"
    fake_run(other, range(0, 3), saved_at=2)
    fake_run(run_dir, range(0, 2), saved_at=None)
    start = start_run(run_dir, "resume_path", str(checkpoint_dir(other, 2)))
    assert (start.checkpoint, start.continue_after) == (checkpoint_dir(other, 2), None)
    assert not (run_dir / "metrics.jsonl").exists() and (run_dir / PREVIOUS_RUNS).is_dir()
    with pytest.raises(ConfigError, match="trainer.resume_from_path: .*global_step_9 is no directory"):
        start_run(run_dir, "resume_path", str(checkpoint_dir(other, 9)))


def test_console_prints_one_line_per_step_when_not_a_terminal(tmp_path, capsys):
    tracker = Tracker(["console"], tmp_path, "p", "e", {})
    tracker.log(1, {"critic/score/mean": 0.5, "actor/pg_loss": -0.01, "timing_s/step": 0.25, "other": 1.0})
    tracker.close()
    # A validation step also shows the reward function's extras (a strict accuracy beside a shaped reward).
    tracker = Tracker(["console"], tmp_path, "p", "e", {})
    tracker.log(2, {"critic/score/mean": 0.5, "val-core/reward/mean": 0.4, "val-aux/acc/mean": 0.35,
                    "val-aux/reward_failed/mean": 0.0, "val-core/openai/gsm8k/reward/mean@1": 0.4,
                    "actor/pg_loss": -0.01, "timing_s/step": 0.25})
    tracker.close()
    assert capsys.readouterr().out == ("step 1 reward=0.5 pg_loss=-0.01 step_s=0.25\n"
                                       "step 2 reward=0.5 val_reward=0.4 val_acc=0.35 pg_loss=-0.01 step_s=0.25\n")
