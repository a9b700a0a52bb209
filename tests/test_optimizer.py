"""AdamW (plain and distributed) against torch.optim.AdamW + clip_grad_norm_ on the full toy model; non-finite
skipping; state_dict round trip; LR schedules against hand-computed values."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel import optimizer
from shardrl.parallel.optimizer import AdamW, LRScheduler
from shardrl.parallel.spec import ShardSpec, get_spec, set_spec
from test_grad_finalize import SMALL_BUCKET_MB, ToyModel, batch, create_layout, full_params, reference_loss, shard_of

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip_grad=0.5)
STEPS = 3
TRAIN_LAYOUTS = {"dp2": LayoutSpec(2), "dp4": LayoutSpec(4), "tp2_dp2": LayoutSpec(4, tp=2),
                 "ep2_edp2": LayoutSpec(4, ep=2), "tp2_pp2": LayoutSpec(4, tp=2, pp=2)}


def _model_and_optimizer(layout: Layout, distributed: bool, seed: int = 0) -> tuple[ToyModel, AdamW]:
    model = ToyModel(layout, full_params(kv_heads=1, seed=seed))
    return model, AdamW(model.parameters(), layout, distributed=distributed, bucket_mb=SMALL_BUCKET_MB, **HYPER)


def _params(model: nn.Module) -> dict:
    return {get_spec(p).hf_name: (get_spec(p), p.detach().to("cpu", copy=True)) for p in model.parameters()}


def _train(layout: Layout, distributed: bool) -> dict:
    model, opt = _model_and_optimizer(layout, distributed)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        model.loss(batch(step)).backward()
        norms.append(opt.step())
    state = [(layout.size(buf.group_name), st.master.numel()) for buf, st in zip(opt.grads.buffers, opt.states)]
    return dict(params=_params(model), norms=norms, state=state)


def _non_finite(layout: Layout, distributed: bool) -> dict:
    model, opt = _model_and_optimizer(layout, distributed)
    model.loss(batch()).backward()
    if dist.get_rank() % 2:  # one rank of the pair only: every rank must still skip
        model.w1.main_grad[0, 0] = float("nan")
    before = _params(model)
    norm, skipped = opt.step()
    unchanged = all(torch.equal(p, before[n][1]) for n, (_, p) in _params(model).items())
    steps_after_skip = opt.num_steps
    opt.zero_grad()
    model.loss(batch()).backward()
    return dict(norm=norm, skipped=skipped, unchanged=unchanged, steps_after_skip=steps_after_skip,
                next_skipped=opt.step()[1])


def _resume(layout: Layout) -> dict:
    model, opt = _model_and_optimizer(layout, distributed=True)
    for step in range(2):
        opt.zero_grad()
        model.loss(batch(step)).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())  # deep copy: the live tensors are views
    resumed, opt2 = _model_and_optimizer(layout, distributed=True, seed=1)
    opt2.load_state_dict(saved)
    loaded_equal = all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))
    for m, o in ((model, opt), (resumed, opt2)):
        o.zero_grad()
        m.loss(batch(2)).backward()
        o.step()
    _, plain = _model_and_optimizer(layout, distributed=False)
    try:
        plain.load_state_dict(saved)
        mismatch = ""
    except ValueError as exc:
        mismatch = str(exc)
    return dict(loaded_equal=loaded_equal, mismatch=mismatch,
                stepped_equal=all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters())))


def optimizer_runs(names: list[str]) -> dict:
    """On every rank: 3 steps in both modes for each named layout, the non-finite and the resume scenarios."""
    train, registry = {}, GroupRegistry()  # one per process: every layout's groups from it
    for name in names:
        layout = create_layout(TRAIN_LAYOUTS[name], registry)
        train[name] = {mode: _train(layout, mode == "distributed") for mode in ("plain", "distributed")}
    dp2 = create_layout(LayoutSpec(2), registry)
    non_finite = {mode: _non_finite(dp2, mode == "distributed") for mode in ("plain", "distributed")}
    return dict(train=train, non_finite=non_finite, resume=_resume(dp2))


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(4, optimizer_runs, list(TRAIN_LAYOUTS))


@pytest.fixture(scope="module")
def reference() -> dict:
    return reference_run()


def reference_run() -> dict:
    """torch.optim.AdamW with clip_grad_norm_ on the full model; no weight decay for 1-D tensors."""
    full = {k: nn.Parameter(v) for k, v in full_params(kv_heads=1).items()}
    groups = [dict(params=[p for p in full.values() if p.ndim >= 2]),
              dict(params=[p for p in full.values() if p.ndim < 2], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], foreach=False)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        reference_loss(full, batch(step)).backward()
        norms.append(nn.utils.clip_grad_norm_(list(full.values()), HYPER["clip_grad"]).item())
        opt.step()
    return dict(params={k: v.detach() for k, v in full.items()}, norms=norms)


def check_against_reference(runs: list[dict], reference: dict, name: str) -> None:
    assert min(reference["norms"]) > HYPER["clip_grad"]  # clipping is active in every step
    for rank, result in enumerate(runs):
        for mode, run in result["train"][name].items():
            assert [skipped for _, skipped in run["norms"]] == [False] * STEPS
            assert [n for n, _ in run["norms"]] == pytest.approx(reference["norms"], rel=1e-5)
            for hf_name, (spec, value) in run["params"].items():
                torch.testing.assert_close(value, shard_of(reference["params"], spec), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} {mode} {hf_name}: {m}")


def check_distributed_equals_plain(runs: list[dict], name: str) -> None:
    for result in runs:
        plain, sharded = result["train"][name]["plain"], result["train"][name]["distributed"]
        assert [n for n, _ in sharded["norms"]] == pytest.approx([n for n, _ in plain["norms"]], rel=1e-6)
        # Each rank keeps 1/dp of the master weights and moments (1/edp for experts).
        assert [numel * dp for dp, numel in sharded["state"]] == [numel for _, numel in plain["state"]]
        for hf_name, (_, value) in plain["params"].items():
            torch.testing.assert_close(sharded["params"][hf_name][1], value, rtol=0, atol=1e-6)


def check_non_finite_and_resume(runs: list[dict]) -> None:
    for result in runs:
        for outcome in result["non_finite"].values():  # plain and distributed
            assert math.isnan(outcome["norm"]) and outcome["skipped"] and outcome["unchanged"]
            assert outcome["steps_after_skip"] == 0 and outcome["next_skipped"] is False
        resume = result["resume"]
        assert resume["loaded_equal"] and resume["stepped_equal"]
        assert "saved with another layout or distributed setting" in resume["mismatch"]


@pytest.mark.parametrize("name", TRAIN_LAYOUTS)
def test_three_clipped_steps_match_torch_adamw(runs, reference, name):
    check_against_reference(runs, reference, name)


@pytest.mark.parametrize("name", TRAIN_LAYOUTS)
def test_distributed_optimizer_equals_plain(runs, name):
    check_distributed_equals_plain(runs, name)


def test_non_finite_grad_skips_everywhere_and_state_dict_round_trips(runs):
    check_non_finite_and_resume(runs)


def _scheduled_lrs(steps: int, **kwargs) -> list[float]:
    param = set_spec(nn.Parameter(torch.zeros(2, 2)), ShardSpec("w", (2, 2)))
    opt = AdamW([param], Layout.single(), lr=1e-3)
    scheduler = LRScheduler(opt, **kwargs)
    lrs = [opt.lr]
    for _ in range(steps):
        scheduler.step()
        lrs.append(opt.lr)
    return lrs


def test_update_joins_consecutive_buckets_up_to_the_piece_cap(monkeypatch):
    """Without the distributed optimizer the buckets of a buffer are updated as one piece (four host views, not four
    per bucket), split only at MAX_PIECE_ELEMENTS; three steps give the same parameters either way."""
    layout = Layout.single()
    results = {}
    for cap in (optimizer.MAX_PIECE_ELEMENTS, 200):
        monkeypatch.setattr(optimizer, "MAX_PIECE_ELEMENTS", cap)
        model, opt = _model_and_optimizer(layout, distributed=False)
        grads = opt._owned_pieces()[0]
        assert sum(len(buf.buckets) for buf in opt.grads.buffers) > len(opt.grads.buffers)  # several buckets each
        if cap == 200:  # above every bucket of this model (a bucket is never cut), below every buffer
            assert len(grads) > len(opt.grads.buffers) and max(g.numel() for g in grads) <= cap
        else:
            assert len(grads) == len(opt.grads.buffers)
        for step in range(STEPS):
            opt.zero_grad()
            model.loss(batch(step)).backward()
            opt.step()
        results[cap] = _params(model)
    joined, split = results.values()
    for name, (_, value) in joined.items():
        assert torch.equal(value, split[name][1]), name


def test_lr_schedules_hand_computed():
    cosine = _scheduled_lrs(13, total_steps=10, warmup_steps=2, style="cosine", min_lr_ratio=0.1)
    # warmup 0, lr/2, lr; progress 2/8 = 0.25: 1e-4 + 9e-4 * (1 + cos(pi/4)) / 2; half way; the end, held.
    assert cosine[:3] == pytest.approx([0.0, 5e-4, 1e-3])
    assert cosine[4] == pytest.approx(8.681980515339464e-4)
    assert cosine[6] == pytest.approx(5.5e-4)
    assert cosine[10] == cosine[13] == pytest.approx(1e-4)
    linear = _scheduled_lrs(10, total_steps=10, warmup_steps=2, style="linear", min_lr_ratio=0.1)
    assert linear[4] == pytest.approx(7.75e-4) and linear[10] == pytest.approx(1e-4)
    constant = _scheduled_lrs(50, total_steps=-1, warmup_steps=4)
    assert constant[1] == pytest.approx(2.5e-4) and constant[4] == constant[50] == 1e-3
    by_ratio = _scheduled_lrs(3, total_steps=10, warmup_steps=-1, warmup_steps_ratio=0.3)
    assert by_ratio == pytest.approx([0.0, 1e-3 / 3, 2e-3 / 3, 1e-3])


def test_lr_scheduler_state_round_trip_and_errors():
    param = set_spec(nn.Parameter(torch.zeros(2)), ShardSpec("b", (2,)))
    opt = AdamW([param], Layout.single(), lr=1e-3)
    scheduler = LRScheduler(opt, total_steps=10, warmup_steps=2, style="cosine")
    for _ in range(5):
        scheduler.step()
    opt2 = AdamW([set_spec(nn.Parameter(torch.zeros(2)), ShardSpec("b", (2,)))], Layout.single(), lr=1e-3)
    resumed = LRScheduler(opt2, total_steps=10, warmup_steps=2, style="cosine")
    resumed.load_state_dict(scheduler.state_dict())
    assert opt2.lr == opt.lr and resumed.num_steps == 5
    with pytest.raises(ValueError, match="cosine lr decay needs total_steps > warmup steps"):
        LRScheduler(opt, total_steps=-1, style="cosine")
    with pytest.raises(ValueError, match="'wsd'"):
        LRScheduler(opt, total_steps=10, style="wsd")
