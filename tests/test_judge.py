"""The generative judge (`reward_model.judge`): its engine writes the verdicts transformers' greedy `generate`
writes for the same judge prompts (1 process and TP2 on gloo), the prompt is the judge's own chat template around
the filled template, scores parse from the last match, unparsed verdicts are counted and scored as configured (or
end the run naming the sample), and a training job on the built-in task is scored by it."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardrl.controller.rank_env import COLLECTIVE_TIMEOUT_ENV
from shardrl.data import builtin_task
from shardrl.data.batch import Batch, as_object_array
from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.parallel.launch import run_distributed
from shardrl.rewards.manager import JudgeScoring, compute_token_level_scores
from shardrl.rewards.outcomes import RewardFunctionError
from shardrl.workers.judge import judge_prompts, parse_score

TEMPLATE = "Question: {prompt}\nAnswer: {response}\nExpected: {ground_truth}\nVerdict:"
QUESTIONS = [("What is 3 + 4?", "7", "7"), ("Name a digit.", "52", "2"), ("Say 9.", "", "9")]  # answers: digits
QWEN3 = "/work/shared/data/tokenizers/qwen3"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return builtin_task.prepare(tmp_path_factory.mktemp("task"))


def sample_batch(tokenizer, response_length: int = 6) -> Batch:
    """Rows with chat prompts, right-padded responses (the attention mask over prompt + response) and seeds."""
    rows = len(QUESTIONS)
    prompt_width = 3  # the judge reads raw_prompt, not the prompt tokens
    responses = torch.full((rows, response_length), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros(rows, prompt_width + response_length, dtype=torch.long)
    attention[:, :prompt_width] = 1
    for row, (_, answer, _) in enumerate(QUESTIONS):
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"][:response_length]
        responses[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[row, prompt_width:prompt_width + len(ids)] = 1
    return Batch({"responses": responses, "attention_mask": attention,
                  "response_mask": attention[:, prompt_width:].float(),
                  "sample_seed": torch.arange(rows, dtype=torch.long) + 100},
                 {"raw_prompt": as_object_array([[{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": q}] for q, _, _ in QUESTIONS]),
                  "reward_model": as_object_array([{"ground_truth": truth} for _, _, truth in QUESTIONS]),
                  "extra_info": as_object_array([{}] * rows), "data_source": as_object_array(["t"] * rows)})


@pytest.mark.skipif(not os.path.isdir(QWEN3), reason="needs ../shared/data's Qwen3 tokenizer")
def test_the_judge_prompt_is_its_chat_template_around_the_filled_template(task):
    """The policy (the built-in task's digit tokenizer) and the judge (Qwen3's) tokenize differently: the response
    is decoded with the policy's and the prompt rendered with the judge's own template."""
    policy, judge = AutoTokenizer.from_pretrained(task["model"]), AutoTokenizer.from_pretrained(QWEN3)
    prompts = judge_prompts(sample_batch(policy), policy, judge, TEMPLATE)
    for ids, (question, answer, truth) in zip(prompts, QUESTIONS):
        text = TEMPLATE.format(prompt=question, response=answer, ground_truth=truth)
        expected = judge.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False)
        assert ids == list(expected)
        assert judge.decode(ids).endswith("<|im_start|>assistant\n")


def test_a_score_is_the_last_match_of_the_pattern():
    pattern = re.compile(r"[Ss]core:\s*(-?\d+(?:\.\d+)?)")
    assert parse_score("score: 3 ... Score: 0.5", pattern) == 0.5
    assert parse_score("Score: -2", pattern) == -2.0
    assert math.isnan(parse_score("no verdict", pattern))
    assert parse_score("a 7 then 4", re.compile(r"\d")) == 4.0  # no group: the whole match
    assert math.isnan(parse_score("x", re.compile(r"(x)")))  # matched, not a number
    assert math.isnan(parse_score("inf", re.compile(r"(inf)")))  # not finite


def judged(seeds_scores, combine, on_parse_failure="score", failure_score=-1.0, weight=2.0, failed_rows=()):
    rows = len(seeds_scores)
    mask = torch.ones(rows, 2)
    tensors = {"judge_scores": torch.tensor(seeds_scores, dtype=torch.float32), "response_mask": mask,
               "responses": torch.ones(rows, 2, dtype=torch.long), "attention_mask": torch.ones(rows, 4)}
    if failed_rows:
        tensors["agent_loop_errors"] = torch.tensor([float(r in failed_rows) for r in range(rows)])
    batch = Batch(tensors, {"judge_verdicts": as_object_array([f"verdict {r}" for r in range(rows)]),
                            "data_source": as_object_array(["t"] * rows),
                            "reward_model": as_object_array([{"ground_truth": "1"}] * rows),
                            "extra_info": as_object_array([{}] * rows)})
    judge = JudgeScoring("/j", combine, weight, on_parse_failure, failure_score)
    return compute_token_level_scores(batch, Tokenizer(), lambda *sample: 10.0, judge=judge)


class Tokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return ["x" for _ in rows]


def test_judge_scores_replace_or_add_to_the_reward_function_and_unparsed_ones_are_counted():
    replaced = judged([0.5, math.nan, 1.0], "replace")
    assert replaced.scores.tolist() == [1.0, -2.0, 2.0]  # weight 2; the unparsed one scores -1 (times the weight)
    assert replaced.token_level[:, -1].tolist() == [1.0, -2.0, 2.0]
    assert replaced.extras == {"judge_score": [0.5, -1.0, 1.0], "judge_parse_failed": [0.0, 1.0, 0.0]}
    added = judged([0.5, math.nan, 1.0], "add")
    assert added.scores.tolist() == [11.0, 8.0, 12.0]  # the reward function's 10 + 2 x the judge's


def test_an_unparsed_verdict_ends_the_run_naming_the_sample_unless_its_episode_failed():
    with pytest.raises(RewardFunctionError, match=r"judge /j: no score in its verdict on sample 1 \('verdict 1'\)"):
        judged([0.5, math.nan], "replace", on_parse_failure="fail")
    assert judged([0.5, math.nan], "replace", on_parse_failure="fail", failed_rows=(1,)).scores[0] == 1.0


@pytest.mark.parametrize("overrides, key", [
    (["reward_model.judge.prompt_template='{answer}'"], "reward_model.judge.prompt_template"),
    (["reward_model.judge.prompt_template='{prompt} only'"], "reward_model.judge.prompt_template"),
    (["reward_model.judge.prompt_template='{response'"], "reward_model.judge.prompt_template"),
    (["reward_model.judge.prompt_template_path=/nonexistent/template.txt"], "reward_model.judge.prompt_template_path"),
    (["reward_model.judge.score_pattern='(unclosed'"], "reward_model.judge.score_pattern"),
    (["reward_model.judge.model_path=null"], "reward_model.judge.model_path"),
    (["reward_model.enable=true", "reward_model.model.path=/a/rm"], "reward_model.judge.enable"),
    (["trainer.n_gpus_per_node=2", "reward_model.judge.tensor_model_parallel_size=4"],
     "reward_model.judge.tensor_model_parallel_size"),
])
def test_bad_judge_settings_are_refused_before_workers_start(overrides, key):
    config = compose("ppo_trainer", ["trainer.device=cpu", "reward_model.judge.enable=true",
                                     "reward_model.judge.model_path=/a/judge", *overrides])
    with pytest.raises(ConfigError) as err:
        plan_job(config)
    assert err.value.key == key


def _judge_on_ranks(model_path: str, tp: int) -> tuple[list[float], list[str]]:
    from shardrl.workers.judge import JudgeWorker

    os.environ[COLLECTIVE_TIMEOUT_ENV] = "120"
    plan = plan_job(compose("ppo_trainer", [
        "trainer.device=cpu", f"trainer.n_gpus_per_node={tp}", "reward_model.judge.enable=true",
        f"reward_model.judge.model_path={model_path}", f"reward_model.judge.tensor_model_parallel_size={tp}",
        f"reward_model.judge.prompt_template='{TEMPLATE}'", "reward_model.judge.score_pattern='(\\d)'",
        "reward_model.judge.response_length=6", "reward_model.judge.max_model_len=256"]))
    worker = JudgeWorker(plan.judge, model_path)
    out = worker.judge(sample_batch(worker.tokenizer))
    return out.tensors["judge_scores"].tolist(), list(out.non_tensors["judge_verdicts"])


@pytest.mark.parametrize("tp", [1, 2])
def test_the_judge_engine_writes_what_transformers_generates_greedily(task, tp):
    tokenizer = AutoTokenizer.from_pretrained(task["model"])
    model = AutoModelForCausalLM.from_pretrained(task["model"], torch_dtype=torch.float32)
    expected = []
    for ids in judge_prompts(sample_batch(tokenizer), tokenizer, tokenizer, TEMPLATE):
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        expected.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    scores, verdicts = run_distributed(tp, _judge_on_ranks, task["model"], tp)[0]
    assert all(expected) and verdicts == expected
    assert [s if not math.isnan(s) else None for s in scores] == [
        float(m[-1]) if (m := re.findall(r"\d", v)) else None for v in expected]


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "judge" / "run_judge_builtin_cpu.sh"


def run_example(tmp_path, task, *overrides):
    env = {**os.environ, "PYTHON": sys.executable, "WORK_DIR": str(tmp_path), "JUDGE": task["model"], "STEPS": "2"}
    return subprocess.run(["bash", str(EXAMPLE), "trainer.logger=[file]", "trainer.val_before_train=false",
                           *overrides], env=env, capture_output=True, text=True, timeout=600)


def test_the_judge_example_on_the_builtin_task_is_scored_by_the_judge(tmp_path, task):
    done = run_example(tmp_path, task, "reward_model.judge.parse_failure_score=-1")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        failed = row["reward_extra/judge_parse_failed/mean"]
        assert 0 < failed < 1, row  # counted: the tiny judge writes a 0 or 1 in some verdicts only
        # replace: the judge's scores are the reward, an unparsed verdict's -1 included
        assert row["critic/score/mean"] == pytest.approx(row["reward_extra/judge_score/mean"])
        assert -failed <= row["reward_extra/judge_score/mean"] <= 1 - failed  # parsed ones are 0 or 1
        assert row["timing_s/score"] > 0


def test_with_on_parse_failure_fail_the_run_ends_with_one_line_naming_the_sample(tmp_path, task):
    done = run_example(tmp_path, task, "reward_model.judge.score_pattern='NEVER(\\d)'",
                       "reward_model.judge.on_parse_failure=fail")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"judge {task['model']}: no score in its verdict on sample" in last and "score_pattern" in last, last


def test_reward_model_scores_replace_or_add_to_the_reward_function_with_their_weight():
    from shardrl.rewards.manager import RewardModelScoring

    rows = 3
    batch = Batch({"rm_scores": torch.tensor([[0.0, 0.5], [0.0, -1.0], [2.0, 0.0]]),
                   "response_mask": torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]),
                   "responses": torch.ones(rows, 2, dtype=torch.long), "attention_mask": torch.ones(rows, 4)},
                  {"data_source": as_object_array(["t"] * rows),
                   "reward_model": as_object_array([{"ground_truth": "1"}] * rows),
                   "extra_info": as_object_array([{}] * rows)})
    calls = []

    def rule(*sample):
        calls.append(sample)
        return 10.0

    replaced = compute_token_level_scores(batch, Tokenizer(), rule, reward_model=RewardModelScoring("replace", 2.0))
    assert replaced.scores.tolist() == [1.0, -2.0, 4.0] and calls == []  # verl's: the rule is not called
    added = compute_token_level_scores(batch, Tokenizer(), rule, reward_model=RewardModelScoring("add", 0.5))
    assert added.scores.tolist() == [10.25, 9.5, 11.0] and len(calls) == rows
    assert added.token_level.tolist() == [[0.0, 10.25], [0.0, 9.5], [11.0, 0.0]]  # on each last response token
