"""The detached placement's workers on gloo without Ray, one world of a trainer pool (2 ranks, DP2) and a rollout pool
(2 ranks, two TP1 replicas). Regression tests for the three bugs of the async seed report:

* a detached actor normalises mini batches exactly as the colocated one (ppo_mini_batch_size x n / DP samples per
  rank: the optimizer steps and their metrics equal the colocated worker's on the same batch);
* a rollout-only worker creates no trainer group (only its own layout's and the sync group: asserted on the groups
  its process's registry made);
* weight sync with param_offload moves the updated weights (the rollout equals an engine built from the actor's HF
  export) and leaves the actor's params offloaded.

Plus partial rollout: a request paused by a sync continues under the new weights, its tokens stamped by version.
"""

import os

import pytest
import torch
import torch.distributed as dist

from shardrl.controller.dispatch import Dispatch, route
from shardrl.controller.rank_env import COLLECTIVE_TIMEOUT_ENV
from shardrl.data import builtin_task
from shardrl.data.batch import Batch, as_object_array
from shardrl.parallel import layout as layout_module
from shardrl.parallel.launch import run_distributed
from shardrl.rollout.engine import Engine
from shardrl.rollout.request import SamplingParams
from shardrl.job.load import compose
from shardrl.job.plan import plan_job

PROMPT_LEN, RESPONSE_LEN, N, PROMPTS = 5, 6, 4, 8
# 8 prompts x n=4 = 32 samples, 16 per DP rank; a mini batch is 4 prompts = 16 samples = 8 per rank, so each of the
# 2 epochs has 2 optimizer steps (4 in all). Skipping the normalisation (4 samples per rank) would give 8.
COMMON = ["trainer.device=cpu", "trainer.n_gpus_per_node=2", f"data.train_batch_size={PROMPTS}",
          "actor_rollout_ref.actor.ppo_mini_batch_size=4", f"actor_rollout_ref.rollout.n={N}",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.ppo_epochs=2",
          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", f"data.max_response_length={RESPONSE_LEN}",
          "actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.ignore_eos=true"]
DETACHED = COMMON + ["rollout.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.param_offload=true",
                     "actor_rollout_ref.actor.megatron.grad_offload=true",
                     "actor_rollout_ref.actor.megatron.optimizer_offload=true"]
OPTIMIZER_STEPS = (PROMPTS // 4) * 2


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return builtin_task.prepare(tmp_path_factory.mktemp("task"))["model"]


def synthetic_batch(vocab: int) -> Batch:
    """32 samples with random prompts, responses of random lengths and random advantages (the update's inputs)."""
    g = torch.Generator().manual_seed(0)
    num = PROMPTS * N
    prompts = torch.randint(2, vocab, (num, PROMPT_LEN), generator=g)
    responses = torch.randint(2, vocab, (num, RESPONSE_LEN), generator=g)
    lengths = torch.randint(1, RESPONSE_LEN + 1, (num, 1), generator=g)
    response_mask = (torch.arange(RESPONSE_LEN) < lengths).float()  # [num, R]
    return Batch({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([torch.ones(num, PROMPT_LEN, dtype=torch.long), response_mask.long()], 1),
        "position_ids": torch.arange(PROMPT_LEN + RESPONSE_LEN).expand(num, -1).clone(),
        "response_mask": response_mask, "advantages": torch.randn(num, RESPONSE_LEN, generator=g) * response_mask})


def prompt_row(token_ids: list[int]) -> Batch:
    ids = torch.tensor([token_ids])
    return Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                  "position_ids": torch.arange(len(token_ids)).unsqueeze(0), "sample_seed": torch.tensor([7])},
                 {"uid": as_object_array(["p"])})


def update_on_my_shard(worker, plan, batch: Batch) -> dict[str, list[float]]:
    """This rank's DP share of `batch` (as the controller routes it), old log-probs, then one PPO update."""
    routing = route(Dispatch.DP_COMPUTE, plan.roles["actor"].spec, (batch,), {})
    (shard,), _ = routing.payloads[routing.payload_of_rank[plan.trainer_ranks.index(dist.get_rank())]]
    return worker.update_actor(shard.union(worker.compute_log_prob(shard)), 0)


def offloaded(engine) -> bool:
    return all(p.untyped_storage().nbytes() == 0 for chunk in engine.chunks for p in chunk.parameters())


def run_colocated(model_path: str, batch: Batch) -> dict[str, list[float]]:
    os.environ[COLLECTIVE_TIMEOUT_ENV] = "120"
    from shardrl.workers.hybrid import ActorRolloutRefWorker

    plan = plan_job(compose("ppo_trainer", COMMON)).with_total_steps(4)
    return update_on_my_shard(ActorRolloutRefWorker(plan.actor, plan.ref, plan.rollout, model_path, 0), plan, batch)


def run_detached(model_path: str, batch: Batch, export_dir: str, prompts: list[list[int]]) -> dict:
    os.environ[COLLECTIVE_TIMEOUT_ENV] = "120"
    from shardrl.workers.detached import DetachedActorWorker
    from shardrl.workers.rollout import RolloutWorker

    plan = plan_job(compose("one_step_off_ppo_trainer", DETACHED)).with_total_steps(4)
    rank, registry = dist.get_rank(), layout_module.GroupRegistry()  # as the Ray rank host passes one
    trainer = rank in plan.trainer_ranks
    worker = (DetachedActorWorker(plan.actor, plan.ref, plan.rollout.weight_sync, model_path, registry) if trainer
              else RolloutWorker(plan.rollout, model_path, 0, registry))
    worker.sync_weights(0)
    result: dict = {}
    if trainer:
        result["update"] = update_on_my_shard(worker, plan, batch)
        result["offloaded_after_update"] = offloaded(worker.actor)
    else:  # a request that the next sync will interrupt: 3 of its 6 tokens under version 0
        mine = prompt_row(prompts[plan.rollout_ranks.index(rank)])
        result["before_sync"], result["before_stats"] = worker.stream(mine, 3)
    result["sync"] = worker.sync_weights(1)
    result["new_groups"] = sorted(registry.rank_sets())
    if trainer:
        result["offloaded_after_sync"] = offloaded(worker.actor)
        worker.save_hf(export_dir)
    else:
        result["after_sync"], result["after_stats"] = worker.stream(None, 10)
    dist.barrier()  # the export is written
    if not trainer:
        engine, engine_config = worker.engine, plan.rollout.engine
        exported = dict(Engine.from_pretrained(export_dir, engine.layout, engine_config).model.named_parameters())
        initial = dict(Engine.from_pretrained(model_path, engine.layout, engine_config).model.named_parameters())
        result["differs_from_export"] = [n for n, p in engine.model.named_parameters()
                                         if not torch.equal(p, exported[n])]
        result["changed_by_update"] = [n for n, p in engine.model.named_parameters()
                                       if not torch.equal(p, initial[n])]
        result["version"] = engine.policy_version
    return result


def greedy(path: str, prompt: list[int], num_tokens: int) -> list[int]:
    """Reference: a fresh single-process engine with `path`'s weights continues `prompt` greedily."""
    engine = Engine.from_pretrained(path, layout_module.Layout.single())
    return engine.generate([prompt], SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                                    ignore_eos=True))[0].token_ids


def test_detached_workers_normalise_like_colocated_build_no_trainer_groups_and_sync_offloaded(model_path, tmp_path):
    vocab = Engine.from_pretrained(model_path, layout_module.Layout.single()).model_config.vocab_size
    batch = synthetic_batch(vocab)
    prompts = [[3, 5, 7, 9, 11], [4, 6, 8]]
    export = str(tmp_path / "export")
    colocated = run_distributed(2, run_colocated, model_path, batch)
    detached = run_distributed(4, run_detached, model_path, batch, export, prompts)
    trainer, rollout = detached[:2], detached[2:]

    # Bug 1: the same normalisation, hence the same optimizer steps with the same losses and gradient norms.
    assert len(colocated[0]["grad_norm"]) == OPTIMIZER_STEPS
    for rank in range(2):
        assert trainer[rank]["update"] == colocated[rank]

    # Bug 2: each pool made only its own layout's groups, plus the sync group over both.
    assert [r["new_groups"] for r in trainer] == [[(0, 1), (0, 1, 2, 3)]] * 2
    assert [r["new_groups"] for r in rollout] == [[(0, 1, 2, 3), (2, 3)]] * 2

    # Bug 3: offloaded before and after the sync, and the rollout holds the updated weights exactly.
    assert all(r["offloaded_after_update"] and r["offloaded_after_sync"] for r in trainer)
    for r in rollout:
        assert r["differs_from_export"] == [] and r["changed_by_update"] and r["version"] == 1
        assert r["sync"]["sync/bytes_received"] > 0

    # Partial rollout: 3 tokens from the initial weights, then (re-prefilled after the sync) 3 from the updated ones.
    for r, prompt in zip(rollout, prompts):
        assert r["before_sync"] is None
        sample = r["after_sync"]
        length = int(sample.tensors["response_mask"].sum())
        tokens = sample.tensors["responses"][0, :length].tolist()
        first = greedy(model_path, prompt, 3)
        assert tokens == first + greedy(export, prompt + first, RESPONSE_LEN - 3)
        assert sample.tensors["policy_versions"][0].tolist() == [0, 0, 0, 1, 1, 1]
        # what the engine did: prefill (token 1) + 2 decode steps; after the sync a re-prefill of prompt + 3 tokens
        # (token 4) + 2 decode steps, one sequence each
        before, after = r["before_stats"], r["after_stats"]
        assert (before["prefill_tokens"], before["decode_steps"], before["decode_rows"]) == (len(prompt), 2, 2)
        assert (after["prefill_tokens"], after["decode_steps"], after["decode_rows"]) == (len(prompt) + 3, 2, 2)
        assert after["engine_s"] >= after["prefill_s"] > 0
