"""Decode steps that run one ahead of the host's bookkeeping (CPU, fp32): requests stopping at different steps are
returned by the step that sampled their last token and keep no token sampled after it; seeded rows next to unseeded
and greedy ones, and seeded rows aborted while a step ran ahead, follow a sampling loop over HF's model with the
uniforms computed on Python ints (`seeded_sampling.py`); admission, partial abort and weight updates in the middle of
a run."""

import pytest
import torch
from safetensors.torch import load_file
from seeded_sampling import reference_draw, reference_uniform
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.rollout.request import SamplingParams

PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 2], [20, 21, 22], [40, 41, 42, 43]]
CONFIG = EngineConfig(max_model_len=40, cpu_kv_cache_tokens=40 * 4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")


@pytest.fixture(scope="module")
def hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _reference(hf, prompt, max_tokens, seed=None, stop=None, temperature=1.0, top_k=0):
    """HF's next-token logits, one full forward per token. Greedy without `seed`; with it, a plain inverse-CDF loop
    over the temperature-scaled top-k softmax with the uniform of (seed, index of the token in the sequence).
    Returns tokens and raw (temperature-1) logprobs, stopping after `stop`."""
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        logits = hf(torch.tensor([prompt + tokens])).logits[0, -1]  # [V]
        if seed is None:
            token = int(logits.argmax())
        else:
            u = reference_uniform(seed, len(prompt) + len(tokens))
            token = reference_draw(logits.tolist(), u, temperature, top_k)
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        if token == stop:
            break
    return tokens, logprobs


def _first_new(tokens, index):
    """A token of `tokens` from `index` on that does not occur before it, and where it first occurs."""
    for i in range(index, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return tokens[i], i
    raise AssertionError(f"no token of {tokens} after position {index} is new")


def _run(engine):
    """Step until done -> {request id: (output, number of the step() call that returned it)}."""
    done, calls = {}, 0
    while engine.has_unfinished():
        calls += 1
        done.update((out.request_id, (out, calls)) for out in engine.step())
    return done


def test_stops_at_different_steps_are_returned_by_the_step_that_sampled_them(path, hf):
    greedy = [_reference(hf, p, 12)[0] for p in PROMPTS]
    stops = [_first_new(tokens, index) for tokens, index in zip(greedy, (2, 5, 9, 3))]
    engine = Engine.from_pretrained(path, Layout.single(), CONFIG)
    for i, (prompt, (stop, _)) in enumerate(zip(PROMPTS, stops)):
        engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,),
                                             ignore_eos=True), request_id=str(i))
    done = _run(engine)
    for i, (tokens, (stop, at)) in enumerate(zip(greedy, stops)):
        out, call = done[str(i)]
        assert out.token_ids == tokens[:at + 1] and out.finish_reason == "stop"
        assert call == at + 1  # call 1 prefills (token 0); call c records token c-1
    stats = engine.stats
    assert stats.decode_tokens == sum(at for _, at in stops)  # no token of a stopped request is counted
    # Stops at tokens 2 (slot 0), 5 (slot 1), 9 (slot 2) and 3 (slot 3). A stopped request's row rides along dead
    # while the batch runs ahead, unless the batch can shrink: the stop in its last slot (3) launched it from the
    # host over slots 0-2, the others did not; the step launched ahead of the last stop was dropped, not recorded.
    assert stats.decode_host_launches == 2 and stats.decode_steps == max(at for _, at in stops)


def test_a_dead_row_stays_inside_its_slot_while_the_others_run_ahead(path, hf):
    """A long request stops early; the short one next to it runs ~27 more steps ahead of the host. Were the dead
    row moved on each step it would write past the 40-token cache row (an index error on CPU); it stays put, and
    the other request's tokens stay exact."""
    long_prompt = list(range(50, 80))  # 30 tokens: stopping at generated token ~2 leaves ~8 positions
    stop, at = _first_new(_reference(hf, long_prompt, 4)[0], 1)
    engine = Engine.from_pretrained(path, Layout.single(), CONFIG)
    engine.submit(long_prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop,),
                                              ignore_eos=True), request_id="long")
    engine.submit(PROMPTS[2], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), request_id="short")
    done = _run(engine)
    assert len(done["long"][0].token_ids) == at + 1 and done["long"][0].finish_reason == "stop"
    assert done["short"][0].token_ids == _reference(hf, PROMPTS[2], 30)[0]
    assert engine.stats.decode_host_launches == 1  # everything after the prefill ran ahead


def test_seeded_rows_next_to_unseeded_and_greedy_rows_follow_the_reference(path, hf):
    seeded_tokens, _ = _reference(hf, PROMPTS[2], 10, seed=11)
    stop, at = _first_new(seeded_tokens, 3)
    params = [SamplingParams(max_tokens=10, seed=7, raw_logprobs=True, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, raw_logprobs=True, ignore_eos=True),
              SamplingParams(max_tokens=10, seed=11, stop_token_ids=(stop,), raw_logprobs=True, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.0, raw_logprobs=True, ignore_eos=True)]
    engine = Engine.from_pretrained(path, Layout.single(), CONFIG)
    outputs = engine.generate(PROMPTS, params)
    expected = [_reference(hf, PROMPTS[0], 10, seed=7), None, _reference(hf, PROMPTS[2], 10, seed=11, stop=stop),
                _reference(hf, PROMPTS[3], 7)]
    for out, reference in zip(outputs, expected):
        if reference is not None:
            assert out.token_ids == reference[0]
            assert_close(torch.tensor(out.raw_logprobs), torch.tensor(reference[1]), atol=1e-5, rtol=0)
    assert len(outputs[2].token_ids) == at + 1 and outputs[2].finish_reason == "stop"
    # The unseeded row: each recorded token is the one fed to the next step (else its logprobs would not match).
    unseeded = outputs[1]
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPTS[1] + unseeded.token_ids])).logits[0, len(PROMPTS[1]) - 1:-1]  # [10, V]
    expected_raw = torch.log_softmax(logits, -1).gather(1, torch.tensor(unseeded.token_ids)[:, None]).squeeze(1)
    assert_close(torch.tensor(unseeded.raw_logprobs), expected_raw, atol=1e-5, rtol=0)
    assert engine.stats.decode_host_launches < engine.stats.decode_steps


def test_seeded_requests_aborted_while_a_step_runs_ahead_follow_the_reference(path, hf):
    """The step launched ahead is dropped by the abort and the requests are re-prefilled on resume (a new slot
    order, a prefill instead of a decode step): each seeded request's tokens are still the reference loop's, which
    knows nothing of batches, steps or aborts. Seed 3 twice, on different prompts."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    params = [SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=seed, ignore_eos=True)
              for seed in (3, 2**31 + 5, 3)]
    engine = Engine.from_pretrained(path, Layout.single(), CONFIG)
    ids = [engine.submit(prompt, p)[0] for prompt, p in zip(prompts, params)]
    for _ in range(4):
        engine.step()
    assert engine._ahead is not None
    partial = engine.abort()
    assert [len(o.token_ids) for o in partial] == [4, 4, 4]
    engine.resume(list(reversed(ids)))
    done = {out.request_id: out for out in engine.stream()}
    for rid, prompt, p in zip(ids, prompts, params):
        expected, _ = _reference(hf, prompt, 9, seed=p.seed, temperature=0.8, top_k=20)
        assert done[rid].token_ids == expected
    assert done[ids[0]].token_ids != done[ids[2]].token_ids


def test_admission_waits_for_a_free_slot_and_outputs_stay_exact(path, hf):
    greedy = [_reference(hf, p, 8)[0] for p in PROMPTS[:3]]
    stop, at = _first_new(greedy[0], 2)
    config = EngineConfig(max_model_len=40, max_num_seqs=2, cpu_kv_cache_tokens=80, max_num_batched_tokens=64)
    engine = Engine.from_pretrained(path, Layout.single(), config)
    engine.submit(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop,),
                                             ignore_eos=True), request_id="a")
    engine.submit(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), request_id="b")
    done, prefills = {}, []  # prefills: the prefill count after each step() call

    def step():
        done.update((out.request_id, out) for out in engine.step())
        prefills.append(engine.stats.prefill_steps)

    step()
    step()
    assert engine._ahead is not None  # "c" arrives while a decode step of "a" and "b" runs ahead
    engine.submit(PROMPTS[2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), request_id="c")
    while engine.has_unfinished():
        step()
    assert done["a"].token_ids == greedy[0][:at + 1] and done["b"].token_ids == greedy[1]
    assert done["c"].token_ids == greedy[2]
    # "a" stops at call at+1; the step launched ahead in that call is still recorded for "b" (call at+2), then
    # "c" is prefilled into the freed slot.
    assert prefills.index(2) + 1 == at + 3


def test_partial_abort_and_weight_update_mid_run_equal_an_uninterrupted_run(path):
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=30, seed=i, ignore_eos=True) for i in range(3)]
    expected = Engine.from_pretrained(path, Layout.single(), CONFIG).generate(PROMPTS[:3], params)
    engine = Engine.from_pretrained(path, Layout.single(), CONFIG)
    ids = [engine.submit(p, q)[0] for p, q in zip(PROMPTS, params)]
    for _ in range(4):  # a prefill and three decode steps, the last one launched the step after it ahead
        engine.step()
    (paused,) = engine.abort([ids[1]])
    assert len(paused.token_ids) == 4
    engine.step()
    engine.update_weights(load_file(path / "model.safetensors").items(), version=2)  # same weights, new version
    engine.resume()
    done = {out.request_id: out for out in engine.stream()}
    for rid, ref in zip(ids, expected):
        assert done[rid].token_ids == ref.token_ids
        assert_close(torch.tensor(done[rid].logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
    assert done[ids[0]].policy_versions == [0] * 5 + [2] * 5
    assert done[ids[1]].policy_versions == [0] * 4 + [2] * 6


def test_steps_run_ahead_until_the_batch_changes(path):
    """A row that reaches its token limit rides along dead (the batch keeps its rows); a request that can be
    admitted changes the batch: the step after it is launched from the host, with the live rows' settings."""
    engine = Engine.from_pretrained(path, Layout.single(), CONFIG)
    engine.submit(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.5, ignore_eos=True))
    engine.submit(PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()  # prefill: first tokens
    assert [len(o.token_ids) for o in engine.step()] == [2]  # the first reaches max_tokens in slot 0
    assert engine._ahead is not None and engine.stats.decode_host_launches == 1  # ran ahead over its dead row
    engine.submit(PROMPTS[2], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the step launched ahead is recorded; none runs ahead of it: the new request waits for a slot
    assert engine._ahead is None
    engine.step()  # the new request's prefill
    engine.step()  # the batch from the host: both live rows at temperature 1
    ahead = engine._ahead
    assert ahead is not None and ahead.sampling.temperature.tolist() == [1.0, 1.0] and ahead.sampling.unit_temperature
    done = {len(o.token_ids) for _ in range(4) for o in engine.step()}
    assert done == {6, 3} and not engine.has_unfinished() and engine.stats.decode_host_launches == 2
