"""Multi-turn continuations on the engine (CPU, fp32): a turn that continues a parked sequence prefills only its
new tokens and samples exactly what a fresh prefill of the whole sequence samples; parked slots survive other
sequences' decode steps riding along, are lent to new sequences when the cache is full (their prefix kept in a
spare cache row if there is one), and go with new weights."""

import pytest
import torch
from torch.testing import assert_close

from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine, EngineConfig, EngineError
from shardrl.rollout.request import SamplingParams

CONFIG = EngineConfig(max_model_len=64, cpu_kv_cache_tokens=64 * 4, max_num_batched_tokens=128)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, raw_logprobs=True)
ENV = [17, 3, 29, 8, 11]  # "tool output" tokens appended between turns


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")


def _engine(path, config=CONFIG):
    return Engine.from_pretrained(path, Layout.single(), config)


def _fresh(path, prompt, params=GREEDY):
    return _engine(path).generate([prompt], params)[0]


def _run(engine):
    return {out.request_id: out for out in engine.stream()}


def test_continuation_prefills_only_new_tokens_and_equals_fresh_prefill(checkpoint):
    engine = _engine(checkpoint)
    first, = engine.submit([1, 5, 7, 9], GREEDY, "t0", keep_cache=True)
    turn1 = _run(engine)[first]
    prompt2 = turn1.prompt_ids + turn1.token_ids + ENV
    engine.stats.prefill_tokens = 0
    second, = engine.submit(prompt2, GREEDY, "t1", keep_cache=True, continues="t0")
    turn2 = _run(engine)[second]
    assert engine.stats.prefill_tokens == len(ENV) + 1  # the last sampled token (its keys may be missing) + new ones
    assert engine.stats.cached_prefill_tokens == len(prompt2) - len(ENV) - 1
    fresh = _fresh(checkpoint, prompt2)
    assert turn2.token_ids == fresh.token_ids
    assert_close(turn2.raw_logprobs, fresh.raw_logprobs, atol=1e-5, rtol=1e-5)
    # A third turn continues the second one's parked slot in turn.
    prompt3 = prompt2 + turn2.token_ids + ENV[:2]
    third, = engine.submit(prompt3, GREEDY, "t2", continues="t1")
    assert _run(engine)[third].token_ids == _fresh(checkpoint, prompt3).token_ids
    assert not engine.scheduler.parked  # t2 did not ask to keep its slot


def test_parked_slot_survives_other_sequences_decoding_over_it(checkpoint):
    """Park a sequence in slot 0 while a sequence in slot 1 decodes many steps: slot 0 rides along in every decode
    batch (rows 0..1), and must not write into the cached prefix."""
    engine = _engine(checkpoint)
    long_params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    parked, = engine.submit([1, 5, 7, 9], GREEDY, "a", keep_cache=True)
    other, = engine.submit([2, 4, 6, 8, 10], long_params, "b")
    done = _run(engine)
    assert engine.scheduler.parked["a"].slot == 0 and engine.stats.decode_steps >= 25
    prompt2 = done[parked].prompt_ids + done[parked].token_ids + ENV
    again, = engine.submit(prompt2, GREEDY, "a2", continues="a")
    assert _run(engine)[again].token_ids == _fresh(checkpoint, prompt2).token_ids


def test_waiting_continuation_keeps_its_prefix_while_others_decode(checkpoint):
    """A continuation submitted while another sequence decodes holds its slot in the queue, idle rows included."""
    engine = _engine(checkpoint)
    engine.submit([1, 5, 7, 9], GREEDY, "a", keep_cache=True)
    out_a = _run(engine)["a"]
    engine.submit([2, 4, 6, 8, 10], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), "b")
    for _ in range(5):
        engine.step()
    prompt2 = out_a.prompt_ids + out_a.token_ids + ENV
    engine.submit(prompt2, GREEDY, "a2", continues="a")
    assert _run(engine)["a2"].token_ids == _fresh(checkpoint, prompt2).token_ids


def test_full_cache_lends_the_oldest_parked_slot_and_its_continuation_prefills_whole(checkpoint):
    engine = _engine(checkpoint, EngineConfig(max_model_len=64, cpu_kv_cache_tokens=64 * 2,
                                              max_num_batched_tokens=128))
    assert engine.max_running == 2
    engine.submit([1, 5, 7, 9], GREEDY, "a", keep_cache=True)
    engine.submit([3, 5, 7], GREEDY, "b", keep_cache=True)
    outs = _run(engine)
    engine.submit([4, 4, 4], GREEDY, "c")  # no free slot: "a" (parked first) lends its slot
    _run(engine)
    assert list(engine.scheduler.parked) == ["b"] and engine.scheduler.evictions == 1
    prompt2 = outs["a"].prompt_ids + outs["a"].token_ids + ENV
    engine.stats.prefill_tokens = 0
    engine.submit(prompt2, GREEDY, "a2", continues="a")
    assert _run(engine)["a2"].token_ids == _fresh(checkpoint, prompt2).token_ids
    assert engine.stats.prefill_tokens == len(prompt2)


def _spare_engine(path, decode_slots, rows):
    """An engine of `decode_slots` decode slots whose cache budget holds `rows` rows in all (the rest spare)."""
    engine = _engine(path, EngineConfig(max_model_len=64, cpu_kv_cache_tokens=64 * rows, max_num_batched_tokens=128,
                                        max_num_seqs=decode_slots, spare_cache_rows=True))
    assert engine.max_running == decode_slots and engine.runner.cache.num_slots == rows
    return engine


def _next_turn(out, env=ENV):
    return out.prompt_ids + out.token_ids + env


def _assert_fresh(checkpoint, out):
    fresh = _fresh(checkpoint, out.prompt_ids)
    assert out.token_ids == fresh.token_ids
    assert_close(out.raw_logprobs, fresh.raw_logprobs, atol=1e-5, rtol=1e-5)


def test_a_lent_slots_prefix_waits_in_a_spare_row_and_its_continuation_prefills_only_new_tokens(checkpoint):
    engine = _spare_engine(checkpoint, decode_slots=2, rows=3)
    engine.submit([1, 5, 7, 9], GREEDY, "a", keep_cache=True)
    engine.submit([3, 5, 7], GREEDY, "b", keep_cache=True)
    outs = _run(engine)
    engine.submit([4, 4, 4], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), "c")
    _run(engine)  # "c" decodes 20 steps in "a"'s old slot, over whatever of it stayed there
    sched = engine.scheduler
    assert list(sched.spared) == ["a"] and list(sched.parked) == ["b"]
    assert (sched.spared_prefixes, sched.evictions) == (1, 0)
    engine.stats = type(engine.stats)()
    engine.submit(_next_turn(outs["a"]), GREEDY, "a2", continues="a")
    a2 = _run(engine)["a2"]
    assert engine.stats.prefill_tokens == len(ENV) + 1 and engine.stats.prefix_moves == 1
    _assert_fresh(checkpoint, a2)
    assert not sched.spared and len(sched.free_spares) == 1


def test_with_every_spare_row_taken_the_oldest_spared_prefix_is_dropped(checkpoint):
    engine = _spare_engine(checkpoint, decode_slots=2, rows=3)
    engine.submit([1, 5, 7, 9], GREEDY, "a", keep_cache=True)
    engine.submit([3, 5, 7], GREEDY, "b", keep_cache=True)
    outs = _run(engine)
    engine.submit([4, 4, 4], GREEDY, "c", keep_cache=True)  # lends "a"'s slot: "a" to the spare row
    engine.submit([6, 2], GREEDY, "d")  # lends "b"'s: "a" gives the spare row up to "b"
    _run(engine)
    assert list(engine.scheduler.spared) == ["b"] and engine.scheduler.evictions == 1
    for rid, new_tokens in (("a", None), ("b", len(ENV) + 1)):
        engine.stats.prefill_tokens = 0
        prompt = _next_turn(outs[rid])
        engine.submit(prompt, GREEDY, rid + "2", continues=rid)
        out = _run(engine)[rid + "2"]
        assert engine.stats.prefill_tokens == (new_tokens or len(prompt))
        _assert_fresh(checkpoint, out)


def test_a_slot_lent_and_refilled_from_a_spare_row_in_one_step(checkpoint):
    """One decode slot: the continuation of the spared "a" takes the slot parked "c" holds, so "c" moves out to a
    spare row and "a" moves in from another in the same step (out before in)."""
    engine = _spare_engine(checkpoint, decode_slots=1, rows=3)
    a = _run_one(engine, [1, 5, 7, 9], "a")
    c = _run_one(engine, [4, 4, 4, 2], "c")  # lends "a"'s slot
    engine.stats = type(engine.stats)()
    a2 = _run_one(engine, _next_turn(a), "a2", continues="a")
    assert engine.stats.prefix_moves == 2 and engine.stats.prefill_tokens == len(ENV) + 1
    _assert_fresh(checkpoint, a2)
    engine.stats = type(engine.stats)()
    c2 = _run_one(engine, _next_turn(c, ENV[:3]), "c2", continues="c")
    assert engine.stats.prefix_moves == 2 and engine.stats.prefill_tokens == 4  # "a2" out, "c" in
    _assert_fresh(checkpoint, c2)


def _run_one(engine, prompt, rid, continues=None):
    engine.submit(prompt, GREEDY, rid, keep_cache=True, continues=continues)
    return _run(engine)[rid]


def test_a_spared_prefix_continued_while_others_decode_is_fed(checkpoint):
    engine = _spare_engine(checkpoint, decode_slots=2, rows=3)
    outs = {rid: _run_one(engine, ids, rid) for rid, ids in (("a", [1, 5, 7, 9]), ("b", [3, 5, 7]))}
    engine.submit([4, 4, 4], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), "c")  # "a" spared
    for _ in range(5):
        engine.step()
    assert list(engine.scheduler.spared) == ["a"]
    engine.stats = type(engine.stats)()
    engine.submit(_next_turn(outs["a"]), GREEDY, "a2", continues="a")  # takes "b"'s slot, "a" moved back in
    a2 = _run(engine)["a2"]
    assert engine.stats.fed_tokens >= len(ENV) + 1 and engine.stats.prefill_tokens == 0
    assert engine.scheduler.evictions == 1  # "b": no spare row left for it
    _assert_fresh(checkpoint, a2)


def test_aborting_a_continuation_that_holds_a_spare_row_frees_it(checkpoint):
    engine = _spare_engine(checkpoint, decode_slots=1, rows=2)
    a = _run_one(engine, [1, 5, 7, 9], "a")
    engine.submit([4, 4, 4], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), "c")
    engine.step()  # "c" prefills in "a"'s slot, "a" spared
    engine.submit(_next_turn(a), GREEDY, "a2", continues="a")  # waits, holding the spare row
    engine.abort(["a2"], keep=False)
    assert engine.scheduler.free_spares == [1]
    _run(engine)
    engine.release_cache()
    assert engine.scheduler.free_spares == [1] and engine.scheduler.free_slots == [0]


def test_new_weights_drop_parked_caches(checkpoint):
    engine = _engine(checkpoint)
    engine.submit([1, 5, 7, 9], GREEDY, "a", keep_cache=True)
    out = _run(engine)["a"]
    engine.set_policy_version(3)
    assert not engine.scheduler.parked and len(engine.scheduler.free_slots) == engine.max_running
    engine.stats.prefill_tokens = 0
    prompt2 = out.prompt_ids + out.token_ids + ENV
    engine.submit(prompt2, GREEDY, "a2", continues="a")
    result = _run(engine)["a2"]
    assert engine.stats.prefill_tokens == len(prompt2) and result.policy_versions == [3] * GREEDY.max_tokens


def test_continuations_mixed_with_fresh_prompts_and_release(checkpoint):
    """Several trajectories at different turns share the engine; each turn equals its fresh prefill; released
    parked slots go back to the free list."""
    engine = _engine(checkpoint)
    prompts = {"x": [1, 2, 3], "y": [9, 8, 7, 6], "z": [5, 5]}
    for rid, ids in prompts.items():
        engine.submit(ids, GREEDY, rid, keep_cache=True)
    outs = _run(engine)
    for rid in ("x", "y"):
        out = outs[rid]
        engine.submit(out.prompt_ids + out.token_ids + ENV, GREEDY, rid + "2", keep_cache=True, continues=rid)
    engine.submit([4, 3, 2, 1], GREEDY, "w")
    second = _run(engine)
    for rid in ("x", "y"):
        assert second[rid + "2"].token_ids == _fresh(checkpoint, second[rid + "2"].prompt_ids).token_ids
    assert second["w"].token_ids == _fresh(checkpoint, [4, 3, 2, 1]).token_ids
    engine.release_cache()
    assert not engine.scheduler.parked and len(engine.scheduler.free_slots) == engine.max_running


def test_continuation_of_n_samples_is_refused(checkpoint):
    with pytest.raises(EngineError, match="continuation is one sequence"):
        _engine(checkpoint).submit([1, 2], SamplingParams(n=2), continues="a")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_continuations_on_gpu_in_bf16_equal_whole_prefills(checkpoint):
    """The CUDA half-precision path (flash attention over keys gathered from the cache, causal from each sequence's
    end) samples what a whole prefill samples."""
    config = EngineConfig(max_model_len=256, max_num_batched_tokens=1024, dtype=torch.bfloat16)
    engine = Engine.from_pretrained(checkpoint, Layout.single(torch.device("cuda")), config)
    fresh_engine = Engine.from_pretrained(checkpoint, Layout.single(torch.device("cuda")), config)
    prompts = {f"p{i}": [1 + (i * 7 + j) % 50 for j in range(5 + 9 * i)] for i in range(6)}
    for rid, ids in prompts.items():
        engine.submit(ids, GREEDY, rid, keep_cache=True)
    firsts = _run(engine)
    seconds = {rid: out.prompt_ids + out.token_ids + ENV[: 1 + int(rid[1:]) % 5] for rid, out in firsts.items()}
    for rid, ids in seconds.items():
        engine.submit(ids, GREEDY, rid + "b", continues=rid)
    continued = _run(engine)
    fresh = fresh_engine.generate(list(seconds.values()), GREEDY)
    for rid, out in zip(seconds, fresh):
        assert continued[rid + "b"].token_ids == out.token_ids
        assert_close(continued[rid + "b"].raw_logprobs, out.raw_logprobs, atol=0.05, rtol=0)


def test_a_short_continuation_joins_the_decode_batch_fed_and_equals_a_prefill(checkpoint):
    """While another sequence decodes, a continuation with few new tokens is fed through its decode rows (no
    prefill step): one row per new token, the last row's sample its first token, the same tokens as a prefill."""
    engine = _engine(checkpoint)
    engine.submit([1, 5, 7, 9], GREEDY, "a", keep_cache=True)
    out_a = _run(engine)["a"]
    engine.submit([2, 4, 6, 8, 10], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), "b")
    engine.step()  # b's prefill: from now on a decode batch runs
    prompt2 = out_a.prompt_ids + out_a.token_ids + ENV
    engine.stats = type(engine.stats)()
    engine.submit(prompt2, GREEDY, "a2", continues="a")
    done = _run(engine)
    assert engine.stats.prefill_steps == 0 and engine.stats.fed_tokens == len(ENV) + 1
    # Fed rows run ahead (their next inputs are known prompt tokens): the host launched the step that admitted a2
    # and the ones after a row stopped or reached its limit, not one per fed token.
    assert engine.stats.decode_host_launches <= 3 < engine.stats.decode_steps
    fresh = _fresh(checkpoint, prompt2)
    assert done["a2"].token_ids == fresh.token_ids
    assert_close(done["a2"].raw_logprobs, fresh.raw_logprobs, atol=1e-5, rtol=1e-5)


def test_a_fed_continuation_aborted_mid_feed_resumes_whole(checkpoint):
    engine = _engine(checkpoint)
    engine.submit([1, 5, 7, 9], GREEDY, "a", keep_cache=True)
    out_a = _run(engine)["a"]
    engine.submit([2, 4, 6, 8, 10], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), "b")
    engine.step()
    prompt2 = out_a.prompt_ids + out_a.token_ids + ENV
    engine.submit(prompt2, GREEDY, "a2", continues="a")
    engine.step()
    engine.step()  # two of its six tokens fed
    engine.abort(keep=True)
    engine.set_policy_version(1)
    engine.resume()
    done = _run(engine)
    assert done["a2"].token_ids == _fresh(checkpoint, prompt2).token_ids
    assert done["a2"].policy_versions == [1] * GREEDY.max_tokens
