"""`TeacherWorker`: one on-policy distillation teacher, a frozen model of its own scoring the student's samples.

A teacher is a role of its own, on the trainer pool's ranks beside the actor (one process per rank holds both, with
shared process groups) or on its share of the teachers' pool (verl 0.8+'s `distillation.n_gpus_per_node`), where
its calls run while the trainer pool computes the other log-probs. Scores are taken at temperature 1, the teacher's
own distribution, as verl scores it whatever the rollout's temperature.
"""

from __future__ import annotations

import torch

from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.data.batch import Batch
from shardrl.job.options import TeacherOptions
from shardrl.parallel.layout import GroupRegistry
from shardrl.workers.actor import compute_log_prob, compute_topk_log_probs
from shardrl.workers.role_model import build_engine, resident


class TeacherWorker:
    def __init__(self, options: TeacherOptions, registry: GroupRegistry | None = None) -> None:
        self.options = options
        if options.memory_fraction is not None and torch.cuda.is_available():
            # verl's gpu_memory_utilization of the teacher's engine: the share of the GPU this process may allocate
            torch.cuda.set_per_process_memory_fraction(options.memory_fraction)
        self.engine = build_engine(options.model, options.model_path, registry)

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """Of the sampled tokens (`teacher_log_probs` [B, R]), or for forward_kl_topk the teacher's top k of every
        response position (`TEACHER_TOPK`), at temperature 1."""
        o = self.options
        with resident(self.engine, o.model):
            if o.topk is not None:
                return compute_topk_log_probs(self.engine, batch, o.log_prob, 1.0, o.topk)
            log_probs, _ = compute_log_prob(self.engine, batch, o.log_prob, 1.0)
        return Batch({"teacher_log_probs": log_probs})
