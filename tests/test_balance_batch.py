"""`trainer.balance_batch`: whole samples reordered so each DP rank gets near-equal tokens, every optimizer step
keeping its samples. Pure checks of the order and the batch reordering, then the trainer's step on gloo with it on
and off: identical metrics at DP=1, equal losses and gradient norms at DP=2 with balanced per-rank tokens."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from transformers import AutoTokenizer
from trainer_in_gloo import colocated_trainer

from shardrl.data import builtin_task
from shardrl.data.balance import dp_balanced_order
from shardrl.data.batch import Batch, as_object_array
from shardrl.data.rl_dataset import RLDataset
from shardrl.parallel.launch import run_distributed
from shardrl.trainer import batch_ops
from shardrl.job.load import compose
from shardrl.job.plan import plan_job


def rank_loads(order: list[int], lens: list[int], num_ranks: int) -> list[int]:
    chunk = len(order) // num_ranks
    return [sum(lens[i] for i in order[r * chunk:(r + 1) * chunk]) for r in range(num_ranks)]


def test_order_balances_ranks_and_keeps_each_steps_samples():
    # 2 ranks x 2 mini batches of 4 rows. Unbalanced, rank 0 holds every long sample.
    lens = [90, 80, 70, 60, 50, 40, 30, 20, 1, 2, 3, 4, 5, 6, 7, 8]
    order = dp_balanced_order(lens, 2, 4)
    assert sorted(order) == list(range(16))
    assert rank_loads(list(range(16)), lens, 2) == [440, 36]
    loads = rank_loads(order, lens, 2)
    assert max(loads) - min(loads) <= max(lens)
    # Step j of rank r is order[r*8 + 4j : r*8 + 4j + 4]; step j's samples across ranks are unchanged.
    for j, expected in enumerate([{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}]):
        assert {i for r in range(2) for i in order[r * 8 + 4 * j:r * 8 + 4 * j + 4]} == expected
    assert dp_balanced_order(lens, 1, 4) == list(range(16))
    with pytest.raises(ValueError, match="16 samples do not split into 2 ranks x mini batches of 3 rows"):
        dp_balanced_order(lens, 2, 3)


def test_balance_over_dp_permutes_whole_samples_and_reports_verl_seqlen_metrics():
    # 2 prompts x n=2, one mini batch of 2 prompts: 2 rows per rank at DP=2. Tokens per sample 10, 8, 2, 1.
    loop = dataclasses.replace(plan_job(compose("ppo_trainer")).loop, train_batch_size=2, actor_mini_batch_size=2,
                               samples_per_prompt=2)
    lens = torch.tensor([10, 8, 2, 1])
    mask = (torch.arange(12) < lens[:, None]).long()  # [4, 12]
    batch = Batch({"attention_mask": mask, "row": torch.arange(4), "scores": torch.randn(4, 3)},
                  {"uid": as_object_array(["a", "a", "b", "b"])})
    balanced, metrics = batch_ops.balance_over_dp(batch, loop, actor_dp=2, critic_dp=None)
    rows = balanced.tensors["row"]
    assert sorted(rows.tolist()) == [0, 1, 2, 3] and rows.tolist() != [0, 1, 2, 3]
    for key in ("attention_mask", "scores"):
        assert torch.equal(balanced.tensors[key], batch.tensors[key][rows])
    assert balanced.non_tensors["uid"].tolist() == [batch.non_tensors["uid"][i] for i in rows]
    # By hand: contiguous split 10+8=18 | 2+1=3; best pairs {10, 1}=11 | {8, 2}=10; mean 21/2.
    assert metrics == {"global_seqlen/min": 3.0, "global_seqlen/max": 18.0, "global_seqlen/minmax_diff": 15.0,
                       "global_seqlen/balanced_min": 10.0, "global_seqlen/balanced_max": 11.0,
                       "global_seqlen/mean": 10.5}


def spread_score(data_source: str, text: str, ground_truth: str, extra_info: dict) -> float:
    """Scores that differ within a group, so advantages and gradients are not zero (the untrained policy almost
    never earns the task's reward)."""
    return float(sum(map(ord, text)) % 5)


def one_step(paths: dict[str, str], prompt_rows: list[int], overrides: list[str]) -> tuple[dict, dict[str, int]]:
    trainer, handle, tokenizer = colocated_trainer(paths["model"], overrides, spread_score)
    prompts = RLDataset(paths["val_files"], tokenizer, trainer.plan.data.max_prompt_length).collate(prompt_rows)
    return trainer.step(prompts), handle.tokens


def step_with_and_without_balancing(paths: dict[str, str], prompt_rows: list[int]) -> dict:
    # 4 prompts x n=4 = 16 samples; mini batch 2 prompts: 2 optimizer steps, 4 rows per rank and step at DP=2.
    common = ["trainer.device=cpu", f"trainer.n_gpus_per_node={dist.get_world_size()}", "data.train_batch_size=4",
              "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"]
    on, on_tokens = one_step(paths, prompt_rows, common + ["trainer.balance_batch=true"])
    off, off_tokens = one_step(paths, prompt_rows, common + ["trainer.balance_batch=false"])
    return {"on": on, "off": off, "on_tokens": on_tokens, "off_tokens": off_tokens}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    paths = builtin_task.prepare(tmp_path_factory.mktemp("task"))
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    lengths = RLDataset(paths["val_files"], tokenizer).prompt_ids
    by_length = sorted(range(len(lengths)), key=lambda i: len(lengths[i]))
    # Two long prompts, then two short: the contiguous DP split gives rank 0 all the long ones.
    return paths, by_length[-2:] + by_length[:2]


def compared(metrics: dict) -> dict:
    timed = ("timing_s/", "perf/throughput", "sync/seconds", "sync/gbps")
    return {k: v for k, v in metrics.items() if not k.startswith((*timed, "global_seqlen/"))}


def test_balancing_changes_nothing_at_dp1(task):
    paths, rows = task
    (result,) = run_distributed(1, step_with_and_without_balancing, paths, rows)
    assert result["on"]["global_seqlen/minmax_diff"] == 0
    assert "global_seqlen/min" not in result["off"]
    assert compared(result["on"]) == compared(result["off"])


def test_balancing_evens_rank_tokens_and_keeps_losses_at_dp2(task):
    paths, rows = task
    results = run_distributed(2, step_with_and_without_balancing, paths, rows)
    on, off = results[0]["on"], results[0]["off"]
    on_loads = [r["on_tokens"]["update_actor"] for r in results]
    off_loads = [r["off_tokens"]["update_actor"] for r in results]
    assert sum(on_loads) == sum(off_loads)
    # Prompts of 7 and 4 tokens plus 1-2 response tokens: unbalanced, rank 0 holds the long ones.
    assert off_loads[0] - off_loads[1] >= 16
    assert abs(on_loads[0] - on_loads[1]) <= 9  # at most one sample's tokens
    assert on["global_seqlen/minmax_diff"] == off_loads[0] - off_loads[1]
    assert on["global_seqlen/balanced_max"] - on["global_seqlen/balanced_min"] == abs(on_loads[0] - on_loads[1])
    assert compared(on).keys() == compared(off).keys()
    for key, value in compared(off).items():
        assert on[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert off["actor/grad_norm"] > 0 and off["critic/advantages/max"] > 0
