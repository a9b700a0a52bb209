"""Gradient finalisation and the plain / distributed optimizer over NCCL: the gloo tests' checks, one GPU per rank."""

import pytest
import torch

from shardrl.parallel.launch import run_distributed
from test_grad_finalize import LAYOUTS, check_grads, check_norm, finalize_layouts
from test_optimizer import (TRAIN_LAYOUTS, check_against_reference, check_distributed_equals_plain,
                            check_non_finite_and_resume, optimizer_runs, reference_run)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("world", [2, 4])
def test_finalize_and_optimizer_on_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    names = [name for name, (spec, _) in LAYOUTS.items() if spec.world_size == world]
    finalized = run_distributed(world, finalize_layouts, names, backend="nccl")
    for name in names:
        check_grads(finalized, name)
        check_norm(finalized, name)
    train_names = [name for name, spec in TRAIN_LAYOUTS.items() if spec.world_size == world]
    runs = run_distributed(world, optimizer_runs, train_names, backend="nccl")
    reference = reference_run()
    for name in train_names:
        check_against_reference(runs, reference, name)
        check_distributed_equals_plain(runs, name)
    check_non_finite_and_resume(runs)
