"""Advantage estimators against hand-computed values, loop references, masking, and the registry's refusal."""

import numpy as np
import pytest
import torch

from shardrl.algos import AdvantageInputs, compute_advantage, register_adv_estimator
from shardrl.algos.gae import discounted_returns, gae_advantages_returns
from shardrl.algos.masked import masked_whiten

ESTIMATORS = ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo"]


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_length3_by_hand():
    # gamma=0.9, lam=0.8, r=[0,0,1], V=[0.5,0.4,0.6]:
    # delta2 = 1 - 0.6 = 0.4; delta1 = 0.9*0.6 - 0.4 = 0.14; delta0 = 0.9*0.4 - 0.5 = -0.14
    # A2 = 0.4; A1 = 0.14 + 0.72*0.4 = 0.428; A0 = -0.14 + 0.72*0.428 = 0.16816; returns = A + V
    adv, ret = gae_advantages_returns(t([[0, 0, 1]]), t([[0.5, 0.4, 0.6]]), t([[1, 1, 1]]), 0.9, 0.8)
    torch.testing.assert_close(adv, t([[0.16816, 0.428, 0.4]]))
    torch.testing.assert_close(ret, t([[0.66816, 0.828, 1.0]]))


def test_gae_skips_masked_hole_and_padding():
    # The same three valid tokens with a tool-output hole at position 1 and right padding at 4; garbage there.
    rewards = t([[0, 5.0, 0, 1, 7.0]])
    values = t([[0.5, 9.0, 0.4, 0.6, -3.0]])
    mask = t([[1, 0, 1, 1, 0]])
    adv, ret = gae_advantages_returns(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, t([[0.16816, 0, 0.428, 0.4, 0]]))
    torch.testing.assert_close(ret, t([[0.66816, 0, 0.828, 1.0, 0]]))


def test_gae_estimator_whitens_over_batch_by_hand():
    # Row 1 as above; row 2: r=[0,2], V=[1,0.5] -> A=[-0.55+0.72*1.5, 1.5] = [0.53, 1.5], returns [1.53, 2.0].
    # Whitening over the 5 valid advantages (unbiased std) was computed by hand (plain arithmetic).
    inputs = AdvantageInputs(
        token_level_rewards=t([[0, 0, 1], [0, 2, 0]]),
        response_mask=t([[1, 1, 1], [1, 1, 0]]),
        values=t([[0.5, 0.4, 0.6], [1.0, 0.5, 0.0]]),
        gamma=0.9,
        lam=0.8,
    )
    adv, ret = compute_advantage("gae", inputs)
    torch.testing.assert_close(
        adv, t([[-0.8447381663, -0.3425399813, -0.3966561650], [-0.1454024548, 1.7293367674, 0]]), atol=1e-7, rtol=0
    )
    torch.testing.assert_close(ret, t([[0.66816, 0.828, 1.0], [1.53, 2.0, 0]]))


def test_masked_whiten_by_hand():
    # [1,2,3,4]: mean 2.5, unbiased var 5/3; the masked 100 must not count.
    out = masked_whiten(t([[1, 2, 100, 3, 4]]), t([[1, 1, 0, 1, 1]]))
    torch.testing.assert_close(out, t([[-1.1618950004, -0.3872983335, 0, 0.3872983335, 1.1618950004]]))


def _loop_gae(rewards, values, mask, gamma, lam):
    """Plain per-sample, per-token reference: walk backwards over valid tokens only."""
    adv = [[0.0] * len(row) for row in rewards]
    ret = [[0.0] * len(row) for row in rewards]
    for b in range(len(rewards)):
        next_value, last = 0.0, 0.0
        for i in reversed(range(len(rewards[b]))):
            if not mask[b][i]:
                continue
            delta = rewards[b][i] + gamma * next_value - values[b][i]
            last = delta + gamma * lam * last
            adv[b][i], ret[b][i] = last, last + values[b][i]
            next_value = values[b][i]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def _random_mask(gen: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """Ragged rows (right padding) with random holes, one empty row, one full row."""
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0], lengths[1] = 0, length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    holes = torch.rand(batch, length, generator=gen) < 0.2
    return torch.where(holes, 0.0, mask)


@pytest.mark.parametrize("gamma, lam", [(0.9, 0.8), (1.0, 1.0), (0.99, 0.95), (0.0, 0.5)])
def test_gae_vectorised_matches_loop_reference_across_chunks(gamma, lam):
    gen = torch.Generator().manual_seed(0)
    batch, length = 6, 150  # 150 tokens span three scan chunks of 64
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = _random_mask(gen, batch, length)
    adv, ret = gae_advantages_returns(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = _loop_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    # lam = 1: GAE returns are the discounted returns (the values telescope away).
    if lam == 1.0:
        torch.testing.assert_close(ret, discounted_returns(rewards, mask, gamma))


def test_gae_float32_long_sequence_matches_reference():
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(2, 1000, generator=gen)
    values = torch.randn(2, 1000, generator=gen)
    mask = torch.ones(2, 1000)
    adv, _ = gae_advantages_returns(rewards, values, mask, 0.999, 0.99)
    ref_adv, _ = _loop_gae(rewards.double().tolist(), values.double().tolist(), mask.tolist(), 0.999, 0.99)
    torch.testing.assert_close(adv.double(), ref_adv, atol=1e-4, rtol=1e-4)


def _outcome_inputs(**kwargs) -> AdvantageInputs:
    # Group "a": three samples scoring 1, 0, 1 with 3, 2, 2 valid tokens; group "b": one sample scoring 2.
    rewards = t([[0, 0, 1], [0, 0, 0], [0.5, 0.5, 9.0], [2.0, 0, 0]])  # 9.0 sits on a masked token
    mask = t([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]])
    return AdvantageInputs(rewards, mask, index=np.array(["a", "a", "a", "b"], dtype=object), **kwargs)


def _expand(per_seq: list[float]) -> torch.Tensor:
    mask = t([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]])
    return mask * t([per_seq]).T


def test_grpo_by_hand():
    # Group a: mean 2/3, unbiased std sqrt(1/3) = 0.5773502692: (1-2/3)/(std+1e-6), (0-2/3)/(std+1e-6).
    # Group b has one sample: baseline 0, scale 1 -> 2 / (1 + 1e-6).
    adv, ret = compute_advantage("grpo", _outcome_inputs())
    torch.testing.assert_close(adv, _expand([0.5773492692, -1.1546985384, 0.5773492692, 1.999998000002]))
    assert torch.equal(adv, ret)


def test_grpo_without_std_normalisation_by_hand():
    adv, _ = compute_advantage("grpo", _outcome_inputs(norm_adv_by_std_in_grpo=False))
    torch.testing.assert_close(adv, _expand([1 / 3, -2 / 3, 1 / 3, 2.0]))


def test_rloo_by_hand():
    # Leave one out: 1 - (0+1)/2 = 0.5; 0 - (1+1)/2 = -1; a single sample keeps its score.
    adv, _ = compute_advantage("rloo", _outcome_inputs())
    torch.testing.assert_close(adv, _expand([0.5, -1.0, 0.5, 2.0]))


def test_opo_by_hand():
    # Length-weighted baseline of group a: (3*1 + 2*0 + 2*1) / 7 = 5/7.
    adv, _ = compute_advantage("opo", _outcome_inputs())
    torch.testing.assert_close(adv, _expand([2 / 7, -5 / 7, 2 / 7, 2.0]))


def test_reinforce_plus_plus_baseline_by_hand():
    # Centred scores 1/3, -2/3, 1/3 (group a) and 2 (single) on 3+2+2+1 tokens, whitened over those 8 tokens.
    adv, ret = compute_advantage("reinforce_plus_plus_baseline", _outcome_inputs())
    pos, neg, single = 0.0505076269, -1.1616754177, 2.0708127011
    torch.testing.assert_close(adv, t([[pos, pos, pos], [neg, neg, 0], [pos, pos, 0], [single, 0, 0]]))
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_by_hand():
    # gamma=0.5: returns [0.25, 0.5, 1] and [1, 2]; whitened over the 5 valid tokens (mean 0.95, var 0.45).
    inputs = AdvantageInputs(t([[0, 0, 1], [0, 2, 3.0]]), t([[1, 1, 1], [1, 1, 0]]), gamma=0.5)
    adv, ret = compute_advantage("reinforce_plus_plus", inputs)
    torch.testing.assert_close(ret, t([[0.25, 0.5, 1.0], [1.0, 2.0, 0]]))
    torch.testing.assert_close(
        adv, t([[-1.0434983779, -0.6708203858, 0.0745355984], [0.0745355984, 1.5652475669, 0]])
    )


def test_remax_by_hand():
    # Reward-to-go [1,1,1] minus baseline 0.3; [1.5, 1, 1] minus 1.2 (the 4.0 is masked).
    inputs = AdvantageInputs(
        t([[0, 0, 1, 4.0], [0.5, 0, 1, 0]]), t([[1, 1, 1, 0], [1, 1, 1, 0]]), reward_baselines=t([[0.3, 1.2]])[0]
    )
    adv, ret = compute_advantage("remax", inputs)
    torch.testing.assert_close(ret, t([[1, 1, 1, 0], [1.5, 1, 1, 0]]))
    torch.testing.assert_close(adv, t([[0.7, 0.7, 0.7, 0], [0.3, -0.2, -0.2, 0]]))


def test_grpo_vectorised_matches_loop_reference():
    gen = torch.Generator().manual_seed(2)
    batch, length = 24, 7
    mask = _random_mask(gen, batch, length)
    mask[0, 0] = 1.0  # no empty rows here: they would score 0 and be a valid group member anyway
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    index = [f"uid{int(i)}" for i in torch.randint(0, 7, (batch,), generator=gen)]
    adv, _ = compute_advantage("grpo", AdvantageInputs(rewards, mask, index=index))
    scores = [sum(r * m for r, m in zip(rr, mm)) for rr, mm in zip(rewards.tolist(), mask.tolist())]
    expected = []
    for i, uid in enumerate(index):
        group = [scores[j] for j, other in enumerate(index) if other == uid]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = (sum((g - mean) ** 2 for g in group) / (len(group) - 1)) ** 0.5
        expected.append((scores[i] - mean) / (std + 1e-6))
    torch.testing.assert_close(adv, mask * torch.tensor(expected, dtype=torch.float64)[:, None])


def test_integer_and_tensor_index_give_same_groups():
    base = _outcome_inputs()
    for index in ([7, 7, 7, 3], torch.tensor([7, 7, 7, 3])):
        inputs = AdvantageInputs(base.token_level_rewards, base.response_mask, index=index)
        torch.testing.assert_close(compute_advantage("grpo", inputs)[0], compute_advantage("grpo", base)[0])


@pytest.mark.parametrize("name", ESTIMATORS)
def test_masked_positions_never_leak(name):
    gen = torch.Generator().manual_seed(3)
    batch, length = 8, 9
    mask = _random_mask(gen, batch, length)
    clean = dict(
        token_level_rewards=torch.randn(batch, length, generator=gen, dtype=torch.float64),
        values=torch.randn(batch, length, generator=gen, dtype=torch.float64),
    )
    garbage = 100 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    dirty = {k: torch.where(mask.bool(), v, garbage) for k, v in clean.items()}
    common = dict(
        response_mask=mask,
        index=[i // 2 for i in range(batch)],
        reward_baselines=torch.randn(batch, generator=gen, dtype=torch.float64),
        gamma=0.9,
        lam=0.95,
    )
    adv_clean, ret_clean = compute_advantage(name, AdvantageInputs(**clean, **common))
    adv_dirty, ret_dirty = compute_advantage(name, AdvantageInputs(**dirty, **common))
    torch.testing.assert_close(adv_clean, adv_dirty)
    torch.testing.assert_close(ret_clean, ret_dirty)
    assert adv_clean[~mask.bool()].abs().max() == 0 and ret_clean[~mask.bool()].abs().max() == 0
    assert adv_clean[mask.bool()].abs().sum() > 0  # the estimator produced something at valid positions


def test_missing_inputs_name_the_estimator_and_field():
    inputs = AdvantageInputs(t([[1.0]]), t([[1.0]]))
    with pytest.raises(ValueError, match="adv_estimator=gae needs `values"):
        compute_advantage("gae", inputs)
    with pytest.raises(ValueError, match="adv_estimator=grpo needs `index"):
        compute_advantage("grpo", inputs)
    with pytest.raises(ValueError, match="adv_estimator=remax needs `reward_baselines"):
        compute_advantage("remax", inputs)
    with pytest.raises(ValueError, match="'nope' is not registered; known: \\['gae'"):
        compute_advantage("nope", inputs)


def test_registry_refuses_a_second_function_under_a_taken_name():
    def mine(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs.token_level_rewards * 3, inputs.token_level_rewards

    def other(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs.token_level_rewards, inputs.token_level_rewards

    register_adv_estimator("test_registry_mine")(mine)
    register_adv_estimator("test_registry_mine")(mine)  # the same function again is fine
    with pytest.raises(ValueError, match="'test_registry_mine' is already registered to .*mine; refusing .*other"):
        register_adv_estimator("test_registry_mine")(other)
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_adv_estimator("grpo")(other)
    adv, _ = compute_advantage("test_registry_mine", AdvantageInputs(t([[1.0, 2.0]]), t([[1.0, 1.0]])))
    torch.testing.assert_close(adv, t([[3.0, 6.0]]))
