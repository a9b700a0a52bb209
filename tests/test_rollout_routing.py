"""The rollout engine records MoE routing (R3's source): every finished output carries, for each position of its
sequence, the experts each MoE layer ran it through, equal to transformers' router top-k over the whole sequence
(an independent forward), at one process and TP2 (EP2, ETP2) on gloo; through shared prefills, run-ahead decode
with rows ending at different steps, cached and fed multi-turn continuations, prefixes kept in spare rows, and an
abort and resume under new weights (the resumed sequence's routing is the new weights', like its re-prefilled
keys). The last sampled token, which no step ran, is marked unknown."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardrl.agents.trajectory import Source, Trajectory
from shardrl.data.batch import Batch
from shardrl.data.chat import left_pad
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.routing import unknown_expert
from shardrl.rollout.engine import Engine, EngineConfig, EngineError
from shardrl.rollout.request import SamplingParams
from shardrl.workers.engine import ROUTED_EXPERTS
from shardrl.workers.samples import trajectories_batch

E, K, LAYERS = 4, 2, 3
CONFIG = EngineConfig(max_model_len=48, cpu_kv_cache_tokens=48 * 6, max_num_batched_tokens=96, record_routing=True)
PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 2], [20, 21, 22]]
# Different lengths end rows at different steps (dead rows ride along in the steps run ahead); n=2 shares a prefill.
PARAMS = [SamplingParams(max_tokens=m, temperature=0.9, n=2, seed=s, ignore_eos=True) for m, s in
          ((7, 1), (3, 2), (11, 3))]
ENV = [17, 3, 29, 8]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return [str(make_tiny_checkpoint("qwen3_moe", root / f"w{seed}", seed=seed, num_hidden_layers=LAYERS))
            for seed in (3, 4)]


def hf_routing(path: str, ids: list[int]) -> torch.Tensor:
    """transformers' router top-k of every position of `ids`: [T, L, k], sorted per token."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    logits = model(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits  # per layer [T, E]
    return torch.stack([torch.topk(layer, K, dim=-1).indices for layer in logits], 1).sort(-1).values


def assert_routing(path: str, out) -> None:
    ids = out.prompt_ids + out.token_ids
    routed = out.routed_experts.cpu()
    assert routed.dtype == torch.uint8 and routed.shape == (len(ids), LAYERS, K), out.request_id
    assert torch.equal(routed[:-1].long().sort(-1).values, hf_routing(path, ids)[:-1]), out.request_id
    assert (routed[-1] == unknown_expert(torch.uint8)).all()  # the last sampled token never ran through the model


def _generate(path: str, layout: Layout) -> list:
    return Engine.from_pretrained(path, layout, CONFIG).generate(PROMPTS, PARAMS)


def test_outputs_carry_each_positions_experts_equal_to_transformers_router(moe):
    outputs = _generate(moe[0], Layout.single())
    assert len(outputs) == 6
    for out in outputs:
        assert_routing(moe[0], out)


def test_routing_is_off_by_default_and_refused_on_a_dense_model(moe, tmp_path):
    plain = Engine.from_pretrained(moe[0], Layout.single(), EngineConfig(max_model_len=48, cpu_kv_cache_tokens=96))
    assert plain.generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0].routed_experts is None
    dense = make_tiny_checkpoint("qwen3", tmp_path / "dense")
    with pytest.raises(EngineError, match="record_routing.*dense"):
        Engine.from_pretrained(dense, Layout.single(), CONFIG)


def test_continuations_cached_and_fed_keep_the_whole_sequences_routing(moe):
    engine = Engine.from_pretrained(moe[0], Layout.single(), CONFIG)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    short, = engine.submit(PROMPTS[0], greedy, "t0", keep_cache=True)
    long, = engine.submit(PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), "long")
    turn1 = None
    while turn1 is None:
        turn1 = next((o for o in engine.step() if o.request_id == short), None)
    assert_routing(moe[0], turn1)
    # While "long" decodes, the continuation's few new tokens are fed through decode rows.
    engine.submit(turn1.prompt_ids + turn1.token_ids + ENV, greedy, "t1", keep_cache=True, continues="t0")
    done = {o.request_id: o for o in engine.stream()}
    assert engine.stats.fed_tokens > 0
    assert_routing(moe[0], done["t1"])
    assert_routing(moe[0], done[long])
    # A third turn prefills its new tokens after the cached prefix (nothing else decodes now).
    turn2 = done["t1"]
    engine.stats.cached_prefill_tokens = 0
    engine.submit(turn2.prompt_ids + turn2.token_ids + ENV[:2], greedy, "t2", continues="t1")
    turn3 = {o.request_id: o for o in engine.stream()}["t2"]
    assert engine.stats.cached_prefill_tokens > 0
    assert_routing(moe[0], turn3)


def test_a_prefix_kept_in_a_spare_row_keeps_its_routing(moe):
    """One decode slot and one spare row: "t0" parks, "other" takes its slot (t0's prefix, routing included,
    moves to the spare row), t0's continuation moves it back and prefills only its new tokens."""
    engine = Engine.from_pretrained(moe[0], Layout.single(), EngineConfig(
        max_model_len=48, cpu_kv_cache_tokens=48 * 2, max_num_batched_tokens=96, record_routing=True,
        max_num_seqs=1, spare_cache_rows=True))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.submit(PROMPTS[0], greedy, "t0", keep_cache=True)
    turn1 = {o.request_id: o for o in engine.stream()}["t0"]
    engine.submit(PROMPTS[2], greedy, "other")
    assert_routing(moe[0], {o.request_id: o for o in engine.stream()}["other"])
    engine.stats.prefill_tokens = 0
    engine.submit(turn1.prompt_ids + turn1.token_ids + ENV, greedy, "t1", continues="t0")
    turn2 = {o.request_id: o for o in engine.stream()}["t1"]
    assert engine.stats.prefill_tokens == len(ENV) + 1 and engine.stats.prefix_moves == 2
    assert_routing(moe[0], turn2)


def test_a_request_resumed_under_new_weights_gets_their_routing(moe):
    engine = Engine.from_pretrained(moe[0], Layout.single(), CONFIG)
    rid, = engine.submit(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True))
    for _ in range(5):
        engine.step()
    partial, = engine.abort()
    assert 0 < len(partial.token_ids) < 12
    engine.update_weights(load_file(f"{moe[1]}/model.safetensors").items())
    engine.resume()
    out, = list(engine.stream())
    assert_routing(moe[1], out)  # re-prefilled, as its keys and values are, under the new weights
    assert not torch.equal(hf_routing(moe[0], out.prompt_ids + out.token_ids), hf_routing(moe[1], out.prompt_ids +
                                                                                          out.token_ids))


def _generate_tp2(path: str) -> list:
    return [[(o.prompt_ids + o.token_ids, o.routed_experts) for o in _generate(path, Layout.create(
        LayoutSpec(world_size=2, **sizes)))] for sizes in (dict(tp=2, ep=2), dict(tp=2, etp=2))]


def test_tp2_engines_record_the_same_routing_on_every_rank(moe):
    for rank in run_distributed(2, _generate_tp2, moe[0]):
        for layout in rank:
            for ids, routed in layout:
                assert torch.equal(routed[:-1].long().sort(-1).values, hf_routing(moe[0], ids)[:-1])
                assert (routed[-1] == unknown_expert(torch.uint8)).all()


def test_a_multi_turn_trajectorys_batch_row_holds_its_last_turns_routing(moe):
    """Two model turns with tool tokens between them and after the last: the batch row holds, per position of
    the trajectory, the routing of the last turn's request (which covers everything before it); the tool tokens after
    it, which no step ran, are unknown; after a rewrite of history only the shared prefix keeps its routing."""
    engine = Engine.from_pretrained(moe[0], Layout.single(), CONFIG)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS[0]
    traj = Trajectory(list(prompt))
    first = engine.generate([prompt], greedy)[0]
    traj.add_model(first.token_ids, first.logprobs, first.policy_versions, first.routed_experts)
    traj.add_environment(ENV, Source.TOOL)
    second = engine.generate([traj.prompt_ids + traj.response_ids], greedy)[0]
    traj.add_model(second.token_ids, second.logprobs, second.policy_versions, second.routed_experts)
    traj.add_environment(ENV[:2], Source.TOOL)
    rows = [left_pad(prompt, 8, 0)]
    prompts = Batch({key: torch.stack([r[i] for r in rows]) for i, key in
                     enumerate(("input_ids", "attention_mask", "position_ids"))},
                    {"extra_info": [{}]})
    batch = trajectories_batch(prompts, [traj], response_length=24, pad_token_id=0)
    routed = batch.tensors[ROUTED_EXPERTS][0]
    sequence = traj.prompt_ids + traj.response_ids
    start, ran = 8 - len(prompt), len(second.prompt_ids) + len(second.token_ids) - 1
    assert torch.equal(routed[start:start + ran].long().sort(-1).values, hf_routing(moe[0], sequence)[:ran])
    assert (routed[start + ran:] == unknown_expert(torch.uint8)).all()  # the last sampled token, the tool tokens
    assert (routed[:start] == unknown_expert(torch.uint8)).all()
    traj.truncate(len(first.token_ids) + 1)  # an external agent went back into the first tool result
    traj.add_environment([5, 5], Source.REWRITTEN)
    kept = traj.recorded_routing()
    assert kept.shape[0] == len(prompt) + len(first.token_ids) + 1
