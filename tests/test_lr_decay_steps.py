"""`optim.lr_decay_steps` (Megatron's meaning, as verl's Megatron optimizer passes it): the decay ends at that step,
counted from 0 with the warmup included, and the lr stays at the minimum after it. Hand-computed values."""

import math

import pytest
import torch
from torch import nn

from shardrl.parallel.layout import Layout
from shardrl.parallel.optimizer import AdamW, LRScheduler
from shardrl.parallel.spec import ShardSpec, set_spec
from test_optimizer import _scheduled_lrs

PEAK, MIN = 1e-3, 1e-4  # test_optimizer._scheduled_lrs's lr; min_lr_ratio 0.1


def _optimizer() -> AdamW:
    return AdamW([set_spec(nn.Parameter(torch.zeros(2)), ShardSpec("b", (2,)))], Layout.single(), lr=PEAK)


def test_linear_and_cosine_decay_end_at_decay_steps_then_hold_the_minimum():
    # Warmup 2 steps, decay over steps 2..6 (4 steps), total 20: the minimum from step 6 on.
    linear = _scheduled_lrs(20, total_steps=20, warmup_steps=2, style="linear", min_lr_ratio=0.1, decay_steps=6)
    assert linear[:7] == pytest.approx([0.0, 5e-4, 1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4])
    assert linear[6:] == pytest.approx([MIN] * 15)
    cosine = _scheduled_lrs(20, total_steps=20, warmup_steps=2, style="cosine", min_lr_ratio=0.1, decay_steps=6)
    half_wave = [MIN + (PEAK - MIN) * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(5)]
    assert half_wave[1] == pytest.approx(8.681980515339464e-4) and half_wave[3] == pytest.approx(2.318019484660536e-4)
    assert cosine[:7] == pytest.approx([0.0, 5e-4, *half_wave])
    assert cosine[6:] == pytest.approx([MIN] * 15)


def test_decay_longer_than_the_run_never_reaches_the_minimum():
    linear = _scheduled_lrs(10, total_steps=10, warmup_steps=0, style="linear", min_lr_ratio=0.1, decay_steps=20)
    assert linear[10] == pytest.approx(5.5e-4)  # half way: 1e-3 - 9e-4 / 2


def test_constant_ignores_decay_steps():
    assert _scheduled_lrs(8, total_steps=8, warmup_steps=2, style="constant", decay_steps=3) == \
        pytest.approx([0.0, 5e-4] + [PEAK] * 7)


def test_warmup_ratio_is_taken_of_decay_steps():
    # verl: lr_warmup_steps = int(lr_warmup_steps_ratio * lr_decay_steps): 0.25 * 8 = 2 steps, not 0.25 * 100.
    linear = _scheduled_lrs(9, total_steps=100, warmup_steps_ratio=0.25, style="linear", min_lr_ratio=0.1,
                            decay_steps=8)
    assert linear[:3] == pytest.approx([0.0, 5e-4, 1e-3])
    assert linear[5] == pytest.approx(5.5e-4) and linear[8] == pytest.approx(MIN)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_none_keeps_the_schedule_bitwise(style):
    kwargs = dict(total_steps=12, warmup_steps_ratio=0.25, style=style, min_lr_ratio=0.1)
    today = _scheduled_lrs(15, **kwargs)
    assert _scheduled_lrs(15, **kwargs, decay_steps=None) == today
    assert _scheduled_lrs(15, **kwargs, decay_steps=12) == today  # null means total_training_steps


def test_bad_decay_steps_are_refused():
    with pytest.raises(ValueError, match="lr_decay_steps=0: expected a positive step count"):
        LRScheduler(_optimizer(), total_steps=10, style="linear", decay_steps=0)
    with pytest.raises(ValueError, match="linear lr decay needs lr_decay_steps > warmup steps, got lr_decay_steps=2, "
                                         "warmup_steps=2"):
        LRScheduler(_optimizer(), total_steps=10, warmup_steps=2, style="linear", decay_steps=2)
