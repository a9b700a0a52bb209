"""DAPO's dynamic sampling and overlong shaping in the synchronous trainer: the group filter on hand-built scored
rounds (which groups are kept, trimming in generation order, the round limit), the shaped score reaching rewards and
advantages, distinct seeds per round, and a 3-step run on the built-in task whose trained batches hold exactly
train_batch_size groups with a spread, and whose loader position counts every round (a resume reads on from there)."""

import os

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer
from trainer_in_gloo import RankHandle

from shardrl.controller.rank_env import COLLECTIVE_TIMEOUT_ENV
from shardrl.data import builtin_task
from shardrl.data.batch import Batch, as_object_array
from shardrl.data.rl_dataset import PromptLoader, RLDataset
from shardrl.parallel.launch import run_distributed
from shardrl.rewards import digits
from shardrl.rewards.manager import SampleScores
from shardrl.rewards.registry import default_compute_score
from shardrl.trainer import batch_ops
from shardrl.job.load import compose
from shardrl.trainer.dynamic_sampling import collect, informative_uids, metric_values
from shardrl.job.plan import plan_job
from shardrl.trainer.ppo import PPOTrainer, Workers


def scored_round(groups: dict[str, list[float]], shaped: dict[str, list[float]] | None = None,
                 extras: dict[str, list] | None = None) -> tuple[Batch, SampleScores]:
    """A scored generation round: per uid its samples' reward-function scores (and, if given, the shaped scores
    that sit on the last token); `row` names each sample as '<uid><i>'."""
    uids = [uid for uid, values in groups.items() for _ in values]
    scores = torch.tensor([v for values in groups.values() for v in values])
    seq = torch.tensor([v for values in (shaped or groups).values() for v in values])
    token_level = torch.stack([torch.zeros_like(seq), seq], dim=1)  # [B, 2]: the score on the last token
    names = [f"{uid}{i}" for uid, values in groups.items() for i in range(len(values))]
    batch = Batch({"token_level_scores": token_level}, {"uid": as_object_array(uids), "row": as_object_array(names)})
    return batch, SampleScores(token_level, scores, extras or {})


def test_uniform_groups_are_the_ones_with_all_values_equal():
    uids = ["a", "a", "a", "b", "b", "b", "c", "c", "c"]
    values = np.array([0.1, 0.1, 0.1, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    assert np.std(values[:3]) > 0  # rounding: a standard deviation test would keep group a
    assert informative_uids(uids, values) == ["b"]
    assert informative_uids(["x", "y", "x", "y"], np.array([1.0, 0.0, 0.0, 0.0])) == ["x"]  # interleaved rows


def test_collect_keeps_the_first_groups_with_a_spread_in_generation_order():
    rounds = [scored_round({"a": [1, 1], "b": [0, 1], "c": [0, 0]}),
              scored_round({"d": [1, 0], "e": [0.5, 0.5], "f": [0, 1]}),
              scored_round({"g": [0, 1]})]
    drawn = []

    def lazily():
        for r in rounds:
            drawn.append(r)
            yield r

    batch, metrics = collect(lazily(), "seq_reward", num_groups=2, max_rounds=0)
    assert batch.non_tensors["row"].tolist() == ["b0", "b1", "d0", "d1"]  # f had a spread too: trimmed
    assert len(drawn) == 2  # the third round was never generated
    assert metrics == {"train/num_gen_batches": 2.0, "train/num_gen_groups": 6.0, "train/num_kept_groups": 3.0,
                       "train/kept_group_ratio": 0.5}
    batch, metrics = collect(iter(rounds), "seq_reward", num_groups=4, max_rounds=3)
    assert batch.non_tensors["row"].tolist() == ["b0", "b1", "d0", "d1", "f0", "f1", "g0", "g1"]
    assert metrics["train/num_gen_batches"] == 3.0


def test_collect_fails_naming_the_round_limit():
    rounds = [scored_round({"a": [1, 1], "b": [0, 1]}), scored_round({"c": [0, 0], "d": [1, 1]})]
    with pytest.raises(RuntimeError, match=r"^algorithm.filter_groups.max_num_gen_batches=2: after 2 generation "
                                           r"rounds only 1 of 4 prompt groups had a spread of acc, 2 needed"):
        collect(iter(rounds), "acc", num_groups=2, max_rounds=2)
    with pytest.raises(RuntimeError, match="ran out of prompt batches with 1 of 2 groups kept"):
        collect(iter(rounds), "acc", num_groups=2, max_rounds=0)


def test_metrics_name_scores_before_or_after_shaping_and_acc():
    # Group a: both right, one overlong (shaped 1 -> 0.5); group b: one right, one wrong.
    batch, scores = scored_round({"a": [1, 1], "b": [1, 0]}, shaped={"a": [1, 0.5], "b": [1, 0]})
    assert metric_values(batch, scores, "score").tolist() == [1, 1, 1, 0]
    assert metric_values(batch, scores, "seq_reward").tolist() == [1, 0.5, 1, 0]
    assert metric_values(batch, scores, "seq_final_reward").tolist() == [1, 0.5, 1, 0]
    assert metric_values(batch, scores, "acc").tolist() == [1, 1, 1, 0]  # a plain-number reward is its own acc
    assert collect(iter([(batch, scores)]), "score", 1, 1)[0].non_tensors["row"].tolist() == ["b0", "b1"]
    assert collect(iter([(batch, scores)]), "seq_reward", 2, 1)[1]["train/num_kept_groups"] == 2.0
    # A reward function's own `acc` decides over its score.
    batch, scores = scored_round({"a": [0.2, 0.7]}, extras={"acc": [True, True]})
    assert metric_values(batch, scores, "acc").tolist() == [1.0, 1.0]
    _, scores = scored_round({"a": [0.2, 0.7]}, extras={"acc": [True, None]})
    with pytest.raises(ValueError, match="returned an 'acc' for some samples only"):
        metric_values(batch, scores, "acc")


def test_each_round_of_a_step_has_its_own_seeds_and_round_0_keeps_them():
    seed = plan_job(compose("ppo_trainer")).loop.seed  # trainer.seed=1
    rows = Batch({"x": torch.zeros(6)})
    seeds = [batch_ops.with_sample_seeds(rows, seed, step, r).tensors["sample_seed"].tolist()
             for step, r in ((0, 0), (0, 1), (0, 2), (1, 0))]
    assert seeds[0] == list(range(1_065_540, 1_065_546))  # (1 * 1_000_003 + 1 * 65_537) + row, as before rounds
    assert seeds[1][0] == 1_065_540 + 2**24 and seeds[2][0] == 1_065_540 + 2 * 2**24
    assert len(set(seeds[0] + seeds[1] + seeds[2] + seeds[3])) == 24


# DAPO's overlong shaping in the DAPO recipe's spelling and in verl's main-trainer one (reward-manager kwargs).
OVERLONG_SPELLINGS = {
    "recipe": ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=1",
               "reward_model.overlong_buffer.penalty_factor=0.5"],
    "reward_kwargs": ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                      "+reward_model.reward_kwargs.overlong_buffer_cfg.len=1",
                      "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
                      "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
                      "+reward_model.reward_kwargs.max_resp_len=2"],
}


@pytest.mark.parametrize("spelling", OVERLONG_SPELLINGS)
def test_overlong_penalty_reaches_rewards_and_advantages(tmp_path, spelling):
    """Two correct responses of 1 and 2 generated tokens with L = 2, B = 1, factor 0.5: the second loses 0.5. The
    group (both right) then has a spread: GRPO gives +-1/sqrt(2) (normalised by the unbiased std of [1, 0.5])."""
    plan = plan_job(compose("ppo_trainer", OVERLONG_SPELLINGS[spelling]))
    tokenizer = builtin_task.make_tokenizer(tmp_path)
    three, eos, pad = (tokenizer.convert_tokens_to_ids(t) for t in ("3", "<eos>", "<pad>"))
    batch = Batch({"responses": torch.tensor([[three, pad], [three, eos]]),
                   "response_mask": torch.tensor([[1, 0], [1, 1]]), "attention_mask": torch.tensor([[1, 0], [1, 1]]),
                   "rollout_log_probs": torch.zeros(2, 2), "old_log_probs": torch.zeros(2, 2)},
                  {"data_source": [builtin_task.DATA_SOURCE] * 2, "reward_model": [{"ground_truth": "3"}] * 2,
                   "extra_info": [{}] * 2, "uid": as_object_array(["p", "p"])})
    batch, scores = batch_ops.score(batch, tokenizer, default_compute_score, plan.reward)
    assert scores.scores.tolist() == [1.0, 1.0] and scores.extras == {}  # .log is off
    batch_ops.apply_rewards_and_correction(batch, plan.algorithm, None)
    batch_ops.advantages(batch, plan.algorithm)
    assert batch.tensors["token_level_rewards"].tolist() == [[1.0, 0.0], [0.0, 0.5]]
    expected = 0.25 / (0.5 / 2**0.5)  # (score - mean) / std, std = |1 - 0.5| / sqrt(2)
    advantages = batch.tensors["advantages"]  # [2, 2]
    assert torch.allclose(advantages[0, :1], torch.tensor([expected]), atol=1e-4)
    assert torch.allclose(advantages[1], torch.tensor([-expected, -expected]), atol=1e-4)


class RecordingTrainer(PPOTrainer):
    """The synchronous trainer, recording what each round generated and what each step trained on."""

    generated: list
    trained: list

    def generate_scored(self, prompts: Batch, step: int, gen_round: int = 0):
        batch, scores = super().generate_scored(prompts, step, gen_round)
        self.generated.append((step, [e["index"] for e in prompts.non_tensors["extra_info"]], rows_of(batch)))
        return batch, scores

    def train(self, batch: Batch, step: int):
        self.trained.append(rows_of(batch))
        return super().train(batch, step)


def rows_of(batch: Batch) -> list[tuple[str, list[int], str]]:
    """(uid, generated token ids, ground truth) per row: enough to score a sample again in the test."""
    t = batch.tensors
    return [(uid, ids[mask.bool()].tolist(), rm["ground_truth"]) for uid, ids, mask, rm in
            zip(batch.non_tensors["uid"], t["responses"], t["response_mask"], batch.non_tensors["reward_model"])]


def filtered_run(paths: dict[str, str], overrides: list[str], num_steps: int) -> dict:
    from shardrl.workers.hybrid import ActorRolloutRefWorker

    os.environ[COLLECTIVE_TIMEOUT_ENV] = "120"
    config = compose("ppo_trainer", overrides)
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    plan = plan_job(config).with_total_steps(num_steps)
    worker = ActorRolloutRefWorker(plan.actor, plan.ref, plan.rollout, paths["model"], tokenizer.pad_token_id)
    data = plan.data
    loader = PromptLoader(RLDataset([paths["train_files"]], tokenizer, data.max_prompt_length), data.gen_batch_size,
                          data.shuffle, data.seed)
    trainer = RecordingTrainer(plan, Workers(RankHandle(worker, plan), None), loader, None, tokenizer,
                               default_compute_score, None, None)
    trainer.generated, trainer.trained = [], []
    steps, metrics, states = trainer.schedule(), [], []
    for _ in range(num_steps):
        metrics.append({k: v for k, v in next(steps).items() if k.startswith(("train/", "critic/score"))})
        states.append(trainer.schedule_state()["dataloader"])
        trainer.global_step += 1
    return {"generated": trainer.generated, "trained": trainer.trained, "metrics": metrics, "states": states}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return builtin_task.prepare(tmp_path_factory.mktemp("task"))


TRAIN_BATCH, GEN_BATCH, N = 4, 8, 4


def test_filtered_steps_train_the_first_groups_with_a_spread_and_the_loader_counts_every_round(task):
    # The untrained policy is right about 1 time in 10: most groups of 4 are all wrong, so a step needs more than
    # one round of 8 prompts to keep 4 groups.
    overrides = ["trainer.device=cpu", "trainer.n_gpus_per_node=1", f"data.train_batch_size={TRAIN_BATCH}",
                 f"data.gen_batch_size={GEN_BATCH}", f"actor_rollout_ref.rollout.n={N}",
                 f"actor_rollout_ref.actor.ppo_mini_batch_size={TRAIN_BATCH}",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
                 "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"]
    (run,) = run_distributed(1, filtered_run, task, overrides, 3)
    tokenizer = AutoTokenizer.from_pretrained(task["model"])

    def score(row) -> float:  # the built-in task's scorer on the decoded response, as the test's own reference
        return digits.compute_score(tokenizer.decode(row[1], skip_special_tokens=True), row[2])

    rounds_per_step = [sum(1 for s, _, _ in run["generated"] if s == step) for step in range(3)]
    assert max(rounds_per_step) > 1
    for step, (trained, metrics) in enumerate(zip(run["trained"], run["metrics"])):
        assert metrics["train/num_gen_batches"] == rounds_per_step[step]
        assert metrics["train/num_gen_groups"] == rounds_per_step[step] * GEN_BATCH
        generated = [row for s, _, rows in run["generated"] if s == step for row in rows]
        groups: dict[str, list[float]] = {}
        for row in generated:
            groups.setdefault(row[0], []).append(score(row))
        spread = [uid for uid, values in groups.items() if len(set(values)) > 1]
        assert metrics["train/num_kept_groups"] == len(spread) >= TRAIN_BATCH
        assert len(trained) == TRAIN_BATCH * N
        assert list(dict.fromkeys(row[0] for row in trained)) == spread[:TRAIN_BATCH]  # first in generation order
        assert sorted(trained) == sorted(row for row in generated if row[0] in spread[:TRAIN_BATCH])

    # The loader's position after each step is that of a fresh loader that served every round so far, and a loader
    # restored there serves the next step's first round.
    dataset = RLDataset([task["train_files"]], tokenizer)
    for step, state in enumerate(run["states"]):
        fresh = PromptLoader(dataset, GEN_BATCH, True, 1)
        batches = iter(fresh)
        for _ in range(sum(rounds_per_step[:step + 1])):
            next(batches)
        assert fresh.state_dict() == state
        if step + 1 < 3:
            resumed = PromptLoader(dataset, GEN_BATCH, True, 1)
            resumed.load_state_dict(state)
            first = next(iter(resumed)).non_tensors["extra_info"]
            assert [e["index"] for e in first] == next(idx for s, idx, _ in run["generated"] if s == step + 1)
