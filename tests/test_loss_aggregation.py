"""loss_agg_mode against verl 0.9.1's `agg_loss`, for the actor and the critic.

verl 0.9.1 (verl/trainer/ppo/core_algos.py `agg_loss`, with the global batch info its engine passes: `dp_size`,
`batch_num_tokens` = valid tokens of the mini batch over DP, `global_batch_size` = sequences of the mini batch,
`loss_scale_factor`), once its DDP has averaged the dp_size-scaled shares, with l_it the loss of sequence i's valid
token t, L_i its valid tokens, N the valid tokens, G the sequences and M the factor:
  token-mean Σ l / N;  token-sum Σ l;  seq-mean-token-sum Σ_i Σ_t l_it / G;
  seq-mean-token-mean Σ_i (Σ_t l_it / L_i) / G;  seq-mean-token-sum-norm Σ_i Σ_t l_it / G / M
  (Dr. GRPO; verl up to 0.7.0 had Σ l / M, G times this).
`verl_reference` below writes those out per sequence in plain Python; the tests compare shardrl's aggregation, its
losses and its real training path (packed micro batches, gloo DP) against it, and check that padding holding
NaN / inf reaches neither a loss nor a gradient.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import get_args

import pytest
import torch

from shardrl.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSS_MODES,
    ClipRange,
    LossScale,
    actor_loss,
    aggregate_loss,
    loss_counts,
    value_loss,
)
from shardrl.algos.covariance import COVARIANCE_MODES
from shardrl.job.load import compose
from shardrl.job.options import EngineOptions, ForwardBatching, OptimOptions, PolicyLossOptions, UpdateOptions
from shardrl.job.plan import plan_job
from shardrl.job.schema import LossAggMode
from shardrl.models.config import ModelConfig
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.workers.actor import compute_log_prob, update_policy
from shardrl.workers.critic import compute_values, update_critic
from shardrl.workers.engine import ModelEngine
from test_parity_matrix import BATCH, RESPONSE, make_batch

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def verl_reference(per_token: torch.Tensor, mask: torch.Tensor, mode: str, factor: float) -> float:
    """verl 0.9.1's aggregation of one whole mini batch, written out per sequence. Rows without a valid token add
    nothing and are not counted (shardrl's G; verl's engine counts every sample of the mini batch)."""
    seqs = [[loss for loss, valid in zip(row, valid_row) if valid]
            for row, valid_row in zip(per_token.tolist(), mask.bool().tolist())]
    seqs = [seq for seq in seqs if seq]
    if not seqs:
        return 0.0
    num_tokens, num_seqs = sum(len(seq) for seq in seqs), len(seqs)
    total = sum(sum(seq) for seq in seqs)
    return {
        "token-mean": total / num_tokens,
        "token-sum": total,
        "seq-mean-token-sum": total / num_seqs,
        "seq-mean-token-mean": sum(sum(seq) / len(seq) for seq in seqs) / num_seqs,
        "seq-mean-token-sum-norm": total / num_seqs / factor,
    }[mode]


def ragged(seed: int, rows: int = 6, width: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token values `[rows, width]` and a right-padded mask with random lengths, row 1 fully masked."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[1] = 0
    mask = (torch.arange(width) < lengths[:, None]).double()
    return torch.randn(rows, width, generator=g, dtype=torch.float64), mask


def test_schema_and_algos_offer_the_same_modes():
    assert get_args(LossAggMode) == LOSS_AGG_MODES
    assert "token-sum" in LOSS_AGG_MODES


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_matches_verl_formula(mode):
    per_token, mask = ragged(seed=1)
    scale = LossScale.from_mask(mask, max_response_length=11)
    assert (scale.num_tokens, scale.num_seqs) == (mask.sum().item(), 5.0)
    got = aggregate_loss(per_token, mask, mode, scale).item()
    assert got == pytest.approx(verl_reference(per_token, mask, mode, 11), rel=1e-12, abs=1e-12)


def test_dr_grpo_and_token_sum_by_hand():
    # Sequences of 3, 1 and 2 valid tokens (and a fully masked row); per-token losses, padding holding garbage:
    #   [1, 2, 3] sum 6, [4] sum 4, [-2, 0.5] sum -1.5: total 8.5 over N = 6 tokens, G = 3 sequences, M = 5.
    per_token = torch.tensor([[1, 2, 3, math.nan, 9], [4, math.inf, 0, 0, 0], [-2, 0.5, -math.inf, 7, 7],
                              [math.nan] * 5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0] * 5], dtype=torch.float64)
    scale = LossScale.from_mask(mask, max_response_length=5)
    expected = {
        "token-mean": 8.5 / 6,
        "token-sum": 8.5,
        "seq-mean-token-sum": 8.5 / 3,
        "seq-mean-token-mean": (2 + 4 - 0.75) / 3,
        "seq-mean-token-sum-norm": 8.5 / 3 / 5,  # 8.5 / 5 before verl 0.7.1 (and in shardrl before): G = 3 times
    }
    assert expected.keys() == set(LOSS_AGG_MODES)
    for mode, value in expected.items():
        assert aggregate_loss(per_token, mask, mode, scale).item() == pytest.approx(value, abs=1e-14), mode


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_only_token_sum_grows_with_the_mini_batch(mode):
    # The same sequences twice over: every mean stays, verl's Dr. GRPO included; only the plain sum doubles.
    per_token, mask = ragged(seed=2)
    once = aggregate_loss(per_token, mask, mode, LossScale.from_mask(mask, 7))
    twice_values, twice_mask = per_token.repeat(2, 1), mask.repeat(2, 1)
    twice = aggregate_loss(twice_values, twice_mask, mode, LossScale.from_mask(twice_mask, 7))
    torch.testing.assert_close(twice, once * (2 if mode == "token-sum" else 1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_masked_mini_batch_gives_zero_loss_and_gradient(mode):
    per_token = torch.full((3, 4), math.nan, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.float64)
    loss = aggregate_loss(per_token, mask, mode, LossScale.from_mask(mask, 4))
    (grad,) = torch.autograd.grad(loss, per_token)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))


def test_dr_grpo_actor_loss_and_gradient_by_hand():
    # On policy (ratio 1) the vanilla surrogate is -A per token, and its gradient d/d log_prob is -A times the token's
    # weight in the aggregation: 1 / (G * M) for Dr. GRPO. Sequence advantages 1, -1, 0.5 over 3, 1, 2 tokens:
    # loss = -(3 - 1 + 1) / 3 / 4 = -0.25; the old shardrl (and verl <= 0.7.0) had -3 / 4.
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0] * 4, [-1.0] * 4, [0.5] * 4, [0.0] * 4], dtype=torch.float64) * mask
    old = -torch.arange(16, dtype=torch.float64).reshape(4, 4) / 10
    padding = ~mask.bool()
    log_prob = torch.where(padding, math.nan, old).requires_grad_()
    loss, metrics = actor_loss(log_prob, torch.where(padding, -math.inf, old), advantages, mask,
                               LossScale.from_mask(mask, 4), "seq-mean-token-sum-norm", ClipRange(0.2))
    assert loss.item() == pytest.approx(-0.25, abs=1e-15)
    assert metrics["pg_loss"].item() == pytest.approx(-0.25, abs=1e-15)
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, -advantages / 12, rtol=0, atol=1e-15)


def test_value_loss_token_sum_and_dr_grpo_by_hand():
    # No clipping (cliprange 10): per-token loss 0.5 (v - R)^2 = 0.5 * [4, 1 | 9]; sum 7, G = 2, M = 3.
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    padding = ~mask.bool()
    vpreds = torch.where(padding, math.inf, torch.tensor([[2.0, 1.0, 0], [3.0, 0, 0]], dtype=torch.float64))
    vpreds.requires_grad_()
    values = torch.where(padding, math.nan, torch.zeros(2, 3, dtype=torch.float64))
    returns = torch.where(padding, -math.inf, torch.zeros(2, 3, dtype=torch.float64))
    scale = LossScale.from_mask(mask, 3)
    for mode, value, weight in (("token-sum", 7.0, 1.0), ("seq-mean-token-sum-norm", 7 / 2 / 3, 1 / 6)):
        loss, metrics = value_loss(vpreds, values, returns, mask, scale, mode, cliprange_value=10.0)
        assert loss.item() == pytest.approx(value, abs=1e-15), mode
        assert metrics["vf_loss"].item() == pytest.approx(value, abs=1e-15), mode
        (grad,) = torch.autograd.grad(loss, vpreds)  # (v - R) * weight on valid tokens, exactly 0 on padding
        expected = torch.tensor([[2.0, 1.0, 0], [3.0, 0, 0]], dtype=torch.float64) * weight
        torch.testing.assert_close(grad, expected, rtol=0, atol=1e-15)


def _with_padding(x: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(mask.bool(), x, fill)


@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_padding_holding_nan_or_inf_reaches_no_loss_or_gradient(mode, fill):
    # Model and rollout outputs at padding (log-probs, entropy, values) are whatever was left there. The loss and
    # the gradient must be those of the clean batch, with gradients exactly 0 on padding. Advantages are 0 there by
    # the estimators' contract and IS weights 1 (off_policy.truncated_is_weights), so they stay clean.
    g = torch.Generator().manual_seed(3)
    _, mask = ragged(seed=3)
    shape = mask.shape

    def rand(scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return torch.rand(shape, generator=g, dtype=torch.float64) * scale + shift

    clean = dict(log_prob=rand(-2.0), old=rand(-2.0), ref=rand(-2.0), entropy=rand(), vpreds=rand(4.0, -2.0),
                 values=rand(4.0, -2.0), returns=rand(4.0, -2.0))
    advantages = torch.randn(shape, generator=g, dtype=torch.float64) * mask
    is_weights = _with_padding(rand(1.5, 0.25), mask, 1.0)
    scale = LossScale.from_mask(mask, 7)
    selected = torch.rand(shape, generator=g) > 0.7  # clip_cov / kl_cov's selection, padding included

    def losses(inputs: dict[str, torch.Tensor], loss_mode: str):
        leaves = {k: inputs[k].clone().requires_grad_() for k in ("log_prob", "entropy", "vpreds")}
        weights = dict(bypass_is=("token", 2.0)) if loss_mode == "reinforce" else dict(is_weights=is_weights)
        pg, pg_metrics = actor_loss(leaves["log_prob"], inputs["old"], advantages, mask, scale, mode,
                                    ClipRange(0.2, dro_beta=0.1),
                                    entropy=leaves["entropy"], entropy_coeff=0.01, ref_log_prob=inputs["ref"],
                                    kl_loss_coef=0.1, loss_mode=loss_mode,
                                    selected=selected if loss_mode in COVARIANCE_MODES else None, **weights)
        vf, vf_metrics = value_loss(leaves["vpreds"], inputs["values"], inputs["returns"], mask, scale, mode, 0.5)
        grads = torch.autograd.grad(pg + vf, list(leaves.values()))
        return pg + vf, grads, pg_metrics | vf_metrics

    dirty = {k: _with_padding(v, mask, fill) for k, v in clean.items()}
    for loss_mode in (*POLICY_LOSS_MODES, "reinforce"):
        clean_loss, clean_grads, clean_metrics = losses(clean, loss_mode)
        loss, grads, metrics = losses(dirty, loss_mode)
        assert torch.isfinite(loss), loss_mode
        torch.testing.assert_close(loss, clean_loss, rtol=0, atol=0)
        for grad, clean_grad in zip(grads, clean_grads):
            assert torch.equal(grad[~mask.bool()], torch.zeros_like(grad[~mask.bool()])), loss_mode
            torch.testing.assert_close(grad, clean_grad, rtol=0, atol=0)
        for name, value in metrics.items():
            torch.testing.assert_close(value, clean_metrics[name], rtol=0, atol=0)


def test_loss_scale_factor_reaches_the_actor_and_the_response_length_the_critic():
    # verl: actor.loss_scale_factor (null: the response width); shardrl's critic divides by the response length.
    plan = plan_job(compose("ppo_trainer", ["algorithm.adv_estimator=gae", "data.max_response_length=6",
                                            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
                                            "actor_rollout_ref.actor.loss_scale_factor=4096"]))
    assert (plan.actor.loss.loss_agg_mode, plan.actor.loss.max_response_length) == ("seq-mean-token-sum-norm", 4096)
    assert (plan.critic.loss_agg_mode, plan.critic.max_response_length) == ("seq-mean-token-sum-norm", 6)
    plan = plan_job(compose("ppo_trainer", ["actor_rollout_ref.actor.loss_agg_mode=token-sum"]))
    assert plan.actor.loss.loss_agg_mode == "token-sum"


def test_docs_give_every_mode_its_formula():
    row = next(line for line in DOC.read_text().splitlines()
               if line.startswith("| `actor_rollout_ref.actor.loss_agg_mode` |"))
    for mode in LOSS_AGG_MODES:
        assert f"`{mode}`:" in row or f"`{mode}` (Dr. GRPO):" in row, mode


# The real training path: update_policy / update_critic (train_epochs: mini batch global counts summed over micro
# batches and all-reduced over DP, packed micro batches by count or token budget), one optimizer step at lr 0.
CUTS = {"micro8": (BATCH, None), "micro1": (1, None), "micro4": (4, None), "dynamic24tokens": (None, 24)}
METRICS = ("pg_loss", "entropy", "pg_clipfrac", "ppo_kl", "vf_loss", "vf_clipfrac", "vpred_mean")


def training_batch(ckpt: str):
    """make_batch() on policy (old log-probs = the model's), with values and returns; padding holds NaN / inf."""
    batch = make_batch(seed=7)
    mask = batch.tensors["response_mask"]
    engine = _engine(ckpt, value_head=False)
    log_probs, _ = compute_log_prob(engine, batch, ForwardBatching(BATCH, None))
    g = torch.Generator().manual_seed(8)
    padding = ~mask.bool()
    batch.tensors["old_log_probs"] = torch.where(padding, math.nan, log_probs)
    batch.tensors["values"] = torch.where(padding, math.inf, torch.randn(BATCH, RESPONSE, generator=g))
    batch.tensors["returns"] = torch.where(padding, -math.inf, torch.randn(BATCH, RESPONSE, generator=g))
    return batch


def _engine(ckpt: str, value_head: bool) -> ModelEngine:
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return ModelEngine(ModelConfig.from_pretrained(ckpt), Layout.create(LayoutSpec(world_size=world)),
                       EngineOptions(value_head=value_head, optim=OptimOptions(lr=0.0)), hf_path=ckpt,
                       optional_weights=["score.weight"] if value_head else ())


def train_metrics(ckpt: str, micro_batch_size: int | None, max_token_len: int | None) -> dict[str, dict]:
    """{mode: {metric: value}} of one actor and one critic step on this rank's share of training_batch()."""
    actor, critic = _engine(ckpt, value_head=False), _engine(ckpt, value_head=True)
    layout = actor.layout
    share = training_batch(ckpt).take(list(range(layout.dp_rank * BATCH // layout.dp_size,
                                                 (layout.dp_rank + 1) * BATCH // layout.dp_size)))
    update = UpdateOptions(mini_batch_size=len(share), micro_batch_size=micro_batch_size, max_token_len=max_token_len)
    out = {}
    for mode in LOSS_AGG_MODES:
        loss = PolicyLossOptions(loss_agg_mode=mode, clip=ClipRange(0.2), entropy_coeff=0.01,
                                 max_response_length=RESPONSE)
        policy = update_policy(actor, share, loss, update)
        values = update_critic(critic, share, update, mode, 0.5, RESPONSE)
        out[mode] = {"actor_grad_norm": policy["grad_norm"][0], "critic_grad_norm": values["grad_norm"][0],
                     "skipped": policy["update_skipped"][0] + values["update_skipped"][0]}
        out[mode] |= {name: (policy | values)[name][0] for name in METRICS}
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    ckpt = str(make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("agg") / "m"))
    return ckpt, train_metrics(ckpt, *CUTS["micro8"])  # reference: one micro batch, one rank


def test_real_path_losses_are_verl_formulas(trained):
    # On policy with lr 0: the actor's pg_loss is agg(-A) and its entropy agg(entropy); the critic's vf_loss is
    # 0.5 agg(max((v - R)^2, (clip(v) - R)^2)), all by verl_reference on the model's own outputs.
    ckpt, reference = trained
    batch = training_batch(ckpt)
    mask = batch.tensors["response_mask"]
    _, entropy = compute_log_prob(_engine(ckpt, value_head=False), batch, ForwardBatching(BATCH, None))
    vpreds = compute_values(_engine(ckpt, value_head=True), batch, ForwardBatching(BATCH, None)).double()
    values, returns = batch.tensors["values"].double(), batch.tensors["returns"].double()
    clipped = values + (vpreds - values).clamp(-0.5, 0.5)
    per_token_vf = 0.5 * torch.maximum((vpreds - returns) ** 2, (clipped - returns) ** 2)
    advantages = batch.tensors["advantages"].double()
    for mode, got in reference.items():
        assert got["skipped"] == 0.0 and math.isfinite(got["actor_grad_norm"]) and got["actor_grad_norm"] > 0
        assert math.isfinite(got["critic_grad_norm"]) and got["critic_grad_norm"] > 0
        assert got["pg_loss"] == pytest.approx(verl_reference(-advantages, mask, mode, RESPONSE), rel=1e-5, abs=1e-6)
        assert got["entropy"] == pytest.approx(verl_reference(entropy.double(), mask, mode, RESPONSE), rel=1e-5)
        assert got["vf_loss"] == pytest.approx(verl_reference(per_token_vf, mask, mode, RESPONSE), rel=1e-5)


def assert_same_metrics(actual: dict, expected: dict, what: str) -> None:
    for mode, ref in expected.items():
        for name, value in ref.items():
            # fp32 sums in another order differ by ulps; a wrong normalisation is off by a factor of the split.
            assert actual[mode][name] == pytest.approx(value, rel=1e-5, abs=1e-7), f"{what}, {mode}, {name}"


@pytest.mark.parametrize("cut", ["micro1", "micro4", "dynamic24tokens"])
def test_micro_batching_changes_no_loss_or_gradient(trained, cut):
    ckpt, reference = trained
    assert_same_metrics(train_metrics(ckpt, *CUTS[cut]), reference, cut)


def test_data_parallel_size_changes_no_loss_or_gradient(trained):
    ckpt, reference = trained
    for rank_result in run_distributed(2, train_metrics, ckpt, *CUTS["micro1"]):
        assert_same_metrics(rank_result, reference, "DP2")


def test_global_counts_are_what_the_modes_divide_by():
    # The counts that train_epochs sums over micro batches and DP ranks are N and G of verl_reference.
    _, mask = ragged(seed=4)
    pieces = [mask[:2], mask[2:3], mask[3:]]
    num_tokens, num_seqs = sum(loss_counts(piece) for piece in pieces).tolist()
    assert (num_tokens, num_seqs) == (mask.sum().item(), float((mask.sum(-1) > 0).sum()))
