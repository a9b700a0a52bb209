"""Off-policy correction: truncated IS weights (token, sequence), their batch normalisation, rejection sampling (both
of verl's spellings, the veto), decoupled PPO, bypass and its REINFORCE loss, metrics, refusals."""

import math

import pytest
import torch

from shardrl.algos import ClipRange, LossScale, actor_loss, rollout_correction
from shardrl.algos.rejection import RejectionSpecError, parse_rejection


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_token_level_tis_by_hand():
    # log pi_old - log pi_behav = [0.1, 1.0, -0.5] (+ a masked token with garbage), threshold 2:
    # w = [exp(0.1), min(e, 2), exp(-0.5)] = [1.1051709181, 2, 0.6065306597]; masked -> 1.
    rollout = t([[-1.0, -2.0, -0.5, -9.0]])
    old = rollout + t([[0.1, 1.0, -0.5, 30.0]])
    mask = t([[1, 1, 1, 0]])
    out = rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0, decoupled=True)
    torch.testing.assert_close(out.is_weights, t([[1.1051709181, 2.0, 0.6065306597, 1.0]]))
    assert torch.equal(out.old_log_prob, old)
    m = {k: v.item() for k, v in out.metrics.items()}
    assert m["rollout_is_mean"] == pytest.approx(1.2372338593, abs=1e-9)  # of the applied weights
    assert m["rollout_is_max"] == pytest.approx(2.7182818285, abs=1e-9)  # before truncation
    assert m["rollout_is_truncated_frac"] == pytest.approx(1 / 3, abs=1e-7)
    assert m["mismatch_kl"] == pytest.approx(-0.2, abs=1e-9)  # mean of log behav - log old = (-0.1 - 1 + 0.5) / 3
    # mean of exp(x) - x - 1 over x = 0.1, 1.0, -0.5: (0.0051709181 + 0.7182818285 + 0.1065306597) / 3
    assert m["mismatch_k3_kl"] == pytest.approx(0.2766611354, abs=1e-9)


def test_sequence_level_tis_by_hand():
    # Sequence log ratios summed over valid tokens: 0.1+0.2 = 0.3; 0.5+0.4 = 0.9; -0.3. Threshold 2:
    # w = exp(0.3) = 1.3498588076; exp(0.9) = 2.4596 -> 2; exp(-0.3) = 0.7408182207, on every valid token.
    log_ratio = t([[0.1, 0.2, 5.0], [0.5, 0.4, 7.0], [-0.3, 3.0, 3.0]])
    mask = t([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
    rollout = torch.full_like(log_ratio, -1.0)
    out = rollout_correction(rollout + log_ratio, rollout, mask, "sequence", 2.0, decoupled=True)
    a, c = 1.3498588076, 0.7408182207
    torch.testing.assert_close(out.is_weights, t([[a, a, 1], [2, 2, 1], [c, 1, 1]]))
    m = {k: v.item() for k, v in out.metrics.items()}
    assert m["rollout_is_max"] == pytest.approx(2.4596031112, abs=1e-9)
    assert m["rollout_is_truncated_frac"] == pytest.approx(1 / 3, abs=1e-7)  # one sequence of three
    assert m["rollout_is_mean"] == pytest.approx((2 * a + 4 + c) / 5, abs=1e-9)


def test_decoupled_ppo_loss_by_hand():
    # pi / pi_prox = [1.5, 0.9, 0.5], A = [1, 1, -1], log pi_prox - log pi_behav = [0.2, 1.0, -0.5], threshold 2.
    # w = [1.2214027582, 2 (e truncated), 0.6065306597]
    # token 1: -w * min(1.5, 1.2) = -1.4656833098; token 2: -2 * 0.9 = -1.8; token 3: w * max(0.5, 0.8) = 0.4852245278
    behav = t([[-1.0, -2.0, -0.7]])
    prox = (behav + t([[0.2, 1.0, -0.5]])).requires_grad_()
    log_prob = (prox.detach() + t([[math.log(1.5), math.log(0.9), math.log(0.5)]])).requires_grad_()
    mask = torch.ones_like(behav)
    corr = rollout_correction(prox, behav, mask, rollout_is="token", rollout_is_threshold=2.0, decoupled=True)
    assert not corr.is_weights.requires_grad and not corr.old_log_prob.requires_grad
    loss, _ = actor_loss(
        log_prob, corr.old_log_prob, t([[1, 1, -1]]), mask, LossScale.from_mask(mask, 3), "token-mean",
        ClipRange(0.2), is_weights=corr.is_weights,
    )
    assert loss.item() == pytest.approx(-0.9268195940, abs=1e-9)  # (-1.4656833098 - 1.8 + 0.4852245278) / 3
    # Only token 2 is unclipped: d/dlog_prob (-w * A * r) / 3 = -2 * 0.9 / 3 = -0.6.
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, t([[0.0, -0.6, 0.0]]))


def test_no_correction_gives_unit_weights_and_old_anchor():
    old, rollout, mask = t([[-1.0, -2.0]]), t([[-1.5, -2.5]]), t([[1, 1]])
    out = rollout_correction(old, rollout, mask, rollout_is=None, rollout_is_threshold=2.0, decoupled=True)
    assert torch.equal(out.is_weights, torch.ones_like(old)) and torch.equal(out.old_log_prob, old)
    assert set(out.metrics) == {"mismatch_kl", "mismatch_k3_kl"}
    # Without rollout log-probs (a sync trainer whose engine returns none) there is nothing to diagnose.
    out = rollout_correction(old, None, mask, rollout_is=None, rollout_is_threshold=2.0, decoupled=True)
    assert torch.equal(out.is_weights, torch.ones_like(old)) and out.metrics == {}


def test_bypass_anchors_on_rollout_log_probs():
    rollout, mask = t([[-1.5, -2.5]]), t([[1, 1]])
    out = rollout_correction(None, rollout, mask, rollout_is=None, rollout_is_threshold=2.0, decoupled=False)
    assert torch.equal(out.old_log_prob, rollout) and torch.equal(out.is_weights, torch.ones_like(rollout))


def test_sync_mode_equals_plain_ppo():
    # Staleness 0 and identical numerics: weights are exactly 1, so the loss equals the uncorrected PPO loss.
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=gen, dtype=torch.float64)
    log_prob = old + 0.1 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    advantages, mask = torch.randn(3, 5, generator=gen, dtype=torch.float64), torch.ones(3, 5, dtype=torch.float64)
    scale = LossScale.from_mask(mask, 5)
    plain, _ = actor_loss(log_prob, old, advantages, mask, scale, "token-mean", ClipRange(0.2))
    for level in ("token", "sequence"):
        corr = rollout_correction(old, old.clone(), mask, level, 2.0, decoupled=True)
        corrected, _ = actor_loss(log_prob, corr.old_log_prob, advantages, mask, scale, "token-mean", ClipRange(0.2),
                                  is_weights=corr.is_weights)
        assert torch.equal(corrected, plain)
        assert corr.metrics["mismatch_kl"].item() == 0.0 and corr.metrics["rollout_is_truncated_frac"].item() == 0.0


@pytest.mark.parametrize(
    "old, rollout, rollout_is, decoupled, message",
    [
        (None, "r", None, True, "decoupled=true needs recomputed old_log_probs"),
        ("o", None, "token", True, "rollout_log_probs missing"),
        ("o", "r", "token", False, "decoupled=false anchors PPO on the rollout log-probs"),
        ("o", None, None, False, "needs rollout_log_probs, rollout_is=null and no rejection sampling"),
        ("o", "r", "geometric", True, "rollout_is='geometric' is not one of"),
    ],
)
def test_refused_modes_name_the_keys(old, rollout, rollout_is, decoupled, message):
    tensors = {"o": t([[-1.0]]), "r": t([[-1.2]]), None: None}
    with pytest.raises(ValueError, match=message):
        rollout_correction(tensors[old], tensors[rollout], t([[1.0]]), rollout_is, 2.0, decoupled)


def test_threshold_must_be_positive():
    with pytest.raises(ValueError, match="rollout_is_threshold must be > 0; got 0.0"):
        rollout_correction(t([[-1.0]]), t([[-1.0]]), t([[1.0]]), "token", 0.0, decoupled=True)


def rejection(rollout_rs, threshold, lower=None, veto=None):
    return parse_rejection(rollout_rs, threshold, lower, veto)


def decoupled(log_ratio, mask, **kwargs):
    """rollout_correction with old = rollout + log_ratio (decoupled, no IS unless given)."""
    rollout = torch.full_like(log_ratio, -1.0)
    kwargs = {"rollout_is": None, "rollout_is_threshold": 2.0} | kwargs
    return rollout_correction(rollout + log_ratio, rollout, mask, kwargs.pop("rollout_is"),
                              kwargs.pop("rollout_is_threshold"), True, **kwargs)


def metrics_of(out):
    return {k: v.item() for k, v in out.metrics.items()}


def test_ratio_rejection_keeps_ratios_inside_lower_and_upper():
    # verl <= 0.7: rollout_rs=token keeps lower <= r <= upper. Ratios [0.6, 1.2, 1.8, 0.9] (+ a masked 30) and
    # [1.0, 1.4] with upper 1.5, lower 0.8: 0.6 is below, 1.8 above, the rest kept.
    log_ratio = t([[math.log(0.6), math.log(1.2), math.log(1.8), math.log(0.9), 30.0], [0.0, math.log(1.4), 0, 0, 0]])
    mask = t([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    out = decoupled(log_ratio, mask, rejection=rejection("token", 1.5, lower=0.8))
    torch.testing.assert_close(out.response_mask, t([[0, 1, 0, 1, 0], [1, 1, 0, 0, 0]]))
    assert out.response_mask.dtype == mask.dtype
    m = metrics_of(out)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 6)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_rs_ratio_fraction_high"] == pytest.approx(1 / 6)
    assert m["rollout_rs_ratio_fraction_low"] == pytest.approx(1 / 6)
    assert m["rollout_rs_mean"] == pytest.approx((0.6 + 1.2 + 1.8 + 0.9 + 1.0 + 1.4) / 6)
    assert (m["rollout_rs_max"], m["rollout_rs_min"]) == (pytest.approx(1.8), pytest.approx(0.6))
    # Without rollout_rs_threshold_lower the lower bound is 1 / upper = 0.667: 0.6 is still out, 0.9 in.
    out = decoupled(log_ratio, mask, rejection=rejection("token", 1.5))
    torch.testing.assert_close(out.response_mask, t([[0, 1, 0, 1, 0], [1, 1, 0, 0, 0]]))


def test_divergence_k1_bounds_the_inverse_ratio():
    # verl after 0.7: token_k1 keeps log(lower) <= -log r <= log(upper), i.e. lower <= pi_behav / pi_old <= upper.
    # With 0.8_1.5 that is r in [0.667, 1.25]: r = 0.7 is kept and r = 1.4 rejected, the reverse of the ratio rule.
    log_ratio, mask = t([[math.log(0.7), math.log(1.4), 0.0]]), t([[1, 1, 1]])
    ratio = decoupled(log_ratio, mask, rejection=rejection("token", 1.5, lower=0.8))
    k1 = decoupled(log_ratio, mask, rejection=rejection("token_k1", "0.8_1.5"))
    torch.testing.assert_close(ratio.response_mask, t([[0, 1, 1]]))
    torch.testing.assert_close(k1.response_mask, t([[1, 0, 1]]))
    m = metrics_of(k1)
    assert m["rollout_rs_token_k1_fraction_high"] == pytest.approx(0.0)  # -log 0.7 = 0.357 < log 1.5
    assert m["rollout_rs_token_k1_fraction_low"] == pytest.approx(1 / 3)  # -log 1.4 = -0.336 < log 0.8 = -0.223
    assert m["rollout_rs_token_k1_max"] == pytest.approx(-math.log(0.7))
    assert m["rollout_rs_token_k1_masked_fraction"] == m["rollout_rs_masked_fraction"] == pytest.approx(1 / 3)


def test_ratio_rejection_levels_token_sequence_geometric():
    # Row A: log r = [0.3, 0.3]: tokens 1.35, sequence exp(0.6) = 1.82, geometric exp(0.3) = 1.35.
    # Row B: log r = [0.5, -0.4]: tokens 1.65 and 0.670, sequence exp(0.1) = 1.11, geometric exp(0.05) = 1.05.
    # Bounds [1/1.5, 1.5] = [0.667, 1.5]: each level rejects something else. Row C has no valid tokens.
    log_ratio, mask = t([[0.3, 0.3], [0.5, -0.4], [7.0, 7.0]]), t([[1, 1], [1, 1], [0, 0]])
    expected = {"token": [[1, 1], [0, 1], [0, 0]], "sequence": [[0, 0], [1, 1], [0, 0]],
                "geometric": [[1, 1], [1, 1], [0, 0]]}
    for level, kept in expected.items():
        out = decoupled(log_ratio, mask, rejection=rejection(level, 1.5))
        torch.testing.assert_close(out.response_mask, t(kept), msg=level)
    m = metrics_of(decoupled(log_ratio, mask, rejection=rejection("sequence", 1.5)))
    assert m["rollout_rs_max"] == pytest.approx(math.exp(0.6)) and m["rollout_rs_min"] == pytest.approx(math.exp(0.1))
    assert m["rollout_rs_ratio_fraction_high"] == pytest.approx(1 / 2)  # of the two sequences with tokens
    assert m["rollout_rs_mean"] == pytest.approx((2 * math.exp(0.6) + 2 * math.exp(0.1)) / 4)  # over valid tokens
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)


@pytest.mark.parametrize("option, kept", [
    # k3 = r - 1 - log r per token. Row A: log r = [0.5, 0, 0, 0] -> k3 [0.1487, 0, 0, 0]: sum 0.1487, mean 0.0372,
    # max 0.1487. Row B: log r = 0.2 x 4 -> k3 0.0214 each: sum 0.0856, mean 0.0214, max 0.0214. Upper bound 0.05.
    ("token_k3", [[0, 1, 1, 1], [1, 1, 1, 1]]),
    ("seq_sum_k3", [[0, 0, 0, 0], [0, 0, 0, 0]]),
    ("seq_mean_k3", [[1, 1, 1, 1], [1, 1, 1, 1]]),
    ("seq_max_k3", [[0, 0, 0, 0], [1, 1, 1, 1]]),
    # k2 = (log r)^2 / 2: A [0.125, 0, 0, 0] (sum 0.125, mean 0.03125), B 0.02 each (sum 0.08, mean 0.02).
    ("seq_sum_k2", [[0, 0, 0, 0], [0, 0, 0, 0]]),
    ("seq_mean_k2", [[1, 1, 1, 1], [1, 1, 1, 1]]),
    ("token_k2", [[0, 1, 1, 1], [1, 1, 1, 1]]),
])
def test_divergence_criteria_by_reduction(option, kept):
    log_ratio, mask = t([[0.5, 0.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2]]), torch.ones(2, 4, dtype=torch.float64)
    out = decoupled(log_ratio, mask, rejection=rejection(option, 0.05))
    torch.testing.assert_close(out.response_mask, t(kept))


def test_divergence_criteria_combine_with_their_own_thresholds():
    # token_k1 with 0.5_2.0 (|log r| <= log 2) rejects only row C's token of log r = -1; seq_mean_k3 with 0.1 keeps
    # every row. All criteria must pass; each reports its own masked fractions.
    log_ratio = t([[0.5, 0.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2], [0.0, -1.0, 0.0, 0.0]])
    mask = torch.ones(3, 4, dtype=torch.float64)
    out = decoupled(log_ratio, mask, rejection=rejection("token_k1, seq_mean_k3,token_k1", "0.5_2.0,0.1"))
    # Row C's k3 mean is (e^-1 - 1 + 1) / 4 = 0.0920 <= 0.1, A's 0.0372, B's 0.0214.
    torch.testing.assert_close(out.response_mask, t([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1]]))
    m = metrics_of(out)
    assert m["rollout_rs_token_k1_masked_fraction"] == pytest.approx(1 / 12)
    assert m["rollout_rs_token_k1_seq_masked_fraction"] == pytest.approx(1 / 3)
    assert m["rollout_rs_seq_mean_k3_masked_fraction"] == pytest.approx(0.0)
    assert m["rollout_rs_seq_mean_k3_max"] == pytest.approx(math.exp(-1.0) / 4)
    # With 0.01 for seq_mean_k3 every row fails it.
    out = decoupled(log_ratio, mask, rejection=rejection("token_k1,seq_mean_k3", "0.5_2.0,0.01"))
    torch.testing.assert_close(out.response_mask, t([[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]))


def test_veto_drops_sequences_with_a_catastrophic_token():
    # verl <= 0.7's rollout_token_veto_threshold: a valid token with r < 1e-4 (log r = -10 < -9.21) drops its
    # sequence; the masked -50 in row B does not count. Alone (no rollout_rs) or on top of a rejection rule.
    log_ratio, mask = t([[0.1, -10.0, 0.2], [0.0, 0.3, -50.0]]), t([[1, 1, 1], [1, 1, 0]])
    out = decoupled(log_ratio, mask, rejection=rejection(None, None, veto=1e-4))
    torch.testing.assert_close(out.response_mask, t([[0, 0, 0], [1, 1, 0]]))
    m = metrics_of(out)
    assert m["rollout_is_veto_fraction"] == pytest.approx(1 / 2)
    assert m["rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)
    assert "rollout_rs_masked_fraction" not in m
    out = decoupled(log_ratio, mask, rejection=rejection("token", 1.3, veto=1e-4))  # r = exp(0.3) = 1.35 > 1.3
    torch.testing.assert_close(out.response_mask, t([[0, 0, 0], [1, 0, 0]]))


def test_batch_normalize_divides_by_the_mean_over_tokens_or_sequences():
    # Token level (the weights of test_token_level_tis_by_hand): mean over valid tokens 1.2372338593.
    rollout = t([[-1.0, -2.0, -0.5, -9.0]])
    old, mask = rollout + t([[0.1, 1.0, -0.5, 30.0]]), t([[1, 1, 1, 0]])
    out = rollout_correction(old, rollout, mask, "token", 2.0, True, rollout_is_batch_normalize=True)
    mean = 1.2372338593
    torch.testing.assert_close(out.is_weights, t([[1.1051709181 / mean, 2.0 / mean, 0.6065306597 / mean, 1.0]]))
    assert out.metrics["rollout_is_batch_norm_factor"].item() == pytest.approx(mean)
    assert out.metrics["rollout_is_mean"].item() == pytest.approx(mean)  # before normalisation
    # Sequence level: weights a = exp(0.3) (2 tokens), 2 (2 tokens, truncated), c = exp(-0.3) (1 token). verl divides
    # by the mean over sequences, (a + 2 + c) / 3 = 1.3635590094, not over tokens ((2a + 4 + c) / 5 = 1.488).
    log_ratio = t([[0.1, 0.2, 5.0], [0.5, 0.4, 7.0], [-0.3, 3.0, 3.0]])
    mask = t([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
    out = decoupled(log_ratio, mask, rollout_is="sequence", rollout_is_batch_normalize=True)
    a, c, mean = math.exp(0.3), math.exp(-0.3), 1.3635590094
    torch.testing.assert_close(out.is_weights, t([[a / mean, a / mean, 1], [2 / mean, 2 / mean, 1], [c / mean, 1, 1]]))
    # Rejection sampling does not change the set the mean is taken over (verl normalises before rejecting).
    out = decoupled(log_ratio, mask, rollout_is="sequence", rollout_is_batch_normalize=True,
                    rejection=rejection("sequence", 2.0))
    torch.testing.assert_close(out.response_mask, t([[1, 1, 0], [0, 0, 0], [1, 0, 0]]))
    assert out.metrics["rollout_is_batch_norm_factor"].item() == pytest.approx(mean)


def test_rejected_tokens_leave_the_loss_and_its_counts():
    # Token-mean PPO loss over the kept mask: the rejected token (r = 1.8 > 1.5) adds nothing and is not counted, so
    # the loss is the mean over the 2 kept tokens, not a sum over 2 divided by 3.
    behav = t([[-1.0, -2.0, -0.7]])
    old = behav + t([[0.0, math.log(1.8), 0.0]])
    mask = torch.ones_like(behav)
    corr = rollout_correction(old, behav, mask, None, 2.0, True, rejection=rejection("token", 1.5))
    scale = LossScale.from_mask(corr.response_mask, 3)
    assert (scale.num_tokens, scale.num_seqs) == (2, 1)
    log_prob = old + t([[math.log(1.1), 0.0, math.log(0.95)]])
    loss, _ = actor_loss(log_prob, corr.old_log_prob, t([[1.0, 5.0, -1.0]]), corr.response_mask, scale, "token-mean",
                         ClipRange(0.2))
    assert loss.item() == pytest.approx((-1.1 + 0.95) / 2)


def test_reinforce_loss_with_current_policy_weights_by_hand():
    # verl's bypass mode with loss_type=reinforce: loss = mean(-A * w * log pi), w = min(pi / pi_behav, 2), detached.
    # pi / pi_behav = [1.5, 3 -> 2, 0.5]; log pi = [-1, -2, -0.7]; A = [1, -1, 2].
    log_prob = t([[-1.0, -2.0, -0.7]]).requires_grad_()
    behav = log_prob.detach() - t([[math.log(1.5), math.log(3.0), math.log(0.5)]])
    advantages, mask = t([[1.0, -1.0, 2.0]]), torch.ones(1, 3, dtype=torch.float64)
    scale = LossScale.from_mask(mask, 3)
    loss, metrics = actor_loss(log_prob, behav, advantages, mask, scale, "token-mean", ClipRange(0.2),
                               bypass_is=("token", 2.0), loss_mode="reinforce")
    assert loss.item() == pytest.approx((1.5 * 1.0 + 2.0 * -2.0 * 1.0 + 0.5 * 2.0 * 0.7) / 3)
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, t([[-1.5 / 3, 2.0 / 3, -1.0 / 3]]))  # -A * w / 3: no gradient through w
    assert metrics["ppo_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(3.0) + math.log(0.5)) / 3)
    assert "pg_clipfrac" not in metrics
    # Without rollout_is: plain REINFORCE, -A * log pi.
    loss, _ = actor_loss(log_prob, behav, advantages, mask, scale, "token-mean", ClipRange(0.2), loss_mode="reinforce")
    assert loss.item() == pytest.approx((1.0 - 2.0 + 1.4) / 3)
    # Sequence level: one weight per sequence, min(1.5 * 3 * 0.5, 2) = 2 on every token.
    loss, _ = actor_loss(log_prob, behav, advantages, mask, scale, "token-mean", ClipRange(0.2),
                         bypass_is=("sequence", 2.0), loss_mode="reinforce")
    assert loss.item() == pytest.approx(2.0 * (1.0 - 2.0 + 1.4) / 3)


@pytest.mark.parametrize("args, key, message", [
    (("token_k4", 1.0, None, None), "rollout_rs", "expected one of token, sequence, geometric or a comma list"),
    (("token,token_k1", 1.0, None, None), "rollout_rs", "expected one of"),
    (("token_k1", None, None, None), "rollout_rs_threshold", "is required with rollout_rs='token_k1'"),
    (("token_k1,seq_mean_k3", "0.5_2,0.1,0.2", None, None), "rollout_rs_threshold", "3 specs for 2"),
    (("seq_mean_k3", "0.1_0.2", None, None), "rollout_rs_threshold", "takes one upper bound"),
    (("token_k1", "2.0_0.5", None, None), "rollout_rs_threshold", "lower bound above upper bound"),
    (("token_k1", "a_2", None, None), "rollout_rs_threshold", "'a': expected a number or lower_upper"),
    (("seq_max_k2", -1.0, None, None), "rollout_rs_threshold", "bounds must be > 0"),
    (("token", "0.5_2.0", None, None), "rollout_rs_threshold", "expected a number with rollout_rs='token'"),
    (("geometric", 1.01, 1.02, None), "rollout_rs_threshold_lower", "above rollout_rs_threshold"),
    (("token_k3", 0.1, 0.5, None), "rollout_rs_threshold_lower", "is only read with rollout_rs = token"),
    ((None, 2.0, None, None), "rollout_rs_threshold", "needs rollout_rs"),
])
def test_rejection_specs_refused_name_the_key(args, key, message):
    with pytest.raises(RejectionSpecError, match=message) as info:
        parse_rejection(*args)
    assert info.value.key == key and "\n" not in str(info.value)


def test_corrections_need_the_decoupled_anchor():
    old, rollout, mask = t([[-1.0]]), t([[-1.2]]), t([[1.0]])
    with pytest.raises(ValueError, match="no rejection sampling; got rollout_is=None, rejection set"):
        rollout_correction(old, rollout, mask, None, 2.0, False, rejection=rejection("token", 2.0))
    with pytest.raises(ValueError, match="rollout_is_batch_normalize=true normalises importance weights"):
        rollout_correction(old, rollout, mask, None, 2.0, True, rollout_is_batch_normalize=True)
    with pytest.raises(ValueError, match="rollout_log_probs when rollout_is or rejection sampling is set"):
        rollout_correction(old, None, mask, None, 2.0, True, rejection=rejection(None, None, veto=1e-4))
