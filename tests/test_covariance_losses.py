"""Clip-Cov and KL-Cov (verl's `clip_cov` / `kl_cov` policy losses, arXiv 2505.22617): the token selection and the
losses against verl's formulas transcribed in plain tensor code, one selection per optimizer step over the whole mini
batch from the log-probs of the weights that step differentiates, and the same update at any micro-batch cut and at
DP2, TP2, CP2 and PP2."""

import math

import pytest
import torch

from shardrl.algos import ClipRange, LossScale, actor_loss
from shardrl.algos.covariance import CovarianceSelection, select_tokens
from shardrl.algos.policy_loss import clip_cov_loss, kl_cov_loss
from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.parallel.launch import run_distributed
from test_distillation import assert_same

ACTOR = "actor_rollout_ref.actor"


def verl_reference(log_prob, old, advantages, mask, mode, ratio, lower=1.0, upper=5.0, coef=0.1, low=0.2, high=0.2,
                   selection_log_prob=None):
    """verl 0.9's clip_cov / kl_cov on one micro batch holding the whole mini batch, in float64: (token-mean loss,
    selected [B, T]). Clip-Cov's random draw is left out: `ratio` must let it take every candidate.
    `selection_log_prob`: covariances from these log-probs instead (a stale selection, to show it differs)."""
    log_prob, old, advantages = log_prob.double(), old.double(), advantages.double()
    valid = mask.bool()
    num_tokens = int(valid.sum())
    cov = torch.full_like(log_prob, -math.inf)
    a = advantages[valid]
    lp = (log_prob if selection_log_prob is None else selection_log_prob.double())[valid]
    cov[valid] = (a - a.mean()) * (lp - lp.mean())
    r = torch.exp(log_prob - old)
    unclipped, clipped = -advantages * r, -advantages * torch.clamp(r, 1 - low, 1 + high)
    if mode == "kl_cov":
        count = max(1, int(num_tokens * ratio))
        flat = valid.reshape(-1).nonzero()[:, 0][torch.topk(cov[valid], count).indices]
        selected = torch.zeros(valid.numel(), dtype=torch.bool)
        selected[flat] = True
        selected = selected.view_as(valid)
        per_token = unclipped + torch.where(selected, coef * (log_prob - old).abs(), 0.0)
    else:
        cov[(clipped > unclipped) & valid] = -math.inf
        selected = (cov > lower) & (cov < upper) & valid
        assert int(selected.sum()) <= max(int(ratio * num_tokens), 1), "the draw would leave candidates out"
        per_token = torch.maximum(unclipped, clipped) * (~selected)
    return torch.where(valid, per_token, 0.0).sum() / num_tokens, selected


def _tokens(seed: int, rows: int = 6, width: int = 10):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None, :] < torch.randint(1, width + 1, (rows,), generator=g)[:, None]).float()
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 4
    log_prob = old + 0.3 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    advantages = torch.randn(rows, width, generator=g, dtype=torch.float64) * 2
    return log_prob, old, advantages, mask


def _flat(mask, *tensors):
    return [t[mask.bool()] for t in tensors]


def test_kl_cov_takes_the_largest_covariances_as_verl():
    log_prob, old, advantages, mask = _tokens(0)
    for ratio in (0.01, 0.1, 0.3):
        _, expected = verl_reference(log_prob, old, advantages, mask, "kl_cov", ratio)
        a, lp = _flat(mask, advantages, log_prob)
        chosen = select_tokens(CovarianceSelection("kl_cov", ratio), a, lp, torch.zeros_like(a, dtype=torch.bool),
                               torch.Generator())
        assert torch.equal(chosen, expected[mask.bool()]) and chosen.sum() == max(1, int(mask.sum() * ratio))


def test_clip_cov_draws_among_its_candidates_at_random():
    log_prob, old, advantages, mask = _tokens(1)
    a, lp, o = _flat(mask, advantages, log_prob, old)
    clipped = -a * torch.clamp(torch.exp(lp - o), 0.8, 1.2) > -a * torch.exp(lp - o)
    assert clipped.any() and not clipped.all()
    wide = CovarianceSelection("clip_cov", 1.0, lower=0.1, upper=3.0)  # takes every candidate
    _, expected = verl_reference(log_prob, old, advantages, mask, "clip_cov", 1.0, lower=0.1, upper=3.0)
    candidates = select_tokens(wide, a, lp, clipped, torch.Generator())
    assert torch.equal(candidates, expected[mask.bool()]) and int(candidates.sum()) >= 4
    narrow = CovarianceSelection("clip_cov", 2.5 / a.numel(), lower=0.1, upper=3.0)  # two of them
    draws = [select_tokens(narrow, a, lp, clipped, torch.Generator().manual_seed(seed)) for seed in range(6)]
    for chosen in draws:
        assert int(chosen.sum()) == 2 and not (chosen & ~candidates).any()
    assert len({tuple(chosen.nonzero()[:, 0].tolist()) for chosen in draws}) > 1  # the draw is random
    again = select_tokens(narrow, a, lp, clipped, torch.Generator().manual_seed(3))
    assert torch.equal(again, draws[3])  # and reproducible from its seed
    none = select_tokens(CovarianceSelection("clip_cov", 0.5, lower=50.0, upper=60.0), a, lp, clipped,
                         torch.Generator())
    assert not none.any()


def test_the_losses_are_verls_and_clip_cov_stops_the_selected_gradients():
    log_prob, old, advantages, mask = _tokens(2)
    scale = LossScale.from_mask(mask, 10)
    for mode, ratio in (("kl_cov", 0.2), ("clip_cov", 1.0)):
        expected, selected = verl_reference(log_prob, old, advantages, mask, mode, ratio, lower=0.1, coef=0.7)
        leaf = log_prob.clone().requires_grad_()
        loss, metrics = actor_loss(leaf, old, advantages, mask, scale, "token-mean", ClipRange(0.2, ppo_kl_coef=0.7),
                                   loss_mode=mode, selected=selected)
        torch.testing.assert_close(loss, expected)
        (grad,) = torch.autograd.grad(loss, leaf)
        if mode == "clip_cov":
            assert selected.any() and torch.equal(grad[selected], torch.zeros_like(grad[selected]))
            torch.testing.assert_close(metrics["pg_clipfrac"], selected.sum() / mask.sum(), check_dtype=False)
        else:
            torch.testing.assert_close(metrics["ppo_kl"], ((log_prob - old).abs() * mask).sum() / mask.sum())
    with pytest.raises(ValueError, match="need it"):
        actor_loss(log_prob, old, advantages, mask, scale, "token-mean", ClipRange(), loss_mode="kl_cov")
    with pytest.raises(ValueError, match="read by"):
        actor_loss(log_prob, old, advantages, mask, scale, "token-mean", ClipRange(), selected=mask.bool())
    # without a selection both are plain: the unclipped surrogate, and PPO without the dual clip
    nothing = torch.zeros_like(mask, dtype=torch.bool)
    r = torch.exp(log_prob - old)
    plain_kl, _ = kl_cov_loss(log_prob, old, advantages, mask, scale, ClipRange(), nothing)
    torch.testing.assert_close(plain_kl[mask.bool()], (-advantages * r)[mask.bool()])
    plain_clip, _ = clip_cov_loss(log_prob, old, advantages, mask, scale, ClipRange(), nothing)
    torch.testing.assert_close(plain_clip[mask.bool()], torch.maximum(-advantages * r, -advantages * r.clamp(0.8, 1.2))
                               [mask.bool()])


def plan(*overrides):
    return plan_job(compose("ppo_trainer", list(overrides)))


def test_verl_keys_reach_the_options():
    options = plan(f"{ACTOR}.policy_loss.loss_mode=clip_cov", f"{ACTOR}.policy_loss.clip_cov_ratio=0.001",
                   f"{ACTOR}.policy_loss.clip_cov_lb=0.5", f"{ACTOR}.policy_loss.clip_cov_ub=4").actor.loss
    assert options.covariance == CovarianceSelection("clip_cov", 0.001, 0.5, 4.0) and options.anchor_is_actor
    options = plan(f"{ACTOR}.policy_loss.loss_mode=kl_cov", f"{ACTOR}.policy_loss.kl_cov_ratio=0.01",
                   f"{ACTOR}.policy_loss.ppo_kl_coef=1.5").actor.loss
    assert options.covariance == CovarianceSelection("kl_cov", 0.01) and options.clip.ppo_kl_coef == 1.5
    assert plan().actor.loss.covariance is None
    bypass = plan(f"{ACTOR}.policy_loss.loss_mode=kl_cov", "algorithm.rollout_correction.bypass_mode=true",
                  "algorithm.rollout_correction.loss_type=ppo_clip").actor.loss
    assert bypass.covariance is not None and not bypass.anchor_is_actor  # the first step then runs its own pass


@pytest.mark.parametrize("overrides, key, reason", [
    ([f"{ACTOR}.policy_loss.kl_cov_ratio=0.01"], "kl_cov_ratio", "read by loss_mode=kl_cov only"),
    ([f"{ACTOR}.policy_loss.ppo_kl_coef=1"], "ppo_kl_coef", "read by loss_mode=kl_cov only"),
    ([f"{ACTOR}.policy_loss.loss_mode=kl_cov", f"{ACTOR}.policy_loss.clip_cov_ub=3"], "clip_cov_ub",
     "read by loss_mode=clip_cov only"),
    ([f"{ACTOR}.policy_loss.tau_pos=2"], "tau_pos", "read by loss_mode=sapo only"),
    ([f"{ACTOR}.policy_loss.loss_mode=clip_cov", f"{ACTOR}.policy_loss.clip_cov_lb=6"], "clip_cov_lb",
     "must be below clip_cov_ub"),
    ([f"{ACTOR}.policy_loss.loss_mode=clip_cov", f"{ACTOR}.policy_loss.clip_cov_ratio=0"], "clip_cov_ratio", ""),
    ([f"{ACTOR}.policy_loss.loss_mode=kl_cov", f"{ACTOR}.policy_loss.kl_cov_ratio=2"], "kl_cov_ratio", ""),
    ([f"{ACTOR}.policy_loss.loss_mode=kl_cov", f"{ACTOR}.policy_loss.ppo_kl_coef=-1"], "ppo_kl_coef", ""),
])
def test_invalid_keys_are_refused_naming_them(overrides, key, reason):
    with pytest.raises(ConfigError) as err:
        plan(*overrides)
    assert err.value.key == f"{ACTOR}.policy_loss.{key}" and reason in str(err.value) and "\n" not in str(err.value)


# Through the real update (update_policy): two optimizer steps (ppo_epochs=2) over one mini batch, whose old
# log-probs are the model's own plus noise, so ratios differ from 1 and the selection matters to the loss.
COV_LAYOUTS = {"dp2": dict(), "tp2": dict(tp=2), "cp2": dict(cp=2), "pp2": dict(pp=2)}
CUTS = {"micro8": (8, None), "micro1": (1, None), "micro3": (3, None), "dynamic24tokens": (None, 24)}
MODES = {"kl_cov": (CovarianceSelection("kl_cov", 0.2), ClipRange(0.2, ppo_kl_coef=2.0)),
         "clip_cov": (CovarianceSelection("clip_cov", 1.0, lower=0.05), ClipRange(0.2)),
         "clip_cov_draw": (CovarianceSelection("clip_cov", 0.1, lower=0.05), ClipRange(0.2))}


def noisy_batch(ckpt: str):
    from test_loss_aggregation import training_batch

    batch = training_batch(ckpt)
    own = batch.tensors["old_log_probs"]
    noise = torch.randn(own.shape, generator=torch.Generator().manual_seed(11)) * 0.3
    batch.tensors["own_log_probs"] = own.clone()
    batch.tensors["old_log_probs"] = own + noise
    return batch


def covariance_steps(ckpt: str, sizes: dict, micro_batch_size: int | None, max_token_len: int | None,
                     lr: float = 0.0, anchor_is_actor: bool = False) -> dict[str, tuple]:
    from test_loss_aggregation import BATCH, RESPONSE

    from shardrl.job.options import EngineOptions, OptimOptions, PolicyLossOptions, UpdateOptions
    from shardrl.models.config import ModelConfig
    from shardrl.parallel.layout import Layout
    from shardrl.parallel.layout_spec import LayoutSpec
    from shardrl.workers.actor import update_policy
    from shardrl.workers.engine import ModelEngine

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    out = {}
    for name, (selection, clip) in MODES.items():
        actor = ModelEngine(ModelConfig.from_pretrained(ckpt), Layout.create(LayoutSpec(world_size=world, **sizes)),
                            EngineOptions(optim=OptimOptions(lr=lr)), hf_path=ckpt)
        layout = actor.layout
        batch = noisy_batch(ckpt)
        if anchor_is_actor:
            batch.tensors["old_log_probs"] = batch.tensors["own_log_probs"]
        share = batch.take(list(range(layout.dp_rank * BATCH // layout.dp_size,
                                      (layout.dp_rank + 1) * BATCH // layout.dp_size)))
        update = UpdateOptions(mini_batch_size=len(share), micro_batch_size=micro_batch_size,
                               max_token_len=max_token_len, ppo_epochs=2, seed=5)
        loss = PolicyLossOptions(loss_mode=name.removesuffix("_draw"), clip=clip, max_response_length=RESPONSE,
                                 covariance=selection, anchor_is_actor=anchor_is_actor)
        metrics = update_policy(actor, share, loss, update)
        out[name] = tuple(v for key in ("pg_loss", "ppo_kl", "pg_clipfrac", "grad_norm") for v in metrics.get(key, []))
    return out


@pytest.fixture(scope="module")
def cov_reference(tmp_path_factory):
    from shardrl.models.tiny import make_tiny_checkpoint

    ckpt = str(make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("cov") / "m"))
    return ckpt, covariance_steps(ckpt, {}, *CUTS["micro8"])


def test_the_update_matches_verl_on_the_whole_mini_batch(cov_reference):
    """At lr 0 both steps differentiate the model's weights: each one's loss is verl's on the whole mini batch with
    the model's log-probs (a selection from the noisy old log-probs would differ)."""
    ckpt, reference = cov_reference
    batch = noisy_batch(ckpt)
    t = batch.tensors
    current, mask = t["own_log_probs"].nan_to_num(0.0), t["response_mask"]
    for name, (selection, clip) in MODES.items():
        if name == "clip_cov_draw":
            continue
        mode = selection.mode
        expected, selected = verl_reference(current, t["old_log_probs"].nan_to_num(0.0), t["advantages"], mask, mode,
                                            selection.ratio, lower=selection.lower, coef=clip.ppo_kl_coef)
        assert 0 < int(selected.sum()) < int(mask.sum())
        pg_losses = reference[name][:2]
        assert pg_losses == pytest.approx([float(expected)] * 2, rel=1e-5), name
        _, stale = verl_reference(current, t["old_log_probs"].nan_to_num(0.0), t["advantages"], mask, mode,
                                  selection.ratio, lower=selection.lower, coef=clip.ppo_kl_coef,
                                  selection_log_prob=t["old_log_probs"].nan_to_num(0.0))
        assert not torch.equal(selected, stale), name
        if mode == "clip_cov":
            assert reference[name][4:6] == pytest.approx([float(selected.sum() / mask.sum())] * 2)


@pytest.mark.parametrize("cut", ["micro1", "micro3", "dynamic24tokens"])
def test_the_update_is_the_same_for_any_micro_batching(cov_reference, cut):
    ckpt, reference = cov_reference
    assert_same(covariance_steps(ckpt, {}, *CUTS[cut]), reference, cut)


@pytest.mark.parametrize("layout", list(COV_LAYOUTS))
def test_the_update_is_the_same_at_dp2_tp2_cp2_and_pp2(cov_reference, layout):
    ckpt, reference = cov_reference
    for rank_result in run_distributed(2, covariance_steps, ckpt, COV_LAYOUTS[layout], *CUTS["micro3"]):
        assert_same(rank_result, reference, layout)


def test_each_step_selects_from_the_weights_it_differentiates(cov_reference):
    """With lr > 0 the second step's selection comes from a forward pass at the weights after the first step: its
    loss is verl's on the mini batch with those weights' log-probs. The first step reuses the old log-probs when the
    actor computed them (they are its weights' own), which gives the same update as its own pass."""
    ckpt, _ = cov_reference
    own_pass = covariance_steps(ckpt, {}, *CUTS["micro3"], lr=0.05, anchor_is_actor=True)
    from test_loss_aggregation import BATCH

    from shardrl.job.options import EngineOptions, ForwardBatching, OptimOptions, PolicyLossOptions, UpdateOptions
    from shardrl.models.config import ModelConfig
    from shardrl.parallel.layout import Layout
    from shardrl.workers.actor import compute_log_prob, update_policy
    from shardrl.workers.engine import ModelEngine

    selection, clip = MODES["kl_cov"]
    actor = ModelEngine(ModelConfig.from_pretrained(ckpt), Layout.single(), EngineOptions(optim=OptimOptions(lr=0.05)),
                        hf_path=ckpt)
    batch = noisy_batch(ckpt)
    batch.tensors["old_log_probs"] = batch.tensors["own_log_probs"]
    loss = PolicyLossOptions(loss_mode="kl_cov", clip=clip, max_response_length=5, covariance=selection)
    first = update_policy(actor, batch, loss, UpdateOptions(mini_batch_size=BATCH, micro_batch_size=3, seed=5))
    assert first["pg_loss"][0] == pytest.approx(own_pass["kl_cov"][0], rel=1e-5)
    moved, _ = compute_log_prob(actor, batch, ForwardBatching(BATCH, None))
    t = batch.tensors
    mask, old = t["response_mask"], t["old_log_probs"].nan_to_num(0.0)
    expected, selected = verl_reference(moved, old, t["advantages"], mask, "kl_cov", selection.ratio,
                                        coef=clip.ppo_kl_coef)
    assert own_pass["kl_cov"][1] == pytest.approx(float(expected), rel=1e-4)
    stale, stale_selected = verl_reference(moved, old, t["advantages"], mask, "kl_cov", selection.ratio,
                                           coef=clip.ppo_kl_coef, selection_log_prob=old)
    assert not torch.equal(selected, stale_selected) and float(stale) != pytest.approx(float(expected), rel=1e-4)
