"""The keys that used to be parsed and then ignored now reach what they control: the planner compiles each into its
role's options, and the workers and the launch act on them (the lower layers' own tests check the effects in
detail: test_model_overrides, test_lr_decay_steps, test_checkpoint_contents, test_reward_fn_key,
test_chat_template_kwargs, test_collective_timeout)."""

import datetime
import os
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from shardrl.controller.rank_env import COLLECTIVE_TIMEOUT_ENV
from shardrl.data import builtin_task
from shardrl.data.batch import Batch
from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.trainer import launch
from shardrl.workers.role_model import build_engine


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return builtin_task.prepare(tmp_path_factory.mktemp("task"))


def plan(*overrides, name="ppo_trainer"):
    return plan_job(compose(name, list(overrides))).with_total_steps(10)


@pytest.mark.parametrize("override, read", [
    ("trainer.collective_timeout_s=5", lambda p: p.cluster.collective_timeout == datetime.timedelta(seconds=5)),
    ("actor_rollout_ref.actor.optim.lr_decay_steps=6", lambda p: p.actor.model.engine.optim.decay_steps == 6),
    ("critic.optim.lr_decay_steps=3", lambda p: p.critic.model.engine.optim.decay_steps == 3),
    ("actor_rollout_ref.actor.checkpoint.load_contents=[model]", lambda p: p.actor.checkpoint.load_contents ==
     ("model",)),
    ("critic.checkpoint.save_contents=[model]", lambda p: p.critic.checkpoint.save_contents == ("model",)),
    ("trainer.max_critic_ckpt_to_keep=1", lambda p: p.loop.max_ckpt_to_keep == {"actor": None, "critic": 1}),
    ("actor_rollout_ref.rollout.free_cache_engine=true", lambda p: p.rollout.free_cache_engine),
    ("actor_rollout_ref.actor.load_weight=false", lambda p: not p.actor.model.load_weight and p.ref is None),
    ("critic.load_weight=false", lambda p: not p.critic.model.load_weight),
    ("data.reward_fn_key=task", lambda p: p.reward.data_source_key == "task"),
    ("+data.apply_chat_template_kwargs.enable_thinking=false",
     lambda p: p.data.apply_chat_template_kwargs == {"enable_thinking": False}),
    ("data.validation_shuffle=true", lambda p: p.data.validation_shuffle),
    ("actor_rollout_ref.model.trust_remote_code=true", lambda p: p.data.trust_remote_code),
    ("+actor_rollout_ref.model.override_config.rms_norm_eps=0.001",
     lambda p: p.actor.model.override_config == p.rollout.override_config == {"rms_norm_eps": 0.001}),
    ("actor_rollout_ref.actor.megatron.seed=7", lambda p: p.actor.seed == 7 and p.loop.seed == 1),
    ("critic.model.path=/some/reward_model", lambda p: p.critic_model_path == "/some/reward_model"),
    ("data.tokenizer=/some/tokenizer", lambda p: p.data.tokenizer == "/some/tokenizer"),
    ("critic.loss_scale_factor=100", lambda p: p.critic.max_response_length == 100),
])
def test_each_formerly_dead_key_reaches_its_option(override, read):
    compiled = plan(override, "algorithm.adv_estimator=gae")
    assert read(compiled)
    assert not read(plan("algorithm.adv_estimator=gae"))  # the default compiles to something else


def test_collective_timeout_reaches_the_worker_group(task, tmp_path):
    compiled = plan("trainer.collective_timeout_s=5", "trainer.device=cpu", "trainer.n_gpus_per_node=1")
    paths = launch.RunPaths(tmp_path, task["model"], task["model"], task["model"], [task["train_files"]], None)
    with mock.patch.object(launch, "WorkerGroup") as group, mock.patch.object(launch, "ResourcePool"):
        launch.start_workers(compiled, paths, pad_token_id=0)
    assert group.call_args.kwargs["collective_timeout"] == datetime.timedelta(seconds=5)


@pytest.fixture
def single_process(monkeypatch):
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "60")


def test_override_config_changes_the_model_the_actor_builds(task, single_process):
    base = build_engine(plan().actor.model, task["model"], None)
    shallow = build_engine(plan("+actor_rollout_ref.model.override_config.num_hidden_layers=1").actor.model,
                           task["model"], None)
    assert base.config.num_layers == 2 and shallow.config.num_layers == 1
    assert sum(p.numel() for p in shallow.chunks[0].parameters()) < sum(p.numel() for p in base.chunks[0].parameters())


def test_a_misspelt_override_is_refused_in_the_dry_run(task):
    with pytest.raises(ConfigError) as err:
        plan_job(compose("ppo_trainer", [f"actor_rollout_ref.model.path={task['model']}",
                                         "+actor_rollout_ref.model.override_config.num_hiden_layers=1"]))
    assert err.value.key == "actor_rollout_ref.model.override_config.num_hiden_layers"


def test_load_weight_false_keeps_the_random_init(task, single_process):
    hf = load_file(os.path.join(task["model"], "model.safetensors"))
    loaded = build_engine(plan().actor.model, task["model"], None)
    random = build_engine(plan("actor_rollout_ref.actor.load_weight=false").actor.model, task["model"], None)
    name = "model.embed_tokens.weight"
    ours = {n: p for n, p in loaded.chunks[0].named_parameters()}
    theirs = {n: p for n, p in random.chunks[0].named_parameters()}
    key = next(n for n in ours if "embed" in n)
    assert torch.equal(ours[key].float(), hf[name].float())
    assert not torch.equal(theirs[key].float(), hf[name].float())


def test_lr_decay_steps_sets_the_actor_schedule(task, single_process):
    engine = build_engine(plan("actor_rollout_ref.actor.optim.lr_decay_style=linear",
                               "actor_rollout_ref.actor.optim.lr_decay_steps=4",
                               "actor_rollout_ref.actor.optim.min_lr_ratio=0.0").actor.model, task["model"], None)
    lrs = []
    for _ in range(6):
        lrs.append(engine.optimizer.lr)
        engine.scheduler.step()
    peak = lrs[0]
    assert lrs == pytest.approx([peak, 0.75 * peak, 0.5 * peak, 0.25 * peak, 0.0, 0.0])  # ends at step 4, not 10


def test_validation_shuffle_picks_other_prompts(task, tmp_path):
    from transformers import AutoTokenizer

    from shardrl.data.rl_dataset import RLDataset

    dataset = RLDataset([task["val_files"]], AutoTokenizer.from_pretrained(task["model"]), 64)
    in_order = launch.validation_prompts(dataset, 8, False, seed=1)
    shuffled = launch.validation_prompts(dataset, 8, True, seed=1)
    assert torch.equal(in_order.tensors["input_ids"], dataset.collate(range(8)).tensors["input_ids"])
    assert not torch.equal(in_order.tensors["input_ids"], shuffled.tensors["input_ids"])
    again = launch.validation_prompts(dataset, 8, True, seed=1)
    assert torch.equal(shuffled.tensors["input_ids"], again.tensors["input_ids"])


def test_critic_model_path_is_what_the_critic_starts_from(task, tmp_path):
    compiled = plan("algorithm.adv_estimator=gae", f"critic.model.path={tmp_path}")
    paths = launch.resolve_paths(compiled)
    assert paths.critic_model == str(tmp_path) and paths.model != str(tmp_path)


def test_free_cache_engine_frees_the_colocated_kv_cache_after_generating(task, single_process):
    from shardrl.workers.hybrid import ActorRolloutRefWorker

    def worker(free: bool):
        compiled = plan("trainer.device=cpu", "trainer.n_gpus_per_node=1",
                        f"actor_rollout_ref.rollout.free_cache_engine={str(free).lower()}")
        return ActorRolloutRefWorker(compiled.actor, compiled.ref, compiled.rollout, task["model"], 0)

    prompts = Batch({"input_ids": torch.tensor([[2, 3, 4]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
                     "position_ids": torch.arange(3)[None], "sample_seed": torch.tensor([5])})
    keeps, frees = worker(False), worker(True)
    first = keeps.generate_sequences(prompts)
    assert keeps.rollout.runner.cache.allocated
    second = frees.generate_sequences(prompts)
    assert not frees.rollout.runner.cache.allocated
    third = frees.generate_sequences(prompts)  # woken for the next generation: same samples
    assert torch.equal(first.tensors["responses"], second.tensors["responses"])
    assert torch.equal(second.tensors["responses"], third.tensors["responses"])


def test_trust_remote_code_reaches_the_tokenizer_load(tmp_path):
    class Loaded(BaseException):  # not an Exception: the launch turns a tokenizer's failing load into a ConfigError
        pass

    def load(path, **kwargs):
        raise Loaded(kwargs)

    compiled = plan("actor_rollout_ref.model.trust_remote_code=true", f"trainer.default_local_dir={tmp_path}")
    with mock.patch.object(launch.AutoTokenizer, "from_pretrained", side_effect=load), \
            pytest.raises(Loaded) as loaded:
        launch.train(compiled)
    assert loaded.value.args[0] == {"trust_remote_code": True}
