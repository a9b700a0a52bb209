"""The run's pictures for a synthetic fully-async run of 128 steps (metrics rows and timeline spans on three lanes,
a critic): one bar per step with every trainer phase, the lanes of the last steps, the title naming the run, its
algorithm and model, the critic's panels only when a critic trained; and atomic writes during the run."""

import json
import random

import numpy as np
import pytest

from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.trainer import plots
from shardrl.trainer.plots import Pictures, curves_figure, ema, run_title, step_times, timeline_figure
from shardrl.trainer.tracking import Timeline

TRAINER_PHASES = ("wait_rollout", "reward", "balance", "values", "adv", "update_critic", "update_actor")
SYNC_EVERY = 4


def synthetic_spans(num_steps: int) -> list[dict]:
    """A fully async run's spans: the trainer's phases (a pause and sync every `SYNC_EVERY` steps) and the rollout's
    generate calls running beside them, the reward lane scoring what finished."""
    rng, spans, t = random.Random(0), [], 0.0

    def span(step: int, phase: str, lane: str, start: float, seconds: float) -> float:
        spans.append({"step": step, "phase": phase, "lane": lane, "start": start, "end": start + seconds})
        return start + seconds

    t = span(-1, "sync", "trainer", t, 0.05)
    for step in range(num_steps):
        begin = t
        for phase in TRAINER_PHASES + (("pause_rollout", "sync") if (step + 1) % SYNC_EVERY == 0 else ()):
            t = span(step, phase, "trainer", t, {"update_actor": 0.3, "update_critic": 0.2}.get(phase, 0.01)
                     * (1 + rng.random()))
        span(step, "step", "trainer", begin, t - begin)
        call = begin
        while call < t - 0.1:
            call = span(step, "generate", "rollout", call, 0.09) + 0.005
            span(step, "score", "reward", call, 0.02)
        t += 0.002  # logging between steps
    return spans


def synthetic_rows(num_steps: int, critic: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for step in range(1, num_steps + 1):
        row = {"step": step, "critic/score/mean": step / num_steps + 0.1 * rng.standard_normal(),
               "response_length/mean": 2.0, "actor/ppo_kl": 1e-3 * rng.random(), "actor/entropy": 2.6,
               "perf/throughput": 8000.0, "critic/returns/mean": 0.5}
        if critic:
            row |= {"critic/vf_loss": 1 / step, "critic/vpred_mean": 0.5 - 1 / step}
        if step % 16 == 0:
            row["val-core/reward/mean"] = step / num_steps
        rows.append(row)
    return rows


def bar_collections(fig):
    """The bars of `timeline_figure`: a collection per phase, a rectangle per step."""
    return fig.axes[0].collections


def test_timeline_has_a_bar_per_step_for_every_phase_and_the_last_steps_lanes():
    spans = synthetic_spans(128)
    fig = timeline_figure(spans)
    bars, zoom = fig.axes[0], fig.axes[1]
    labels = [c.get_label().rsplit(" ", 1)[0] for c in bars.collections]
    assert labels == [*TRAINER_PHASES, "pause_rollout", "sync"]  # every trainer phase, in order ("step" is their sum)
    assert all(len(c.get_paths()) == 128 for c in bars.collections)  # one bar per step
    centres = [p.vertices[:4, 0].mean() for p in bars.collections[0].get_paths()]
    assert centres == pytest.approx(range(1, 129))  # 1-based, as metrics.jsonl counts
    shares = {c.get_label().rsplit(" ", 1)[0]: c.get_label().rsplit(" ", 1)[1] for c in bars.collections}
    assert shares["update_actor"] == "54%" and shares["sync"] == "<1%"
    heights = [np.ptp(p.vertices[:4, 1]) for p in bars.collections[-1].get_paths()]  # sync's
    assert [h > 0 for h in heights] == [(s + 1) % SYNC_EVERY == 0 for s in range(128)]
    assert [t.get_text() for t in zoom.get_yticklabels()] == ["trainer", "rollout", "reward"]
    assert [t.get_text() for t in zoom.texts] == [" step 126", " step 127", " step 128"]
    lanes_drawn = {round(c.get_paths()[0].vertices[:, 1].mean()) for c in zoom.collections if c.get_paths()}
    assert lanes_drawn == {0, 1, 2}  # generation (rollout lane) beside training (trainer lane)
    legend = [t.get_text() for t in zoom.get_legend().get_texts()]
    assert legend[:2] == ["generate", "score"] and legend[2].startswith("between steps")  # logging between steps


def test_timeline_of_a_short_run_and_of_a_long_one():
    fig = timeline_figure(synthetic_spans(5))
    assert all(len(c.get_paths()) == 5 for c in bar_collections(fig))
    assert len(fig.axes[1].texts) == 3
    times = step_times(synthetic_spans(1000))
    assert times.steps[0] == 1 and len(times.steps) == 1000
    long_bars = bar_collections(timeline_figure(synthetic_spans(1000)))
    assert all(len(c.get_paths()) == 200 for c in long_bars)  # 5 steps a bar: bars stay wider than a pixel
    assert timeline_figure([]) is None


@pytest.mark.parametrize("critic", [True, False])
def test_curves_have_a_title_smoothing_and_a_critic_panel_only_with_a_critic(critic):
    fig = curves_figure(synthetic_rows(128, critic), "p/e: gae, fully_async, model m")
    assert fig.get_suptitle() == "p/e: gae, fully_async, model m"
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert ("critic value loss" in titles) == critic and ("critic values" in titles) == critic
    reward = fig.axes[titles.index("reward")]
    assert [line.get_label() for line in reward.get_legend().get_lines()] == ["train (EMA 8 steps)", "validation"]
    raw, smooth, val = reward.get_lines()
    assert len(raw.get_xdata()) == len(smooth.get_xdata()) == 128 and len(val.get_xdata()) == 8
    assert np.std(np.diff(smooth.get_ydata())) < np.std(np.diff(raw.get_ydata()))
    assert all(float(t).is_integer() for t in reward.get_xticks())
    resumed = synthetic_rows(128, critic)[:100] + synthetic_rows(128, critic)[90:]  # steps 91..100 logged twice
    assert len(curves_figure(resumed, "t").axes[0].get_lines()[0].get_xdata()) == 128
    few = curves_figure(synthetic_rows(5, critic), "t")
    assert all(len(ax.get_lines()) == len(ax.get_legend().get_lines()) for ax in few.axes if ax.get_visible())


def test_ema_is_debiased_and_skips_nans():
    assert ema(np.array([2.0, 2.0, 2.0]), 4) == pytest.approx([2.0, 2.0, 2.0])
    assert ema(np.array([np.nan, 1.0, np.nan]), 4)[1:] == pytest.approx([1.0, 1.0])


def test_pictures_are_written_atomically_when_due(tmp_path, monkeypatch):
    timeline = Timeline()
    timeline._spans.extend(synthetic_spans(4))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in synthetic_rows(4, True)))
    pictures = Pictures(tmp_path, "t", timeline)
    pictures.refresh()  # not due: just started
    assert not list(tmp_path.glob("*.png"))
    monkeypatch.setattr(plots, "REFRESH_S", 0.0)
    pictures.refresh()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl", "timeline.png"]
    assert pictures.cost_s > 0


def test_the_title_tells_a_grpo_run_from_a_gae_one():
    grpo = run_title(plan_job(compose("ppo_trainer", ["trainer.experiment_name=a"])))
    gae = run_title(plan_job(compose("fully_async_ppo_trainer", ["algorithm.adv_estimator=gae"])))
    assert grpo == "shardrl/a: grpo, sync, model built-in task model"
    assert gae == "shardrl/default: gae, fully_async, model built-in task model, with a critic"
