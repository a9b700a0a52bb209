"""The run directory (`trainer.default_local_dir`) holds one run's outputs, never a mix of two runs'.

A run either continues the run whose checkpoint it resumes from (`trainer.resume_mode`, as in verl: `auto` takes the
directory's latest checkpoint when there is one, `resume_path` takes `trainer.resume_from_path`, `disable` none) or
starts afresh. Continuing, it keeps that run's metrics file (the Tracker drops the rows after the checkpoint's step).
Starting afresh in a directory that holds an earlier run's outputs, it first moves them to
`previous_runs/<when that run last wrote>/` and says so in one line: `metrics.jsonl`, the plots and `hf_export/`
are then always this run's, and nothing is deleted. The built-in task's files (inputs, not outputs) stay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from shardrl.job.errors import ConfigError
from shardrl.models.checkpoint import LATEST_FILE, find_latest, step_of

# What a run writes into its directory (checkpoints are the `global_step_<N>` directories beside these).
RUN_OUTPUTS = ("metrics.jsonl", "val_generations.jsonl", "curves.png", "timeline.png", "hf_export", LATEST_FILE,
               "tensorboard", "wandb")
PREVIOUS_RUNS = "previous_runs"


@dataclass(frozen=True)
class RunStart:
    checkpoint: Path | None  # the checkpoint directory this run resumes from; None: from the initial weights
    continue_after: int | None  # continuing the run directory's own run: its files' rows up to this step stay


def start_run(run_dir: Path, resume_mode: str, resume_from_path: str | None) -> RunStart:
    """Where this run starts. A fresh run, or one resuming from another directory's checkpoint, first moves the
    earlier run's outputs aside (`move_aside`)."""
    checkpoint = find_latest(run_dir) if resume_mode == "auto" else None
    if resume_mode == "resume_path":
        checkpoint = Path(resume_from_path).expanduser()
        if not checkpoint.is_dir():
            raise ConfigError("trainer.resume_from_path", f"{checkpoint} is no directory; pass the global_step_<N> "
                                                          f"directory of the checkpoint to resume from")
    if checkpoint is not None and checkpoint.resolve().parent == run_dir.resolve():
        return RunStart(checkpoint, step_of(checkpoint))
    moved = move_aside(run_dir)
    if moved is not None:
        why = "it resumes from another directory's checkpoint" if checkpoint else f"trainer.resume_mode={resume_mode}"
        print(f"run directory {run_dir}: a new run ({why}); the previous run's outputs are now in {moved}",
              flush=True)
    return RunStart(checkpoint, None)


def move_aside(run_dir: Path) -> Path | None:
    """Move the earlier run's outputs in `run_dir` to `previous_runs/<time of its last write>/`; where to (None:
    there were none)."""
    if not run_dir.is_dir():
        return None
    old = sorted(p for p in run_dir.iterdir() if p.name in RUN_OUTPUTS or step_of(p) is not None)
    if not old:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(max(p.stat().st_mtime for p in old)))
    dest, number = run_dir / PREVIOUS_RUNS / stamp, 1
    while dest.exists():  # two runs ended within one second
        number += 1
        dest = run_dir / PREVIOUS_RUNS / f"{stamp}-{number}"
    dest.mkdir(parents=True)
    for path in old:
        path.rename(dest / path.name)
    return dest


def summary(run_dir: Path, steps: int, wall_s: float, last: dict[str, float], checkpoint: Path | None,
            interrupted: bool = False) -> str:
    """The end-of-run block: where everything is and how the run ended (`last`: the last logged value per key;
    `interrupted`: stopped by Ctrl-C or SIGINT, so there is no hf_export of this run and a resume starts from
    `checkpoint`)."""
    def reward(key: str) -> str:
        return f"{last[key]:.3f}" if key in last else "-"

    lines = [f"run directory   {run_dir}",
             f"steps           {steps} in {wall_s:.0f} s; final reward: train {reward('critic/score/mean')}, "
             f"validation {reward('val-core/reward/mean')}"]
    for name in ("metrics.jsonl", "curves.png", "timeline.png", "hf_export"):
        if (run_dir / name).exists():
            lines.append(f"{name:<15} {run_dir / name}")
    lines.append(f"{'checkpoint':<15} {checkpoint if checkpoint is not None else 'none saved (trainer.save_freq)'}")
    title = f"run interrupted after step {steps}" if interrupted else "run finished"
    return "\n".join(["", title, *("  " + line for line in lines)])
