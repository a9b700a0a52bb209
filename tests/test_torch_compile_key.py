"""verl's `actor.use_torch_compile` / `ref.use_torch_compile`: the actor's and the reference's models built with
compiled elementwise chains (`FastPaths.compile` on every layer), the same log-probs as the eager model (slow: the
compiler runs), and the refusals (bitwise mode, a LoRA reference that would differ from its actor)."""

import pytest
import torch

from shardrl.controller.rank_env import COLLECTIVE_TIMEOUT_ENV
from shardrl.data import builtin_task
from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from tests.test_distillation import sample_batch

KL = ["actor_rollout_ref.actor.use_kl_loss=true"]


def plan(overrides: list[str]):
    return plan_job(compose("ppo_trainer", overrides))


def test_the_key_compiles_the_actor_and_by_default_the_reference():
    compiled = plan(KL + ["actor_rollout_ref.actor.use_torch_compile=true"])
    assert compiled.actor.model.engine.fast.compile and compiled.ref.model.engine.fast.compile
    eager_ref = plan(KL + ["actor_rollout_ref.actor.use_torch_compile=true",
                           "actor_rollout_ref.ref.use_torch_compile=false"])
    assert eager_ref.actor.model.engine.fast.compile and not eager_ref.ref.model.engine.fast.compile
    default = plan(KL)
    assert not default.actor.model.engine.fast.compile and not default.ref.model.engine.fast.compile


@pytest.mark.parametrize("overrides, key", [
    (["actor_rollout_ref.actor.use_torch_compile=true", "actor_rollout_ref.rollout.bitwise_logprobs=true",
      "trainer.device=cuda"], "actor_rollout_ref.actor.use_torch_compile"),
    (KL + ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.actor.use_torch_compile=true",
           "actor_rollout_ref.ref.use_torch_compile=false"], "actor_rollout_ref.ref.use_torch_compile"),
])
def test_refusals_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        plan(overrides)
    assert err.value.key == key


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
