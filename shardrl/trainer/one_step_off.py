"""One-step-off-policy PPO: the synchronous step with generation moved one step ahead, onto the rollout pool.

While the trainer pool trains on batch k, the rollout pool generates batch k+1 with the weights it was last synced
to, those of step k-1's update; after step k's update and that generation, the weights are synced. Samples are at
most one version old (batch 0 is on-policy). The step's verbs are `PPOTrainer`'s; only their timing differs.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from shardrl.data.batch import Batch
from shardrl.trainer.ppo import PPOTrainer


class OneStepOffTrainer(PPOTrainer):
    def schedule(self) -> Iterator[dict[str, Any]]:
        prompts = self.prompt_batches()
        # One thread waits on the rollout pool's call, so the timeline records when generation really ended.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") as rollout:
            upcoming = rollout.submit(self._generate, next(prompts), self.global_step)
            while True:
                step, t = self.global_step, self.timeline
                with t.phase(step, "step"):
                    with t.phase(step, "wait_rollout"):
                        batch = upcoming.result()
                    if step + 1 < self.total_steps:
                        upcoming = rollout.submit(self._generate, next(prompts), step + 1)
                    batch, metrics = self.train(batch, step)
                    with t.phase(step, "wait_rollout"):
                        wait([upcoming])  # the sync needs an idle rollout pool
                    metrics |= self.sync_weights(step)
                metrics["timing_s/rollout_overlap"] = t.overlap(step, "rollout", idle=("wait_rollout",))
                yield metrics | self.step_metrics(batch, step)

    def _generate(self, prompts: Batch, step: int) -> Batch:
        with self.timeline.phase(step, "gen", lane="rollout"):
            return self.generate(prompts, step)
