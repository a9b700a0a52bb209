"""verl 0.8+'s distillation teachers (`distillation.teacher_models.<name>`, `distillation.teacher_key`): how the
entries resolve (verl's rules, and refusals where verl drops or ignores a key), each sample scored by the teacher its
field names (against transformers' log-probs of that teacher), the teachers' temperature 1 whatever the rollout's, the
launch check of the training rows' routes, and a job with two teachers (slow)."""

import json
import subprocess
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardrl.controller.rank_env import COLLECTIVE_TIMEOUT_ENV
from shardrl.data import builtin_task
from shardrl.data.batch import Batch, as_object_array
from shardrl.data.rl_dataset import RLDataset
from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.trainer.launch import check_teacher_routes
from shardrl.trainer.ppo import submit_teacher_log_probs
from tests.test_distillation import make_teacher, sample_batch

TWO = ["distillation.enabled=true", "+distillation.teacher_models.math.key=math",
       "+distillation.teacher_models.math.model_path=/m", "+distillation.teacher_models.code.key=code",
       "+distillation.teacher_models.code.model_path=/c"]


POOL = TWO + ["distillation.nnodes=1", "distillation.n_gpus_per_node=4", "trainer.n_gpus_per_node=2"]


def plan(overrides: list[str]):
    return plan_job(compose("ppo_trainer", overrides))


def test_two_teachers_route_by_data_source_and_a_lone_one_scores_everything():
    teachers = plan(TWO).teacher
    assert {key: (t.path_key, t.model_path) for key, t in teachers.by_key.items()} == {
        "math": ("distillation.teacher_models.math.model_path", "/m"),
        "code": ("distillation.teacher_models.code.model_path", "/c")}
    assert teachers.route_field == "data_source"
    assert all(t.model.ranks == [0] and t.memory_fraction is None for t in teachers.by_key.values())  # trainer pool
    assert plan(TWO + ["distillation.teacher_key=ability"]).teacher.route_field == "ability"
    lone = plan(["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/t"]).teacher
    assert lone.sources == [("distillation.teacher_models.teacher_model.model_path", "/t")]
    assert list(lone.by_key) == ["default"] and lone.route_field is None
    # shardrl's earlier spelling is the same teacher
    assert plan(["distillation.enabled=true", "distillation.teacher_model.model_path=/t"]).teacher == lone
    # verl's check of the teacher's context: prompt + response + 1 fits
    fits = plan(TWO + ["+distillation.teacher_models.math.inference.max_model_len=67"]).teacher
    assert fits.sources == teachers.sources
    # verl's k1 scripts set topk (its default sets it always): read only by forward_kl_topk
    k1 = plan(TWO + ["distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.topk=64"])
    assert k1.actor.distillation.topk is None and all(t.topk is None for t in k1.teacher.by_key.values())
    topk = plan(TWO + ["distillation.distillation_loss.loss_mode=forward_kl_topk",
                       "distillation.distillation_loss.use_policy_gradient=false"])
    assert all(t.topk == 32 for t in topk.teacher.by_key.values())  # verl's default k


def test_teachers_on_their_own_pool_take_their_shares_laid_out_by_their_inference_sizes():
    """verl's placement: the pool's ranks follow the trainer's; each teacher takes num_replicas x TP x DP x PP of them
    in entry order, laid out by its `inference` sizes, with its share of each GPU's memory; a lone teacher's
    replicas fill the pool."""
    two = plan(POOL + [f"+distillation.teacher_models.{t}.num_replicas=1" for t in ("math", "code")] +
               ["+distillation.teacher_models.code.inference.gpu_memory_utilization=0.3"])
    math_teacher, code_teacher = two.teacher.by_key["math"], two.teacher.by_key["code"]
    assert math_teacher.model.ranks == [2, 3] and code_teacher.model.ranks == [4, 5]
    assert (math_teacher.model.spec.tp, math_teacher.model.spec.dp) == (2, 1)
    assert (math_teacher.memory_fraction, code_teacher.memory_fraction) == (0.5, 0.3)
    assert two.cluster.teacher_nodes == 1 and two.cluster.teacher_gpus_per_node == 4
    assert two.roles["teacher/code"].ranks == [4, 5] and "teacher" not in two.roles
    lone = plan(["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/t",
                 "distillation.nnodes=1", "distillation.n_gpus_per_node=4"]).teacher.by_key["default"]
    assert lone.model.ranks == [1, 2, 3, 4] and (lone.model.spec.tp, lone.model.spec.dp) == (2, 2)


@pytest.mark.parametrize("overrides, key", [
    (TWO + ["distillation.teacher_models.teacher_model.model_path=/t"],
     "distillation.teacher_models.teacher_model.model_path"),  # verl drops it without a word
    (["distillation.enabled=true", "+distillation.teacher_models.math.model_path=/m",
      "+distillation.teacher_models.code.key=code", "+distillation.teacher_models.code.model_path=/c"],
     "distillation.teacher_models.math.key"),
    (TWO[:3] + ["+distillation.teacher_models.code.key=math", "+distillation.teacher_models.code.model_path=/c"],
     "distillation.teacher_models.code.key"),
    (TWO[:1] + ["+distillation.teacher_models.math.key=math", "+distillation.teacher_models.code.key=code",
                "+distillation.teacher_models.code.model_path=/c"], "distillation.teacher_models.math.model_path"),
    (TWO + ["+distillation.teacher_models.code.num_replicas=2"], "distillation.teacher_models.code.num_replicas"),
    (TWO + ["+distillation.teacher_models.math.inference.tensor_model_parallel_size=4"],
     "distillation.teacher_models.math.inference.tensor_model_parallel_size"),
    (TWO + ["+distillation.teacher_models.math.inference.temperature=0.7"],
     "distillation.teacher_models.math.inference.temperature"),
    (TWO + ["+distillation.teacher_models.math.inference.max_model_len=66"],
     "distillation.teacher_models.math.inference.max_model_len"),
    (TWO + ["+distillation.teacher_models.math.inference.bogus=1"], "distillation.teacher_models.math.inference.bogus"),
    (TWO + ["distillation.teacher_model.megatron.use_dist_checkpointing=true",
            "distillation.teacher_model.megatron.dist_checkpointing_path=/d"],
     "distillation.teacher_model.megatron.use_dist_checkpointing"),
    # the teachers' own pool (distillation.nnodes x n_gpus_per_node)
    (POOL + ["+distillation.teacher_models.math.num_replicas=1", "+distillation.teacher_models.code.num_replicas=2",
             *(f"+distillation.teacher_models.{t}.inference.tensor_model_parallel_size=1" for t in ("math", "code"))],
     "distillation.n_gpus_per_node"),  # 3 ranks taken of 4
    (POOL + ["+distillation.teacher_models.math.num_replicas=2"], "distillation.teacher_models.code.num_replicas"),
    (POOL + [f"+distillation.teacher_models.{t}.num_replicas=1" for t in ("math", "code")] +
     ["+distillation.teacher_models.math.inference.enforce_eager=false"],
     "distillation.teacher_models.math.inference.enforce_eager"),
    (["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/t", "distillation.nnodes=1",
      "distillation.n_gpus_per_node=3"], "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size"),
    (["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/t", "distillation.nnodes=1",
      "distillation.n_gpus_per_node=2", "distillation.teacher_model.megatron.tensor_model_parallel_size=2"],
     "distillation.teacher_model.megatron.tensor_model_parallel_size"),
    (["distillation.nnodes=1", "distillation.n_gpus_per_node=2"], "distillation.n_gpus_per_node"),
    (["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/t", "distillation.nnodes=1",
      "distillation.n_gpus_per_node=4", "distillation.teacher_models.teacher_model.num_replicas=1"],
     "distillation.teacher_models.teacher_model.num_replicas"),  # the pool holds 2 replicas of TP2
])
def test_teacher_entries_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        plan(overrides)
    assert err.value.key == key


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return builtin_task.prepare(tmp_path_factory.mktemp("task"))


@pytest.fixture(scope="module")
def teachers(task, tmp_path_factory):
    """Two teachers of different sizes and weights, with the student's tokenizer."""
    return {"math": make_teacher(task, tmp_path_factory.mktemp("math")),
            "code": make_teacher(task, tmp_path_factory.mktemp("code"), layers=2, hidden=64, seed=11)}


class InProcess:
    """A role handle whose calls run on one in-process worker (one rank: the DP split is the whole batch)."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def call(self, method, *args):
        return method(self.worker, *args)

    def submit(self, method, *args):
        return types.SimpleNamespace(get=lambda: method(self.worker, *args))


def transformers_log_probs(model_dir, batch: Batch) -> torch.Tensor:
    """The response tokens' log-probs under `model_dir` at temperature 1: [B, R]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        log_probs = model(batch.tensors["input_ids"]).logits[:, 2:5].log_softmax(-1)
    return log_probs.gather(-1, batch.tensors["responses"][..., None])[..., 0]


@pytest.mark.parametrize("loss", [[], ["distillation.distillation_loss.loss_mode=forward_kl_topk",
                                       "distillation.distillation_loss.topk=3",
                                       "distillation.distillation_loss.use_policy_gradient=false"]],
                         ids=["k3", "forward_kl_topk"])
def test_each_sample_is_scored_by_its_teacher_at_temperature_one(task, teachers, loss, monkeypatch):
    """Rows routed code, math, code, math: each row's teacher scores equal transformers' for that row's teacher at
    temperature 1, although the rollout samples at 0.5 (verl scores the teacher's own distribution)."""
    from shardrl.workers.teacher import TeacherWorker

    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "120")
    overrides = ["trainer.device=cpu", "trainer.n_gpus_per_node=1", "distillation.enabled=true",
                 "actor_rollout_ref.rollout.temperature=0.5", "data.train_batch_size=2",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1", *loss]
    for name, path in teachers.items():
        overrides += [f"+distillation.teacher_models.{name}.key={name}",
                      f"+distillation.teacher_models.{name}.model_path={path}"]
    options = plan_job(compose("ppo_trainer", overrides)).with_total_steps(1)
    handles = {key: InProcess(TeacherWorker(teacher)) for key, teacher in options.teacher.by_key.items()}
    batch = sample_batch(AutoConfig.from_pretrained(task["model"]).vocab_size)
    routes = ["code", "math", "code", "math"]
    batch.non_tensors["data_source"] = as_object_array(routes)
    scored = submit_teacher_log_probs(handles, batch, options.teacher.route_field)()
    expected = {name: transformers_log_probs(path, batch) for name, path in teachers.items()}
    assert not torch.allclose(expected["math"], expected["code"], atol=1e-2)  # the two teachers differ
    for row, route in enumerate(routes):
        if loss:  # the teacher's top 3 of every position, as its full log_softmax gives them
            model = AutoModelForCausalLM.from_pretrained(teachers[route])
            with torch.no_grad():
                top = model(batch.tensors["input_ids"][row:row + 1]).logits[0, 2:5].log_softmax(-1).topk(3, dim=-1)
            assert torch.equal(scored.tensors["teacher_topk_ids"][row].long(), top.indices), (row, route)
            torch.testing.assert_close(scored.tensors["teacher_topk_log_probs"][row], top.values, rtol=1e-5,
                                       atol=1e-5)
        else:
            torch.testing.assert_close(scored.tensors["teacher_log_probs"][row], expected[route][row], rtol=1e-5,
                                       atol=1e-5)


def test_a_training_row_no_teacher_scores_is_refused_before_workers_start(task):
    from shardrl.trainer.launch import load_tokenizer

    dataset = RLDataset(task["train_files"], load_tokenizer(task["model"], "actor_rollout_ref.model.path", False),
                        max_prompt_length=32, max_samples=8, carried_columns=("ability",))
    assert list(dataset.collate([0, 1]).non_tensors["ability"]) == ["digits", "digits"]
    check_teacher_routes(dataset, "ability", ["digits"])
    with pytest.raises(ConfigError, match="row 0 has ability='digits', which no teacher's key names") as err:
        check_teacher_routes(dataset, "ability", ["math", "code"])
    assert err.value.key == "distillation.teacher_key"


@pytest.mark.slow
@pytest.mark.parametrize("pool", [[], ["distillation.nnodes=1", "distillation.n_gpus_per_node=3",
                                       "+distillation.teacher_models.math.num_replicas=1",
                                       "+distillation.teacher_models.math.inference.tensor_model_parallel_size=2",
                                       "+distillation.teacher_models.code.num_replicas=1",
                                       "+distillation.teacher_models.code.inference.tensor_model_parallel_size=1"]],
                         ids=["trainer_pool", "own_pool"])
def test_a_job_with_two_teachers_trains_on_both(task, teachers, tmp_path, pool):
    """Prompts routed by a column of their own (`teacher`), alternately to two teachers of different sizes, on the
    trainer pool or on a pool of their own (3 processes: the math teacher at TP2, the code teacher on one); the
    student trains on the teachers alone for 3 steps, every step logging the distillation loss."""
    table = pq.read_table(task["train_files"])
    routes = ["math" if i % 2 else "code" for i in range(table.num_rows)]
    train = tmp_path / "train.parquet"
    pq.write_table(table.append_column("teacher", pa.array(routes)), train)
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", f"trainer.default_local_dir={tmp_path / 'run'}",
           "trainer.logger=[file]", "trainer.total_training_steps=3", "trainer.test_freq=-1",
           "trainer.val_before_train=false", f"actor_rollout_ref.model.path={task['model']}",
           f"data.train_files={train}", f"data.val_files={task['val_files']}", "distillation.enabled=true",
           "distillation.teacher_key=teacher", "distillation.distillation_loss.use_task_rewards=false",
           "distillation.distillation_loss.loss_mode=k1", "data.train_batch_size=32",
           "actor_rollout_ref.actor.ppo_mini_batch_size=32", *pool]
    for name, path in teachers.items():
        cmd += [f"+distillation.teacher_models.{name}.key={name}",
                f"+distillation.teacher_models.{name}.model_path={path}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    if pool:
        assert "teacher pool ranks 1,2,3" in done.stdout, done.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all("actor/distillation/reverse_kl" in r for r in rows)
