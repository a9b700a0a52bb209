"""R2 routing replay through the actor's passes: the old-logprob pass records the experts every MoE layer of a real
(tiny, HF-made) Qwen3-MoE chose for every token, equal to transformers' router top-k, at one process, EP2, TP2 with
sequence parallelism, PP2 x EP2 and context parallelism (CP2, CP2 x EP2, CP2 x TP2 with SP: each CP rank routes its
share of the tokens), with fixed and dynamic micro batches; a pass that replays a routing table uses
exactly its experts for each token whatever the micro batches and layout, so replayed log-probs agree across them
and differ from the model's own routing. The job keys are refused or checked before workers start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.options import EngineOptions, ForwardBatching
from shardrl.job.plan import plan_job
from shardrl.models.config import ModelConfig
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.workers.actor import log_prob_pass
from shardrl.workers.engine import ROUTED_EXPERTS, ModelEngine
from test_parity_matrix import BATCH, make_batch

E, K = 4, 2  # the tiny qwen3_moe's experts and top-k
LAYOUTS = {"1": ({}, 1), "ep2": (dict(ep=2), 2), "tp2_sp": (dict(tp=2), 2), "pp2_ep2": (dict(pp=2, ep=2), 4),
           "cp2": (dict(cp=2), 2), "cp2_ep2": (dict(cp=2, ep=2), 4), "cp2_tp2_sp": (dict(cp=2, tp=2), 4)}
BATCHINGS = [ForwardBatching(3, None), ForwardBatching(None, 20)]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe"), seed=3, num_hidden_layers=4))


def _passes(ckpt: str, sizes: dict, batching: ForwardBatching, table: torch.Tensor | None):
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    layout = Layout.create(LayoutSpec(world_size=world, **sizes))
    options = EngineOptions(sequence_parallel=layout.tp_size > 1)
    engine = ModelEngine(ModelConfig.from_pretrained(ckpt), layout, options, hf_path=ckpt)
    dp, rank = layout.dp_size, layout.dp_rank
    rows = list(range(rank * BATCH // dp, (rank + 1) * BATCH // dp))
    batch = make_batch(seed=1)
    share = batch.take(rows)
    recorded = log_prob_pass(engine, share, batching, 1.0, routing="record")
    # Replaying what was recorded reproduces the model's own log-probs: a table one token off would not.
    share.tensors[ROUTED_EXPERTS] = recorded[ROUTED_EXPERTS]
    own = log_prob_pass(engine, share, batching, 1.0, routing="replay")
    response = share.tensors["response_mask"].bool()
    torch.testing.assert_close(own["log_probs"][response], recorded["log_probs"][response], atol=1e-6, rtol=1e-6)
    replayed = None
    if table is not None:
        share.tensors[ROUTED_EXPERTS] = table[rows]
        replayed = log_prob_pass(engine, share, batching, 1.0, routing="replay")
    return rows, recorded, replayed


def run_layout(ckpt: str, name: str, batching: ForwardBatching, table: torch.Tensor | None = None):
    """Every DP share's results, put back in batch order."""
    sizes, world = LAYOUTS[name]
    ranks = [_passes(ckpt, sizes, batching, table)] if world == 1 else run_distributed(
        world, _passes, ckpt, sizes, batching, table)
    out = {}
    for rows, recorded, replayed in ranks:
        for key, value in recorded.items():
            out.setdefault(key, torch.zeros((BATCH, *value.shape[1:]), dtype=value.dtype))[rows] = value
        if replayed is not None:
            out.setdefault("replayed", torch.zeros(BATCH, replayed["log_probs"].shape[1]))[rows] = replayed["log_probs"]
    return out


def hf_top_k(ckpt: str) -> list[torch.Tensor]:
    """transformers' router choices per row: [valid tokens, layers, k], sorted per token."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    batch = make_batch(seed=1)
    t = batch.tensors
    out = []
    for row in range(BATCH):
        mask = t["attention_mask"][row].bool()
        logits = model(input_ids=t["input_ids"][row][mask][None], position_ids=t["position_ids"][row][mask][None],
                       output_router_logits=True).router_logits  # per layer [T, E]
        out.append(torch.stack([torch.topk(layer, K, dim=-1).indices for layer in logits], 1).sort(-1).values)
    return out


@pytest.mark.parametrize("name, batching", [
    ("1", BATCHINGS[0]), ("1", BATCHINGS[1]), ("ep2", BATCHINGS[0]), ("tp2_sp", BATCHINGS[1]),
    ("pp2_ep2", BATCHINGS[0]), pytest.param("pp2_ep2", BATCHINGS[1], marks=pytest.mark.slow), ("cp2", BATCHINGS[1]),
    pytest.param("cp2_ep2", BATCHINGS[0], marks=pytest.mark.slow),
    pytest.param("cp2_tp2_sp", BATCHINGS[1], marks=pytest.mark.slow)], ids=lambda v: v if isinstance(v, str) else (
    "dynamic" if v.max_token_len else "fixed"))
def test_recorded_routing_is_transformers_router_top_k_and_replay_follows_the_table(moe, name, batching):
    expected = hf_top_k(moe)
    mask = make_batch(seed=1).tensors["attention_mask"].bool()
    table = None
    if name != "1" or batching.max_token_len:  # the replay table: the single-process recording, shifted
        reference = run_layout(moe, "1", BATCHINGS[0])
        table = ((reference[ROUTED_EXPERTS].long() + 1) % E).to(torch.uint8) * mask[:, :, None, None]
    out = run_layout(moe, name, batching, table)
    routed = out[ROUTED_EXPERTS]
    assert routed.dtype == torch.uint8 and routed.shape == (BATCH, mask.shape[1], 4, K)
    for row in range(BATCH):
        assert torch.equal(routed[row][mask[row]].long().sort(-1).values, expected[row]), (name, row)
        assert not routed[row][~mask[row]].any()
    if table is not None:
        one = run_layout(moe, "1", ForwardBatching(1, None), table)  # one row per micro batch: no packing at all
        response = make_batch(seed=1).tensors["response_mask"].bool()
        torch.testing.assert_close(out["replayed"][response], one["replayed"][response], atol=1e-5, rtol=1e-5)
        assert (out["replayed"] - out["log_probs"])[response].abs().max() > 1e-3  # the table, not its own routing


R3 = ["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]


@pytest.mark.parametrize("overrides, key", [
    (["actor_rollout_ref.actor.router_replay.mode=R3"], "actor_rollout_ref.actor.router_replay.mode"),
    (["actor_rollout_ref.ref.router_replay.mode=R3"], "actor_rollout_ref.ref.router_replay.mode"),
    (["actor_rollout_ref.ref.router_replay.mode=R2"], "actor_rollout_ref.ref.router_replay.mode"),
    (["actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.ref.router_replay.mode=R3",
      "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"], "actor_rollout_ref.ref.router_replay.mode"),
    # Nothing would read the rollout's routing: no old-logprob pass (PPO anchors on the rollout's log-probs), no R3.
    (["actor_rollout_ref.rollout.enable_rollout_routing_replay=true", "algorithm.rollout_correction.bypass_mode=true"],
     "actor_rollout_ref.rollout.enable_rollout_routing_replay"),
    (["actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.actor.router_replay.record_file=/r.pt"],
     "actor_rollout_ref.actor.router_replay.record_file"),
    # The counterfactual of replay: nothing to compare without R3, nothing to run without the old-logprob pass.
    (["actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.actor.router_replay.measure_unreplayed=true"],
     "actor_rollout_ref.actor.router_replay.measure_unreplayed"),
    ([*R3, "actor_rollout_ref.actor.router_replay.measure_unreplayed=true",
      "algorithm.rollout_correction.bypass_mode=true"],
     "actor_rollout_ref.actor.router_replay.measure_unreplayed"),
    ([*R3, "actor_rollout_ref.ref.router_replay.measure_unreplayed=true", "actor_rollout_ref.actor.use_kl_loss=true"],
     "actor_rollout_ref.ref.router_replay.measure_unreplayed"),
])
def test_router_replay_settings_shardrl_cannot_honour_are_refused(moe, overrides, key):
    with pytest.raises(ConfigError) as err:  # an MoE model: on a dense one any replay is refused first
        plan_job(compose("ppo_trainer", ["trainer.device=cpu", f"actor_rollout_ref.model.path={moe}", *overrides]))
    assert err.value.key == key


@pytest.mark.parametrize("overrides, key", [
    (["actor_rollout_ref.actor.router_replay.mode=R2"], "actor_rollout_ref.actor.router_replay.mode"),
    (R3, "actor_rollout_ref.actor.router_replay.mode"),
    (["actor_rollout_ref.rollout.enable_rollout_routing_replay=true"],
     "actor_rollout_ref.rollout.enable_rollout_routing_replay"),
])
def test_routing_replay_on_a_dense_model_is_refused_before_workers_start(tmp_path, overrides, key):
    dense = make_tiny_checkpoint("qwen3", tmp_path / "dense")
    with pytest.raises(ConfigError, match="dense model") as err:
        plan_job(compose("ppo_trainer", ["trainer.device=cpu", f"actor_rollout_ref.model.path={dense}", *overrides]))
    assert err.value.key == key


def test_r2_and_r3_compile_to_the_passes_they_name(moe):
    model = f"actor_rollout_ref.model.path={moe}"
    plan = plan_job(compose("ppo_trainer", ["trainer.device=cpu", model,
                                            "actor_rollout_ref.actor.router_replay.mode=R2"]))
    assert plan.actor.router_replay == "R2" and not plan.rollout.engine.record_routing
    plan = plan_job(compose("ppo_trainer", ["trainer.device=cpu", model, *R3,
                                            "actor_rollout_ref.ref.router_replay.mode=R3",
                                            "actor_rollout_ref.actor.use_kl_loss=true"]))
    assert plan.actor.router_replay == "R3" and plan.rollout.engine.record_routing
    assert plan.ref.replay_rollout_routing


def moe_builtin_task(tmp_path) -> list[str]:
    """The built-in task's data and tokenizer with a tiny Qwen3-MoE policy of its vocabulary."""
    import json as _json

    from shardrl.data import builtin_task

    task = builtin_task.prepare(tmp_path / "task")
    config = _json.loads((Path(task["model"]) / "config.json").read_text())
    model = make_tiny_checkpoint("qwen3_moe", tmp_path / "moe_policy", seed=1, vocab_size=config["vocab_size"],
                                 eos_token_id=config["eos_token_id"], pad_token_id=0, bos_token_id=None)
    return [f"actor_rollout_ref.model.path={model}", f"data.tokenizer={task['model']}",
            f"data.train_files={task['train_files']}", "trainer.test_freq=-1", "trainer.val_before_train=false",
            "trainer.total_training_steps=2", "actor_rollout_ref.actor.router_replay.mode=R2"]


@pytest.mark.parametrize("config_name, extra", [
    ("ppo_trainer", ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"]),
    pytest.param("fully_async_ppo_trainer", ["trainer.n_gpus_per_node=2",
                                              "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                                              "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                              "async_training.use_rollout_log_probs=false",  # the pass R2 records
                                              "algorithm.rollout_correction.decoupled=true"],
                 marks=pytest.mark.slow),
])
def test_an_r2_job_trains_an_moe_policy_with_the_old_log_prob_passs_routing(tmp_path, config_name, extra):
    """The routing travels from the old-logprob pass through the controller (balancing, DP padding and split,
    dynamic micro batches) to the update, which replays it; lr=0 keeps the weights, so ppo_kl is 0 exactly only if
    every token's replayed experts are the ones recorded for it (a table one token off changes the log-probs)."""
    from async_jobs import run_job

    rows, _ = run_job(tmp_path / "run", config_name, *moe_builtin_task(tmp_path), *extra,
                      "actor_rollout_ref.actor.optim.lr=0")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(abs(r["actor/ppo_kl"]) < 1e-6 and r["actor/pg_clipfrac"] == 0 for r in rows), rows


@pytest.mark.parametrize("config_name, extra", [
    ("ppo_trainer", ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                     "actor_rollout_ref.actor.optim.lr=0"]),
    pytest.param("fully_async_ppo_trainer", ["trainer.n_gpus_per_node=2",
                                              "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                                              "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                              "async_training.use_rollout_log_probs=false",
                                              "algorithm.rollout_correction.decoupled=true",
                                              "trainer.total_training_steps=4"],
                 marks=pytest.mark.slow),
])
def test_an_r3_job_replays_the_rollouts_routing_in_every_pass(tmp_path, config_name, extra):
    """The rollout's routing travels in the sample batch through the controller (balancing, DP split, dynamic micro
    batches) to the old-logprob pass and the update, which replay it. Sync at lr=0: the trainer holds the rollout's
    weights, so its own routing equals the rollout's at every (token, layer) pair only if every token's row is its
    own (one token off, most pairs differ), and the update's ratio is exactly 1. Fully async: the rollout runs
    behind the trainer, whose own routing drifts from the rollout's; the replay overrides those choices.
    `measure_unreplayed` runs the old-logprob pass once more routing itself: with nothing to override (sync) its
    mismatch is the replayed pass's; where replay overrode choices (async) the two passes' log-probs differ."""
    from async_jobs import run_job

    task = [a for a in moe_builtin_task(tmp_path) if "router_replay" not in a]
    rows, _ = run_job(tmp_path / "run", config_name, *task, *R3, *extra,
                      "actor_rollout_ref.actor.router_replay.measure_unreplayed=true")
    assert all("routing/rollout_mismatch" in r and "actor/router_replay/overridden" in r for r in rows), rows
    replayed = [r["rollout_corr/mismatch_k3_kl"] for r in rows]
    unreplayed = [r["rollout_corr/unreplayed/mismatch_k3_kl"] for r in rows]
    if config_name == "ppo_trainer":
        assert [r["step"] for r in rows] == [1, 2]
        assert all(r["routing/rollout_mismatch"] == 0 and r["actor/router_replay/overridden"] == 0
                   and abs(r["actor/ppo_kl"]) < 1e-6 for r in rows), rows
        assert unreplayed == pytest.approx(replayed, abs=1e-9)
    else:
        assert rows[0]["routing/rollout_mismatch"] == 0  # generated with the trainer's first weights
        assert max(r["actor/router_replay/overridden"] for r in rows) > 0.01, rows
        overridden = [i for i, r in enumerate(rows) if r["routing/rollout_mismatch"] > 0]
        assert any(unreplayed[i] != replayed[i] for i in overridden), (replayed, unreplayed)
