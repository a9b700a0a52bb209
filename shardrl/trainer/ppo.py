"""The PPO loop. A step reads as the named verbs of DESIGN.md: `generate` (rollout), `score`, `train` (log-probs,
values, advantages, updates) and `sync_weights`. `schedule()` decides when generation runs and with which weights:
the synchronous schedule is here, the async modes override it (one_step_off.py, fully_async.py) with the same verbs.
The synchronous step may generate several prompt batches (DAPO's dynamic sampling, dynamic_sampling.py).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardrl.agents.driver import RunnerStats
from shardrl.algos import KLController
from shardrl.controller.group import RoleHandle
from shardrl.data.batch import Batch
from shardrl.data.rl_dataset import PromptLoader
from shardrl.models.checkpoint import checkpoint_dir, mark_latest
from shardrl.models.hf_export import export_dir
from shardrl.rewards.manager import SampleScores
from shardrl.trainer import batch_ops, dynamic_sampling, staleness
from shardrl.job.options import RewardOptions
from shardrl.job.plan import JobPlan
from shardrl.trainer.plots import Pictures, run_title
from shardrl.trainer.reward_loop import ScoringThread, stream_generation
from shardrl.trainer.tracking import Timeline, Tracker
from shardrl.workers.actor import ActorRefWorker
from shardrl.workers.critic import CriticWorker
from shardrl.workers.judge import JudgeWorker
from shardrl.workers.reward_model import RewardModelWorker
from shardrl.workers.detached import DetachedActorWorker
from shardrl.workers.engine import ROUTED_EXPERTS
from shardrl.workers.hybrid import ActorRolloutRefWorker
from shardrl.workers.rollout import RolloutWorker
from shardrl.workers.teacher import TeacherWorker


@dataclass
class Workers:
    """The roles the loop calls, each by reference to its worker class's methods (`RoleHandle.call`)."""

    actor: RoleHandle  # ActorRefWorker: log-probs, ref log-probs, update, weight sync; colocated also generation
    critic: RoleHandle | None  # CriticWorker
    rollout: RoleHandle | None = None  # RolloutWorker: the detached pool (async modes); None: the hybrid engine
    reward_model: RoleHandle | None = None  # RewardModelWorker: `reward_model.enable`
    judge: RoleHandle | None = None  # JudgeWorker: `reward_model.judge.enable`
    teachers: dict[str, RoleHandle] = field(default_factory=dict)  # TeacherWorker by routing key (distillation)

    def score(self, batch: Batch, tokenizer, score_fn, reward: RewardOptions, keep_extras: Sequence[str] = (),
              extras_as_columns: bool = False) -> tuple[Batch, SampleScores]:
        """Token-level scores of generated samples: the reward model's when there is one (verl's: then the reward
        function is not called), the judge's (instead of the reward function's or added to it), else the reward
        function's (`batch_ops.score`)."""
        if self.reward_model is not None:
            batch = batch.union(self.reward_model.call(RewardModelWorker.compute_rm_score, batch))
        if self.judge is not None:
            batch = batch.union(self.judge.call(JudgeWorker.judge, batch))
        return batch_ops.score(batch, tokenizer, score_fn, reward, keep_extras, extras_as_columns)

    def generate(self, samples: Batch, validate: bool = False) -> Batch:
        """One response per row, on the hybrid engine or the detached rollout pool."""
        if self.rollout is None:
            return self.actor.call(ActorRolloutRefWorker.generate_sequences, samples, validate=validate)
        return self.rollout.call(RolloutWorker.generate_sequences, samples, validate=validate)

    def stream_generate(self, samples: Batch, on_finished: Callable[[Batch], None]) -> list[list[dict[str, Any]]]:
        """`generate` (training sampling) with each sample handed to `on_finished` as it finishes
        (`reward_loop.stream_generation`); each engine replica's reports, one per call."""
        if self.rollout is None:
            return stream_generation(self.actor, ActorRolloutRefWorker.stream_sequences, samples, on_finished)
        return stream_generation(self.rollout, RolloutWorker.stream, samples, on_finished)


class PPOTrainer:
    def __init__(self, plan: JobPlan, workers: Workers, loader: PromptLoader, val_prompts: Batch | None,
                 tokenizer, score_fn, tracker: Tracker, kl_ctrl: KLController | None) -> None:
        """`plan`: the compiled job, its total steps bound (`JobPlan.with_total_steps`)."""
        self.plan, self.workers, self.loader, self.val_prompts = plan, workers, loader, val_prompts
        self.tokenizer, self.score_fn, self.tracker, self.kl_ctrl = tokenizer, score_fn, tracker, kl_ctrl
        self.loop, self.algorithm = plan.loop, plan.algorithm
        self.total_steps = plan.loop.total_steps
        self.timeline = Timeline()
        self.global_step = 0
        self.policy_version = 0  # of the actor's weights (see staleness.py)
        # The colocated worker syncs its rollout when it is built; a detached pool gets its weights in fit().
        self.rollout_version: int | None = 0 if workers.rollout is None else None
        self.max_staleness = staleness.max_staleness(plan)
        # this step's summed over its generation rounds: multi-turn (`record_agent_stats`), scoring while generating
        self.step_extra: dict[str, float] = {}

    def step(self, prompts: Batch, more_prompts: Iterable[Batch] = ()) -> dict[str, Any]:
        """generate -> score -> train (log-probs, values, advantages, updates) -> sync: the synchronous schedule.
        Dynamic sampling takes further prompt batches from `more_prompts` (the schedule's loader stream)."""
        step, t = self.global_step, self.timeline
        with t.phase(step, "step"):
            batch, metrics = self.rollout(prompts, more_prompts, step)
            batch, train_metrics = self.train(batch, step)
            metrics |= train_metrics | self.sync_weights(step)
        return metrics | self.step_metrics(batch, step)

    def rollout(self, prompts: Batch, more_prompts: Iterable[Batch], step: int) -> tuple[Batch, dict[str, Any]]:
        """The step's scored samples: those of `prompts`, or with `algorithm.filter_groups` the first
        `data.train_batch_size` groups with a spread from as many rounds as that takes (dynamic_sampling.py)."""
        batches = itertools.chain([prompts], more_prompts)
        rounds = (self.generate_scored(p, step, gen_round) for gen_round, p in enumerate(batches))
        groups = self.algorithm.filter_groups
        if groups is None:
            batch, scores = next(rounds)
            return batch, batch_ops.reward_metrics(scores.extras)
        return dynamic_sampling.collect(rounds, groups.metric, self.loop.train_batch_size,
                                        groups.max_num_gen_batches)

    def generate_scored(self, prompts: Batch, step: int, gen_round: int = 0) -> tuple[Batch, SampleScores]:
        """One generation round's samples, scored: each as soon as it finishes (`reward.while_generating`,
        reward_loop.py), else the whole batch after generation."""
        if not self.plan.reward.while_generating:
            return self.score(self.generate(prompts, step, gen_round), step)
        scoring = ScoringThread(self.score_samples, self.timeline, lambda: step)
        try:
            with self.timeline.phase(step, "gen"):
                reports = self.workers.stream_generate(self.sample_rows(prompts, step, gen_round), scoring.submit)
            if self.plan.rollout.agent is not None:
                self.record_agent_stats(step, [RunnerStats(
                    sum(r["decode_steps_during_tools"] for r in calls), sum(r["tool_idle_s"] for r in calls),
                    [span for r in calls for span in r["tool_idle_spans"]]) for calls in reports])
            with self.timeline.phase(step, "reward"):
                batch, scores, metrics = scoring.finish()
        finally:
            scoring.close()
        for key, value in metrics.items():
            self.step_extra[key] = self.step_extra.get(key, 0.0) + value
        return batch, scores

    def generate(self, prompts: Batch, step: int, gen_round: int = 0) -> Batch:
        with self.timeline.phase(step, "gen"):
            batch = self.workers.generate(self.sample_rows(prompts, step, gen_round))
        if self.plan.rollout.agent is not None:
            w = self.workers
            self.record_agent_stats(step, w.actor.call(ActorRolloutRefWorker.take_agent_stats) if w.rollout is None
                                    else w.rollout.call(RolloutWorker.take_agent_stats))
        return batch

    def record_agent_stats(self, step: int, stats: list[RunnerStats]) -> None:
        """Multi-turn: the rollout's time idle on tools (timeline spans on the rollout lane, the first entry's) and
        the decode steps that hid tool waits (the most of any entry: one per rank or replica), summed over the
        step's generation rounds (`step_extra`)."""
        for start, end in stats[0].tool_idle_spans:
            self.timeline.add_wall_span(step, "tool_idle", "rollout", start, end)
        m = self.step_extra
        m["agent/tool_idle_s"] = m.get("agent/tool_idle_s", 0.0) + max(s.tool_idle_seconds for s in stats)
        m["agent/decode_steps_during_tools"] = m.get("agent/decode_steps_during_tools", 0.0) + max(
            s.decode_steps_during_tools for s in stats)

    def sample_rows(self, prompts: Batch, step: int, gen_round: int = 0) -> Batch:
        """`rollout.n` rows per prompt (one per sample, grouped by uid), seeded by (seed, step, round, row): what
        they generate depends only on the weights and the data."""
        samples = batch_ops.assign_uids(prompts).repeat(self.loop.samples_per_prompt)
        return batch_ops.with_sample_seeds(samples, self.loop.seed, step, gen_round)

    def score(self, batch: Batch, step: int) -> tuple[Batch, SampleScores]:
        with self.timeline.phase(step, "reward"):
            return self.score_samples(batch)

    def score_samples(self, samples: Batch) -> tuple[Batch, SampleScores]:
        """`Workers.score` with this run's tokenizer, reward function and options (also the reward loop's)."""
        return self.workers.score(samples, self.tokenizer, self.score_fn, self.plan.reward,
                                  self.algorithm.gdpo_reward_keys or (), bool(self.loop.rollout_data_dir))

    def train(self, batch: Batch, step: int) -> tuple[Batch, dict[str, Any]]:
        """On a scored batch: balance -> log-probs (old, ref, distillation teacher) -> values -> advantages (then
        PF-PPO's resampling) -> update critic, actor."""
        w, t = self.workers, self.timeline
        metrics: dict[str, Any] = {}
        if self.loop.rollout_data_dir:  # verl's dump of the samples the step trains on (its steps count from 1)
            batch_ops.write_records(self.loop.rollout_data_dir, step + 1,
                                    batch_ops.sample_records(batch, self.tokenizer, step + 1))
        if self.loop.balance_batch:
            with t.phase(step, "balance"):
                batch, metrics = batch_ops.balance_over_dp(batch, self.loop, w.actor.layout.dp,
                                                           w.critic.layout.dp if w.critic is not None else None)
        metrics |= staleness.lag_metrics(batch.tensors["policy_versions"], batch.tensors["response_mask"],
                                         self.policy_version, self.max_staleness)
        # The teachers (on a pool of their own) score while the trainer pool computes the other log-probs.
        teacher_scores = (submit_teacher_log_probs(w.teachers, batch, self.plan.teacher.route_field)
                          if self.plan.teacher is not None else None)
        if self.plan.actor.log_prob is not None:  # recompute the old logprobs (else PPO anchors on behaviour's)
            with t.phase(step, "old_log_prob"):
                old = w.actor.call(ActorRefWorker.compute_log_prob, batch)
                if ROUTED_EXPERTS in old.tensors.keys():  # R2's record takes the place of the rollout's (if any)
                    batch.tensors.pop(ROUTED_EXPERTS, None)
                batch = batch.union(old)
        if self.plan.ref is not None:
            with t.phase(step, "ref"):
                batch = batch.union(w.actor.call(ActorRefWorker.compute_ref_log_prob, batch))
        if teacher_scores is not None:
            with t.phase(step, "teacher"):  # what is left of the teachers' passes
                batch = batch.union(teacher_scores())
        if w.critic is not None:
            with t.phase(step, "values"):
                batch = batch.union(w.critic.call(CriticWorker.compute_values, batch))
        with t.phase(step, "adv"):
            metrics |= batch_ops.apply_rewards_and_correction(batch, self.algorithm, self.kl_ctrl)
            batch_ops.advantages(batch, self.algorithm)
            if self.algorithm.policy_filtration is not None:
                batch, filtration_metrics = batch_ops.policy_filtration(batch, self.algorithm, self.loop.seed, step)
                metrics |= filtration_metrics
        if w.critic is not None:
            with t.phase(step, "update_critic"):
                metrics |= _prefixed("critic", w.critic.call(CriticWorker.update_critic, batch, step))
        if step >= self.loop.critic_warmup:
            with t.phase(step, "update_actor"):
                metrics |= _prefixed("actor", w.actor.call(ActorRefWorker.update_actor, batch, step))
            self.policy_version = step + 1
        return batch, metrics | batch_ops.data_metrics(batch)

    def sync_weights(self, step: int) -> dict[str, float]:
        """Hand the rollout the actor's current weights unless it has them; a detached pool receives while the
        trainer pool sends. Metrics are the receiving side's (bytes it loaded)."""
        if self.rollout_version == self.policy_version:
            return {}
        w, version = self.workers, self.policy_version
        with self.timeline.phase(step, "sync"):
            if w.rollout is None:
                metrics = w.actor.call(ActorRolloutRefWorker.sync_weights, version)[0]
            else:
                sending = w.actor.submit(DetachedActorWorker.sync_weights, version)
                metrics = w.rollout.call(RolloutWorker.sync_weights, version)[0]
                sending.get()
        self.rollout_version = version
        return metrics

    def step_metrics(self, batch: Batch, step: int) -> dict[str, float]:
        """Timing of the step's phases and its token throughput (after the step's phases closed)."""
        metrics = self.timeline.step_timing(step) | self.step_extra
        self.step_extra = {}
        tokens = float(batch.tensors["attention_mask"].sum())
        return metrics | {"perf/total_num_tokens": tokens, "perf/throughput": tokens / metrics["timing_s/step"]}

    def schedule(self) -> Iterator[dict[str, Any]]:
        """The synchronous schedule: every step generates with the weights it then updates (staleness 0)."""
        batches = self.prompt_batches()
        for prompts in batches:
            yield self.step(prompts, batches)

    def prompt_batches(self) -> Iterator[Batch]:
        """The loader's batches, epoch after epoch (the schedule decides when to stop)."""
        while True:
            yield from self.loader

    def validate(self) -> dict[str, float]:
        """Generate and score the validation prompts: verl's val-core / val-aux metrics, and `timing_s/testing` (its
        time, also a trainer phase of the step it follows, so the timeline shows what validation costs)."""
        start = time.perf_counter()
        with self.timeline.phase(self.global_step - 1, "testing"):  # spans count steps from 0, global_step from 1
            metrics = self._validation_metrics()
        return metrics | {"timing_s/testing": time.perf_counter() - start}

    def _validation_metrics(self) -> dict[str, float]:
        n = self.loop.val_samples_per_prompt
        samples = batch_ops.with_sample_seeds(batch_ops.assign_uids(self.val_prompts).repeat(n), self.loop.seed, -1)
        batch = self.workers.generate(samples, validate=True)
        batch, sample_scores = self.workers.score(batch, self.tokenizer, self.score_fn, self.plan.reward,
                                                  extras_as_columns=bool(self.loop.validation_data_dir))
        scores = batch.tensors["token_level_scores"].sum(-1).numpy()
        if self.loop.validation_data_dir:
            batch_ops.write_records(self.loop.validation_data_dir, self.global_step,
                                    batch_ops.sample_records(batch, self.tokenizer, self.global_step))
        if self.loop.log_val_generations:
            self.tracker.log_generations(self.global_step, batch_ops.val_generations(
                batch, self.tokenizer, scores, self.loop.log_val_generations))
        sources = batch.non_tensors[self.plan.reward.data_source_key]
        metrics = {f"val-core/{s}/reward/mean@1": float(scores[sources == s].mean()) for s in set(sources)}
        metrics["val-core/reward/mean"] = float(np.mean(scores))
        # A reward function's extras (e.g. `acc` beside a shaped score) as verl's val-aux metrics.
        metrics.update({f"val-aux/{key.removeprefix('reward_extra/')}": value
                        for key, value in batch_ops.reward_metrics(sample_scores.extras).items()})
        return metrics

    def save(self) -> None:
        """Every role's checkpoint of this step, then (all written) the `latest` pointer: atomic as a whole."""
        state = {"step": self.global_step, "policy_version": self.policy_version,
                 "kl_coef": self.kl_ctrl.value if self.kl_ctrl is not None else None} | self.schedule_state()
        root = self.tracker.run_dir
        self.workers.actor.call(ActorRefWorker.save_checkpoint, str(root), self.global_step, state)
        if self.loop.save_hf:  # "hf_model" in actor.checkpoint.save_contents, verl's key for it
            self.save_hf(checkpoint_dir(root, self.global_step) / "actor_hf")
        if self.workers.critic is not None:
            self.workers.critic.call(CriticWorker.save_checkpoint, str(root), self.global_step, state)
        mark_latest(root, self.global_step, self.loop.max_ckpt_to_keep)

    def save_hf(self, out_dir: Path) -> None:
        """The actor as a self-contained HF model directory (weights, config, this run's tokenizer and chat
        template, generation config), written under a temporary name and renamed into place (hf_export.py)."""
        export_dir(out_dir, lambda tmp: self.workers.actor.call(ActorRefWorker.save_hf, str(tmp)), self.tokenizer)

    def schedule_state(self) -> dict[str, Any]:
        """What the schedule needs to continue exactly (synchronous: the loader's position after this step,
        `dataloader`; the async modes add what is in flight)."""
        return {"dataloader": self.loader.state_dict()}

    def restore_schedule(self, state: dict[str, Any]) -> None:
        """A checkpoint's `schedule_state()` (the trainer state it was saved in)."""
        self.loader.load_state_dict(state["dataloader"])

    def epoch(self) -> int:
        """The loader's epoch (the async modes ask their prompt feed: its thread reads the loader)."""
        return self.loader.state_dict()["epoch"]

    def resume(self, step_dir: Path) -> None:
        """Continue from the checkpoint in `step_dir` (chosen by `trainer.resume_mode`, `run_dir.start_run`)."""
        state = self.workers.actor.call(ActorRefWorker.load_checkpoint, str(step_dir))[0]
        if self.workers.critic is not None:
            self.workers.critic.call(CriticWorker.load_checkpoint, str(step_dir))
        self.global_step, self.policy_version = state["step"], state["policy_version"]
        self.restore_schedule(state)
        self.rollout_version = None  # the rollout still holds the initial weights: fit() syncs
        if self.kl_ctrl is not None:
            self.kl_ctrl.value = state["kl_coef"]
        print(f"resumed from {step_dir} at step {self.global_step}")

    def fit(self, resume_from: Path | None = None) -> None:
        """Train to the last step, from the start or (`resume_from`) from that checkpoint directory."""
        loop = self.loop
        if resume_from is not None:
            self.resume(resume_from)
        print(staleness.describe(self.plan))
        self.sync_weights(-1)
        if self.val_prompts is not None and loop.val_before_train:
            self.tracker.log(self.global_step, self.validate())
            if loop.val_only:  # verl's: the validation was the run
                return
        start = time.perf_counter()
        progress = self.tracker.progress(self.total_steps, self.global_step, self.timeline)
        pictures = Pictures(self.tracker.run_dir, run_title(self.plan), self.timeline)
        # closing() stops an async schedule's rollouter, then draws the pictures a last time (failed or not)
        with contextlib.closing(pictures), progress as step_done, contextlib.closing(self.schedule()) as steps:
            for metrics in steps:
                step_done()
                self.global_step += 1
                last = self.global_step >= self.total_steps
                if self.val_prompts is not None and loop.test_freq > 0 and (
                        last or self.global_step % loop.test_freq == 0):
                    metrics |= self.validate()
                metrics["timing_s/step_total"] = time.perf_counter() - start
                metrics["training/global_step"] = self.global_step
                metrics["training/epoch"] = self.epoch()
                self.tracker.log(self.global_step, metrics)
                if loop.save_freq > 0 and (last or self.global_step % loop.save_freq == 0):
                    self.save()
                if last:
                    return
                start = time.perf_counter()
                pictures.refresh()  # when due; its time counts in the next step's timing_s/step_total


def submit_teacher_log_probs(teachers: dict[str, RoleHandle], batch: Batch,
                             route_field: str | None) -> Callable[[], Batch]:
    """Start the distillation teachers' scoring of `batch`'s samples, each by the teacher its `route_field` value
    names (None: the lone teacher scores all): one pass per teacher over its own samples, split over its DP as every
    pass is. Returns the wait for the scores, in the batch's row order. Teachers on a pool of their own score while
    the caller goes on; on the trainer pool their calls queue on its ranks."""
    if route_field is None:
        (only,) = teachers.values()
        return only.submit(TeacherWorker.compute_log_prob, batch).get
    routes = batch.non_tensors[route_field]
    if stray := next((route for route in routes if route not in teachers), None):
        raise ValueError(f"a sample's {route_field}={stray!r} names no teacher (distillation.teacher_key; the "
                         f"teachers' keys: {sorted(teachers)})")
    order, pending = [], []
    for key, teacher in teachers.items():
        rows = [row for row, route in enumerate(routes) if route == key]
        if rows:
            pending.append(teacher.submit(TeacherWorker.compute_log_prob, batch.take(rows)))
            order += rows
    back = torch.empty(len(order), dtype=torch.long)
    back[torch.tensor(order)] = torch.arange(len(order))  # merged row back[i] is the batch's row i
    return lambda: Batch.concat([call.get() for call in pending]).take(back)


def _prefixed(role: str, per_replica: list[dict[str, list[float]]]) -> dict[str, float]:
    """Worker update metrics (identical on every DP replica: already summed over DP) -> step means per key."""
    return {f"{role}/{k}": float(np.mean(v)) for k, v in per_replica[0].items()}
