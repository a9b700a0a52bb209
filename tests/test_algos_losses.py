"""Policy and value losses against hand-computed values; aggregation modes; invariance to micro batching and DP."""

import math

import pytest
import torch

from shardrl.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSS_MODES,
    ClipRange,
    LossScale,
    actor_loss,
    aggregate_loss,
    gspo_loss,
    loss_counts,
    ppo_clip_loss,
    value_loss,
)
from shardrl.algos.covariance import COVARIANCE_MODES


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _log(ratios: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)


def test_ppo_clip_both_sides_and_dual_clip_by_hand():
    # old = 0, so r = exp(log_prob). clip 0.2, dual c = 3. A 6th, masked token holds garbage.
    # r=1.5,A=+1: max(-1.5, -1.2) = -1.2 (clipped)     r=0.5,A=+1: max(-0.5, -0.8) = -0.5
    # r=0.5,A=-1: max(0.5, 0.8) = 0.8 (clipped)         r=5,A=-1: max(5, 1.2) = 5 -> dual min(5, 3) = 3
    # r=1.5,A=-1: max(1.5, 1.2) = 1.5
    log_prob = torch.cat([_log([1.5, 0.5, 0.5, 5.0, 1.5]), t([[50.0]])], dim=1).requires_grad_()
    advantages = t([[1, 1, -1, -1, -1, 100.0]])
    mask = t([[1, 1, 1, 1, 1, 0]])
    scale = LossScale.from_mask(mask, max_response_length=6)
    per_token, metrics = ppo_clip_loss(log_prob, torch.zeros_like(log_prob), advantages, mask, scale, ClipRange(0.2))
    torch.testing.assert_close(per_token[:, :5], t([[-1.2, -0.5, 0.8, 3.0, 1.5]]))
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.4, abs=1e-6)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.2, abs=1e-6)
    assert metrics["ppo_kl"].item() == pytest.approx(-0.2068147535, abs=1e-9)
    # Gradient -A*r/5 only where the unclipped branch is active (tokens 1 and 4); clipped tokens get none.
    loss = aggregate_loss(per_token, mask, "token-mean", scale)
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, t([[0, -0.1, 0, 0, 0.3, 0]]))


def test_clip_higher_asymmetry_by_hand():
    # r = [1.5, 1.25, 0.5, 0.7], A = [1, 1, -1, 1]
    log_prob, advantages = _log([1.5, 1.25, 0.5, 0.7]), t([[1, 1, -1, 1]])
    mask = torch.ones_like(log_prob)
    scale = LossScale.from_mask(mask, 4)

    def losses(clip: ClipRange) -> torch.Tensor:
        return ppo_clip_loss(log_prob, torch.zeros_like(log_prob), advantages, mask, scale, clip)[0]

    # Symmetric 0.2: 1.25 is clipped to 1.2.
    torch.testing.assert_close(losses(ClipRange(0.2)), t([[-1.2, -1.2, 0.8, -0.7]]))
    # high = 0.28: the upper bound moves to 1.28 (1.25 now unclipped), the lower bound stays at 0.8.
    torch.testing.assert_close(losses(ClipRange(0.2, clip_ratio_high=0.28)), t([[-1.28, -1.25, 0.8, -0.7]]))
    # low = 0.1: the lower bound moves to 0.9 for the negative-advantage token.
    torch.testing.assert_close(
        losses(ClipRange(0.2, clip_ratio_low=0.1, clip_ratio_high=0.28)), t([[-1.28, -1.25, 0.9, -0.7]])
    )


def test_clip_range_validation():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        ClipRange(0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="0 <= clip_ratio_low < 1"):
        ClipRange(0.2, clip_ratio_low=1.5)


def test_value_loss_clipping_by_hand():
    # cliprange 0.5 around old values 1:
    # v=2.0,R=1: clip 1.5; max(1, 0.25) = 1        v=1.2,R=3: both 3.24
    # v=0.0,R=2: clip 0.5; max(4, 2.25) = 4         v=2.0,R=3: clip 1.5; max(1, 2.25) = 2.25 (clipped)
    # loss = 0.5 * mean = 0.5 * (1 + 3.24 + 4 + 2.25) / 4 = 1.31125
    vpreds = t([[2.0, 1.2, 0.0, 2.0, 9.0]]).requires_grad_()
    mask = t([[1, 1, 1, 1, 0]])
    scale = LossScale.from_mask(mask, 5)
    loss, metrics = value_loss(
        vpreds, t([[1, 1, 1, 1, 1]]), t([[1.0, 3.0, 2.0, 3.0, -50]]), mask, scale, "token-mean", cliprange_value=0.5
    )
    assert loss.item() == pytest.approx(1.31125, abs=1e-9)
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.25, abs=1e-6)
    assert metrics["vpred_mean"].item() == pytest.approx(1.3, abs=1e-9)
    # d/dv 0.5*(v-R)^2 / 4 = (v-R)/4 where unclipped; the clipped token's prediction is at its bound: no gradient.
    (grad,) = torch.autograd.grad(loss, vpreds)
    torch.testing.assert_close(grad, t([[0.25, -0.45, -0.5, 0, 0]]))


def test_aggregation_modes_by_hand():
    # Row 3 has no valid token: it counts neither as a token nor as a sequence. inf at masked spots must not leak.
    per_token = t([[1, 2, 3], [4, 5, math.inf], [math.inf, 7, 8]])
    mask = t([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    scale = LossScale.from_mask(mask, max_response_length=4)
    assert (scale.num_tokens, scale.num_seqs) == (5.0, 2.0)
    expected = {
        "token-mean": 15 / 5,
        "token-sum": 15,
        "seq-mean-token-sum": (6 + 9) / 2,
        "seq-mean-token-mean": (2 + 4.5) / 2,
        "seq-mean-token-sum-norm": (6 + 9) / 2 / 4,  # verl 0.9's Dr. GRPO: mean over sequences / max_response_length
    }
    for mode, value in expected.items():
        assert aggregate_loss(per_token, mask, mode, scale).item() == pytest.approx(value, abs=1e-12)
    with pytest.raises(ValueError, match="loss_agg_mode='mean' is not one of"):
        aggregate_loss(per_token, mask, "mean", scale)


def test_actor_loss_combines_terms_by_hand():
    # pg per token [-1.2, -0.5] (r = 1.5, 0.5; A = 1); entropy [0.7, 0.3]; k1 KL to ref=0 is log r.
    log_prob, mask = _log([1.5, 0.5]), t([[1, 1]])
    scale = LossScale.from_mask(mask, 2)
    common = dict(
        log_prob=log_prob, old_log_prob=torch.zeros_like(log_prob), advantages=t([[1, 1]]), response_mask=mask,
        scale=scale, loss_agg_mode="token-mean", clip=ClipRange(0.2), entropy=t([[0.7, 0.3]]), entropy_coeff=0.01,
        ref_log_prob=torch.zeros_like(log_prob), kl_loss_coef=0.1, kl_loss_type="kl",
    )
    # -0.85 - 0.01 * 0.5 + 0.1 * (log 1.5 + log 0.5) / 2
    loss, metrics = actor_loss(**common)
    assert loss.item() == pytest.approx(-0.8693841036, abs=1e-9)
    assert metrics["pg_loss"].item() == pytest.approx(-0.85, abs=1e-9)
    assert metrics["entropy"].item() == pytest.approx(0.5, abs=1e-9)
    assert metrics["kl_loss"].item() == pytest.approx(-0.1438410362, abs=1e-9)
    # IS weights [2, 0.5] scale only the policy-gradient term: pg = mean(-2.4, -0.25) = -1.325.
    loss, _ = actor_loss(**common, is_weights=t([[2.0, 0.5]]))
    assert loss.item() == pytest.approx(-1.3443841036, abs=1e-9)
    with pytest.raises(ValueError, match="entropy_coeff=0.01 needs the per-token entropy"):
        actor_loss(**(common | {"entropy": None}))


def _ragged_batch(seed: int) -> dict[str, torch.Tensor]:
    """8 sequences of lengths 1..12 with a hole, right-padded to 12, garbage at masked positions."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 12, 1, 7, 5, 9, 2, 11])
    mask = (torch.arange(12)[None, :] < lengths[:, None]).double()
    mask[1, 4] = 0.0  # a tool-output hole

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    old = -rand(8, 12).abs()
    batch = dict(
        mask=mask, old=old, log_prob=old + 0.3 * rand(8, 12), advantages=rand(8, 12), entropy=rand(8, 12).abs(),
        ref=old + 0.2 * rand(8, 12), is_weights=(0.5 + rand(8, 12).abs()).clamp(max=2.0),
        values=rand(8, 12), returns=rand(8, 12), vpreds=rand(8, 12),
    )
    batch = {k: v if k == "mask" else torch.where(mask.bool(), v, 1e3) for k, v in batch.items()}
    # the tokens a covariance selection chose (clip_cov, kl_cov); on padding too, which they must ignore
    return batch | {"selected": rand(8, 12) > 0.8}


def _losses(piece: dict[str, torch.Tensor], mode: str, scale: LossScale,
            loss_mode: str = "vanilla") -> tuple[torch.Tensor, dict]:
    actor, actor_metrics = actor_loss(
        piece["log_prob"], piece["old"], piece["advantages"], piece["mask"], scale, mode,
        ClipRange(0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, dro_beta=0.1), is_weights=piece["is_weights"],
        entropy=piece["entropy"], entropy_coeff=0.01, ref_log_prob=piece["ref"], kl_loss_coef=0.05,
        kl_loss_type="low_var_kl", loss_mode=loss_mode,
        selected=piece["selected"] if loss_mode in COVARIANCE_MODES else None,
    )
    critic, critic_metrics = value_loss(
        piece["vpreds"], piece["values"], piece["returns"], piece["mask"], scale, mode, cliprange_value=0.2
    )
    return actor + critic, actor_metrics | critic_metrics


# Each split: DP ranks, each a list of micro batches (sample indices). Sums over all of them must equal the full batch.
SPLITS = {
    "micro_batches_of_1": [[[i] for i in range(8)]],
    "micro_batches_3_5": [[[0, 1, 2], [3, 4, 5, 6, 7]]],
    "dp2": [[[0, 5], [2, 7]], [[1, 3, 4], [6]]],
    "dp4": [[[7], [0]], [[1, 6]], [[2, 3]], [[5], [4]]],
}


@pytest.mark.parametrize("loss_mode", POLICY_LOSS_MODES)
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_and_gradient_independent_of_micro_batching_and_dp(mode, split, loss_mode):
    batch = _ragged_batch(seed=4)
    leaves = {k: batch[k].clone().requires_grad_() for k in ("log_prob", "vpreds")}
    full = batch | leaves
    scale = LossScale.from_mask(batch["mask"], max_response_length=12)
    full_loss, full_metrics = _losses(full, mode, scale, loss_mode)
    full_grads = torch.autograd.grad(full_loss, list(leaves.values()))

    # The trainer's way to the global counts: per-piece counts, summed over micro batches and ranks.
    pieces = [micro for rank in SPLITS[split] for micro in rank]
    counts = sum(loss_counts(batch["mask"][idx]) for idx in pieces)
    global_scale = LossScale(counts[0].item(), counts[1].item(), max_response_length=12)
    assert global_scale == scale
    total, metric_sums = 0.0, {}
    for idx in pieces:
        width = int(batch["mask"][idx].nonzero()[:, 1].max()) + 1  # dynamic padding: each piece trimmed
        loss, metrics = _losses({k: v[idx, :width] for k, v in full.items()}, mode, global_scale, loss_mode)
        total = total + loss
        metric_sums = {k: metric_sums.get(k, 0.0) + v for k, v in metrics.items()}
    piece_grads = torch.autograd.grad(total, list(leaves.values()))

    torch.testing.assert_close(total, full_loss, atol=1e-6, rtol=0)
    for piece_grad, full_grad in zip(piece_grads, full_grads):
        assert full_grad.abs().sum() > 0
        torch.testing.assert_close(piece_grad, full_grad, atol=1e-6, rtol=0)
    assert metric_sums.keys() == full_metrics.keys()
    for name, value in full_metrics.items():
        torch.testing.assert_close(metric_sums[name], value, atol=1e-6, rtol=0)


def test_per_micro_batch_means_would_not_be_invariant():
    # Guard on the invariance test's data: normalising by each piece's own counts gives a different loss.
    batch = _ragged_batch(seed=4)
    full = _losses(batch, "token-mean", LossScale.from_mask(batch["mask"], 12))[0]
    local = [_losses({k: v[idx] for k, v in batch.items()}, "token-mean", LossScale.from_mask(batch["mask"][idx], 12))
             for idx in ([0, 1, 2], [3, 4, 5, 6, 7])]
    assert abs((local[0][0] + local[1][0]) / 2 - full) > 1e-3


# GSPO (actor.policy_loss.loss_mode=gspo): three sequences of lengths 3, 1, 2 and 2, right-padded to 4 with garbage.
# Token log ratios (log_prob - old_log_prob) and advantages per sequence, before padding:
GSPO_LOG_RATIOS = [[0.3, -0.1, 0.1], [0.5], [-0.6, -0.2], [2.0, 1.0]]
GSPO_ADVANTAGES = [[1.0, -1.0, 2.0], [1.0], [-1.0, -0.5], [-1.0, -2.0]]
GSPO_CLIP = ClipRange(0.2, clip_ratio_high=0.28)  # s clipped to [0.8, 1.28]


def _padded(rows: list[list[float]], fill: float) -> torch.Tensor:
    return t([row + [fill] * (4 - len(row)) for row in rows])


def _gspo_inputs() -> dict[str, torch.Tensor]:
    mask = _padded([[1.0] * len(r) for r in GSPO_LOG_RATIOS], 0.0)
    old = _padded([[-0.5 - 0.25 * i - 0.1 * j for j in range(len(r))] for i, r in enumerate(GSPO_LOG_RATIOS)], 0.0)
    log_prob = old + _padded(GSPO_LOG_RATIOS, 0.0)
    padding = ~mask.bool()
    return dict(log_prob=torch.where(padding, math.inf, log_prob), old_log_prob=torch.where(padding, 1e3, old),
                advantages=_padded(GSPO_ADVANTAGES, 100.0), response_mask=mask)


def _gspo_reference(low: float, high: float) -> tuple[list[list[float]], list[list[float]]]:
    """Per-token losses and d loss / d log_prob under seq-mean-token-mean, one sequence at a time.

    s_i = exp(mean of the sequence's log ratios); loss = -min(s A, clip(s) A); the token's gradient is -A s_i times
    its aggregation weight 1 / (len_i * num_seqs) where the unclipped branch is the smaller, else 0.
    """
    losses, grads = [], []
    for log_ratios, advs in zip(GSPO_LOG_RATIOS, GSPO_ADVANTAGES):
        s = math.exp(sum(log_ratios) / len(log_ratios))
        s_clipped = min(max(s, 1 - low), 1 + high)
        weight = 1 / (len(log_ratios) * len(GSPO_LOG_RATIOS))
        losses.append([-min(s * a, s_clipped * a) for a in advs])
        grads.append([-a * s * weight if s * a <= s_clipped * a else 0.0 for a in advs])
    return losses, grads


def test_gspo_loss_by_hand():
    # s = e^0.1 = 1.105 (inside), e^0.5 = 1.649 (above, A > 0: clipped to 1.28), e^-0.4 = 0.670 (below, A < 0:
    # clipped to 0.8), e^1.5 = 4.48 (above, A < 0: unclipped and no dual clip, vanilla would stop at 3 * |A|).
    inputs = _gspo_inputs()
    per_token, metrics = gspo_loss(**inputs, scale=LossScale.from_mask(inputs["response_mask"], 4), clip=GSPO_CLIP)
    expected, _ = _gspo_reference(0.2, 0.28)
    for row, seq_losses in enumerate(expected):
        torch.testing.assert_close(per_token[row, :len(seq_losses)], t([seq_losses])[0])
    assert expected[3] == pytest.approx([math.exp(1.5), 2 * math.exp(1.5)])  # the reference itself, spot-checked
    assert metrics["pg_clipfrac"].item() == pytest.approx(3 / 8, abs=1e-9)  # sequences 1 and 2: 3 of 8 tokens
    assert metrics["ppo_kl"].item() == pytest.approx(-3.0 / 8, abs=1e-9)  # -mean of the token log ratios
    assert "pg_clipfrac_lower" not in metrics


def test_gspo_gradient_is_the_gspo_token_gradient_and_not_vanilla():
    inputs = _gspo_inputs()
    log_prob = inputs.pop("log_prob").requires_grad_()
    scale = LossScale.from_mask(inputs["response_mask"], 4)
    common = dict(old_log_prob=inputs["old_log_prob"], advantages=inputs["advantages"],
                  response_mask=inputs["response_mask"], scale=scale, loss_agg_mode="seq-mean-token-mean",
                  clip=GSPO_CLIP)
    loss, _ = actor_loss(log_prob, **common, loss_mode="gspo")
    expected_losses, expected_grads = _gspo_reference(0.2, 0.28)
    assert loss.item() == pytest.approx(sum(sum(r) / len(r) for r in expected_losses) / 4, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, _padded(expected_grads, 0.0))  # zero (not NaN) on padding
    # Vanilla weighs and clips each token by its own ratio r_it instead of s_i: in sequence 0 (weight 1/12), token 1
    # (r = e^-0.1, A = -1) gets +e^-0.1/12 instead of +e^0.1/12; token 0 (r = e^0.3 > 1.28, A = 1) is clipped there.
    (vanilla_grad,) = torch.autograd.grad(actor_loss(log_prob, **common, loss_mode="vanilla")[0], log_prob)
    assert vanilla_grad[0, :2].tolist() == pytest.approx([0.0, math.exp(-0.1) / 12], abs=1e-12)
    assert grad[0, :2].tolist() == pytest.approx([-math.exp(0.1) / 12, math.exp(0.1) / 12], abs=1e-12)
    assert (vanilla_grad - grad).abs().max() > 0.05


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_equals_vanilla_when_the_policy_has_not_moved(mode):
    # All ratios 1: both surrogates are -A per token, and since verl 0.9.1 GSPO's term follows `loss_agg_mode` like
    # every other term, so GSPO's loss is vanilla's, in value, gradient and metrics.
    batch = _ragged_batch(seed=5)
    on_policy = torch.where(batch["mask"].bool(), batch["old"], 1e3)
    scale = LossScale.from_mask(batch["mask"], 12)

    def run(loss_mode: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
        log_prob = on_policy.clone().requires_grad_()
        loss, metrics = actor_loss(log_prob, batch["old"], batch["advantages"], batch["mask"], scale, mode,
                                   ClipRange(0.2, clip_ratio_high=0.28), is_weights=batch["is_weights"],
                                   loss_mode=loss_mode, entropy=batch["entropy"], entropy_coeff=0.01,
                                   ref_log_prob=batch["ref"], kl_loss_coef=0.05)
        return loss, torch.autograd.grad(loss, log_prob)[0], metrics

    gspo, gspo_grad, gspo_metrics = run("gspo")
    vanilla, vanilla_grad, vanilla_metrics = run("vanilla")
    torch.testing.assert_close(gspo, vanilla, atol=1e-12, rtol=0)
    assert gspo_grad.abs().sum() > 0
    torch.testing.assert_close(gspo_grad, vanilla_grad, atol=1e-12, rtol=0)
    for name in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss"):
        torch.testing.assert_close(gspo_metrics[name], vanilla_metrics[name], atol=1e-12, rtol=0)


def test_gspo_term_follows_loss_agg_mode_as_verl_091():
    # The reference (_gspo_reference) gives each token's loss, and its gradient under seq-mean-token-mean (the
    # paper's: weight 1 / (len_i * num_seqs)); token-mean weighs every token 1 / num_tokens instead.
    inputs = _gspo_inputs()
    log_prob = inputs.pop("log_prob").requires_grad_()
    losses, seq_mean_grads = _gspo_reference(0.2, 0.28)
    num_seqs, num_tokens = len(losses), sum(len(r) for r in losses)
    token_mean_grads = [[g * len(r) * num_seqs / num_tokens for g in r] for r in seq_mean_grads]
    expected = {"seq-mean-token-mean": (sum(sum(r) / len(r) for r in losses) / num_seqs, seq_mean_grads),
                "token-mean": (sum(sum(r) for r in losses) / num_tokens, token_mean_grads)}
    for mode, (value, grads) in expected.items():
        loss, metrics = actor_loss(log_prob, **inputs, scale=LossScale.from_mask(inputs["response_mask"], 4),
                                   loss_agg_mode=mode, clip=GSPO_CLIP, loss_mode="gspo")
        assert loss.item() == pytest.approx(value, abs=1e-12), mode
        assert metrics["pg_loss"].item() == pytest.approx(loss.item(), abs=1e-12)
        (grad,) = torch.autograd.grad(loss, log_prob)
        torch.testing.assert_close(grad, _padded(grads, 0.0), msg=mode)


def test_gspo_log_ratio_clamped_above_at_10_only():
    # Sequence 0: log s = 12 with A = -1 (unclipped branch active): value e^10 per token (verl's clamp) and no
    # gradient. Sequence 1: log s = -25 with A = +1: value -e^-25 per token (no lower clamp; -e^-20 with one) and the
    # unclipped gradient -A * s / (len * num_seqs) = -e^-25 / 4. ppo_kl is the unclamped -mean log ratio:
    # -(24 - 50) / 4.
    log_ratios = t([[12.0, 12.0], [-25.0, -25.0]])
    old = t([[-1.0, -2.0], [-0.5, -0.7]])
    log_prob = (old + log_ratios).requires_grad_()
    mask, advantages = torch.ones_like(old), t([[-1.0, -1.0], [1.0, 1.0]])
    scale = LossScale.from_mask(mask, 2)
    per_token, metrics = gspo_loss(log_prob, old, advantages, mask, scale, ClipRange(0.2))
    torch.testing.assert_close(per_token, t([[math.exp(10)] * 2, [-math.exp(-25)] * 2]), rtol=1e-12, atol=0)
    assert metrics["ppo_kl"].item() == pytest.approx(26 / 4, abs=1e-12)
    (grad,) = torch.autograd.grad(aggregate_loss(per_token, mask, "seq-mean-token-mean", scale), log_prob)
    torch.testing.assert_close(grad, t([[0.0, 0.0], [-math.exp(-25) / 4] * 2]), rtol=1e-12, atol=0)


def test_unknown_loss_mode_names_the_key():
    inputs = _gspo_inputs()
    with pytest.raises(ValueError, match=r"actor.policy_loss.loss_mode='gpo' is not one of "
                                         r"\['vanilla', 'gspo', 'gpg', 'cispo', 'sapo', 'geo_mean', 'dppo_tv', "
                                         r"'dppo_kl', 'dro', 'clip_cov', 'kl_cov'\]"):
        actor_loss(**inputs, scale=LossScale.from_mask(inputs["response_mask"], 4), loss_agg_mode="token-mean",
                   clip=GSPO_CLIP, loss_mode="gpo")


@pytest.mark.parametrize("loss_mode", POLICY_LOSS_MODES)
def test_nan_advantages_and_weights_on_padding_reach_no_loss_or_gradient(loss_mode):
    batch = _ragged_batch(seed=9)
    padding = ~batch["mask"].bool()
    scale = LossScale.from_mask(batch["mask"], 12)
    clip = ClipRange(0.2, clip_ratio_high=0.28, dro_beta=0.1)

    def run(advantages, weights):
        log_prob = batch["old"].clone().requires_grad_()
        loss, _ = actor_loss(log_prob, batch["old"], advantages, batch["mask"], scale, "token-mean", clip,
                             is_weights=weights, loss_mode=loss_mode,
                             selected=batch["selected"] if loss_mode in COVARIANCE_MODES else None)
        return loss, torch.autograd.grad(loss, log_prob)[0]

    clean, clean_grad = run(batch["advantages"], batch["is_weights"])
    dirty, dirty_grad = run(torch.where(padding, math.nan, batch["advantages"]),
                            torch.where(padding, math.inf, batch["is_weights"]))
    assert torch.isfinite(dirty) and torch.isfinite(dirty_grad).all()
    torch.testing.assert_close(dirty, clean, atol=0, rtol=0)
    torch.testing.assert_close(dirty_grad, clean_grad, atol=0, rtol=0)
