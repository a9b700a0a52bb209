"""KL estimators, KL in the reward and the KL controllers against hand-computed values."""

import pytest
import torch

from shardrl.algos import AdaptiveKLController, apply_kl_penalty, kl_estimate, make_kl_controller


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# log p = [-1.0, -0.5], log q = [-1.5, -0.2]: log p - log q = [0.5, -0.3]
LOG_P, LOG_Q = t([[-1.0, -0.5]]), t([[-1.5, -0.2]])


@pytest.mark.parametrize(
    "names, expected",
    [
        (("kl", "k1"), [[0.5, -0.3]]),
        (("abs",), [[0.5, 0.3]]),
        (("mse", "k2"), [[0.125, 0.045]]),  # 0.5 * 0.25, 0.5 * 0.09
        # exp(-0.5) + 0.5 - 1 = 0.1065306597; exp(0.3) - 0.3 - 1 = 0.0498588076
        (("low_var_kl", "k3"), [[0.1065306597, 0.0498588076]]),
    ],
)
def test_kl_estimators_by_hand(names, expected):
    for name in names:
        torch.testing.assert_close(kl_estimate(LOG_P, LOG_Q, name), t(expected))


def test_low_var_kl_is_clamped_to_ten():
    # log q - log p = 20: exp(20) - 21 is huge; = -30 (clamped to -20 first): exp(-20) + 19 ~ 19. Both clamp to 10.
    out = kl_estimate(t([[-25.0, -1.0, -1.0]]), t([[-5.0, -31.0, -1.0]]), "low_var_kl")
    torch.testing.assert_close(out, t([[10.0, 10.0, 0.0]]))


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="KL estimator 'k4'"):
        kl_estimate(LOG_P, LOG_Q, "k4")


def test_kl_penalty_in_reward_by_hand():
    # Row 1: k1 = [0.5, -0.3, 0] on 3 valid tokens -> rewards = scores - 0.1 * kl; sequence mean 0.2/3.
    # Row 2: k1 = [1, 0] on 2 valid tokens -> sequence mean 0.5. Batch KL = (0.2/3 + 0.5) / 2.
    scores = t([[0, 0, 1, 0], [0, 1, 0, 0]])
    old = t([[-1.0, -0.5, -2.0, 9.0], [-1.0, -1.0, 3.0, 3.0]])
    ref = t([[-1.5, -0.2, -2.0, 0.0], [-2.0, -1.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kl_penalty="kl")
    torch.testing.assert_close(rewards, t([[-0.05, 0.03, 1.0, 0.0], [-0.1, 1.0, 0.0, 0.0]]))
    assert metrics["reward_kl_penalty"].item() == pytest.approx(0.2833333333, abs=1e-9)
    assert metrics["reward_kl_penalty_coeff"].item() == pytest.approx(0.1)


def test_adaptive_controller_update_by_hand():
    # KL 0.08 vs target 0.05: error 0.6 clipped to 0.2 -> beta = 0.1 * (1 + 0.2 * 256 / 10000) = 0.100512.
    ctrl = make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.05, horizon=10000)
    ctrl.update(current_kl=0.08, n_steps=256)
    assert ctrl.value == pytest.approx(0.100512, abs=1e-12)
    # KL 0.045: error -0.1 (not clipped) -> beta = 0.1 * (1 - 0.1 * 256 / 10000) = 0.099744.
    ctrl = AdaptiveKLController(value=0.1, target_kl=0.05, horizon=10000)
    ctrl.update(current_kl=0.045, n_steps=256)
    assert ctrl.value == pytest.approx(0.099744, abs=1e-12)
    # KL 0 (far below): error clipped to -0.2 -> 0.1 * (1 - 0.2 * 256 / 10000) = 0.099488.
    ctrl.value = 0.1
    ctrl.update(current_kl=0.0, n_steps=256)
    assert ctrl.value == pytest.approx(0.099488, abs=1e-12)


def test_fixed_controller_keeps_beta_and_config_errors_name_keys():
    ctrl = make_kl_controller("fixed", kl_coef=0.001)
    ctrl.update(current_kl=5.0, n_steps=1000)
    assert ctrl.value == 0.001
    with pytest.raises(ValueError, match="kl_ctrl.type=adaptive needs target_kl > 0 and horizon > 0"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=None, horizon=10000)
    with pytest.raises(ValueError, match="kl_ctrl.type='linear' is not one of"):
        make_kl_controller("linear", kl_coef=0.1)
