"""Pictures in the run directory, redrawn while the run goes on (`Pictures`) so a long run can be watched:

* `curves.png`: learning curves, titled with the run, its algorithm and model (a GRPO and a GAE run must not look
  alike), raw points beside their moving average, a critic panel when a critic trains.
* `timeline.png`: where each step's time went (a stacked bar per step, a colour per phase, each phase's share of the
  run in the legend), then a zoom on the last steps with one row per lane (trainer, rollout, reward) so what the
  async modes overlap can be seen. Both read the phase spans of `tracking.Timeline`.

The figures are built by plain functions (`curves_figure`, `timeline_figure`) that the tests inspect; drawing uses
matplotlib's object API with the Agg canvas only (no pyplot state, no display).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from shardrl.job.plan import JobPlan
from shardrl.trainer.tracking import Timeline


@dataclass(frozen=True)
class Panel:
    """One axes of `curves.png`: drawn when `keys[0]` was logged; the other keys join it where logged."""

    title: str
    keys: tuple[tuple[str, str], ...]  # (metric key, legend label)


PANELS = (
    Panel("reward", (("critic/score/mean", "train"), ("val-core/reward/mean", "validation"))),
    Panel("response length", (("response_length/mean", "mean"), ("response_length/max", "max"))),
    Panel("actor KL", (("actor/ppo_kl", "ppo_kl"), ("actor/kl_loss", "kl_loss"))),
    Panel("actor entropy", (("actor/entropy", "entropy"),)),
    Panel("critic value loss", (("critic/vf_loss", "vf_loss"),)),
    Panel("critic values", (("critic/vpred_mean", "predicted"), ("critic/returns/mean", "returns"))),
    Panel("throughput (tokens/s)", (("perf/throughput", "tokens/s"),)),
)
POINTS_PER_SPAN = 16  # the moving average's span is the points over this; under 2, the raw points are drawn alone
MAX_BARS = 200  # more steps than this: a bar holds the mean of consecutive steps (bars stay wider than a pixel)
ZOOM_STEPS = 3  # the lanes of the last steps
LANES = ("trainer", "rollout", "reward")  # row order of the zoom; other lanes follow
REFRESH_S = 30.0  # at most one mid-run redraw per this many seconds
MAX_OVERHEAD = 0.05  # ... and at most this share of the run's time spent redrawing


def run_title(plan: JobPlan) -> str:
    """What tells two runs' pictures apart: the run's name, the schedule, the advantage estimator and the models."""
    tracking, model = plan.tracking, plan.model_path or "built-in task model"
    critic = "" if plan.critic is None else (f", critic {plan.critic_model_path}" if plan.critic_model_path
                                             not in (None, plan.model_path) else ", with a critic")
    return (f"{tracking.project}/{tracking.experiment}: {plan.algorithm.adv_estimator}, {plan.mode}, "
            f"model {model}{critic}")


def ema(values: np.ndarray, span: int) -> np.ndarray:
    """Exponential moving average, debiased (the first points are not pulled towards 0); NaNs are skipped."""
    weight, out, acc, norm = 1.0 - 2.0 / (span + 1), np.empty_like(values), 0.0, 0.0
    for i, value in enumerate(values):
        if not math.isnan(value):
            acc, norm = weight * acc + (1 - weight) * value, weight * norm + (1 - weight)
        out[i] = acc / norm if norm else math.nan
    return out


def curves_figure(rows: Sequence[dict[str, Any]], title: str) -> Figure | None:
    """The learning curves of the logged `rows` (metrics.jsonl's), None when no panel's metric was logged."""
    panels = [p for p in PANELS if any(p.keys[0][0] in r for r in rows)]
    if not panels:
        return None
    num_cols = 2 if len(panels) > 1 else 1
    num_rows = -(-len(panels) // num_cols)
    height = 2.6 * num_rows + 0.8  # inches; margins are fixed (a layout engine would double the drawing time)
    fig = Figure(figsize=(6 * num_cols, height))
    fig.suptitle(title, fontsize=11)
    axes = fig.subplots(num_rows, num_cols, squeeze=False, sharex=True, gridspec_kw=dict(
        left=0.08, right=0.98, top=1 - 0.7 / height, bottom=0.5 / height, hspace=0.45, wspace=0.2)).ravel()
    for ax, panel in zip(axes, panels):
        for i, (key, label) in enumerate(panel.keys):
            # by step, the last value logged: a resumed run appends the steps after its checkpoint again
            points = {r["step"]: r[key] for r in rows if isinstance(r.get(key), (int, float))}
            if points:
                _series(ax, np.array(sorted(points.items()), dtype=float), label, f"C{i}")
        ax.set_title(panel.title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7, loc="best")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax in axes[len(panels) - num_cols:len(panels)]:
        ax.set_xlabel("step")
        ax.xaxis.set_tick_params(labelbottom=True)
    return fig


def _series(ax: Axes, points: np.ndarray, label: str, color: str) -> None:
    """Raw points (light) and, when there are enough of them, their moving average (solid) in one colour."""
    steps, values = points[:, 0], points[:, 1]
    span = min(100, len(points) // POINTS_PER_SPAN)
    if span < 2:  # a short run or a sparse metric (validation): the points themselves are readable
        ax.plot(steps, values, marker="o", markersize=4, color=color, label=label)
        return
    ax.plot(steps, values, marker=".", markersize=3, linewidth=0.6, alpha=0.35, color=color)
    ax.plot(steps, ema(values, span), linewidth=1.8, color=color, label=f"{label} (EMA {span} steps)")


@dataclass(frozen=True)
class StepTimes:
    """Seconds per step and trainer phase: a step is displayed 1-based, as metrics.jsonl and the progress bar count."""

    steps: np.ndarray  # [S] display step
    phases: list[str]
    seconds: np.ndarray  # [S, P]


def step_times(spans: Sequence[dict[str, Any]]) -> StepTimes:
    """The trainer lane's phases per step ("step" itself left out: it holds them). The sync before the first step
    (step -1) is not a training step and is left out."""
    trainer = [s for s in spans if s["lane"] == "trainer" and s["phase"] != "step" and s["step"] >= 0]
    phases = list(dict.fromkeys(s["phase"] for s in trainer))
    steps = sorted({s["step"] for s in trainer})
    row, col = {st: i for i, st in enumerate(steps)}, {p: j for j, p in enumerate(phases)}
    seconds = np.zeros((len(steps), len(phases)))
    for s in trainer:
        seconds[row[s["step"]], col[s["phase"]]] += s["end"] - s["start"]
    return StepTimes(np.array(steps) + 1, phases, seconds)


def timeline_figure(spans: Sequence[dict[str, Any]]) -> Figure | None:
    """Stacked phase time per step above a Gantt of the last `ZOOM_STEPS` steps' lanes; None without a step."""
    times = step_times(spans)
    if not len(times.steps):
        return None
    others = [s["phase"] for s in spans if s["lane"] != "trainer" and s["phase"] != "step"]
    phases = list(dict.fromkeys([*times.phases, *others]))
    colors = {p: f"C{i}" if len(phases) <= 10 else colormaps["tab20"](i % 20) for i, p in enumerate(phases)}
    lanes = sorted({s["lane"] for s in spans}, key=lambda lane: (LANES + (lane,)).index(lane))
    height = 4.2 + 0.5 * len(lanes)  # inches
    fig = Figure(figsize=(12, height))
    bars_ax, zoom_ax = fig.subplots(2, 1, height_ratios=[3, 0.9 + 0.45 * len(lanes)], gridspec_kw=dict(
        left=0.07, right=0.86, top=1 - 0.35 / height, bottom=0.5 / height, hspace=0.45))
    _draw_bars(bars_ax, times, colors)
    _draw_zoom(zoom_ax, spans, lanes, colors)
    return fig


def _draw_bars(ax: Axes, times: StepTimes, colors: dict[str, Any]) -> None:
    """One bar per step (or per `k` steps' mean beyond `MAX_BARS`), the trainer's phases stacked in order. A phase
    is one collection of rectangles, not a patch per bar: ten times faster to draw at a few hundred steps."""
    k = -(-len(times.steps) // MAX_BARS)
    num_bars = -(-len(times.steps) // k)
    pad = num_bars * k - len(times.steps)
    seconds = np.pad(times.seconds, ((0, pad), (0, 0)), constant_values=np.nan)
    seconds = np.nanmean(seconds.reshape(num_bars, k, -1), axis=1)  # [bars, P]
    left = times.steps[::k] - 0.5 + 0.075 * k  # [bars]; bar i covers steps x_i .. x_i + k - 1
    right = left + 0.85 * k
    total = times.seconds.sum()
    bottom = np.zeros(num_bars)
    for j, phase in enumerate(times.phases):
        top = bottom + seconds[:, j]
        corners = np.stack([np.stack(c, axis=-1) for c in
                            ((left, bottom), (right, bottom), (right, top), (left, top))], axis=1)  # [bars, 4, 2]
        share = times.seconds[:, j].sum() / total if total else 0.0
        ax.add_collection(PolyCollection(corners, facecolors=colors[phase], linewidths=0,
                                         label=f"{phase} {share:.0%}" if share >= 0.005 else f"{phase} <1%"))
        bottom = top
    per = f" (a bar: the mean of {k} steps)" if k > 1 else ""
    ax.set_title(f"trainer time per step{per}: {total:.1f} s in {len(times.steps)} steps; "
                 f"legend: each phase's share", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(times.steps[0] - 0.5, times.steps[::k][-1] + k - 0.5)
    ax.set_ylim(0, 1.05 * np.nanmax(bottom))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def _draw_zoom(ax: Axes, spans: Sequence[dict[str, Any]], lanes: list[str], colors: dict[str, Any]) -> None:
    """The spans of every lane during the last steps (from the first one's start to the last one's end), with the
    steps' boundaries: a rollout bar beside a trainer phase is generation overlapping training."""
    shown = sorted({s["step"] for s in spans if s["lane"] == "trainer" and s["step"] >= 0})[-ZOOM_STEPS:]
    bounds = {}
    for s in spans:
        if s["lane"] == "trainer" and s["step"] in shown:
            lo, hi = bounds.get(s["step"], (s["start"], s["end"]))
            bounds[s["step"]] = (min(lo, s["start"]), max(hi, s["end"]))
    begin, end = min(lo for lo, _ in bounds.values()), max(hi for _, hi in bounds.values())
    inside = [s for s in spans if s["phase"] != "step" and s["end"] > begin and s["start"] < end]
    pieces: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in inside:
        lo, hi = max(s["start"], begin), min(s["end"], end)
        pieces.setdefault((s["lane"], s["phase"]), []).append((lo, hi - lo))
    # longest first, so a phase of short spans inside a long one of its lane (tool_idle in generate) shows on top
    for (lane, phase), xs in sorted(pieces.items(), key=lambda item: -np.mean([w for _, w in item[1]])):
        ax.broken_barh(xs, (lanes.index(lane) - 0.4, 0.8), facecolors=colors[phase], edgecolors=colors[phase],
                       linewidth=0.5)  # the edge keeps sub-pixel spans visible
    ordered = sorted(bounds.items())
    for step, (lo, _) in ordered:
        ax.axvline(lo, color="black", linewidth=0.8, linestyle="--")
        ax.text(lo, -0.55, f" step {step + 1}", fontsize=8, va="bottom")
    gaps = [(hi, lo - hi) for (_, (_, hi)), (_, (lo, _)) in zip(ordered, ordered[1:]) if lo > hi]
    ax.broken_barh(gaps, (-0.4, 0.8), facecolors="none", edgecolors="0.6", hatch="//", linewidth=0)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.7)
    ax.set_xlim(begin, end)
    ax.set_xlabel("seconds since the run started")
    ax.set_title(f"the last {len(shown)} steps, every lane (colours as above)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    trainer_phases = {s["phase"] for s in spans if s["lane"] == "trainer"}
    # what the bars above do not name: the other lanes' phases, and the trainer's time outside a step
    handles = [Patch(facecolor=colors[p], label=p) for p in colors
               if p not in trainer_phases and any(s["phase"] == p for s in inside)]
    if gaps:
        handles.append(Patch(facecolor="none", edgecolor="0.6", hatch="//", linewidth=0,
                             label="between steps\n(saving, logging,\npictures)"))
    if handles:
        ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


@dataclass
class Pictures:
    """Writes `curves.png` and `timeline.png` into the run directory: mid-run when at least `REFRESH_S` seconds have
    passed since the last write and redrawing stays under `MAX_OVERHEAD` of the run's time, and at the end.
    Each file is replaced atomically (written beside it, then renamed): a viewer never reads a half-written one."""

    run_dir: Path
    title: str
    timeline: Timeline
    last_write: float = field(default_factory=time.perf_counter)
    cost_s: float = 0.0  # the last write's

    def refresh(self) -> None:
        """After a step: redraw when due."""
        if time.perf_counter() - self.last_write >= max(REFRESH_S, self.cost_s / MAX_OVERHEAD):
            self.write()

    def close(self) -> None:
        """At the end of the run (`contextlib.closing`): the last pictures."""
        self.write()

    def write(self) -> None:
        start = time.perf_counter()
        text = (self.run_dir / "metrics.jsonl").read_text()  # the Tracker's, created before the first step
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        for name, fig in (("curves.png", curves_figure(rows, self.title)),
                          ("timeline.png", timeline_figure(self.timeline.snapshot()))):
            if fig is not None:
                _save_atomic(fig, self.run_dir / name)
        self.last_write = time.perf_counter()
        self.cost_s = self.last_write - start


def _save_atomic(fig: Figure, path: Path) -> None:
    """Written beside `path` (an ordinary open: the file gets the umask's permissions), then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
