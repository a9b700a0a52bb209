"""GPG, Pass@k GRPO, GDPO and the vectorised GRPO / RLOO advantages; the GPG, CISPO, SAPO, GMPO (geo_mean), DPPO
(dppo_tv, dppo_kl) and DRO surrogates (issue "RL maths").

Every expected value is computed here independently of shardrl.algos: by hand, or by a plain-Python transcription of
the paper's formula. Masked positions hold NaN / inf in every input; they must reach neither the loss, nor the
advantages of valid tokens, nor any gradient.
"""

import math
import statistics

import numpy as np
import pytest
import torch

from shardrl.algos import (
    AdvantageInputs,
    ClipRange,
    LossScale,
    actor_loss,
    aggregate_loss,
    cispo_loss,
    compute_advantage,
    dppo_kl_loss,
    dppo_tv_loss,
    dro_loss,
    geo_mean_loss,
    gdpo_reward_components,
    gpg_loss,
    ppo_clip_loss,
    sapo_loss,
)
from shardrl.algos.masked import masked_whiten

NAN, INF = math.nan, math.inf


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _per_token(values: list[float], mask: torch.Tensor) -> torch.Tensor:
    """What an outcome estimator must return: each row's value on its valid tokens, 0 elsewhere."""
    return torch.where(mask.bool(), t(values)[:, None], 0.0)


# Six responses of four tokens: groups a (rows 0-2), b (3-4), c (5). Row 0 has a hole, row 2 no valid token at all;
# every masked position holds garbage. Summed rewards over valid tokens: [1, 0, 0, 1, 1, 0.5].
MASK = t([[1, 1, 0, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
REWARDS = t([[0, 0, NAN, 1], [0, 0, 0, INF], [NAN, INF, -INF, NAN], [1, -INF, NAN, NAN],
             [0.25, 0.25, 0.25, 0.25], [0, 0.5, NAN, INF]])
INDEX = ["a", "a", "a", "b", "b", "c"]


def _inputs(**extra) -> AdvantageInputs:
    return AdvantageInputs(token_level_rewards=REWARDS, response_mask=MASK, index=INDEX, **extra)


def test_gpg_scales_centred_scores_by_batch_over_valid_samples():
    # Group a scores [1, 0, 0]: mean 1/3. Group b [1, 1] has no spread: M = 2 samples carry no gradient.
    # Group c is a single sample: raw score 0.5. alpha = B / (B - M) = 6 / 4 = 1.5. No std division.
    advantages, returns = compute_advantage("gpg", _inputs())
    expected = [1.5 * (1 - 1 / 3), 1.5 * (0 - 1 / 3), 0.0, 0.0, 0.0, 1.5 * 0.5]
    torch.testing.assert_close(advantages, _per_token(expected, MASK))
    assert torch.equal(advantages, returns)
    assert torch.isfinite(advantages).all() and (advantages[2] == 0).all()


def test_gpg_without_any_spread_gives_zero_advantages():
    rewards = torch.zeros(4, 2, dtype=torch.float64)
    rewards[:, 1] = 1.0
    inputs = AdvantageInputs(rewards, torch.ones(4, 2, dtype=torch.float64), index=["a", "a", "b", "b"])
    advantages, _ = compute_advantage("gpg", inputs)
    assert torch.equal(advantages, torch.zeros_like(advantages))


def _passk_reference(scores: list[float], groups: list[str], by_std: bool) -> list[float]:
    """Pass@k as verl states it: each group's best sample gets (max - second max) / (std + 1e-6), others 0."""
    out = [0.0] * len(scores)
    for g in dict.fromkeys(groups):
        members = [i for i, x in enumerate(groups) if x == g]
        ranked = sorted(members, key=lambda i: -scores[i])
        lead = scores[ranked[0]] - scores[ranked[1]]
        std = statistics.stdev([scores[i] for i in members])
        out[ranked[0]] = lead / (std + 1e-6) if by_std else lead
    return out


@pytest.mark.parametrize("by_std", [True, False])
def test_grpo_passk_rewards_only_each_groups_best(by_std):
    # Scores a: [0.2, 0.9, 0.5] (best row 1, runner-up 0.5), b: [1, 1] (a tie: 0), c: [0, 0, 1, 0].
    scores = [0.2, 0.9, 0.5, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    groups = ["a", "a", "a", "b", "b", "c", "c", "c", "c"]
    mask = torch.ones(9, 3, dtype=torch.float64)
    mask[1, 2] = 0.0  # a hole in the best response: its reward sits on a valid token
    rewards = torch.zeros(9, 3, dtype=torch.float64)
    rewards[:, 0] = t(scores)
    rewards[1, 2] = NAN
    advantages, _ = compute_advantage("grpo_passk", AdvantageInputs(rewards, mask, index=groups,
                                                                     norm_adv_by_std_in_grpo=by_std))
    torch.testing.assert_close(advantages, _per_token(_passk_reference(scores, groups, by_std), mask))
    assert advantages[1, 2] == 0.0


def test_grpo_passk_refuses_a_single_sample_group():
    with pytest.raises(ValueError, match="grpo_passk needs at least 2 samples per prompt"):
        compute_advantage("grpo_passk", _inputs())  # group c has one sample


def _gdpo_reference(components: list[list[float]], weights: list[float], groups: list[str],
                    mask: list[list[float]]) -> list[list[float]]:
    """GDPO (arXiv 2601.05242) transcribed: per component, (r - group mean) / (group std + 1e-6) (a one-sample
    group: mean 0, std 1, as verl's GRPO); the weighted sum; whitened over the batch's valid tokens (unbiased
    variance + 1e-8, verl's masked_whiten)."""
    total = [0.0] * len(groups)
    for weight, values in zip(weights, components):
        for g in dict.fromkeys(groups):
            members = [i for i, x in enumerate(groups) if x == g]
            own = [values[i] for i in members]
            mean, std = (0.0, 1.0) if len(own) == 1 else (statistics.mean(own), statistics.stdev(own))
            for i in members:
                total[i] += weight * (values[i] - mean) / (std + 1e-6)
    tokens = [total[b] for b, row in enumerate(mask) for m in row if m]
    mu = statistics.mean(tokens)
    var = sum((v - mu) ** 2 for v in tokens) / (len(tokens) - 1)
    return [[(total[b] - mu) / math.sqrt(var + 1e-8) if m else 0.0 for m in row] for b, row in enumerate(mask)]


def test_gdpo_normalises_each_reward_in_its_group_then_whitens():
    fmt = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    acc = [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    weights = [1.0, 2.0]
    # token_level_rewards are all NaN: gdpo reads the components only (as verl: neither the in-reward KL nor
    # overlong shaping enters).
    inputs = AdvantageInputs(token_level_rewards=torch.full_like(REWARDS, NAN), response_mask=MASK, index=INDEX,
                             reward_components=t([fmt, acc]), reward_weights=weights)
    advantages, returns = compute_advantage("gdpo", inputs)
    torch.testing.assert_close(advantages, t(_gdpo_reference([fmt, acc], weights, INDEX, MASK.tolist())))
    assert torch.equal(advantages, returns) and (advantages[2] == 0).all()


def test_gdpo_keeps_reward_combinations_that_grpo_merges():
    # The paper's Figure 2: two binary rewards, two rollouts. Summed totals [0, 2] and [0, 1] give GRPO the same
    # advantages; normalised reward by reward they differ.
    groups = ["p", "p", "q", "q"]
    fmt, acc = [0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0]  # totals p: [0, 2], q: [0, 1]
    mask = torch.ones(4, 1, dtype=torch.float64)
    summed = t([[f + a] for f, a in zip(fmt, acc)])
    grpo, _ = compute_advantage("grpo", AdvantageInputs(summed, mask, index=groups))
    gdpo, _ = compute_advantage("gdpo", AdvantageInputs(summed, mask, index=groups,
                                                         reward_components=t([fmt, acc])))
    torch.testing.assert_close(grpo[:2], grpo[2:], rtol=0, atol=1e-6)  # both: -1/sqrt(2), 1/sqrt(2) (up to eps)
    assert gdpo[1].item() > 1.5 * gdpo[3].item() > 0  # before whitening: sqrt(2) against 1/sqrt(2)
    # With a single component GDPO is GRPO whitened over the batch's tokens.
    one, _ = compute_advantage("gdpo", AdvantageInputs(summed, mask, index=groups, reward_components=summed.T))
    torch.testing.assert_close(one, masked_whiten(grpo, mask))


def test_gdpo_needs_its_components_and_one_weight_each():
    with pytest.raises(ValueError, match="adv_estimator=gdpo needs `reward_components"):
        compute_advantage("gdpo", _inputs())
    with pytest.raises(ValueError, match="gdpo: 1 reward weights for 2 reward components"):
        compute_advantage("gdpo", _inputs(reward_components=torch.zeros(2, 6, dtype=torch.float64),
                                          reward_weights=[1.0]))


def test_gdpo_reward_components_from_the_reward_extras():
    extras = {"fmt": [True, False, 1], "acc": np.array([np.int64(1), 0.5, np.float32(0.25)], dtype=object),
              "pred": ["7", None, "3"]}
    assert gdpo_reward_components(extras, ["acc", "fmt"], 3).tolist() == [[1.0, 0.5, 0.25], [1.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match=r"'format' is not a per-sample column of the batch "
                                         r"\(it has \['acc', 'fmt', 'pred'\]\)"):
        gdpo_reward_components(extras, ["format"], 3)
    with pytest.raises(ValueError, match="'pred' needs a finite number for every sample; sample 0 has '7'"):
        gdpo_reward_components(extras, ["pred"], 3)
    with pytest.raises(ValueError, match="sample 1 has nan"):
        gdpo_reward_components({"x": [1.0, NAN]}, ["x"], 2)


# --- surrogates -------------------------------------------------------------------------------------------------


def _log(ratios: list[float]) -> list[float]:
    return [math.log(r) for r in ratios]


def _with_garbage(valid: list[float], garbage: float) -> torch.Tensor:
    """One row: the valid values, then two masked positions holding garbage; a second row, all masked, all NaN."""
    return t([valid + [garbage, -garbage], [NAN] * (len(valid) + 2)])


def _mask(num_valid: int) -> torch.Tensor:
    return t([[1.0] * num_valid + [0.0, 0.0], [0.0] * (num_valid + 2)])


def test_gpg_loss_is_the_policy_gradient():
    # -A log pi with A = [2, -0.5], pi = [0.5, 0.25]: [2 ln 2, -ln 2]; token-mean (ln 2) / 2; dL/dlog pi = -A / 2.
    log_prob = _with_garbage(_log([0.5, 0.25]), INF).requires_grad_()
    old, advantages, mask = _with_garbage(_log([0.4, 0.25]), NAN), _with_garbage([2.0, -0.5], NAN), _mask(2)
    scale = LossScale.from_mask(mask, 4)
    per_token, metrics = gpg_loss(log_prob, old, advantages, mask, scale, ClipRange())
    torch.testing.assert_close(per_token[0, :2], t([2 * math.log(2), -math.log(2)]))
    assert metrics["ppo_kl"].item() == pytest.approx(-math.log(0.5 / 0.4) / 2, abs=1e-12)
    loss, metrics = actor_loss(log_prob, old, advantages, mask, scale, "token-mean", ClipRange(), loss_mode="gpg")
    assert loss.item() == pytest.approx(math.log(2) / 2, abs=1e-12)
    assert set(metrics) == {"ppo_kl", "pg_loss"}
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, t([[-1.0, 0.25, 0, 0], [0, 0, 0, 0]]))


CISPO_RATIOS, CISPO_ADV = [1.5, 0.5, 1.1, 0.05], [1.0, 1.0, -1.0, -1.0]


def _cispo(clip: ClipRange):
    log_prob = _with_garbage(_log(CISPO_RATIOS), NAN).requires_grad_()
    old, advantages, mask = torch.zeros_like(log_prob), _with_garbage(CISPO_ADV, INF), _mask(4)
    old[0, 4] = INF
    scale = LossScale.from_mask(mask, 6)
    per_token, metrics = cispo_loss(log_prob, old, advantages, mask, scale, clip)
    loss = aggregate_loss(per_token, mask, "token-mean", scale)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return per_token, metrics, grad, (log_prob, old, advantages, mask, scale)


def test_cispo_detaches_the_clipped_weight_and_keeps_every_tokens_gradient():
    # clip 0.2: w = sg(clip(r, 0.8, 1.2)) = [1.2, 0.8, 1.1, 0.8]; loss -w A log r; dL/dlog pi = -w A / 4.
    weights = [1.2, 0.8, 1.1, 0.8]
    per_token, metrics, grad, args = _cispo(ClipRange(0.2))
    expected = [-w * a * math.log(r) for w, a, r in zip(weights, CISPO_ADV, CISPO_RATIOS)]
    torch.testing.assert_close(per_token[0, :4], t(expected))
    torch.testing.assert_close(grad, t([[-w * a / 4 for w, a in zip(weights, CISPO_ADV)] + [0, 0], [0] * 6]))
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.75)  # r = 1.5, 0.5, 0.05 clipped
    # PPO drops the gradient of its clipped tokens (r = 1.5 with A > 0, r = 0.05 with A < 0); CISPO keeps all four.
    ppo, _ = ppo_clip_loss(*args, ClipRange(0.2))
    (ppo_grad,) = torch.autograd.grad(aggregate_loss(ppo, args[3], "token-mean", args[4]), args[0])
    assert ppo_grad[0, 0] == 0 and ppo_grad[0, 3] == 0 and (grad[0, :4] != 0).all()


def test_cispo_with_low_at_least_one_has_no_lower_bound():
    # verl's CISPO example: clip_ratio_low=10, clip_ratio_high=0.2; w = [1.2, 0.5, 1.1, 0.05].
    _, metrics, grad, _ = _cispo(ClipRange(0.2, clip_ratio_low=10.0, clip_ratio_high=0.2, weight_clip=True))
    torch.testing.assert_close(grad[0, :4], t([-1.2 / 4, -0.5 / 4, 1.1 / 4, 0.05 / 4]))
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="0 <= clip_ratio_low < 1"):
        ClipRange(0.2, clip_ratio_low=10.0)  # a trust region needs its lower bound


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_sapo_soft_gate_by_formula():
    # Row 0: r = [1, 1.5, 0.5], A = [1, 1, -1]; row 1: r = 2, A = -1; tau_pos = 1, tau_neg = 2.
    # f(r) = sigmoid(tau (r - 1)) * 4 / tau; loss per token -f(r) A; aggregated seq-mean-token-mean (always).
    # dL/dlog pi = -A * 4 s (1 - s) * r / (L_i * 2 sequences), s = sigmoid(tau (r - 1)).
    ratios, adv, taus, lengths = [1.0, 1.5, 0.5, 2.0], [1.0, 1.0, -1.0, -1.0], [1.0, 1.0, 2.0, 2.0], [3, 3, 3, 1]
    log_prob = t([_log(ratios[:3]) + [NAN], [math.log(2.0), INF, NAN, NAN]]).requires_grad_()
    old = t([[0, 0, 0, INF], [0, NAN, 0, 0]])
    advantages = t([adv[:3] + [NAN], [-1.0, INF, NAN, 0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    scale = LossScale.from_mask(mask, 4)
    clip = ClipRange(0.2, tau_pos=1.0, tau_neg=2.0)
    gates = [_sigmoid(tau * (r - 1)) * 4 / tau for r, tau in zip(ratios, taus)]
    per_token, metrics = sapo_loss(log_prob, old, advantages, mask, scale, clip)
    torch.testing.assert_close(per_token[mask.bool()], t([-g * a for g, a in zip(gates, adv)]))
    assert set(metrics) == {"ppo_kl"}
    expected_loss = (sum(-g * a for g, a in zip(gates[:3], adv[:3])) / 3 + -gates[3] * adv[3]) / 2
    for agg in ("token-mean", "seq-mean-token-sum"):  # verl: sapo's term ignores loss_agg_mode
        loss, _ = actor_loss(log_prob, old, advantages, mask, scale, agg, clip, loss_mode="sapo")
        assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, log_prob)
    slopes = [4 * _sigmoid(tau * (r - 1)) * (1 - _sigmoid(tau * (r - 1))) * r for r, tau in zip(ratios, taus)]
    expected_grad = [-a * s / (n * 2) for a, s, n in zip(adv, slopes, lengths)]
    torch.testing.assert_close(grad[mask.bool()], t(expected_grad))
    assert grad[~mask.bool()].eq(0).all()
    assert expected_grad[0] == pytest.approx(-1 / 6)  # at r = 1 the gate's slope is 1: the policy gradient


def test_new_surrogates_on_an_all_masked_batch_give_zero():
    log_prob = t([[NAN, INF], [-INF, NAN]]).requires_grad_()
    mask = torch.zeros(2, 2, dtype=torch.float64)
    scale = LossScale.from_mask(mask, 2)
    for mode in ("gpg", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "dro"):
        loss, metrics = actor_loss(log_prob, t([[INF, NAN], [0, 0]]), t([[NAN, 1], [INF, 0]]), mask, scale,
                                   "token-mean", ClipRange(dro_beta=0.5), loss_mode=mode)
        (grad,) = torch.autograd.grad(loss, log_prob)
        assert loss.item() == 0.0 and grad.eq(0).all(), mode
        assert all(torch.isfinite(v) for v in metrics.values()), mode


def test_clip_range_refuses_non_positive_sapo_temperatures():
    with pytest.raises(ValueError, match="tau_pos and tau_neg must be > 0"):
        ClipRange(tau_neg=0.0)


def test_vectorised_grpo_is_grpo_and_vectorised_rloo_zeroes_one_sample_groups():
    """verl's *_vectorized estimators: GRPO's is the same maths; RLOO's gives a one-sample group 0, not its score.
    Groups a = rows 0-2 with scores [1, 0, 0], b = [1, 1], c = [0.5] alone."""
    for by_std in (True, False):
        inputs = _inputs(norm_adv_by_std_in_grpo=by_std)
        torch.testing.assert_close(compute_advantage("grpo_vectorized", inputs), compute_advantage("grpo", inputs))
    rloo, _ = compute_advantage("rloo", _inputs())
    vectorised, _ = compute_advantage("rloo_vectorized", _inputs())
    # leave-one-out: s - mean of the others; a: [1 - 0, 0 - 0.5, 0 - 0.5], b: [0, 0]
    torch.testing.assert_close(vectorised, _per_token([1.0, -0.5, -0.5, 0.0, 0.0, 0.0], MASK))
    torch.testing.assert_close(rloo, _per_token([1.0, -0.5, -0.5, 0.0, 0.0, 0.5], MASK))


# GMPO: row 0 has ratios [1.5, 0.5, 1.1] with A = 1 (the sequence-level advantage on each token), row 1 ratios
# [0.5, 3.0] with A = -2; clip 0.2 on the log ratio.
GEO_RATIOS, GEO_ADV = [[1.5, 0.5, 1.1], [0.5, 3.0]], [1.0, -2.0]


def _geo_inputs():
    log_prob = t([_log(GEO_RATIOS[0]) + [NAN], _log(GEO_RATIOS[1]) + [INF, NAN]]).requires_grad_()
    old = t([[0, 0, 0, INF], [0, 0, NAN, 0]])
    advantages = t([[1, 1, 1, NAN], [-2, -2, INF, 0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    return log_prob, old, advantages, mask, LossScale.from_mask(mask, 4)


def test_geo_mean_is_the_advantage_times_the_geometric_mean_of_the_side_clipped_ratios():
    """Per sequence -A exp(mean_t x_t), x_t = min(log r, 0.2) where A > 0, max(log r, -0.2) where A < 0; the term is
    a mean over sequences whatever loss_agg_mode; d/d log pi_t = -A s_i / L_i / 2 on unclipped tokens, 0 on
    clipped ones."""
    log_prob, old, advantages, mask, scale = _geo_inputs()
    clipped = [[min(math.log(r), 0.2) for r in GEO_RATIOS[0]], [max(math.log(r), -0.2) for r in GEO_RATIOS[1]]]
    ratios = [math.exp(sum(x) / len(x)) for x in clipped]
    expected = [-a * s for a, s in zip(GEO_ADV, ratios)]
    per_token, metrics = geo_mean_loss(log_prob, old, advantages, mask, scale, ClipRange(0.2))
    torch.testing.assert_close(per_token[mask.bool()], t([expected[0]] * 3 + [expected[1]] * 2))
    # As verl's, the fractions count the tokens outside [-0.2, 0.2] by their advantage's sign, clipped or not: row 0
    # (A > 0) has r = 1.5 (clipped) and 0.5 (outside, below: not clipped), row 1 (A < 0) r = 0.5 (clipped) and 3.0.
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(2 / 5)
    for agg in ("token-mean", "seq-mean-token-sum"):
        loss, _ = actor_loss(log_prob, old, advantages, mask, scale, agg, ClipRange(0.2), loss_mode="geo_mean")
        assert loss.item() == pytest.approx(sum(expected) / 2, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, log_prob)
    free = [[False, True, True], [False, True]]  # the clipped tokens' log ratio is a constant
    expected_grad = [-a * s / len(f) / 2 * unclipped for a, s, f in zip(GEO_ADV, ratios, free) for unclipped in f]
    torch.testing.assert_close(grad[mask.bool()], t(expected_grad))
    assert grad[~mask.bool()].eq(0).all()


def test_geo_mean_weighs_a_sequence_by_the_geometric_mean_of_its_token_weights():
    log_prob, old, advantages, mask, scale = _geo_inputs()
    weights = t([[0.5, 2.0, 4.0, NAN], [0.25, 1.0, INF, 0]])
    plain, _ = actor_loss(log_prob, old, advantages, mask, scale, "token-mean", ClipRange(0.2), loss_mode="geo_mean")
    per_sequence, _ = geo_mean_loss(log_prob, old, advantages, mask, scale, ClipRange(0.2))
    weighted, _ = actor_loss(log_prob, old, advantages, mask, scale, "token-mean", ClipRange(0.2),
                             is_weights=weights, loss_mode="geo_mean")
    geometric = [(0.5 * 2.0 * 4.0) ** (1 / 3), (0.25 * 1.0) ** (1 / 2)]
    expected = (per_sequence[0, 0] * geometric[0] + per_sequence[1, 0] * geometric[1]) / 2
    # (verl's log(w + 1e-10) moves the product by ~1e-9)
    assert weighted.item() == pytest.approx(expected.item(), rel=1e-8) and weighted.item() != plain.item()


# DPPO: p_old = [0.5, 0.5, 0.5, 0.9] and p = [0.8, 0.6, 0.2, 0.3]; A = [1, 1, -1, -1]; clip 0.2, clip_ratio_c 1.5.
DPPO_OLD, DPPO_NEW, DPPO_ADV = [0.5, 0.5, 0.5, 0.9], [0.8, 0.6, 0.2, 0.3], [1.0, 1.0, -1.0, -1.0]


def _bernoulli_kl(p_old: float, p: float) -> float:
    return p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_dppo_keeps_the_truncated_policy_gradient_inside_its_probability_trust_region(mode):
    """Per token -A sg(min(r, c)) log pi inside the region, 0 outside (no gradient); TV: p - p_old <= 0.2 for A > 0,
    >= -0.2 for A < 0; KL: Bernoulli KL(p_old || p) <= 0.2, or a move against A."""
    log_prob = _with_garbage(_log(DPPO_NEW), NAN).requires_grad_()
    old, advantages, mask = _with_garbage(_log(DPPO_OLD), INF), _with_garbage(DPPO_ADV, NAN), _mask(4)
    scale = LossScale.from_mask(mask, 6)
    clip = ClipRange(0.2, clip_ratio_c=1.5)
    if mode == "dppo_tv":
        inside = [p - q <= 0.2 if a > 0 else p - q >= -0.2 for q, p, a in zip(DPPO_OLD, DPPO_NEW, DPPO_ADV)]
    else:
        inside = [_bernoulli_kl(q, p) <= 0.2 or (p <= q if a > 0 else p >= q)
                  for q, p, a in zip(DPPO_OLD, DPPO_NEW, DPPO_ADV)]
    assert inside == ([False, True, False, False] if mode == "dppo_tv" else [False, True, False, False])
    weights = [min(p / q, 1.5) for q, p in zip(DPPO_OLD, DPPO_NEW)]
    fn = dppo_tv_loss if mode == "dppo_tv" else dppo_kl_loss
    per_token, metrics = fn(log_prob, old, torch.where(mask.bool(), advantages, 0.0), mask, scale, clip)
    expected = [-a * w * math.log(p) * k for a, w, p, k in zip(DPPO_ADV, weights, DPPO_NEW, inside)]
    torch.testing.assert_close(per_token[0, :4], t(expected))
    assert metrics["pg_clipfrac"].item() == pytest.approx(3 / 4)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.0)  # the one token inside has r = 1.2 < 1.5
    loss, _ = actor_loss(log_prob, old, advantages, mask, scale, "token-mean", clip, loss_mode=mode)
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, t([[-a * w * k / 4 for a, w, k in zip(DPPO_ADV, weights, inside)] + [0, 0],
                                        [0] * 6]))


def test_dppo_regions_differ_where_the_binary_kl_allows_a_large_move_of_a_likely_token():
    """p_old 0.95 -> p 0.99 with A > 0: TV moves 0.04 (inside 0.2) and the Bernoulli KL is 0.014 (inside); p_old 0.3
    -> p 0.55: TV 0.25 (outside), KL 0.13 (inside): DPPO-KL keeps it, DPPO-TV drops it."""
    old, new = [0.95, 0.3], [0.99, 0.55]
    assert _bernoulli_kl(0.3, 0.55) < 0.2 < 0.55 - 0.3
    log_prob = _with_garbage(_log(new), NAN)
    old_lp, advantages, mask = _with_garbage(_log(old), NAN), _with_garbage([1.0, 1.0], NAN), _mask(2)
    scale = LossScale.from_mask(mask, 4)
    advantages = torch.where(mask.bool(), advantages, 0.0)
    tv, _ = dppo_tv_loss(log_prob, old_lp, advantages, mask, scale, ClipRange(0.2, clip_ratio_c=20.0))
    kl, _ = dppo_kl_loss(log_prob, old_lp, advantages, mask, scale, ClipRange(0.2, clip_ratio_c=20.0))
    assert tv[0, 0] != 0 and tv[0, 1] == 0 and kl[0, 0] != 0 and kl[0, 1] != 0


def test_dro_is_the_policy_gradient_with_a_quadratic_log_ratio_penalty():
    """Per token -(A log pi - beta / 2 (log r)^2), beta 0.5; d/d log pi = -A + beta log r."""
    ratios, adv = [1.5, 0.5, 1.0], [1.0, -2.0, 0.5]
    log_prob = _with_garbage([math.log(0.3 * r) for r in ratios], NAN).requires_grad_()
    old, advantages, mask = _with_garbage([math.log(0.3)] * 3, INF), _with_garbage(adv, NAN), _mask(3)
    scale = LossScale.from_mask(mask, 5)
    per_token, metrics = dro_loss(log_prob, old, torch.where(mask.bool(), advantages, 0.0), mask, scale,
                                  ClipRange(dro_beta=0.5))
    expected = [-(a * math.log(0.3 * r) - 0.25 * math.log(r) ** 2) for r, a in zip(ratios, adv)]
    torch.testing.assert_close(per_token[0, :3], t(expected))
    loss, _ = actor_loss(log_prob, old, advantages, mask, scale, "token-mean", ClipRange(dro_beta=0.5),
                         loss_mode="dro")
    (grad,) = torch.autograd.grad(loss, log_prob)
    torch.testing.assert_close(grad, t([[(-a + 0.5 * math.log(r)) / 3 for r, a in zip(ratios, adv)] + [0, 0],
                                        [0] * 5]))
    with pytest.raises(ValueError, match="needs actor.policy_loss.dro_beta"):
        dro_loss(log_prob, old, advantages, mask, scale, ClipRange())
    with pytest.raises(ValueError, match="dro_beta must be > 0"):
        ClipRange(dro_beta=0.0)



def _otb_reference(rewards, mask, index, old_log_probs, sum_pi_squared, is_weights=None):
    """verl's optimal token baseline transcribed loop by loop in plain Python."""
    rows, width = len(rewards), len(rewards[0])
    returns = [[sum(rewards[i][j] * mask[i][j] for j in range(t, width)) for t in range(width)] for i in range(rows)]
    cumulative = []
    for i in range(rows):
        total, row = 0.0, []
        for t in range(width):
            w = 1 - 2 * math.exp(old_log_probs[i][t]) + sum_pi_squared[i][t]
            if is_weights is not None:
                w *= is_weights[i][t] ** 2
            total += w * mask[i][t]
            row.append(total)
        cumulative.append(row)
    baselines = [[0.0] * width for _ in range(rows)]
    for group in dict.fromkeys(index):
        members = [i for i in range(rows) if index[i] == group]
        if len(members) == 1:
            continue
        for t in range(width):
            num = sum(returns[i][t] * cumulative[i][t] * mask[i][t] for i in members)
            den = sum(cumulative[i][t] * mask[i][t] for i in members) + 1e-8
            for i in members:
                baselines[i][t] = num / den
        lengths = sorted(sum(mask[i]) for i in members)
        longest = [i for i in members if sum(mask[i]) == lengths[-1]]
        if len(longest) == 1 and lengths[-1] > lengths[-2]:
            for t in range(int(lengths[-2]), width):
                baselines[longest[0]][t] = 0.0
    return [[(returns[i][t] - baselines[i][t]) * mask[i][t] for t in range(width)] for i in range(rows)]


def test_optimal_token_baseline_matches_verls_loops():
    """Groups: a = rows 0-2 (lengths 2, 4, 3: row 1 alone is the longest, so past length 3 its baseline is 0),
    b = rows 3-4 (lengths 4 and 4), c = row 5 alone (baseline 0); token rewards anywhere in the response."""
    g = torch.Generator().manual_seed(0)
    mask = t([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
    rewards = torch.rand(6, 4, generator=g, dtype=torch.float64)
    old_log_probs = -torch.rand(6, 4, generator=g, dtype=torch.float64) * 3
    sum_pi_squared = torch.rand(6, 4, generator=g, dtype=torch.float64) * 0.5
    index = ["a", "a", "a", "b", "b", "c"]
    weights = torch.rand(6, 4, generator=g, dtype=torch.float64) + 0.5
    for is_weights in (None, weights):
        expected = _otb_reference(rewards.tolist(), mask.tolist(), index, old_log_probs.tolist(),
                                  sum_pi_squared.tolist(), None if is_weights is None else is_weights.tolist())
        garbage = torch.where(mask.bool(), rewards, NAN)  # padding holds NaN: it must reach nothing
        inputs = AdvantageInputs(token_level_rewards=garbage, response_mask=mask, index=index,
                                 old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared, is_weights=is_weights)
        advantages, returns = compute_advantage("optimal_token_baseline", inputs)
        torch.testing.assert_close(advantages, t(expected))
        assert advantages[1, 3] == returns[1, 3] != 0  # the lone tail keeps its whole return
        torch.testing.assert_close(advantages[5], returns[5])  # alone in its group: baseline 0
    with pytest.raises(ValueError, match="sum_pi_squared"):
        compute_advantage("optimal_token_baseline", AdvantageInputs(garbage, mask, index=index,
                                                                    old_log_probs=old_log_probs))


def _tir_otb_reference(rewards, mask, index, old_log_probs, sum_pi_squared, is_weights=None):
    """verl's tool-integrated optimal token baseline, loop by loop: the OTB of the rows' valid tokens moved left
    (compared at the k-th generated token), moved back to their response positions; empty rows have no group."""
    rows, width = len(rewards), len(rewards[0])
    keep = [[t for t in range(width) if mask[i][t]] for i in range(rows)]
    wide = max(len(k) for k in keep)
    returns = [[sum(rewards[i][j] * mask[i][j] for j in range(t, width)) for t in range(width)] for i in range(rows)]

    def compact(values):
        return [[values[i][t] for t in keep[i]] + [0.0] * (wide - len(keep[i])) for i in range(rows)]

    compact_returns = compact(returns)
    cumulative = []
    for i in range(rows):
        total, row = 0.0, []
        for k in range(wide):
            if k < len(keep[i]):
                t = keep[i][k]
                w = 1 - 2 * math.exp(old_log_probs[i][t]) + sum_pi_squared[i][t]
                if is_weights is not None:
                    w *= is_weights[i][t] ** 2
                total += w
            row.append(total if k < len(keep[i]) else 0.0)
        cumulative.append(row)
    baselines = [[0.0] * wide for _ in range(rows)]
    for group in dict.fromkeys(index):
        group_rows = [i for i in range(rows) if index[i] == group and keep[i]]
        if len(group_rows) < 2:
            continue
        for k in range(wide):
            num = sum(compact_returns[i][k] * cumulative[i][k] for i in group_rows)
            den = sum(cumulative[i][k] for i in group_rows) + 1e-8
            for i in group_rows:
                baselines[i][k] = num / den
        lengths = sorted(len(keep[i]) for i in group_rows)
        longest = [i for i in group_rows if len(keep[i]) == lengths[-1]]
        if len(longest) == 1 and lengths[-1] > lengths[-2]:
            for k in range(lengths[-2], wide):
                baselines[longest[0]][k] = 0.0
    out = [[0.0] * width for _ in range(rows)]
    for i in range(rows):
        for k, t in enumerate(keep[i]):
            out[i][t] = compact_returns[i][k] - baselines[i][k]
    return out


def test_tir_optimal_token_baseline_compares_the_kth_generated_tokens():
    """Multi-turn masks (tool outputs masked inside the response): rows 0-2 share a prompt and generate their
    tokens at different response positions, so the TIR baseline at each row's k-th valid token differs from OTB's
    at the same position; row 3 is empty (it has no group), row 4 is its group's only non-empty row (baseline 0).
    On single-turn masks (valid tokens a prefix) both estimators agree exactly."""
    g = torch.Generator().manual_seed(1)
    mask = t([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 1], [1, 1, 1, 0, 1, 0], [0] * 6, [1, 0, 1, 0, 0, 0]])
    rewards = torch.rand(5, 6, generator=g, dtype=torch.float64)
    old_log_probs = -torch.rand(5, 6, generator=g, dtype=torch.float64) * 3
    sum_pi_squared = torch.rand(5, 6, generator=g, dtype=torch.float64) * 0.5
    weights = torch.rand(5, 6, generator=g, dtype=torch.float64) + 0.5
    index = ["a", "a", "a", "b", "b"]
    for is_weights in (None, weights):
        expected = _tir_otb_reference(rewards.tolist(), mask.tolist(), index, old_log_probs.tolist(),
                                      sum_pi_squared.tolist(), None if is_weights is None else is_weights.tolist())
        inputs = AdvantageInputs(token_level_rewards=torch.where(mask.bool(), rewards, NAN), response_mask=mask,
                                 index=index, old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared,
                                 is_weights=is_weights)
        advantages, returns = compute_advantage("tir_optimal_token_baseline", inputs)
        torch.testing.assert_close(advantages, t(expected))
        otb, otb_returns = compute_advantage("optimal_token_baseline", inputs)
        torch.testing.assert_close(returns, otb_returns)
        assert (advantages - otb).abs().max() > 1e-3  # the positions it compares differ
        torch.testing.assert_close(advantages[4], returns[4] * mask[4])  # no other non-empty row in its group
    prefix = t([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]])
    inputs = AdvantageInputs(token_level_rewards=rewards, response_mask=prefix, index=index,
                             old_log_probs=old_log_probs, sum_pi_squared=sum_pi_squared)
    torch.testing.assert_close(compute_advantage("tir_optimal_token_baseline", inputs)[0],
                               compute_advantage("optimal_token_baseline", inputs)[0], rtol=0, atol=0)
