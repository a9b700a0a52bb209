"""Plot a GSM8K GRPO run's metrics.jsonl: train reward and its parts per step, validation accuracy per evaluation.

    python examples/gsm8k/plot_gsm8k_run.py RUN_DIR/metrics.jsonl docs/gsm8k_smollm2_curve.png

Reads the keys the format-bonus reward produces (`reward_extra/acc`, `reward_extra/formatted`, `val-aux/...`) and
falls back to the plain reward alone when a run used the strict scorer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = (
    ("train (per step, 512 samples)", (("critic/score/mean", "reward"), ("reward_extra/acc/mean", "accuracy (strict)"),
                                       ("reward_extra/formatted/mean", "answer in #### format"))),
    ("validation (GSM8K test, 1,319 prompts, greedy)", (("val-core/reward/mean", "reward"),
                                                         ("val-aux/acc/mean", "accuracy (strict)"),
                                                         ("val-aux/formatted/mean", "answer in #### format"))),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path)
    parser.add_argument("output", type=Path)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(11, 3.6))
    for ax, (title, series) in zip(axes, PANELS):
        for key, label in series:
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 20 else None, label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
