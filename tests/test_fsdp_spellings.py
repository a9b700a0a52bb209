"""verl's FSDP command lines on shardrl's one engine: the FSDP engine and optimizer keys folded into the Megatron-style
keys before interpolations resolve (so the reference follows the actor), FSDP's sharding knobs accepted without
changing the plan, the rest refused naming the key; `+key=` of a key shardrl holds overrides it; the native engine's
prefill budget checked at planning; `actor/ref.use_torch_compile` building compiled models that score as the eager
ones (slow: the compiler runs)."""

import dataclasses

import pytest
import torch
from hydra import compose as hydra_compose, initialize_config_dir

from shardrl.controller.rank_env import COLLECTIVE_TIMEOUT_ENV
from shardrl.data import builtin_task
from shardrl.job.errors import ConfigError
from shardrl.job.load import CONFIG_DIR, compose, load_config
from shardrl.job.plan import plan_job
from shardrl.trainer.command_line import add_or_override
from tests.test_distillation import sample_batch

ACTOR, REF = "actor_rollout_ref.actor", "actor_rollout_ref.ref"
KL = [f"{ACTOR}.use_kl_loss=true"]  # a reference pass


def plan(overrides: list[str]):
    return plan_job(compose("ppo_trainer", overrides))


def engine(options):
    return options.model.engine


def test_offloads_dtype_seed_and_compile_fold_into_the_roles_keys():
    p = plan(KL + [f"{ACTOR}.fsdp_config.param_offload=true", f"{ACTOR}.fsdp_config.optimizer_offload=true",
                   f"{ACTOR}.fsdp_config.dtype=bfloat16", f"{REF}.fsdp_config.param_offload=true",
                   f"{ACTOR}.fsdp_config.use_torch_compile=true", "critic.fsdp.param_offload=true",
                   "algorithm.adv_estimator=gae"])
    actor, ref, critic = p.actor.model.offload, p.ref.model.offload, p.critic.model.offload
    assert actor.params and actor.optimizer_state and not actor.grads
    assert ref.params and critic.params and not critic.optimizer_state
    # the reference follows the actor's folded dtype (its default interpolates the actor's)
    assert str(engine(p.actor).dtype) == "torch.bfloat16" and str(engine(p.ref).dtype) == "torch.bfloat16"
    assert engine(p.actor).fast.compile and engine(p.ref).fast.compile
    default = plan(KL)
    assert not default.actor.model.offload.params and str(engine(default.actor).dtype) == "torch.float32"


def test_offload_policy_puts_every_state_in_host_memory():
    p = plan(KL + [f"{ACTOR}.fsdp_config.offload_policy=true", f"{REF}.fsdp_config.offload_policy=true"])
    actor = p.actor.model.offload
    assert actor.params and actor.grads and actor.optimizer_state and p.ref.model.offload.params


@pytest.mark.parametrize("key", [f"{ACTOR}.ulysses_sequence_parallel_size",
                                 f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size"])
def test_ulysses_sequence_parallelism_is_context_parallelism_of_actor_and_reference(key):
    p = plan(KL + ["trainer.n_gpus_per_node=2", f"{key}=2"])
    assert p.actor.model.spec.cp == 2 and p.ref.model.spec.cp == 2 and p.actor.model.spec.dp == 1


@pytest.mark.parametrize("key", [f"{ACTOR}.entropy_checkpointing", f"{ACTOR}.entropy_from_logits_with_chunking",
                                 f"{ACTOR}.fsdp_config.entropy_checkpointing"])
def test_chunked_entropy_is_the_fused_log_prob_path(key):
    assert engine(plan([f"{key}=true"]).actor).fast.fused_logprobs
    assert not engine(plan([]).actor).fast.fused_logprobs


def test_the_fsdp_schedule_name_is_the_decay_style():
    config = compose("ppo_trainer", [f"{ACTOR}.optim.lr_scheduler_type=cosine", "critic.optim.warmup_style=linear"])
    assert config.actor_rollout_ref.actor.optim.lr_decay_style == "cosine"
    assert config.critic.optim.lr_decay_style == "linear"


def test_sharding_knobs_and_engine_names_change_nothing():
    knobs = [f"{group}.{key}" for group in (f"{ACTOR}.fsdp_config", f"{REF}.fsdp_config", "critic.fsdp")
             for key in ("fsdp_size=8", "forward_prefetch=true", "reshard_after_forward=false", "use_orig_params=true",
                         "wrap_policy.min_num_params=1000000", "strategy=fsdp2")]
    knobs += [f"{ACTOR}.strategy=fsdp2", f"{REF}.strategy=fsdp", "critic.strategy=fsdp2", "model_engine=dp",
              "actor_rollout_ref.rollout.layered_summon=true"]
    tuned, default = plan(KL + knobs), plan(KL)
    assert (tuned.actor, tuned.ref, tuned.rollout) == (default.actor, default.ref, default.rollout)


@pytest.mark.parametrize("overrides, key", [
    ([f"{ACTOR}.fsdp_config.model_dtype=bf16"], f"{ACTOR}.fsdp_config.model_dtype"),
    ([f"{ACTOR}.fsdp_config.full_determinism=true"], f"{ACTOR}.fsdp_config.full_determinism"),
    ([f"{ACTOR}.fsdp_config.qat.enable=true"], f"{ACTOR}.fsdp_config.qat.enable"),
    ([f"+{ACTOR}.fsdp_config.mixed_precision.reduce_dtype=fp32"], f"{ACTOR}.fsdp_config.mixed_precision"),
    ([f"{REF}.fsdp_config.optimizer_offload=true"], f"{REF}.fsdp_config.optimizer_offload"),
    (["critic.fsdp.entropy_checkpointing=true"], "critic.fsdp.entropy_checkpointing"),
    ([f"{ACTOR}.optim.num_cycles=1.0"], f"{ACTOR}.optim.num_cycles"),
    ([f"{ACTOR}.optim.optimizer=SGD"], f"{ACTOR}.optim.optimizer"),
    ([f"{ACTOR}.fsdp_config.dtype=bfloat16", f"{ACTOR}.megatron.dtype=float16"], f"{ACTOR}.fsdp_config.dtype"),
    (["model_engine=veomni"], "model_engine"),
    (["actor_rollout_ref.rollout.max_num_batched_tokens=64"], "actor_rollout_ref.rollout.max_num_batched_tokens"),
    ([f"{ACTOR}.use_torch_compile=true", "actor_rollout_ref.rollout.bitwise_logprobs=true", "trainer.device=cuda"],
     f"{ACTOR}.use_torch_compile"),  # compiled kernels round differently from the batch-invariant ones
    (KL + ["actor_rollout_ref.model.lora_rank=4", f"{ACTOR}.use_torch_compile=true", f"{REF}.use_torch_compile=false"],
     f"{REF}.use_torch_compile"),  # a LoRA reference runs on the actor's engine
])
def test_refusals_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        plan(overrides)
    assert err.value.key == key


def test_a_plus_on_a_key_shardrl_holds_overrides_it():
    """verl's scripts add with `+` the keys verl's config lacks (SAPO's tau_pos): where shardrl's holds the key, the
    override becomes `++` (add or override); new keys keep their `+`."""
    given = ["+actor_rollout_ref.actor.policy_loss.tau_pos=2.0", "+actor_rollout_ref.model.override_config.x=1",
             "actor_rollout_ref.actor.policy_loss.loss_mode=sapo"]
    rewritten = add_or_override(given)
    assert rewritten == ["++actor_rollout_ref.actor.policy_loss.tau_pos=2.0", *given[1:]]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        config = load_config(hydra_compose(config_name="ppo_trainer", overrides=rewritten))
    assert config.actor_rollout_ref.actor.policy_loss.tau_pos == 2.0
    assert dataclasses.asdict(config)["actor_rollout_ref"]["model"]["override_config"] == {"x": 1}


def test_the_prefill_budget_defaults_to_the_longest_sequence():
    """verl's long-context scripts leave max_num_batched_tokens at its default (vLLM chunks longer prefills): the
    native engine's budget is then the longest sequence, and never below 8192."""
    long = plan(["data.max_prompt_length=8192", "data.max_response_length=2048"])
    assert long.rollout.engine.max_num_batched_tokens == 10240
    assert plan([]).rollout.engine.max_num_batched_tokens == 8192
    assert plan(["actor_rollout_ref.rollout.max_num_batched_tokens=4096"]).rollout.engine.max_num_batched_tokens == 4096


def test_the_key_compiles_the_actor_and_by_default_the_reference():
    compiled = plan(KL + ["actor_rollout_ref.actor.use_torch_compile=true"])
    assert compiled.actor.model.engine.fast.compile and compiled.ref.model.engine.fast.compile
    eager_ref = plan(KL + ["actor_rollout_ref.actor.use_torch_compile=true",
                           "actor_rollout_ref.ref.use_torch_compile=false"])
    assert eager_ref.actor.model.engine.fast.compile and not eager_ref.ref.model.engine.fast.compile
    default = plan(KL)
    assert not default.actor.model.engine.fast.compile and not default.ref.model.engine.fast.compile


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return builtin_task.prepare(tmp_path_factory.mktemp("task"))


def old_log_probs(task: dict, compile: bool) -> tuple[torch.Tensor, list[bool]]:
    from shardrl.workers.actor import ActorRefWorker

    options = plan(["trainer.device=cpu", "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.megatron.dtype=float32",
                    f"actor_rollout_ref.actor.use_torch_compile={str(compile).lower()}", "data.train_batch_size=2",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
                    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]).with_total_steps(1)
    worker = ActorRefWorker(options.actor, None, task["model"])
    norms = [m.compile for m in worker.actor.chunks[0].modules() if m.__class__.__name__ == "RMSNorm"]
    batch = sample_batch(14)
    return worker.compute_log_prob(batch).tensors["old_log_probs"], norms


@pytest.mark.slow
def test_a_compiled_actor_scores_as_the_eager_one(task, monkeypatch):
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "120")
    eager, eager_norms = old_log_probs(task, False)
    compiled, compiled_norms = old_log_probs(task, True)
    assert compiled_norms and all(compiled_norms) and not any(eager_norms)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
