"""A GRPO run whose only reward is a learned reward model (`reward_model.enable=true`), end to end on the built-in
task's policy: the reward model, built here as an HF `Qwen2ForSequenceClassification` that scores 1 when a
sample's last token is "7" and 0 otherwise, is all the policy learns from, and its score rises."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from shardrl.data import builtin_task


def make_sevens_reward_model(task_model: str, out_dir, seven: float = 1.0) -> str:
    """One layer whose outputs are zeroed, so the last hidden state is the last token's embedding: only "7"'s has a
    component on dimension 0, which the score head reads (normalised by the final RMSNorm to sqrt(H), scaled to
    `seven`)."""
    tokenizer = AutoTokenizer.from_pretrained(task_model)
    hidden = 16
    config = AutoConfig.for_model("qwen2", vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=64, num_labels=1, pad_token_id=0,
                                  architectures=["Qwen2ForSequenceClassification"])
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed[:, 0] = 0.0
        token = tokenizer.convert_tokens_to_ids("7")
        embed[token] = 0.0
        embed[token, 0] = 1.0
        model.score.weight.zero_()
        model.score.weight[0, 0] = seven / hidden ** 0.5
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    ids = tokenizer(["1 2 ->7", "1 2 ->3"], return_tensors="pt")
    assert model(**ids).logits[:, 0].tolist() == [pytest_approx(seven), pytest_approx(0.0)]
    return str(out_dir)


def pytest_approx(value: float):
    import pytest
    return pytest.approx(value, abs=1e-4)


def run(tmp_path, rm: str, *overrides: str) -> list[dict]:
    task = builtin_task.prepare(tmp_path / "task")
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", *overrides, f"trainer.default_local_dir={tmp_path / 'run'}",
           "trainer.logger=[file]", f"actor_rollout_ref.model.path={task['model']}",
           f"data.train_files={task['train_files']}", f"data.val_files={task['val_files']}",
           "reward_model.enable=true", f"reward_model.model.path={rm}", "reward_model.micro_batch_size_per_gpu=64",
           "data.max_response_length=1", "trainer.test_freq=-1", "trainer.val_before_train=false"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_a_run_whose_only_reward_is_a_reward_model_learns(tmp_path):
    rm = make_sevens_reward_model(builtin_task.prepare(tmp_path / "task")["model"], tmp_path / "rm")
    rows = run(tmp_path, rm, "trainer.total_training_steps=16")
    scores = [r["critic/score/mean"] for r in rows]
    assert scores[0] < 0.3, scores  # "7" about one time in ten, at random
    assert sum(scores[-5:]) / 5 >= 0.6, scores
    # The reward model's own metrics: its score is the reward (no shaping here), 0 or 1 per sample.
    assert all(r["reward_model/score/mean"] == pytest_approx(r["critic/score/mean"]) for r in rows)
    assert all(r["reward_model/score/max"] <= 1 + 1e-4 and r["reward_model/score/min"] >= -1e-4 for r in rows)
    assert rows[0]["reward_model/score/std"] > 0


@pytest.mark.slow  # 42 s; the RM on the trainer pool runs in the default suite
def test_a_reward_model_on_a_pool_of_its_own_scores_as_it_does_on_the_trainer_pool(tmp_path):
    """Its own two ranks at TP2 (after the trainer's one), scoring while the trainer pool generates: the same
    scores, so the same run, as the reward model on the trainer pool."""
    rm = make_sevens_reward_model(builtin_task.prepare(tmp_path / "task")["model"], tmp_path / "rm", seven=0.5)
    shared = run(tmp_path, rm, "trainer.total_training_steps=2")
    own = run(tmp_path, rm, "trainer.total_training_steps=2", "reward_model.enable_resource_pool=true",
              "reward_model.nnodes=1", "reward_model.n_gpus_per_node=2",
              "reward_model.megatron.tensor_model_parallel_size=2")
    for a, b in zip(shared, own):
        assert b["critic/score/mean"] == pytest_approx(a["critic/score/mean"])
        assert b["actor/pg_loss"] == pytest_approx(a["actor/pg_loss"])
    assert shared[0]["critic/score/max"] == pytest_approx(0.5)


@pytest.mark.slow  # the sync-mode jobs above score with the same worker
def test_the_reward_model_scores_in_the_fully_async_mode(tmp_path):
    """The trainer scores what the rollouter streams with the reward model too: its scores (0.5 for a "7", else 0;
    the rule reward would give 1 for a right successor) are every step's."""
    rm = make_sevens_reward_model(builtin_task.prepare(tmp_path / "task")["model"], tmp_path / "rm", seven=0.5)
    rows = run(tmp_path, rm, "--config-name=fully_async_ppo_trainer", "trainer.total_training_steps=3")
    assert len(rows) == 3 and all(r["critic/score/max"] == pytest_approx(0.5) for r in rows), rows


def test_samples_are_re_rendered_only_for_a_reward_model_with_another_tokenizer(tmp_path):
    """Launch compares the two tokenizers: the same ones score the policy's ids (input_tokenizer None), another
    template makes the worker re-render with reward_model.model.input_tokenizer."""
    from shardrl.job.load import compose
    from shardrl.job.plan import plan_job
    from shardrl.trainer.launch import with_reward_model_tokenizer
    task = builtin_task.prepare(tmp_path / "task")
    rm = make_sevens_reward_model(task["model"], tmp_path / "rm")
    plan = plan_job(compose("ppo_trainer", ["reward_model.enable=true", f"reward_model.model.path={rm}",
                                            f"reward_model.model.input_tokenizer={task['model']}"]))
    policy = AutoTokenizer.from_pretrained(task["model"])
    assert with_reward_model_tokenizer(plan, policy).reward_model.input_tokenizer is None
    other = AutoTokenizer.from_pretrained(rm)
    other.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    other.save_pretrained(tmp_path / "rm")
    assert with_reward_model_tokenizer(plan, policy).reward_model.input_tokenizer == task["model"]


def test_a_reward_model_pool_takes_the_ranks_after_the_others_or_is_refused_empty():
    from shardrl.job.errors import ConfigError
    from shardrl.job.load import compose
    from shardrl.job.plan import plan_job

    base = ["trainer.device=cpu", "trainer.n_gpus_per_node=2", "reward_model.enable=true",
            "reward_model.model.path=/a/rm", "reward_model.enable_resource_pool=true", "reward_model.nnodes=1"]
    plan = plan_job(compose("ppo_trainer", [*base, "reward_model.n_gpus_per_node=4"]))
    assert plan.roles["reward_model"].ranks == [2, 3, 4, 5] == plan.reward_model.model.ranks
    assert plan.roles["actor"].ranks == [0, 1]
    detached = plan_job(compose("fully_async_ppo_trainer", [*base, "reward_model.n_gpus_per_node=1",
                                                            "rollout.nnodes=1", "rollout.n_gpus_per_node=2"]))
    assert detached.rollout_ranks == [2, 3] and detached.roles["reward_model"].ranks == [4]
    try:
        plan_job(compose("ppo_trainer", [*base, "reward_model.n_gpus_per_node=0"]))
    except ConfigError as err:
        assert err.key == "reward_model.n_gpus_per_node"
    else:
        raise AssertionError("an empty reward-model pool was planned")
