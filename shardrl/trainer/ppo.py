"""The synchronous PPO loop on a colocated hybrid engine: one `step` reads as the named verbs of DESIGN.md."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardrl.algos import KLController
from shardrl.controller.group import RoleHandle
from shardrl.data.batch import Batch
from shardrl.data.rl_dataset import PromptLoader
from shardrl.models.checkpoint import find_latest, mark_latest
from shardrl.trainer import batch_ops
from shardrl.trainer.config import PPOConfig
from shardrl.trainer.tracking import Timeline, Tracker


@dataclass
class Workers:
    actor: RoleHandle  # ActorRolloutRefWorker: generate, log-probs, ref log-probs, update, weight sync
    critic: RoleHandle | None


class PPOTrainer:
    def __init__(self, config: PPOConfig, workers: Workers, loader: PromptLoader, val_prompts: Batch | None,
                 tokenizer, score_fn, tracker: Tracker, kl_ctrl: KLController | None, total_steps: int) -> None:
        self.config, self.workers, self.loader, self.val_prompts = config, workers, loader, val_prompts
        self.tokenizer, self.score_fn, self.tracker, self.kl_ctrl = tokenizer, score_fn, tracker, kl_ctrl
        self.total_steps = total_steps
        self.timeline = Timeline()
        self.global_step = 0

    def step(self, prompts: Batch) -> dict[str, float]:
        """generate -> score -> log-probs (old, ref) -> values -> advantages -> update critic, actor -> sync."""
        step, w, t = self.global_step, self.workers, self.timeline
        metrics: dict[str, Any] = {}
        with t.phase(step, "step"):
            with t.phase(step, "gen"):
                samples = batch_ops.assign_uids(prompts).repeat(self.config.actor_rollout_ref.rollout.n)
                batch = w.actor.generate_sequences(batch_ops.with_sample_seeds(samples, self.config, step))
            with t.phase(step, "reward"):
                batch, reward_metrics = batch_ops.score(batch, self.tokenizer, self.score_fn)
            if self.config.recompute_old_log_probs:
                with t.phase(step, "old_log_prob"):
                    batch = batch.union(w.actor.compute_log_prob(batch))
            if self.config.use_reference_policy:
                with t.phase(step, "ref"):
                    batch = batch.union(w.actor.compute_ref_log_prob(batch))
            if w.critic is not None:
                with t.phase(step, "values"):
                    batch = batch.union(w.critic.compute_values(batch))
            with t.phase(step, "adv"):
                metrics |= batch_ops.apply_rewards_and_correction(batch, self.config, self.kl_ctrl)
                batch_ops.advantages(batch, self.config)
            if w.critic is not None:
                with t.phase(step, "update_critic"):
                    metrics |= _prefixed("critic", w.critic.update_critic(batch, step))
            if step >= self.config.trainer.critic_warmup:
                with t.phase(step, "update_actor"):
                    metrics |= _prefixed("actor", w.actor.update_actor(batch, step))
                with t.phase(step, "sync"):
                    metrics |= w.actor.sync_weights(step + 1)[0]
        metrics |= reward_metrics | batch_ops.data_metrics(batch) | t.step_timing(step)
        tokens = float(batch.tensors["attention_mask"].sum())
        metrics["perf/total_num_tokens"] = tokens
        metrics["perf/throughput"] = tokens / metrics["timing_s/step"]
        return metrics

    def validate(self) -> dict[str, float]:
        n = self.config.actor_rollout_ref.rollout.val_kwargs.n
        samples = batch_ops.with_sample_seeds(batch_ops.assign_uids(self.val_prompts).repeat(n), self.config, -1)
        batch = self.workers.actor.generate_sequences(samples, validate=True)
        batch, _ = batch_ops.score(batch, self.tokenizer, self.score_fn)
        scores = batch.tensors["token_level_scores"].sum(-1).numpy()
        sources = batch.non_tensors["data_source"]
        metrics = {f"val-core/{s}/reward/mean@1": float(scores[sources == s].mean()) for s in set(sources)}
        metrics["val-core/reward/mean"] = float(np.mean(scores))
        return metrics

    def save(self) -> None:
        """Every role's checkpoint of this step, then (all written) the `latest` pointer: atomic as a whole."""
        state = {"step": self.global_step, "dataloader": self.loader.state_dict(), "policy_version": self.global_step,
                 "kl_coef": self.kl_ctrl.value if self.kl_ctrl is not None else None}
        root = self.tracker.run_dir
        self.workers.actor.save_checkpoint(str(root), self.global_step, state)
        if self.workers.critic is not None:
            self.workers.critic.save_checkpoint(str(root), self.global_step, state)
        mark_latest(root, self.global_step, self.config.trainer.max_actor_ckpt_to_keep)

    def resume(self) -> None:
        trainer = self.config.trainer
        if trainer.resume_mode == "disable":
            return
        step_dir = find_latest(self.tracker.run_dir) if trainer.resume_mode == "auto" else trainer.resume_from_path
        if step_dir is None:
            return
        state = self.workers.actor.load_checkpoint(str(step_dir))[0]
        if self.workers.critic is not None:
            self.workers.critic.load_checkpoint(str(step_dir))
        self.loader.load_state_dict(state["dataloader"])
        self.global_step = state["step"]
        if self.kl_ctrl is not None:
            self.kl_ctrl.value = state["kl_coef"]
        print(f"resumed from {step_dir} at step {self.global_step}")

    def fit(self) -> None:
        trainer = self.config.trainer
        self.resume()
        if self.val_prompts is not None and trainer.val_before_train:
            self.tracker.log(self.global_step, self.validate())
        while self.global_step < self.total_steps:
            for prompts in self.loader:
                start = time.perf_counter()
                metrics = self.step(prompts)
                self.global_step += 1
                last = self.global_step >= self.total_steps
                if self.val_prompts is not None and trainer.test_freq > 0 and (
                        last or self.global_step % trainer.test_freq == 0):
                    metrics |= self.validate()
                metrics["timing_s/step_total"] = time.perf_counter() - start
                metrics["training/global_step"] = self.global_step
                metrics["training/epoch"] = self.loader.state_dict()["epoch"]
                self.tracker.log(self.global_step, metrics)
                if trainer.save_freq > 0 and (last or self.global_step % trainer.save_freq == 0):
                    self.save()
                if last:
                    return


def _prefixed(role: str, per_replica: list[dict[str, list[float]]]) -> dict[str, float]:
    """Worker update metrics (identical on every DP replica: already summed over DP) -> step means per key."""
    return {f"{role}/{k}": float(np.mean(v)) for k, v in per_replica[0].items()}
