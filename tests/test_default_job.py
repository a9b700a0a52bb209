"""The default job (`make run`) end to end: GRPO on the built-in task learns from reward alone, and the run
directory holds metrics, plots and an HF export that transformers loads."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_job(run_dir, *overrides, timeout=600):
    """The run's metrics rows."""
    run_command(run_dir, *overrides, timeout=timeout)
    return metrics_rows(run_dir)


def run_command(run_dir, *overrides, timeout=600) -> str:
    """Run the job; its stdout."""
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", f"trainer.default_local_dir={run_dir}",
           "trainer.logger=[file]", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def metrics_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def validation_rewards(rows):
    return [(r["step"], r["val-core/reward/mean"]) for r in rows if "val-core/reward/mean" in r]


def test_default_job_learns_and_exports(tmp_path):
    out = run_command(tmp_path, "trainer.total_training_steps=60", "trainer.test_freq=30")
    rows = metrics_rows(tmp_path)
    val = validation_rewards(rows)
    assert val[0][0] == 0 and val[0][1] < 0.3, val  # the untrained policy
    assert val[-1][0] == 60 and val[-1][1] >= 0.9, val
    assert max(r.get("critic/score/mean", 0) for r in rows) >= 0.7  # sampled at temperature 1
    assert all(abs(r["rollout_corr/mismatch_kl"]) < 1e-4 for r in rows if "rollout_corr/mismatch_kl" in r)
    # What each validation cost, under verl's name, on the rows that validated and no others.
    assert [r["step"] for r in rows if r.get("timing_s/testing", 0) > 0] == [step for step, _ in val]
    for name in ("curves.png", "timeline.png", "hf_export/config.json"):
        assert (tmp_path / name).exists(), name
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_export")
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "builtin_task" / "model")
    changed = [not torch.equal(a, b) for a, b in zip(exported.parameters(), initial.parameters())]
    assert any(changed)
    # The export alone (its own tokenizer and generation config) answers a question and stops: digit, then EOS.
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf_export")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "3 8 1 ->"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    answer = exported.generate(**prompt, max_new_tokens=5, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert tokenizer.decode(answer) == "2<eos>"
    lines = out.splitlines()
    summary = lines[lines.index("run finished"):]  # the end-of-run block
    assert summary[1] == f"  run directory   {tmp_path}", out[-2000:]
    assert f"  curves.png      {tmp_path / 'curves.png'}" in summary


def test_default_job_runs_gspo_with_verl_flags(tmp_path):
    rows = run_job(tmp_path, "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
                   "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                   "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                   "actor_rollout_ref.actor.clip_ratio_low=0.0003", "actor_rollout_ref.actor.clip_ratio_high=0.0004")
    assert [r["step"] for r in rows] == [1, 2]
    # A second, fresh run (no checkpoint to resume) into the same directory: its files are its own, the first run's
    # moved aside whole; the summary names where everything is.
    out = run_command(tmp_path, "trainer.total_training_steps=1", "trainer.val_before_train=false",
                      "trainer.test_freq=-1")
    assert [r["step"] for r in metrics_rows(tmp_path)] == [1]
    (previous,) = (tmp_path / "previous_runs").iterdir()
    assert [r["step"] for r in metrics_rows(previous)] == [1, 2] and (previous / "hf_export").is_dir()
    assert f"the previous run's outputs are now in {previous}" in out.splitlines()[0]
    assert f"curves.png      {tmp_path / 'curves.png'}" in out and f"run directory   {tmp_path}" in out
    # The gspo surrogate ran: it has no dual clip (vanilla always reports pg_clipfrac_lower), and its tiny clip range
    # clips some sequences once the first mini batch has moved the policy.
    assert all("actor/pg_clipfrac" in r and "actor/pg_clipfrac_lower" not in r for r in rows)
    assert max(r["actor/pg_clipfrac"] for r in rows) > 0


def test_default_job_runs_dapo_with_verl_flags(tmp_path):
    """Dynamic sampling and overlong shaping through the real command line: the untrained policy leaves most groups
    of 8 all wrong, so some step needs a second round of 64 prompts to keep 32 groups; every answer (a digit and EOS)
    ends in the 1-token buffer, so the logged penalty is -0.5 for those and the mean lies in [-0.5, 0)."""
    rows = run_job(tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=-1",
                   "data.gen_batch_size=64", "algorithm.filter_groups.enable=True",
                   "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10",
                   "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
                   "reward_model.overlong_buffer.len=1", "reward_model.overlong_buffer.penalty_factor=0.5",
                   "reward_model.overlong_buffer.log=True")
    train = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train] == [1, 2]
    assert max(r["train/num_gen_batches"] for r in train) > 1
    for r in train:
        assert r["train/num_gen_groups"] == 64 * r["train/num_gen_batches"]
        assert r["train/num_kept_groups"] >= 32
        assert r["train/kept_group_ratio"] == r["train/num_kept_groups"] / r["train/num_gen_groups"]
        assert -0.5 <= r["reward_extra/overlong_reward/mean"] < 0
    assert "val-aux/overlong_reward/mean" in rows[0]  # validation is shaped too, as in verl's DAPO recipe


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tensor_model_parallel_size", "pipeline_model_parallel_size"])
def test_default_job_learns_with_two_rank_actor(tmp_path, layout):
    rows = run_job(tmp_path, "trainer.n_gpus_per_node=2", f"actor_rollout_ref.actor.megatron.{layout}=2",
                   "trainer.total_training_steps=60", "trainer.test_freq=30")
    val = validation_rewards(rows)
    assert val[0][1] < 0.3 and val[-1][1] >= 0.9, val


@pytest.mark.slow  # 2-2.5 min; the default suite runs this agent through the endpoint in test_agent_job.py
def test_an_openai_client_agent_trains_on_the_builtin_task(tmp_path):
    """examples/openai_agent (a plain `openai` client in a tool loop, in agent processes, through the endpoint) on the
    built-in digit-lookup task: the agent's own reward rises as the policy learns to call the tool (0.1) and copy
    its answer (1.0); every episode is served, none fails."""
    rows = run_job(tmp_path, "actor_rollout_ref.rollout.multi_turn.enable=true", "data.max_response_length=8",
                   f"actor_rollout_ref.rollout.agent.agent_loop_config_path={EXAMPLES}/openai_agent/"
                   "builtin_task_loops.yaml", "actor_rollout_ref.rollout.agent.num_workers=2",
                   "trainer.total_training_steps=40", "trainer.test_freq=-1", "trainer.val_before_train=false")
    scores = [r["critic/score/mean"] for r in rows]
    assert sum(scores[-5:]) / 5 >= sum(scores[:5]) / 5 + 0.05, scores
    requests = [r["agent/endpoint/requests_per_episode"] for r in rows]
    assert sum(requests[-5:]) / 5 > sum(requests[:5]) / 5 + 0.2, requests  # more episodes call the tool
    assert all(r["agent/endpoint/episodes"] == 256 and r["agent/endpoint/failed_episodes"] == 0 for r in rows)
    assert all(abs(r["rollout_corr/mismatch_kl"]) < 1e-4 for r in rows if "rollout_corr/mismatch_kl" in r)


@pytest.mark.slow  # 2-3 minutes; the default suite's multi-turn learning test is the OpenAI-client agent's above
def test_builtin_multi_turn_task_learns_through_its_tool(tmp_path):
    """`make run ARGS="actor_rollout_ref.rollout.multi_turn.enable=true data.max_response_length=8
    trainer.total_training_steps=150"`: the digit-lookup task, whose answer only its tool knows, learns from reward
    alone: the model learns to call the tool and copy what it answers."""
    rows = run_job(tmp_path, "actor_rollout_ref.rollout.multi_turn.enable=true", "data.max_response_length=8",
                   "trainer.total_training_steps=150", "trainer.test_freq=75")
    val = validation_rewards(rows)
    assert val[0][0] == 0 and val[0][1] < 0.3, val
    assert val[-1][0] == 150 and val[-1][1] >= 0.9, val
    last = rows[-1]
    assert last["agent/tool_calls/mean"] >= 0.9 and last["agent/tokens_tool/mean"] > 0
    assert all(abs(r["rollout_corr/mismatch_kl"]) < 1e-4 for r in rows if "rollout_corr/mismatch_kl" in r)
