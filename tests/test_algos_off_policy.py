"""Off-policy correction: truncated IS weights (token, sequence), decoupled PPO, bypass, metrics, refusals."""

import math

import pytest
import torch

from shardrl.algos import ClipRange, LossScale, actor_loss, rollout_correction


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
        ("o", None, None, False, "needs rollout_log_probs and rollout_is=null"),
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
