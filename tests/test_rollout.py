"""Rollout engine on CPU (fp32): greedy equals HF `generate`, logprobs equal the trainer model's full forward,
continuous batching equals one-at-a-time, abort/resume equals an uninterrupted run, weight updates, sleep/wake."""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import load_hf_weights
from shardrl.models.tiny import TINY_CONFIGS, make_tiny_checkpoint
from shardrl.models.transformer import Transformer
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine, EngineConfig, EngineError
from shardrl.rollout.request import SamplingParams

FAMILIES = list(TINY_CONFIGS)
PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 2], [20, 21, 22]]
CONFIG = EngineConfig(max_model_len=48, cpu_kv_cache_tokens=48 * 4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_checkpoint(family, root / family) for family in FAMILIES}


def _engine(path, config=CONFIG):
    return Engine.from_pretrained(path, Layout.single(), config)


def _tokens(outputs):
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_generate(checkpoints, family):
    outputs = _engine(checkpoints[family]).generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0,
                                                                            ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(PROMPTS, outputs):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert out.token_ids == expected[0, len(prompt):].tolist()
        assert out.finish_reason == "length" and out.policy_versions == [0] * 8


def _trainer_logprobs(path, outputs, temperature):
    """Per request, the trainer model's logprobs of the generated tokens from one packed full forward."""
    model = Transformer(ModelConfig.from_pretrained(path), Layout.single())
    load_hf_weights(model, path)
    sequences = [o.prompt_ids + o.token_ids for o in outputs]
    lengths = [len(s) for s in sequences]
    ids = torch.tensor([t for s in sequences for t in s])
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).int()
    with torch.no_grad():
        logprobs, _ = model.compute_logprobs(model(ids, positions, cu_seqlens), ids.roll(-1), temperature)
    return [logprobs[start + len(o.prompt_ids) - 1: start + n - 1]
            for o, start, n in zip(outputs, cu_seqlens.tolist(), lengths)]


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_logprobs_equal_trainer_forward(checkpoints, family):
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=3, raw_logprobs=True, ignore_eos=True)
    outputs = _engine(checkpoints[family]).generate(PROMPTS, params)
    scaled = _trainer_logprobs(checkpoints[family], outputs, 0.7)
    raw = _trainer_logprobs(checkpoints[family], outputs, 1.0)
    for out, expected_scaled, expected_raw in zip(outputs, scaled, raw):
        assert_close(torch.tensor(out.logprobs), expected_scaled, atol=1e-5, rtol=0)
        assert_close(torch.tensor(out.raw_logprobs), expected_raw, atol=1e-5, rtol=0)


def test_raw_logprobs_mode_reports_the_unscaled_unfiltered_logprob_of_the_same_draws(checkpoints):
    """vLLM's logprobs_mode, engine-wide: the draws stay those of the filtered, scaled distribution; each token's
    reported logprob becomes the trainer's at temperature 1 (and differs from the processed one)."""
    path = checkpoints["qwen2"]
    params = SamplingParams(max_tokens=10, temperature=0.7, top_k=20, seed=3, ignore_eos=True)
    processed = _engine(path).generate(PROMPTS, params)
    raw = _engine(path, replace(CONFIG, logprobs_mode="raw_logprobs")).generate(PROMPTS, params)
    assert _tokens(raw) == _tokens(processed)
    for out, expected, other in zip(raw, _trainer_logprobs(path, raw, 1.0), processed):
        assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)
        assert (torch.tensor(out.logprobs) - torch.tensor(other.logprobs)).abs().max() > 1e-2


def test_continuous_batching_equals_one_at_a_time(checkpoints):
    path = checkpoints["llama"]
    prompts = [[(7 * i + j) % 100 + 1 for j in range(n)] for i, n in enumerate([3, 12, 5, 20, 7])]
    params = [SamplingParams(max_tokens=m, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
              for i, m in enumerate([9, 3, 14, 6, 11])]
    # Two running at a time and 32-token prefill batches: requests finish, free slots and get refilled mid-run.
    config = EngineConfig(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=32, cpu_kv_cache_tokens=64)
    engine = _engine(path, config)
    batched = engine.generate(prompts, params)
    assert engine.stats.prefill_steps == 4  # prompts 0+1 together, then each of the others as a slot frees
    for prompt, p, out in zip(prompts, params, batched):
        alone = _engine(path, config).generate([prompt], p)[0]
        assert out.token_ids == alone.token_ids
        assert_close(torch.tensor(out.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)


def test_abort_resume_equals_uninterrupted(checkpoints):
    path = checkpoints["qwen3"]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=5, ignore_eos=True)
    expected = _engine(path).generate(PROMPTS, params)
    engine = _engine(path)
    ids = [engine.submit(p, params)[0] for p in PROMPTS]
    for _ in range(5):  # one prefill, then four decode steps
        assert engine.step() == []
    partial = engine.abort()
    assert [o.request_id for o in partial] == ids and not engine.has_unfinished()
    assert all(len(o.token_ids) == 5 and not o.finished for o in partial)
    engine.update_weights(load_file(path / "model.safetensors").items(), version=4)  # same weights, new version
    engine.resume()
    resumed = sorted(engine.stream(), key=lambda o: ids.index(o.request_id))
    assert _tokens(resumed) == _tokens(expected)
    for out, ref in zip(resumed, expected):
        assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
        assert out.policy_versions == [0] * 5 + [4] * 7


def test_abort_without_keep_drops_requests(checkpoints):
    engine = _engine(checkpoints["qwen2"])
    first, second = (engine.submit(p, SamplingParams(max_tokens=4))[0] for p in PROMPTS[:2])
    engine.step()
    dropped = engine.abort([first], keep=False)
    engine.resume()
    assert [o.request_id for o in dropped] == [first]
    assert [o.request_id for o in engine.stream()] == [second]


def test_update_weights_equals_fresh_engine(checkpoints, tmp_path):
    other = make_tiny_checkpoint("qwen2", tmp_path / "other", seed=1)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=2, ignore_eos=True)
    engine = _engine(checkpoints["qwen2"])
    before = engine.generate(PROMPTS, params)
    engine.update_weights(load_file(other / "model.safetensors").items())
    after = engine.generate(PROMPTS, params)
    fresh = _engine(other).generate(PROMPTS, params)
    assert _tokens(after) == _tokens(fresh) != _tokens(before)
    assert after[0].logprobs == fresh[0].logprobs
    assert engine.policy_version == 1 and after[0].policy_versions == [1] * 8
    with pytest.raises(EngineError, match="lm_head.bias"):
        engine.update_weights([("lm_head.bias", torch.zeros(128))])
    # Weights written in place (weight sync) only need the new version; an empty update is refused, not taken
    # for that.
    with pytest.raises(EngineError, match="no tensors given; .* call set_policy_version"):
        engine.update_weights([], version=5)
    engine.set_policy_version(5)
    engine.set_policy_version()
    assert engine.policy_version == 6 and _tokens(engine.generate(PROMPTS, params)) == _tokens(after)


def test_sleep_wake_round_trip(checkpoints):
    engine = _engine(checkpoints["mixtral"])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = engine.generate(PROMPTS, params)
    stats = engine.stats  # one prefill of 5 + 9 + 3 tokens, then 5 decode steps of 3 requests
    assert (stats.prefill_steps, stats.prefill_tokens, stats.decode_steps, stats.decode_tokens) == (1, 17, 5, 15)
    engine.sleep(offload_weights=True)
    assert not engine.runner.cache.allocated
    with pytest.raises(EngineError, match="asleep"):
        engine.submit(PROMPTS[0], params)
        engine.step()
    engine.abort(keep=False)
    engine.wake_up()
    assert _tokens(engine.generate(PROMPTS, params)) == _tokens(before)


def test_stop_tokens_n_samples_and_streaming_order(checkpoints):
    engine = _engine(checkpoints["llama"])
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop = greedy.token_ids[3]
    first_stop = greedy.token_ids.index(stop)
    stopped = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop,),
                                                           ignore_eos=True))[0]
    assert stopped.token_ids == greedy.token_ids[:first_stop + 1] and stopped.finish_reason == "stop"
    samples = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=6, n=3, seed=9, ignore_eos=True))
    assert [o.request_id.split("/")[1] for o in samples] == ["0", "1", "2"]
    assert len({tuple(o.token_ids) for o in samples}) == 3  # seeds seed+i give different samples
    engine.submit(PROMPTS[0], SamplingParams(max_tokens=7, ignore_eos=True), request_id="long")
    engine.submit(PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True), request_id="short")
    assert [o.request_id for o in engine.stream()] == ["short", "long"]


def test_prompt_longer_than_model_len_is_refused(checkpoints):
    with pytest.raises(EngineError, match="max_model_len"):
        _engine(checkpoints["qwen2"]).submit(list(range(48)), SamplingParams())


def test_padding_rows_leave_running_rows_unchanged(checkpoints):
    """What the CUDA-graph decode relies on: rows for free slots ride along without touching the others."""
    engine = _engine(checkpoints["qwen2"])
    for prompt in PROMPTS[:2]:
        engine.submit(prompt, SamplingParams(max_tokens=4))
    engine.step()  # prefill both into slots 0 and 1
    running = [engine.scheduler.running[s] for s in (0, 1)]
    ids = torch.tensor([r.token_ids[-1] for r in running])
    positions = torch.tensor([r.num_tokens - 1 for r in running])
    with torch.inference_mode():
        exact = engine.runner.decode_hidden(ids, positions, length=16)
        padded = engine.runner.decode_hidden(torch.cat([ids, torch.zeros(2, dtype=torch.long)]),
                                             torch.cat([positions, torch.zeros(2, dtype=torch.long)]), length=48)
    assert_close(padded[:2], exact, atol=1e-6, rtol=0)



def test_the_samples_of_a_prompt_share_one_prefill(checkpoints):
    """The n samples of a prompt, prefilled in one step, run the prompt through the model once and copy its cache
    rows: the same tokens and logprobs as prefilling each copy (which reads the copied keys and values in every
    decode step), fewer tokens run, and each sample still draws its own tokens."""
    path = checkpoints["qwen2"]
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 2
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True) for seed in range(5)]
    config = replace(CONFIG, cpu_kv_cache_tokens=48 * 6)
    shared_engine, alone_engine = _engine(path, config), _engine(path, replace(config, share_prefill=False))
    shared, alone = shared_engine.generate(prompts, params), alone_engine.generate(prompts, params)
    assert _tokens(shared) == _tokens(alone)
    for s, a in zip(shared, alone):
        assert_close(torch.tensor(s.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
    assert len({tuple(t) for t in _tokens(shared)[:3]}) > 1  # one prompt, different samples
    assert (shared_engine.stats.prefill_steps, alone_engine.stats.prefill_steps) == (1, 1)
    assert shared_engine.stats.prefill_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
    assert alone_engine.stats.prefill_tokens == 3 * len(PROMPTS[0]) + 2 * len(PROMPTS[1])
