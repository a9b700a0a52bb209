"""Bitwise mode (`actor_rollout_ref.rollout.bitwise_logprobs`) on CPU: the key reaches the rollout engine and the
actor's model, what it cannot honour is refused before workers start, and the sampler's bitwise path reports the
trainer's own logprob function's bits. The kernels and the rollout == trainer equality are GPU tests
(tests/test_bitwise_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.parallel.layout import Layout
from shardrl.parallel.vocab import vocab_parallel_logprobs
from shardrl.rollout.engine import Engine, EngineConfig, EngineError
from shardrl.rollout.request import SamplingParams
from shardrl.rollout.sampler import SamplingBatch, sample

BITWISE = ["trainer.device=cuda", "actor_rollout_ref.rollout.bitwise_logprobs=true",
           "actor_rollout_ref.actor.megatron.dtype=bfloat16", "actor_rollout_ref.rollout.dtype=bfloat16"]


def test_bitwise_logprobs_reaches_the_rollout_engine_and_the_actor_only():
    plan = plan_job(compose("ppo_trainer", BITWISE))
    assert plan.rollout.engine.bitwise and plan.actor.model.engine.fast.bitwise
    default = plan_job(compose("ppo_trainer", BITWISE[:1] + BITWISE[2:]))
    assert not default.rollout.engine.bitwise and not default.actor.model.engine.fast.bitwise


@pytest.mark.parametrize("overrides, key", [
    (["trainer.device=cpu"], "actor_rollout_ref.rollout.bitwise_logprobs"),
    (["actor_rollout_ref.actor.megatron.dtype=float32", "actor_rollout_ref.rollout.dtype=bfloat16"],
     "actor_rollout_ref.actor.megatron.dtype"),
    (["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"),
    (["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    (["actor_rollout_ref.rollout.dtype=float16"], "actor_rollout_ref.rollout.dtype"),
    (["actor_rollout_ref.rollout.top_k=20"], "actor_rollout_ref.rollout.bitwise_logprobs"),
    (["actor_rollout_ref.rollout.top_p=0.9"], "actor_rollout_ref.rollout.bitwise_logprobs"),
    (["actor_rollout_ref.rollout.logprobs_mode=raw_logprobs"], "actor_rollout_ref.rollout.logprobs_mode"),
])
def test_what_bitwise_mode_cannot_honour_is_refused_before_workers_start(overrides, key):
    with pytest.raises(ConfigError) as err:
        plan_job(compose("ppo_trainer", BITWISE + overrides))
    assert err.value.key == key


def test_the_engine_refuses_bitwise_mode_off_the_gpu(tmp_path):
    from shardrl.models.config import ModelConfig
    from shardrl.models.tiny import make_tiny_checkpoint

    config = ModelConfig.from_pretrained(make_tiny_checkpoint("qwen2", tmp_path / "m"))
    with pytest.raises(EngineError, match="bitwise mode"):
        Engine(config, Layout.single("cpu"), EngineConfig(max_model_len=64, bitwise=True))


def test_bitwise_sampling_reports_the_trainers_logprob_of_the_drawn_token():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 500, generator=g) * 3).bfloat16()
    params = [SamplingParams(temperature=0.7, seed=i) for i in range(6)]
    batch = SamplingBatch.build(params, list(range(6)), 500, torch.device("cpu"))
    counters = torch.arange(6) + 10
    drawn = sample(logits, batch, counters, bitwise=True)
    trainer, _ = vocab_parallel_logprobs(logits / 0.7, drawn.token_ids, None, 500)  # compute_logprobs' op
    assert torch.equal(drawn.logprobs, trainer)
    # The draw is softmax(logits / T): the same tokens as the default path draws from the same uniforms up to the
    # bf16 rounding of the division, which moves no token here.
    assert torch.equal(drawn.token_ids, sample(logits, batch, counters).token_ids)
    mixed = SamplingBatch.build([SamplingParams(temperature=0.7), SamplingParams(temperature=1.0)], [0, 1], 500,
                                torch.device("cpu"))
    with pytest.raises(ValueError, match="mixed temperatures"):
        sample(logits[:2], mixed, counters[:2], bitwise=True)
