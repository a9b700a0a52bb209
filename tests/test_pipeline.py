"""Pipeline schedules on gloo against the same toy model run in one process with gradient accumulation.

The toy model: token embedding (first stage) -> L x (Linear + tanh) -> LM head (last stage); the loss is the summed
next-token cross entropy divided by the token count of the whole mini batch (DESIGN.md's normalisation), so the
reference's accumulated gradients must equal the pipeline's exactly up to float rounding.
"""

import datetime
import weakref

import pytest
import torch
from torch import nn

from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.p2p import PipelineCommError
from shardrl.parallel.pipeline import chunk_pre_post, forward_backward, stage_layer_ids

VOCAB, HIDDEN, LAYERS = 11, 6, 8
LENGTHS = (5, 9, 3, 7, 4, 6, 2, 8)
AUX_COEF = 0.01  # tokens per micro batch: every activation has its own shape


class Toy(nn.Module):
    """The full model, or (with `layer_ids`, `pre`, `post`) one pipeline chunk of it under the same param names."""

    def __init__(self, layer_ids=range(LAYERS), pre: bool = True, post: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN) if pre else None
        self.layers = nn.ModuleDict({str(i): nn.Linear(HIDDEN, HIDDEN) for i in layer_ids})
        self.head = nn.Linear(HIDDEN, VOCAB) if post else None


def full_model() -> Toy:
    torch.manual_seed(0)
    return Toy()


def chunk_of(full: Toy, layer_ids: range, pre: bool, post: bool) -> Toy:
    chunk = Toy(layer_ids, pre, post)
    chunk.load_state_dict({k: v for k, v in full.state_dict().items() if k in chunk.state_dict()})
    return chunk


def micro_batches(num: int, device: torch.device | str = "cpu") -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    lengths = LENGTHS[:num]
    total = sum(n - 1 for n in lengths)  # predicted tokens in the whole mini batch
    return [dict(tokens=torch.randint(0, VOCAB, (n,), generator=gen).to(device), num_global_tokens=total)
            for n in lengths]


def forward_step_with_aux(chunk: Toy, mb: dict, x: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Also returns a per-layer activation penalty, like an MoE aux loss (per layer, so its sum ignores the cut)."""
    if x is None:
        x = chunk.embed(mb["tokens"])[None]  # [1, T, H]
    aux = torch.zeros((), device=x.device)
    for layer in chunk.layers.values():
        x = torch.tanh(layer(x))
        aux = aux + AUX_COEF * x.pow(2).sum()
    return (x if chunk.head is None else chunk.head(x)), aux  # [1, T, H] or logits [1, T, V]


def forward_step(chunk: Toy, mb: dict, x: torch.Tensor | None) -> torch.Tensor:
    return forward_step_with_aux(chunk, mb, x)[0]


def loss_step(logits: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
    tokens = mb["tokens"]
    logprobs = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, tokens[1:, None])[:, 0]  # [T-1]
    loss = -logprobs.sum() / mb["num_global_tokens"]
    return loss, dict(logprobs=logprobs, num_tokens=torch.tensor(len(tokens), device=tokens.device))


def reference(num: int, aux: bool = False) -> tuple[list[dict], dict]:
    model = full_model()
    outs = []
    for mb in micro_batches(num):
        logits, aux_loss = forward_step_with_aux(model, mb, None)
        loss, outputs = loss_step(logits, mb)
        (loss + aux_loss if aux else loss).backward()
        outs.append(dict(loss=loss.detach(), **outputs))
    return outs, {name: p.grad for name, p in model.named_parameters()}


def _cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    return [_cpu(v) for v in tree] if isinstance(tree, list) else tree


def _train_and_evaluate(chunks: list[Toy], layout: Layout, num: int, aux: bool) -> dict:
    live: list[weakref.ref] = []  # this rank's stage outputs; the alive ones are held for a backward
    peak = [0]

    def counting_step(chunk: Toy, mb: dict, x):
        y = forward_step_with_aux(chunk, mb, x) if aux else forward_step(chunk, mb, x)
        live.append(weakref.ref(y[0] if aux else y))
        peak[0] = max(peak[0], sum(r() is not None for r in live))
        return y

    mbs = micro_batches(num, layout.device)
    trained = forward_backward(chunks, mbs, layout, counting_step, loss_step, broadcast_outputs=True)
    grads = {name: p.grad for chunk in chunks for name, p in chunk.named_parameters()}
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    evaluated = forward_backward(chunks, mbs, layout, forward_step, loss_step, forward_only=True)
    return _cpu(dict(trained=trained, grads=grads, peak=peak[0], evaluated=evaluated,
                     grads_after_eval=[p.grad for chunk in chunks for p in chunk.parameters() if p.grad is not None],
                     evaluated_requires_grad=any(v.requires_grad for d in evaluated for v in d.values())))


Case = tuple[int, int, tuple[int, ...], bool]  # PP, VPP, micro-batch counts to run, chunks return an aux loss


def _pipeline_rank(world: int, cases: list[Case]) -> list[dict]:
    """Every case in the same processes (one spawn per world size keeps the suite fast on two cores), all layouts
    from one registry (at PP4 the middle stages make no embedding group, so a second registry would hang)."""
    results, registry = [], GroupRegistry()
    for pp, vpp, nums, aux in cases:
        layout = Layout.create(LayoutSpec(world_size=world, pp=pp, vpp=vpp), registry=registry)
        full = full_model()
        chunks = []
        for c in range(vpp):
            ids = stage_layer_ids(LAYERS, pp, vpp, layout.pp_rank, c)
            chunks.append(chunk_of(full, ids, *chunk_pre_post(pp, vpp, layout.pp_rank, c)).to(layout.device))
        runs = [_train_and_evaluate(chunks, layout, num, aux) for num in nums]
        results.append(dict(pp_rank=layout.pp_rank, dp_rank=layout.dp_rank, runs=runs))
    return results


def assert_outputs_equal(got: list[dict], want: list[dict], atol: float) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for key in w:
            assert g[key].shape == w[key].shape and g[key].dtype == w[key].dtype, key
            torch.testing.assert_close(g[key], w[key], rtol=0, atol=atol)


def check_against_reference(per_rank: list[list[dict]], cases: list[Case], atol: float) -> None:
    for i, case in enumerate(cases):
        _check_case([rank_results[i] for rank_results in per_rank], *case, atol=atol)


def _check_case(results: list[dict], pp: int, vpp: int, nums: tuple[int, ...], aux: bool, atol: float) -> None:
    for replica in {res["dp_rank"] for res in results}:  # each data-parallel replica is its own pipeline
        stages = sorted((res for res in results if res["dp_rank"] == replica), key=lambda res: res["pp_rank"])
        for i, num in enumerate(nums):
            runs = [stage["runs"][i] for stage in stages]
            want, want_grads = reference(num, aux)
            for run in runs:  # broadcast_outputs: every stage has the last stage's outputs
                assert_outputs_equal(run["trained"], want, atol)
            grads = {name: g for run in runs for name, g in run["grads"].items()}
            assert grads.keys() == want_grads.keys()
            for name, grad in want_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=0, atol=atol, msg=name)

            # Forward only: same outputs on the last stage, nothing elsewhere, no grads and no graph kept.
            assert_outputs_equal(runs[-1]["evaluated"], reference(num)[0], atol)
            assert all(run["evaluated"] == [] for run in runs[:-1])
            assert all(run["grads_after_eval"] == [] and not run["evaluated_requires_grad"] for run in runs)

            # Peak number of micro batches whose activations stage 0 holds: PP for 1F1B (not `num`, as
            # all-forwards-first would give); interleaved: a warm-up of 2*(PP-1) + (VPP-1)*PP virtual ones, plus one.
            bound = pp if vpp == 1 else 2 * (pp - 1) + (vpp - 1) * pp + 1
            assert runs[0]["peak"] == min(bound, num * vpp)


# PP2 runs on 4 ranks (DP2): the PP groups are then [0, 2] and [1, 3], so group and global ranks differ.
CPU_CASES = {
    2: [(2, 1, (8,), False), (2, 2, (8,), False)],
    4: [(4, 1, (8, 2), False), (4, 2, (4,), True)],  # 2 micro batches < PP: clipped warm-up; aux losses per chunk
}


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_matches_single_process(pp):
    cases = CPU_CASES[pp]
    check_against_reference(run_distributed(4, _pipeline_rank, 4, cases), cases, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pipeline_on_nccl():
    cases = [(2, 1, (8, 2), False), (2, 2, (4,), True)]
    check_against_reference(run_distributed(2, _pipeline_rank, 2, cases, backend="nccl"), cases, atol=1e-5)


def test_no_pipeline_is_gradient_accumulation():
    model = full_model()
    mbs = micro_batches(4)
    out = forward_backward([model], mbs, Layout.single(), forward_step, loss_step)
    want, want_grads = reference(4)
    assert_outputs_equal(out, want, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], rtol=0, atol=1e-6, msg=name)


def _rank_fails_mid_pipeline() -> None:
    layout = Layout.create(LayoutSpec(world_size=2, pp=2), timeout=datetime.timedelta(seconds=20))
    full = full_model()
    chunk = chunk_of(full, stage_layer_ids(LAYERS, 2, 1, layout.pp_rank, 0), *chunk_pre_post(2, 1, layout.pp_rank, 0))

    def broken_loss(logits, mb):
        raise ValueError("loss exploded")

    forward_backward([chunk], micro_batches(2), layout, forward_step, broken_loss)


def test_failed_peer_is_named():
    with pytest.raises(RuntimeError) as info:
        run_distributed(2, _rank_fails_mid_pipeline)
    message = str(info.value)
    assert "loss exploded" in message
    assert PipelineCommError.__name__ in message and "global rank 1" in message
