"""Checkpoints move between the distributed optimizer (flat DP-sharded state) and the plain one: DP2 with it ->
1 process without it, and back, take the same next step as a run that never stopped (see test_checkpoint_resume)."""

from __future__ import annotations

import torch

from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry
from test_checkpoint_resume import SAVED_AT, assert_same_step, model, reference, session  # noqa: F401 (fixtures)


def dp2_distributed_optimizer(hf: str, single_saved: str, save: str) -> dict:
    """On 2 ranks with the distributed optimizer: resume from the 1-process checkpoint; train afresh and save."""
    registry = GroupRegistry()  # both sessions' layouts in this process share their groups
    return dict(resumed=session(hf, {}, True, single_saved, 0, None, 1, registry),
                saved=session(hf, {}, True, None, SAVED_AT, save, 0, registry))


def test_distributed_optimizer_checkpoints_load_without_it_and_back(model, reference, tmp_path):  # noqa: F811
    dp2 = run_distributed(2, dp2_distributed_optimizer, model, reference["saved"], str(tmp_path / "dp2"))[0]
    assert_same_step(dp2["resumed"], reference, "1 process -> DP2 distributed optimizer")
    for a, b in zip(dp2["saved"]["losses"], reference["losses"][:SAVED_AT], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), f"DP2 before the save: {a} vs {b}"
    resumed = session(model, {}, False, str(tmp_path / "dp2"), 0, None, 1)
    assert_same_step(resumed, reference, "DP2 distributed optimizer -> 1 process")
    # The single process takes the DP2 checkpoint's rank-0 RNG states: it draws what that rank drew after saving.
    assert torch.equal(resumed["draw"], dp2["saved"]["draw"])
