"""verl's LoRA keys through the job: they reach the actor and the rollout engine, the reference becomes the actor's
base model, what shardrl cannot honour is refused before workers start, and the default job runs with adapters:
the rollout samples with the trainer's adapters (mismatch 0), weight sync moves the adapters alone after its first
sync, the reference pass is the base model (KL exactly 0 while the adapters are still 0, then > 0), and the export
holds the merged model and a PEFT adapter."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.models.tiny import make_tiny_checkpoint
from tests.test_default_job import run_job

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]


def test_lora_keys_reach_the_actor_and_the_rollout_and_the_reference_runs_on_the_actor():
    plan = plan_job(compose("ppo_trainer", [*LORA, "actor_rollout_ref.model.exclude_modules=[down_proj]",
                                            "actor_rollout_ref.actor.use_kl_loss=true"]))
    lora = plan.actor.model.engine.lora
    assert (lora.rank, lora.scale, lora.target_modules, lora.exclude_modules) == (8, 2.0, "all-linear", ("down_proj",))
    assert plan.rollout.engine.lora == lora and plan.ref.on_actor
    full = plan_job(compose("ppo_trainer", ["actor_rollout_ref.actor.use_kl_loss=true"]))
    assert full.actor.model.engine.lora is None and full.rollout.engine.lora is None and not full.ref.on_actor


def test_critic_lora_keys_reach_the_critic_alone():
    plan = plan_job(compose("ppo_trainer", ["algorithm.adv_estimator=gae", "critic.model.lora_rank=4",
                                            "critic.model.lora_alpha=8", "critic.model.target_modules=[q_proj,v_proj]",
                                            "critic.model.exclude_modules=[v_proj]"]))
    lora = plan.critic.model.engine.lora
    assert (lora.rank, lora.scale, lora.target_modules, lora.exclude_modules) == (4, 2.0, ("q_proj", "v_proj"),
                                                                                 ("v_proj",))
    assert plan.actor.model.engine.lora is None and plan.rollout.engine.lora is None
    for overrides, key in ((["critic.model.target_modules=[qkv]"], "critic.model.target_modules"),
                           (["critic.model.target_parameters=[mlp.experts.down_proj]"],
                            "critic.model.target_parameters")):  # the built-in model is dense
        with pytest.raises(ConfigError) as err:
            plan_job(compose("ppo_trainer", ["algorithm.adv_estimator=gae", "critic.model.lora_rank=4", *overrides]))
        assert err.value.key == key


@pytest.mark.slow
def test_a_gae_job_with_a_lora_critic_trains_it(tmp_path):
    rows = run_job(tmp_path, "algorithm.adv_estimator=gae", "critic.model.lora_rank=8",
                   "trainer.total_training_steps=3", "trainer.val_before_train=false", "trainer.test_freq=-1")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["critic/vf_loss"] > 0 for r in rows) and rows[-1]["critic/vf_loss"] != rows[0]["critic/vf_loss"]


@pytest.mark.parametrize("overrides, key", [
    (["actor_rollout_ref.model.target_modules=q_proj"], "actor_rollout_ref.model.target_modules"),
    (["actor_rollout_ref.model.target_modules=[q_proj,qkv]"], "actor_rollout_ref.model.target_modules"),
    (["actor_rollout_ref.model.exclude_modules=[lm_head]"], "actor_rollout_ref.model.exclude_modules"),
    (["actor_rollout_ref.actor.use_kl_loss=true", "trainer.n_gpus_per_node=2",
      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
      "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1"], "actor_rollout_ref.ref.megatron"),
    (["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.megatron.dtype=bfloat16"],
     "actor_rollout_ref.ref.megatron.dtype"),
    (["trainer.device=cuda", "actor_rollout_ref.rollout.bitwise_logprobs=true",
      "actor_rollout_ref.actor.megatron.dtype=bfloat16", "actor_rollout_ref.rollout.dtype=bfloat16"],
     "actor_rollout_ref.model.lora_rank"),
])
def test_what_lora_cannot_honour_is_refused_before_workers_start(overrides, key):
    with pytest.raises(ConfigError) as err:
        plan_job(compose("ppo_trainer", LORA + overrides))
    assert err.value.key == key


def test_expert_adapters_are_named_by_target_parameters_and_refused_where_they_reach_nothing(tmp_path):
    moe = make_tiny_checkpoint("qwen3_moe", tmp_path / "moe")
    shared = make_tiny_checkpoint("qwen2_moe", tmp_path / "shared")  # a shared expert: ordinary gate/up/down
    experts = "actor_rollout_ref.model.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"
    plan = plan_job(compose("ppo_trainer", [*LORA, f"actor_rollout_ref.model.path={moe}", experts]))
    assert plan.actor.model.engine.lora.target_parameters == ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    assert plan.rollout.engine.lora == plan.actor.model.engine.lora
    # all-linear is the linears (as in PEFT): the attention here, and the run says the experts got none.
    attention_only = plan_job(compose("ppo_trainer", [*LORA, f"actor_rollout_ref.model.path={moe}"]))
    assert attention_only.actor.model.engine.lora.target_parameters == ()
    assert any("target_parameters" in note for note in attention_only.model_notes)
    assert plan_job(compose("ppo_trainer", [*LORA, f"actor_rollout_ref.model.path={shared}",
                                            "actor_rollout_ref.model.target_modules=[gate_proj]"])).actor
    for overrides, key in (
            ([f"actor_rollout_ref.model.path={moe}", "actor_rollout_ref.model.target_modules=[q_proj,gate_proj]"],
             "actor_rollout_ref.model.target_modules"),  # no linear of that name: the experts are stacked
            ([experts], "actor_rollout_ref.model.target_parameters"),  # the built-in model is dense
            ([f"actor_rollout_ref.model.path={moe}", "actor_rollout_ref.model.target_parameters=[mlp.experts.w1]"],
             "actor_rollout_ref.model.target_parameters")):
        with pytest.raises(ConfigError) as err:
            plan_job(compose("ppo_trainer", LORA + overrides))
        assert err.value.key == key, overrides


def test_the_default_job_trains_adapters_samples_with_them_and_keeps_the_base_as_reference(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rows = run_job(tmp_path, *LORA, "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.use_kl_loss=true",
                   "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",  # one update a step
                   "trainer.total_training_steps=3", "trainer.val_before_train=false", "trainer.test_freq=-1")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # The rollout applies the synced adapters: its log-probs are the trainer's (B moves from 0 after step 1).
    assert all(abs(r["rollout_corr/mismatch_kl"]) < 1e-5 for r in rows), rows
    # The reference is the base model: identical to the policy at step 1 (one update, computed before it), apart
    # after it.
    assert rows[0]["actor/kl_loss"] == 0 and all(r["actor/kl_loss"] > 0 for r in rows[1:]), rows
    # Weight sync moves every tensor once, when the job starts, then the adapters alone (the base is frozen): a
    # step's sync moves their bytes, in the rollout's dtype (fp32 here), as the exported adapter holds them.
    adapter_bytes = sum(t.numel() * 4 for t in load_file(tmp_path / "hf_export" / "lora_adapter" /
                                                         "adapter_model.safetensors").values())
    assert all(r["sync/bytes"] == adapter_bytes for r in rows), [(r["sync/bytes"], adapter_bytes) for r in rows]
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "builtin_task" / "model")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_export")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "builtin_task" / "model"),
                                        tmp_path / "hf_export" / "lora_adapter")
    ids = torch.arange(2, 12)[None]
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, adapted(ids).logits, atol=1e-5)
        assert not torch.allclose(merged(ids).logits, base(ids).logits, atol=1e-4)


def _adapter(directory, **config) -> str:
    """A PEFT adapter directory with `config` in its adapter_config.json (tensors: none needed to plan)."""
    import json

    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 12, "target_modules": ["q_proj", "v_proj"], **config}))
    (directory / "adapter_model.safetensors").write_bytes(b"")
    return str(directory)


def test_a_peft_adapter_to_start_from_sets_the_adapters_as_verl_does(tmp_path):
    key = "actor_rollout_ref.model.lora_adapter_path"
    plan = plan_job(compose("ppo_trainer", [f"{key}={_adapter(tmp_path / 'a')}"]))
    lora = plan.actor.model.engine.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.initial) == (4, 12.0, ("q_proj", "v_proj"),
                                                                          str(tmp_path / "a"))
    for name, config, overrides, refused in (
            ("missing", None, [], key), ("dora", dict(use_dora=True), [], key),
            ("regex", dict(target_modules=".*proj"), [], key), ("bias", dict(bias="all"), [], key),
            ("rank", {}, ["actor_rollout_ref.model.lora_rank=8"], "actor_rollout_ref.model.lora_rank")):
        where = tmp_path / name if config is None else _adapter(tmp_path / name, **config)
        with pytest.raises(ConfigError) as err:
            plan_job(compose("ppo_trainer", [f"{key}={where}", *overrides]))
        assert err.value.key == refused, name


@pytest.mark.slow  # the plan and the model start from an adapter in the default suite
def test_the_default_job_starts_from_a_peft_adapter(tmp_path):
    """At lr=0 the job's exported adapter is the one it started from, and the rollout samples with it too."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardrl.data import builtin_task

    task = builtin_task.prepare(tmp_path / "task")
    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(task["model"]), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "up_proj"], init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    run = tmp_path / "run"
    rows = run_job(run, f"actor_rollout_ref.model.path={task['model']}", f"data.tokenizer={task['model']}",
                   f"data.train_files={task['train_files']}",
                   f"actor_rollout_ref.model.lora_adapter_path={tmp_path}/adapter",
                   "actor_rollout_ref.actor.optim.lr=0", "trainer.total_training_steps=1",
                   "trainer.val_before_train=false", "trainer.test_freq=-1")
    assert abs(rows[0]["rollout_corr/mismatch_kl"]) < 1e-6
    started = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    exported = load_file(run / "hf_export" / "lora_adapter" / "adapter_model.safetensors")
    assert sorted(exported) == sorted(started) and all(torch.equal(exported[k], started[k]) for k in started)


@pytest.mark.slow
def test_the_default_job_with_lora_learns(tmp_path):
    """The built-in task's model is random and its LM head and final norm stay frozen, so adapters can turn the hidden
    state toward the right digit but not sharpen the sampled distribution (sampled reward stays near 0.2): greedy
    validation passes 0.9 after about 120 steps (full fine-tuning: 60). The response is the answer alone
    (`max_response_length=1`, which the scorer takes as ended): stopping after it as well, which the full model
    learns, is beyond these adapters in 150 steps (greedy reward stays near the answer-without-EOS credit)."""
    from tests.test_default_job import validation_rewards

    rows = run_job(tmp_path, "actor_rollout_ref.model.lora_rank=64", "actor_rollout_ref.model.lora_alpha=64",
                   "actor_rollout_ref.actor.optim.lr=3e-3", "trainer.total_training_steps=150", "trainer.test_freq=30",
                   "data.max_response_length=1")
    val = validation_rewards(rows)
    assert val[0][1] < 0.3 and max(v for _, v in val[-2:]) >= 0.9, val


@pytest.mark.slow
def test_a_fully_async_job_trains_adapters_on_a_detached_rollout_pool(tmp_path):
    from async_jobs import run_job as run_async_job

    rows, _ = run_async_job(tmp_path / "run", "fully_async_ppo_trainer", *LORA, "actor_rollout_ref.actor.optim.lr=1e-2",
                            "actor_rollout_ref.actor.use_kl_loss=true", "trainer.total_training_steps=3",
                            "trainer.val_before_train=false", "trainer.test_freq=-1")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["actor/kl_loss"] == 0 and all(r["actor/kl_loss"] > 0 for r in rows[1:]), rows
    assert (tmp_path / "run" / "hf_export" / "lora_adapter" / "adapter_model.safetensors").is_file()
