"""verl's straight-through KL estimators (kl+/k1+, abs+, low_var_kl+/k3+): the named estimator's value with k2's
gradient, against values and derivatives written out here; NaN/inf padding never reaches the KL loss or its
gradient; the names are accepted by the config and reach the actor's loss options and the KL in the reward."""

import math
from typing import get_args

import pytest
import torch

from shardrl.algos import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    ClipRange,
    LossScale,
    actor_loss,
    aggregate_loss,
    apply_kl_penalty,
    kl_estimate,
)
from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.job.schema import KLEstimator

NAN, INF = math.nan, math.inf


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# r = log p - log q = [0.5, -0.3, 1.2, -25, 30]: ordinary tokens, then two beyond the +-20 bound of k3's log ratio.
LOG_P = [-1.0, -0.5, -2.0, -26.0, -1.0]
LOG_Q = [-1.5, -0.2, -3.2, -1.0, -31.0]
RATIOS = [p - q for p, q in zip(LOG_P, LOG_Q)]


def k3_by_hand(r: float) -> float:
    """q/p - log(q/p) - 1 with log(q/p) = -r clamped to [-20, 20] and the result to [-10, 10]."""
    x = min(max(-r, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def k3_gradient_by_hand(r: float) -> float:
    """d k3 / d log p = 1 - exp(-r) inside both clamps, 0 where either clamp holds."""
    x = -r
    return 1.0 - math.exp(x) if -20.0 <= x <= 20.0 and abs(math.exp(x) - x - 1.0) <= 10.0 else 0.0


# name -> (value of the estimator before the "+", gradient of that estimator itself), per log ratio r.
BASES = {
    "k1": (lambda r: r, lambda r: 1.0),
    "abs": (abs, lambda r: math.copysign(1.0, r)),
    "k3": (k3_by_hand, k3_gradient_by_hand),
}
PLUS = {"kl+": "k1", "k1+": "k1", "abs+": "abs", "low_var_kl+": "k3", "k3+": "k3"}


def value_and_gradient(kl_type: str, log_p: list[float] = LOG_P, log_q: list[float] = LOG_Q):
    log_prob = t([log_p]).requires_grad_()
    kl = kl_estimate(log_prob, t([log_q]), kl_type)
    kl.sum().backward()
    return kl.detach(), log_prob.grad


def test_hand_values_of_the_bases():
    # k3(0.5) = exp(-0.5) + 0.5 - 1; k3(-25): log(q/p) = 25 -> 20, exp(20) - 21 -> 10; k3(30): exp(-20) + 19 -> 10.
    expected = [0.1065306597, 0.0498588076, 0.5011942119, 10.0, 10.0]
    assert [k3_by_hand(r) for r in RATIOS] == pytest.approx(expected, abs=1e-9)
    assert k3_gradient_by_hand(0.5) == pytest.approx(1 - math.exp(-0.5))
    assert k3_gradient_by_hand(-25.0) == k3_gradient_by_hand(30.0) == 0.0


@pytest.mark.parametrize("kl_type", sorted(PLUS))
def test_plus_is_the_value_of_its_base_with_the_gradient_of_k2(kl_type):
    value_by_hand, _ = BASES[PLUS[kl_type]]
    value, grad = value_and_gradient(kl_type)
    torch.testing.assert_close(value, t([[value_by_hand(r) for r in RATIOS]]), rtol=0, atol=1e-12)
    # d/d log p of k2 = 0.5 * (log p - log q)^2 is log p - log q: unclamped, also where k3's value is clamped.
    torch.testing.assert_close(grad, t([RATIOS]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("base", sorted(BASES))
def test_bases_keep_their_own_gradient(base):
    value_by_hand, gradient_by_hand = BASES[base]
    value, grad = value_and_gradient(base)
    torch.testing.assert_close(value, t([[value_by_hand(r) for r in RATIOS]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, t([[gradient_by_hand(r) for r in RATIOS]]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_plus_values_are_bitwise_their_bases_and_k2_is_unchanged(dtype):
    gen = torch.Generator().manual_seed(0)
    log_prob = -torch.rand(4, 16, generator=gen, dtype=torch.float64).mul(30).to(dtype)
    ref = -torch.rand(4, 16, generator=gen, dtype=torch.float64).mul(30).to(dtype)
    for plus, base in [("kl+", "kl"), ("k1+", "k1"), ("abs+", "abs"), ("low_var_kl+", "low_var_kl"), ("k3+", "k3")]:
        assert torch.equal(kl_estimate(log_prob, ref, plus), kl_estimate(log_prob, ref, base)), plus
    # k2 as it was written before its gradient was guarded: 0.5 * r^2, gradient r, bit for bit.
    leaf = log_prob.clone().requires_grad_()
    kl_estimate(leaf, ref, "k2").sum().backward()
    assert torch.equal(kl_estimate(log_prob, ref, "mse"), 0.5 * (log_prob - ref).square())
    assert torch.equal(leaf.grad, log_prob - ref)


# Row 0: two valid tokens, NaN and +inf in the policy's padding. Row 1: one valid token, -inf/NaN/inf padding on both
# sides. Row 2: all masked, garbage everywhere. The clean batch holds zeros where the garbage was.
GARBAGE_P = [[-1.0, -0.5, NAN, INF], [-2.0, -INF, -0.1, NAN], [NAN, INF, -INF, 1e30]]
GARBAGE_Q = [[-1.5, -0.2, -1.0, -1.0], [-3.2, -1.0, -INF, INF], [-INF, NAN, INF, -1.0]]
MASK = [[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]


def masked_kl_loss(log_p, log_q, mask, kl_type, mode):
    log_prob, mask = t(log_p).requires_grad_(), t(mask)
    loss = aggregate_loss(kl_estimate(log_prob, t(log_q), kl_type), mask, mode, LossScale.from_mask(mask, 4))
    loss.backward()
    return loss.detach(), log_prob.grad


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("kl_type", KL_ESTIMATORS)
def test_nan_and_inf_padding_never_reach_the_kl_loss(kl_type, mode):
    loss, grad = masked_kl_loss(GARBAGE_P, GARBAGE_Q, MASK, kl_type, mode)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
    assert (grad[~t(MASK).bool()] == 0).all()
    clean = t(MASK).bool()
    clean_p = torch.where(clean, t(GARBAGE_P), 0.0).tolist()
    clean_q = torch.where(clean, t(GARBAGE_Q), 0.0).tolist()
    clean_loss, clean_grad = masked_kl_loss(clean_p, clean_q, MASK, kl_type, mode)
    assert torch.equal(loss, clean_loss) and torch.equal(grad, clean_grad)


@pytest.mark.parametrize("kl_type", KL_ESTIMATORS)
def test_an_all_masked_batch_gives_zero_loss_and_zero_gradient(kl_type):
    loss, grad = masked_kl_loss(GARBAGE_P, GARBAGE_Q, [[0] * 4] * 3, kl_type, "token-mean")
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros(3, 4, dtype=torch.float64))


def test_k3_plus_in_the_actor_loss_changes_the_kl_gradient_only():
    # token-mean over 3 tokens with coefficient 0.1: the KL term adds 0.1 * r / 3 to d loss / d log p under k3+,
    # 0.1 * (1 - exp(-r)) / 3 under k3; the loss value is the same.
    ratios = [0.5, -0.3, 1.2]
    mask = t([[1, 1, 1]])
    common = dict(old_log_prob=t([[-1.0, -1.0, -1.0]]), advantages=t([[1.0, -1.0, 0.5]]), response_mask=mask,
                  scale=LossScale.from_mask(mask, 3), loss_agg_mode="token-mean", clip=ClipRange(0.2),
                  ref_log_prob=t([[-1.0 - r for r in ratios]]))

    def loss_and_grad(kl_type, coef):
        log_prob = t([[-1.0, -1.0, -1.0]]).requires_grad_()
        loss, metrics = actor_loss(log_prob, **common, kl_loss_coef=coef, kl_loss_type=kl_type)
        loss.backward()
        return loss.detach(), log_prob.grad, metrics

    _, pg_grad, _ = loss_and_grad("k3", 0.0)
    loss_plus, grad_plus, metrics_plus = loss_and_grad("k3+", 0.1)
    loss_k3, grad_k3, metrics_k3 = loss_and_grad("k3", 0.1)
    assert torch.equal(loss_plus, loss_k3) and torch.equal(metrics_plus["kl_loss"], metrics_k3["kl_loss"])
    torch.testing.assert_close(grad_plus - pg_grad, t([[0.1 * r / 3 for r in ratios]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_k3 - pg_grad, t([[0.1 * (1 - math.exp(-r)) / 3 for r in ratios]]),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("plus, base", [("kl+", "kl"), ("k1+", "kl"), ("abs+", "abs"), ("k3+", "k3"),
                                        ("low_var_kl+", "low_var_kl")])
def test_kl_in_the_reward_takes_only_the_value(plus, base):
    scores = t([[0, 0, 1, 0], [0, 1, 0, 0]])
    old = t([[-1.0, -0.5, -2.0, NAN], [-1.0, -26.0, INF, 3.0]])
    ref = t([[-1.5, -0.2, -3.2, 0.0], [-2.0, -1.0, 0.0, -INF]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kl_penalty=plus)
    base_rewards, base_metrics = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kl_penalty=base)
    assert torch.equal(rewards, base_rewards) and torch.isfinite(rewards).all()
    assert all(torch.equal(metrics[k], base_metrics[k]) for k in base_metrics)


def test_the_schema_choices_are_the_estimators_kl_estimate_knows():
    assert sorted(get_args(KLEstimator)) == sorted(KL_ESTIMATORS)


def test_k3_plus_kl_loss_plans_and_reaches_the_actor_loss():
    plan = plan_job(compose("ppo_trainer", ["actor_rollout_ref.actor.kl_loss_type=k3+",
                                            "actor_rollout_ref.actor.use_kl_loss=true"]))
    assert plan.actor.loss.kl_loss_type == "k3+"
    assert plan.ref is not None and "ref" in plan.roles


def test_low_var_kl_plus_in_the_reward_plans():
    plan = plan_job(compose("ppo_trainer", ["algorithm.kl_penalty=low_var_kl+", "algorithm.use_kl_in_reward=true"]))
    assert plan.algorithm.kl_in_reward is not None and plan.algorithm.kl_in_reward.estimator == "low_var_kl+"


@pytest.mark.parametrize("override, key", [("actor_rollout_ref.actor.kl_loss_type=k2+",
                                            "actor_rollout_ref.actor.kl_loss_type"),
                                           ("algorithm.kl_penalty=k4+", "algorithm.kl_penalty")])
def test_unknown_plus_names_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        compose("ppo_trainer", [override])
    assert info.value.key == key and "k3+" in str(info.value)
