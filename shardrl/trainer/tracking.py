"""Where metrics go: a jsonl file in the run directory (always; one row per step), the console (in a terminal a rich
table per step under a progress bar, else one line per step, as a log file wants), and wandb / tensorboard / mlflow
when `trainer.logger` asks for them. Validation generations (`trainer.log_val_generations`) go the same ways:
`val_generations.jsonl`, a console table, a wandb table, tensorboard text, an mlflow artifact. Plus the phase
timeline the plots are drawn from.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


@dataclass
class Timeline:
    """Start/end of every phase of every step (seconds since the run started): `timing_s/*` and the Gantt plot.
    `on_phase(step, name)` is told when a trainer phase starts (the progress bar shows it).

    The async rollouter's thread records its spans here too (lane "rollout"), so the spans are kept under the
    timeline's own lock and read as a copy (`snapshot`); the progress bar is only ever told from the trainer's
    thread (trainer lane)."""

    origin: float = field(default_factory=time.perf_counter)
    wall_origin: float = field(default_factory=time.time)  # the same instant, for spans other processes measured
    _spans: list[dict[str, Any]] = field(default_factory=list)
    on_phase: Callable[[int, str], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def phase(self, step: int, name: str, lane: str = "trainer") -> Iterator[None]:
        if self.on_phase is not None and lane == "trainer":
            self.on_phase(step, name)
        start = time.perf_counter() - self.origin
        try:
            yield
        finally:
            span = {"step": step, "phase": name, "lane": lane, "start": start, "end": time.perf_counter() - self.origin}
            with self._lock:
                self._spans.append(span)

    def add_wall_span(self, step: int, name: str, lane: str, start: float, end: float) -> None:
        """A span a worker measured in wall-clock time (`time.time()`), e.g. the rollout engine idle on tools."""
        span = {"step": step, "phase": name, "lane": lane, "start": start - self.wall_origin,
                "end": end - self.wall_origin}
        with self._lock:
            self._spans.append(span)

    def snapshot(self) -> list[dict[str, Any]]:
        """The spans recorded so far (a copy: the rollouter's thread may be adding one)."""
        with self._lock:
            return list(self._spans)

    def overlap(self, step: int, lane: str, idle: tuple[str, ...] = ()) -> float:
        """Seconds in which the trainer worked on `step` (its phases but "step" itself and the `idle` ones) while
        `lane` was busy: the rollout pool generating while the trainer pool trains, what the async schedules gain."""
        spans = self.snapshot()
        working = [s for s in spans if s["step"] == step and s["lane"] == "trainer"
                   and s["phase"] not in ("step", *idle)]
        busy = [s for s in spans if s["lane"] == lane]
        return sum(max(0.0, min(w["end"], b["end"]) - max(w["start"], b["start"])) for w in working for b in busy)

    def step_timing(self, step: int) -> dict[str, float]:
        timing: dict[str, float] = {}
        for span in self.snapshot():
            if span["step"] == step:
                key = f"timing_s/{span['phase']}"
                timing[key] = timing.get(key, 0.0) + span["end"] - span["start"]
        return timing


@dataclass(frozen=True)
class _Backend:
    """One external logger: how it takes a step's scalars and a validation's generations."""

    metrics: Callable[[int, dict[str, float]], Any]
    generations: Callable[[int, list[dict[str, Any]]], Any]


GENERATION_COLUMNS = ("step", "input", "output", "score")


def _wandb(project: str, experiment: str, config: dict, run_dir: Path) -> _Backend:
    import wandb

    wandb.init(project=project, name=experiment, config=config, dir=str(run_dir))
    return _Backend(lambda step, m: wandb.log(m, step=step), lambda step, rows: wandb.log(
        {"val/generations": wandb.Table(columns=list(GENERATION_COLUMNS), data=_generation_rows(step, rows))},
        step=step))


def _tensorboard(run_dir: Path) -> _Backend:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir / "tensorboard"))
    header = " | ".join(GENERATION_COLUMNS) + "\n" + " | ".join("---" for _ in GENERATION_COLUMNS)
    return _Backend(lambda step, m: [writer.add_scalar(k, v, step) for k, v in m.items()],
                    lambda step, rows: writer.add_text("val/generations", "\n".join(
                        [header] + [" | ".join(map(str, r)) for r in _generation_rows(step, rows)]), step))


def _mlflow(project: str, experiment: str) -> _Backend:
    import mlflow

    mlflow.set_experiment(project)
    mlflow.start_run(run_name=experiment)
    return _Backend(lambda step, m: mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in m.items()}, step=step),
                    lambda step, rows: mlflow.log_dict({"step": step, "generations": rows},
                                                       f"val_generations/step_{step}.json"))


class Tracker:
    def __init__(self, loggers: list[str], run_dir: Path, project: str, experiment: str, config: dict,
                 resume_step: int | None = None) -> None:
        """A fresh run (`resume_step` None) starts the run directory's files; a run resumed from the checkpoint of
        `resume_step` continues them without the rows of later steps (its own, logged after that save), so their
        steps keep increasing."""
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = run_dir / "metrics.jsonl"
        self._last_row: dict[str, Any] | None = None  # the file's last row and where it starts: a step logs once
        self._last_offset = 0
        if resume_step is None:
            self.file = open(metrics, "w")
        else:
            self._last_row = _keep_steps_up_to(metrics, resume_step)
            _keep_steps_up_to(run_dir / "val_generations.jsonl", resume_step)
            self.file = open(metrics, "r+")
            self._last_offset = _last_line_start(self.file)
            self.file.seek(0, 2)
        self.latest: dict[str, float] = {}  # the last value of each scalar: the end-of-run summary's
        self.console = Console() if "console" in loggers else None
        self.backends: list[_Backend] = []
        if "wandb" in loggers:
            self.backends.append(_wandb(project, experiment, config, run_dir))
        if "tensorboard" in loggers:
            self.backends.append(_tensorboard(run_dir))
        if "mlflow" in loggers:
            self.backends.append(_mlflow(project, experiment))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write the step's row; a second log of the file's last step (a resumed run validating before it trains
        again) merges into that row, as wandb merges a step's logs."""
        row = {"step": step, **metrics}
        if self._last_row is not None and self._last_row["step"] == step:
            row = self._last_row | row
            self.file.seek(self._last_offset)
            self.file.truncate()
        self._last_offset = self.file.tell()
        self._last_row = row
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}  # lists (histograms): file only
        self.latest |= scalars
        for backend in self.backends:
            backend.metrics(step, scalars)
        if self.console is not None:
            if self.console.is_terminal:
                self.console.print(_table(step, scalars))
            else:
                self.console.print(_line(step, scalars), highlight=False, soft_wrap=True)

    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Validation samples, each {"input", "output", "score"}: appended to `val_generations.jsonl` with the step
        (a file per run, so generations of all validations can be read side by side), and to every logger."""
        with open(self.run_dir / "val_generations.jsonl", "a") as f:
            f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        for backend in self.backends:
            backend.generations(step, rows)
        if self.console is not None:
            self.console.print(_generations_table(step, rows))

    @contextmanager
    def progress(self, total_steps: int, done: int, timeline: Timeline) -> Iterator[Callable[[], None]]:
        """A progress bar over the run's steps (console logger only) whose text names the phase running now
        (gen, old_log_prob, update_actor, sync, ...); yields the function that marks a step done."""
        if self.console is None or not self.console.is_terminal:  # a log file gets the steps' lines alone
            yield lambda: None
            return
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn())
        with Progress(*columns, console=self.console, transient=True) as bar:
            task = bar.add_task("training", total=total_steps, completed=done)
            timeline.on_phase = lambda step, name: bar.update(task, description=f"step {step + 1}: {name}")
            try:
                yield lambda: bar.advance(task)
            finally:
                timeline.on_phase = None

    def close(self) -> None:
        self.file.close()


SUMMARY_KEYS = ("critic/score/mean", "val-core/reward/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy",
                "actor/grad_norm", "critic/vf_loss", "response_length/mean", "rollout_corr/mismatch_kl",
                "perf/throughput", "timing_s/step", "timing_s/gen", "timing_s/update_actor", "async/staleness_mean",
                "timing_s/rollout_overlap")


def _table(step: int, metrics: dict[str, float]) -> Table:
    table = Table(title=f"step {step}", show_header=False, box=None, padding=(0, 2))
    for key in SUMMARY_KEYS:
        if key in metrics:
            table.add_row(key, f"{metrics[key]:.4g}")
    return table


# The one-line step: rewards first, then the reward function's validation extras, then losses and time.
LINE_REWARDS = (("critic/score/mean", "reward"), ("val-core/reward/mean", "val_reward"))
LINE_REST = (("actor/pg_loss", "pg_loss"), ("actor/ppo_kl", "ppo_kl"), ("actor/kl_loss", "kl_loss"),
             ("actor/entropy", "entropy"), ("critic/vf_loss", "vf_loss"), ("response_length/mean", "response_len"),
             ("timing_s/step", "step_s"))


def _line(step: int, metrics: dict[str, float]) -> str:
    """A step as one line (stdout is not a terminal): the reward, the validation extras of the reward function (e.g.
    `val_acc` beside a shaped `val_reward`), the key losses and the step time."""
    def named(keys: tuple[tuple[str, str], ...]) -> list[str]:
        return [f"{name}={metrics[key]:.4g}" for key, name in keys if key in metrics]

    extras = [f"val_{key.split('/')[1]}={value:.4g}" for key, value in metrics.items()
              if key.startswith("val-aux/") and key.endswith("/mean") and key != "val-aux/reward_failed/mean"]
    return " ".join([f"step {step}", *named(LINE_REWARDS), *extras, *named(LINE_REST)])


def _keep_steps_up_to(path: Path, step: int) -> dict[str, Any] | None:
    """Rewrite jsonl file `path` (if any) without its rows of steps after `step`; its last row kept."""
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [row for row in rows if row["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
    tmp.replace(path)
    return kept[-1] if kept else None


def _last_line_start(file) -> int:
    """The offset of the last line of text `file` (0 when empty)."""
    lines = file.read().splitlines(keepends=True)
    return sum(len(line.encode()) for line in lines[:-1])


def _generation_rows(step: int, rows: list[dict[str, Any]]) -> list[list[Any]]:
    return [[step, r["input"], r["output"], r["score"]] for r in rows]


def _generations_table(step: int, rows: list[dict[str, Any]], max_chars: int = 80) -> Table:
    """Inputs (questions) cut to their first `max_chars` characters, outputs to their last: a question starts with
    what it asks, an answer ends with its result."""
    table = Table(title=f"validation generations, step {step}", padding=(0, 1))
    for column in GENERATION_COLUMNS[1:]:
        table.add_column(column)
    for r in rows:
        question = r["input"] if len(r["input"]) <= max_chars else r["input"][:max_chars - 1] + "…"
        table.add_row(question, r["output"][-max_chars:], f"{r['score']:.4g}")
    return table
