"""R3 routing replay from the engine to the trainer's passes: a rollout engine whose routers differ from the
trainer's (noised router weights: its experts are not the ones the trainer would choose) records its routing; the
sample batch carries it (`routed_experts`, aligned with `input_ids`); the old-logprob pass replaying it at one
process, EP2, EP2 x ETP2 and PP2 x EP2, with fixed and dynamic micro batches, gives the log-probs of a per-sequence
reference that runs each engine output's tokens through the engine's own routing, with no batch in between. A
routing off by one token, or no replay, gives other log-probs (the test would fail); the pass counts the tokens
whose own choice replay overrode, over every recorded (token, layer) pair."""


import pytest
import torch
from safetensors.torch import load_file, save_file

from shardrl.data.batch import Batch
from shardrl.data.chat import left_pad
from shardrl.job.options import EngineOptions, ForwardBatching
from shardrl.models.config import ModelConfig
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.expert import attached
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.routing import RoutingTable, unknown_expert
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.rollout.request import SamplingParams
from shardrl.workers.actor import log_prob_pass
from shardrl.workers.engine import ROUTED_EXPERTS, ROUTING_MISMATCH, ModelEngine
from shardrl.workers.samples import samples_batch

PROMPT, RESPONSE, LAYERS = 8, 10, 4
PROMPTS = [[3, 9, 4], [5, 6, 7, 8, 9, 10, 11, 12], [30, 31], [7, 7, 7, 7, 7], [2, 40, 41, 42, 43, 44], [8]]
LAYOUTS = {"1": ({}, 1), "ep2": (dict(ep=2), 2), "ep2_etp2": (dict(tp=2, ep=2, etp=2), 4),
           "pp2_ep2": (dict(pp=2, ep=2), 4), "cp2": (dict(cp=2), 2), "cp2_ep2": (dict(cp=2, ep=2), 4)}
FIXED, DYNAMIC = ForwardBatching(2, None), ForwardBatching(None, 24)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    """The trainer's tiny Qwen3-MoE and the rollout's copy of it with noised router weights."""
    root = tmp_path_factory.mktemp("r3")
    trainer = make_tiny_checkpoint("qwen3_moe", root / "trainer", seed=7, num_hidden_layers=LAYERS)
    rollout = root / "rollout"
    rollout.mkdir()
    for f in trainer.iterdir():
        if f.name != "model.safetensors":
            (rollout / f.name).write_bytes(f.read_bytes())
    g = torch.Generator().manual_seed(0)
    weights = {name: t + 0.5 * torch.randn(t.shape, generator=g) * t.std() if name.endswith("mlp.gate.weight") else t
               for name, t in load_file(trainer / "model.safetensors").items()}
    save_file(weights, rollout / "model.safetensors", metadata={"format": "pt"})
    return str(trainer), str(rollout)


def rollout_samples(rollout: str) -> tuple[Batch, list]:
    engine = Engine.from_pretrained(rollout, Layout.single(), EngineConfig(
        max_model_len=PROMPT + RESPONSE, cpu_kv_cache_tokens=(PROMPT + RESPONSE) * 4, record_routing=True))
    params = [SamplingParams(max_tokens=RESPONSE - i, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outputs = engine.generate(PROMPTS, params)
    rows = [left_pad(p, PROMPT, 0) for p in PROMPTS]
    prompts = Batch({key: torch.stack([r[i] for r in rows]) for i, key in
                     enumerate(("input_ids", "attention_mask", "position_ids"))})
    return samples_batch(prompts, outputs, RESPONSE, pad_token_id=0), outputs


def reference_log_probs(trainer: str, outputs: list) -> list[torch.Tensor]:
    """Each engine output's response log-probs under the trainer's weights and the engine's routing: its tokens
    alone (one sequence, no padding or packing), every MoE layer replaying the output's own `routed_experts`."""
    engine = ModelEngine(ModelConfig.from_pretrained(trainer), Layout.single(), EngineOptions(), hf_path=trainer)
    model, layer_ids = engine.chunks[0], sorted(engine.config.moe.layers)
    out = []
    with torch.no_grad():
        for o in outputs:
            ids = torch.tensor(o.prompt_ids + o.token_ids)
            with attached(model, RoutingTable(o.routed_experts, layer_ids, replay=True)):
                hidden = model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32))
            log_probs, _ = model.compute_logprobs(hidden[:-1], ids[1:])
            out.append(log_probs[len(o.prompt_ids) - 1:])
    return out


def _passes(trainer: str, sizes: dict, batching: ForwardBatching, batch: Batch):
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    layout = Layout.create(LayoutSpec(world_size=world, **sizes))
    engine = ModelEngine(ModelConfig.from_pretrained(trainer), layout,
                         EngineOptions(sequence_parallel=layout.tp_size > 1), hf_path=trainer)
    rows = list(range(layout.dp_rank, len(batch), layout.dp_size))
    share = batch.take(rows)
    replayed = log_prob_pass(engine, share, batching, 1.0, routing="replay")
    compared = log_prob_pass(engine, share, batching, 1.0, routing="compare")
    return rows, replayed, compared


def run_layout(trainer: str, name: str, batching: ForwardBatching, batch: Batch) -> dict[str, torch.Tensor]:
    sizes, world = LAYOUTS[name]
    ranks = [_passes(trainer, sizes, batching, batch)] if world == 1 else run_distributed(
        world, _passes, trainer, sizes, batching, batch)
    out: dict[str, torch.Tensor] = {}
    for rows, replayed, compared in ranks:
        for prefix, result in (("replayed", replayed), ("compared", compared)):
            for key, value in result.items():
                full = out.setdefault(f"{prefix}/{key}", torch.zeros((len(batch), *value.shape[1:]), dtype=value.dtype))
                full[rows] = value
    return out


def shifted(batch: Batch) -> Batch:
    """The batch with its routing one token late (what a misaligned assembly would give)."""
    late = batch.take(list(range(len(batch))))
    late.tensors[ROUTED_EXPERTS] = torch.roll(batch.tensors[ROUTED_EXPERTS], 1, dims=1)
    return late


@pytest.fixture(scope="module")
def rollout(checkpoints):
    return rollout_samples(checkpoints[1])


def test_the_sample_batch_aligns_the_engines_routing_with_input_ids(rollout):
    batch, outputs = rollout
    routed, mask = batch.tensors[ROUTED_EXPERTS], batch.tensors["attention_mask"].bool()
    assert routed.dtype == torch.uint8 and routed.shape == (len(PROMPTS), PROMPT + RESPONSE, LAYERS, 2)
    for row, out in enumerate(outputs):
        assert torch.equal(routed[row][mask[row]], out.routed_experts)  # the valid tokens, in order
        assert (routed[row][~mask[row]] == unknown_expert(torch.uint8)).all()


@pytest.mark.parametrize("name, batching", [
    ("1", FIXED), ("1", DYNAMIC), ("ep2", FIXED), ("ep2_etp2", DYNAMIC), ("pp2_ep2", FIXED),
    pytest.param("pp2_ep2", DYNAMIC, marks=pytest.mark.slow), ("cp2", DYNAMIC),
    pytest.param("cp2_ep2", FIXED, marks=pytest.mark.slow)],
    ids=lambda v: v if isinstance(v, str) else ("dynamic" if v.max_token_len else "fixed"))
def test_r3_old_log_prob_pass_replays_the_rollouts_experts_at_every_layout(checkpoints, rollout, name, batching):
    trainer, _ = checkpoints
    batch, outputs = rollout
    out = run_layout(trainer, name, batching, batch)
    reference = reference_log_probs(trainer, outputs)
    for row, expected in enumerate(reference):
        n = len(expected)
        torch.testing.assert_close(out["replayed/log_probs"][row, :n], expected, atol=2e-5, rtol=2e-5)
    # Without replay the trainer routes itself, and that is not what the rollout did.
    own = out["compared/log_probs"]
    response = batch.tensors["response_mask"].bool()
    assert (own - out["replayed/log_probs"])[response].abs().max() > 1e-3
    # The rollout's routers differ: replay overrode many (token, layer) choices; a pass routing itself differs
    # from the rollout at a like share (not the same pairs: past the first layer its hidden states differ too).
    recorded = LAYERS * sum(len(o.prompt_ids) + len(o.token_ids) - 1 for o in outputs)  # all but the last tokens
    for prefix in ("replayed", "compared"):
        differs, compared = out[f"{prefix}/{ROUTING_MISMATCH}"].sum(0)
        assert compared == recorded and 0.1 < differs / compared < 0.9, prefix


def test_a_routing_one_token_off_changes_the_replayed_log_probs(checkpoints, rollout):
    trainer, _ = checkpoints
    batch, outputs = rollout
    late = run_layout(trainer, "1", FIXED, shifted(batch))
    reference = reference_log_probs(trainer, outputs)
    worst = max((late["replayed/log_probs"][row, :len(e)] - e).abs().max() for row, e in enumerate(reference))
    assert worst > 1e-3
