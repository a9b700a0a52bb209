"""Shared by trainer tests that run `PPOTrainer` without Ray: on every rank of a gloo world (`run_distributed`),
the trainer calls its colocated worker through `RankHandle`, which routes each call as the controller would."""

import os
import types

import torch.distributed as dist
from transformers import AutoTokenizer

from shardrl.controller.dispatch import DISPATCH_ATTR, DISPATCH_LAYOUT_ATTR, route
from shardrl.controller.rank_env import COLLECTIVE_TIMEOUT_ENV
from shardrl.data.batch import Batch
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.trainer.ppo import PPOTrainer, Workers


class RankHandle:
    """The controller's role handle inside a gloo world: each rank runs its dispatch payload on its own worker and
    all ranks gather the results, so every rank's trainer sees what the controller would. Records the tokens of
    this rank's share of the last batch each method was handed."""

    def __init__(self, worker, plan) -> None:
        self.worker, self.plan, self.layout = worker, plan, plan.roles["actor"].spec
        self.tokens: dict[str, int] = {}

    def call(self, method, *args, **kwargs):
        """As `RoleHandle.call`: `method` is the worker class's method, run here on this rank's worker."""
        name = method.__name__
        bound = getattr(self.worker, name)
        spec = self.plan.roles[getattr(method, DISPATCH_LAYOUT_ATTR) or "actor"].spec
        routing = route(getattr(method, DISPATCH_ATTR), spec, args, kwargs)
        mine_args, mine_kwargs = routing.payloads[routing.payload_of_rank[dist.get_rank()]]
        for value in (*mine_args, *mine_kwargs.values()):
            if isinstance(value, Batch) and "attention_mask" in value.tensors.keys():
                self.tokens[name] = int(value.unpad().tensors["attention_mask"].sum())
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, bound(*mine_args, **mine_kwargs))
        return routing.collect({r: gathered[r] for r in routing.reporting_ranks})

    def submit(self, method, *args, **kwargs):
        """As `RoleHandle.submit`, run at once (every rank submits in the same order): a call already done."""
        value = self.call(method, *args, **kwargs)
        return types.SimpleNamespace(get=lambda: value)

    def replicas(self, method) -> int:
        """As `RoleHandle.replicas`."""
        return self.plan.roles[getattr(method, DISPATCH_LAYOUT_ATTR) or "actor"].spec.dp


def colocated_trainer(model_path: str, overrides: list[str], score_fn, tracker=None, val_prompts=None):
    """(PPOTrainer over a fresh colocated actor worker on this world's ranks, its RankHandle, its tokenizer)."""
    from shardrl.workers.hybrid import ActorRolloutRefWorker

    os.environ[COLLECTIVE_TIMEOUT_ENV] = "120"
    plan = plan_job(compose("ppo_trainer", overrides)).with_total_steps(1)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    worker = ActorRolloutRefWorker(plan.actor, plan.ref, plan.rollout, model_path, tokenizer.pad_token_id)
    handle = RankHandle(worker, plan)
    trainer = PPOTrainer(plan, Workers(handle, None), None, val_prompts, tokenizer, score_fn, tracker, None)
    return trainer, handle, tokenizer
