"""End-of-run pictures in the run directory: learning curves and a Gantt timeline of the phases of every step."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

from shardrl.trainer.tracking import Timeline  # noqa: E402

CURVES = (("critic/score/mean", "reward (train)"), ("val-core/reward/mean", "reward (validation)"),
          ("actor/ppo_kl", "actor ppo_kl"), ("actor/kl_loss", "actor kl_loss"),
          ("perf/throughput", "throughput (tokens/s)"), ("response_length/mean", "response length"))


def write_plots(run_dir: Path, timeline: Timeline) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curves = [(key, title) for key, title in CURVES if any(key in r for r in rows)]
    if curves:
        fig, axes = plt.subplots(len(curves), 1, figsize=(7, 2.2 * len(curves)), sharex=True, squeeze=False)
        for ax, (key, title) in zip(axes[:, 0], curves):
            points = [(r["step"], r[key]) for r in rows if key in r]
            ax.plot(*zip(*points), marker=".")
            ax.set_ylabel(title, fontsize=8)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(run_dir / "curves.png", dpi=110)
        plt.close(fig)
    spans = [s for s in timeline.snapshot() if s["phase"] != "step"]
    if spans:
        phases = sorted({s["phase"] for s in spans}, key=[s["phase"] for s in spans].index)
        lanes = sorted({(s["lane"], s["phase"]) for s in spans}, key=lambda lp: (lp[0], phases.index(lp[1])))
        colors = {p: plt.cm.tab10(i % 10) for i, p in enumerate(phases)}
        fig, ax = plt.subplots(figsize=(10, 0.4 * len(lanes) + 1.5))
        for s in spans:
            y = lanes.index((s["lane"], s["phase"]))
            ax.barh(y, s["end"] - s["start"], left=s["start"], color=colors[s["phase"]], height=0.8)
        ax.set_yticks(range(len(lanes)), [f"{lane}: {phase}" for lane, phase in lanes], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds since start")
        ax.set_title("phases per step")
        fig.tight_layout()
        fig.savefig(run_dir / "timeline.png", dpi=110)
        plt.close(fig)
