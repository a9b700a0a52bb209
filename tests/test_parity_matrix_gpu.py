"""The parity matrix of tests/test_parity_matrix.py on NCCL: every layout of the CPU matrix whose world fits the GPUs
present (2-rank layouts on 2 GPUs; the 4- and 8-rank ones skip unless that many exist), through the same actor path
(packing, pipeline schedule, vocab-parallel logprobs, PPO loss with global counts, gradient finalisation, AdamW),
once in fp32 and once in bf16. All cases of one world size run in a single spawn (one NCCL start-up).

Reference: the same code on one GPU in fp32, itself checked against the CPU fp32 reference at the fp32 tolerance.

fp32 tolerance: 1e-4 (max error relative to max |reference| for logprobs, step-0 gradients and the parameters after
3 AdamW steps; relative error of every step's loss), ten times the CPU matrix's 1e-5. cuBLAS picks different kernels
(split-K reductions) for the halved TP shapes and NCCL's ring sums in another order than gloo, so the rounding
noise (fp32 eps 1.2e-7 per op) differs from the CPU's, and three Adam steps amplify it; a layout bug (a missed
reduction, a wrong shard) shows up at 1e-2 or more.

bf16 tolerances (a bf16 layout against the fp32 reference; bf16 keeps 8 significand bits, 2^-9 relative rounding per
op; gradients accumulate and AdamW updates fp32 master weights). Measured with the same cases in bf16 on CPU gloo
(2-rank layouts), the errors were: logprobs mean |d| <= 0.0095 and max |d| <= 0.09 nats (the MoE maximum, 8x the
dense one's, fits a token whose top-k routing is near a tie), loss <= 0.3% relative, gradients <= 2.4% relative L2
over the whole model and <= 14% for the worst tensor (of those with >= 1% of the largest tensor norm), and the
3-step update (params - initial params) <= 8.2% relative L2. The bounds below leave ~3x headroom for the GPU's
different kernels (flash attention, cuBLAS bf16 GEMMs): logprobs mean 0.03 / max 0.3, loss 2% relative, gradients 6%
overall / 30% worst tensor, update 25%. A layout bug moves these to O(1) (a missing DP reduction, for one, leaves
each replica with the gradient of half the batch: another direction, not a rounding error).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry
from test_parity_matrix import (
    LAYOUTS,
    check_against_reference,
    checkpoints,  # noqa: F401 (fixture: the same tiny dense and MoE checkpoints as the CPU matrix)
    gathered_log_probs,
    make_batch,
    train_on_layout,
)

pytestmark = pytest.mark.gpu
NUM_GPUS = torch.cuda.device_count()
FP32_RTOL = 1e-4
BF16_BOUNDS = dict(log_prob_mean=0.03, log_prob_max=0.3, loss_rel=2e-2, grad_rel=0.06, grad_rel_worst=0.3,
                   update_rel=0.25)

_ALL_LAYOUTS = [*LAYOUTS, (("moe",), 8, dict(tp=2, pp=2, ep=2), False, 1)]
# (kind, world, sizes, distributed optimizer, micro batch size, dtype)
CASES = [(kind, world, sizes, opt, micro, dtype) for kinds, world, sizes, opt, micro in _ALL_LAYOUTS
         for kind in kinds for dtype in (torch.float32, torch.bfloat16)]


def case_id(case: tuple) -> str:
    kind, world, sizes, opt, _, dtype = case
    return "-".join([kind, *(f"{d}{n}" for d, n in sizes.items()), f"w{world}", *(["distopt"] if opt else []),
                     str(dtype).removeprefix("torch.")])


def train_cases(ckpts: dict[str, str], cases: list[tuple]) -> list[dict | None]:
    """Every case of one world size on this rank, one after the other (importable: runs in the spawned ranks), all
    layouts from one registry."""
    registry = GroupRegistry()
    return [train_on_layout(ckpts[kind], sizes, opt, micro, dtype, registry=registry)
            for kind, _, sizes, opt, micro, dtype in cases]


@pytest.fixture(scope="module")
def gpu_references(checkpoints) -> dict[str, dict]:  # noqa: F811 (the imported fixture)
    return {kind: train_on_layout(path, {}, False, 2, device="cuda") for kind, path in checkpoints.items()}


@pytest.fixture(scope="module")
def layout_results(checkpoints):  # noqa: F811 (the imported fixture)
    """world -> {case id: per-rank results}; one spawn per world size, run on first use and remembered."""
    cache: dict[int, dict | RuntimeError] = {}

    def results(world: int) -> dict[str, list]:
        if world not in cache:
            cases = [c for c in CASES if c[1] == world]
            try:
                per_rank = run_distributed(world, train_cases, checkpoints, cases, backend="nccl")
                cache[world] = {case_id(c): [rank[i] for rank in per_rank] for i, c in enumerate(cases)}
            except RuntimeError as exc:  # remembered so the other cases fail at once instead of re-spawning
                cache[world] = exc
        if isinstance(cache[world], RuntimeError):
            raise cache[world]
        return cache[world]

    return results


def _rel_l2(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
            base: dict[str, torch.Tensor] | None = None) -> float:
    """||actual - expected|| / ||expected - base|| over all tensors (base: zeros)."""
    num = sum(((actual[n].float() - e) ** 2).sum() for n, e in expected.items())
    den = sum(((e - (0 if base is None else base[n])) ** 2).sum() for n, e in expected.items())
    return (num / den).sqrt().item()


def bf16_errors(results: list[dict | None], ref: dict, initial: dict[str, torch.Tensor],
                distributed_optimizer: bool) -> dict[str, float]:
    """The worst error of each kind (see the module docstring) over the reporting ranks."""
    results, log_probs = gathered_log_probs(results)
    mask = make_batch().tensors["response_mask"].bool()
    diff = (log_probs - ref["log_probs"])[mask].abs()
    errors = dict(log_prob_mean=diff.mean().item(), log_prob_max=diff.max().item(), loss_rel=0.0, update_rel=0.0)
    for r in results:
        errors["loss_rel"] = max([errors["loss_rel"]] + [abs(a - b) / max(abs(b), 1e-2)
                                                         for a, b in zip(r["losses"], ref["losses"])])
        errors["update_rel"] = max(errors["update_rel"], _rel_l2(r["params"], ref["params"], initial))
        if not distributed_optimizer:  # the distributed optimizer's gradients are never whole on one rank
            largest = max(g.norm() for g in ref["grads"].values())
            worst = max(_rel_l2({n: r["grads"][n]}, {n: g}) for n, g in ref["grads"].items()
                        if g.norm() >= 1e-2 * largest)
            errors["grad_rel"] = max(errors.get("grad_rel", 0.0), _rel_l2(r["grads"], ref["grads"]))
            errors["grad_rel_worst"] = max(errors.get("grad_rel_worst", 0.0), worst)
    return errors


@pytest.mark.skipif(NUM_GPUS < 1, reason="needs CUDA")
def test_single_gpu_reference_matches_cpu(checkpoints, gpu_references):  # noqa: F811 (the imported fixture)
    for kind, path in checkpoints.items():
        check_against_reference([gpu_references[kind]], train_on_layout(path, {}, False, 2), False, FP32_RTOL)


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c), marks=pytest.mark.skipif(
    NUM_GPUS < c[1], reason=f"needs {c[1]} GPUs")) for c in CASES])
def test_layout_matches_single_gpu_over_nccl(checkpoints, gpu_references, layout_results, case):  # noqa: F811
    kind, world, _, distributed_optimizer, _, dtype = case
    results = layout_results(world)[case_id(case)]
    if dtype == torch.float32:
        check_against_reference(results, gpu_references[kind], distributed_optimizer, FP32_RTOL)
        return
    initial = load_file(f"{checkpoints[kind]}/model.safetensors")
    errors = bf16_errors(results, gpu_references[kind], initial, distributed_optimizer)
    print(f"{case_id(case)} bf16 vs fp32: " + ", ".join(f"{k} {v:.4g}" for k, v in errors.items()))
    too_large = {k: f"{v:.4g} > {BF16_BOUNDS[k]}" for k, v in errors.items() if v > BF16_BOUNDS[k]}
    assert not too_large, f"{case_id(case)}: bf16 errors against the fp32 reference too large: {too_large}"
