"""Issue 4's parity matrix: every layout gives the 1-process reference's loss, logprobs, gradients and (after 3
clipped AdamW steps) parameters, for a tiny dense and a tiny MoE model, through the real actor path (packing,
pipeline schedule, vocab-parallel logprobs, PPO loss with global counts, gradient finalisation, optimizer)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from shardrl.algos import ClipRange, LossScale, loss_counts
from shardrl.data.batch import Batch
from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import export_hf_weights, save_hf_checkpoint, save_peft_adapter
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.lora import LoRASettings
from shardrl.parallel.spec import get_spec
from shardrl.workers.actor import compute_log_prob, policy_loss_fn
from shardrl.job.options import EngineOptions, ForwardBatching, OptimOptions, PolicyLossOptions
from shardrl.workers.engine import ModelEngine, all_reduce_sum, make_micro_batches

PROMPT, RESPONSE, BATCH, VOCAB = 6, 5, 8, 128
LOSS = PolicyLossOptions(loss_agg_mode="seq-mean-token-mean", clip=ClipRange(0.2, clip_ratio_c=3.0),
                         entropy_coeff=0.01, max_response_length=RESPONSE)
KEYS = ("old_log_probs", "advantages", "response_mask")


def make_batch(seed: int = 0) -> Batch:
    """Left-padded prompts + right-padded responses of random lengths, random advantages and old logprobs."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, PROMPT + 1, (BATCH,), generator=g)
    response_lens = torch.randint(1, RESPONSE + 1, (BATCH,), generator=g)
    ids = torch.randint(0, VOCAB, (BATCH, PROMPT + RESPONSE), generator=g)
    cols = torch.arange(PROMPT + RESPONSE)
    attention = ((cols >= PROMPT - prompt_lens[:, None]) & (cols < PROMPT + response_lens[:, None])).long()
    position = (attention.cumsum(-1) - 1).clamp_min(0)
    response_mask = attention[:, PROMPT:].float()
    return Batch({"input_ids": ids * attention, "attention_mask": attention, "position_ids": position,
                  "responses": (ids * attention)[:, PROMPT:], "response_mask": response_mask,
                  "advantages": torch.randn(BATCH, RESPONSE, generator=g) * response_mask,
                  "old_log_probs": (-torch.rand(BATCH, RESPONSE, generator=g) * 6) * response_mask})


@contextmanager
def grads_as_data(params):
    """Temporarily point each param's data at its finalised gradient so the HF export gathers gradients."""
    saved = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.view_as(p)
    try:
        yield
    finally:
        for p, data in zip(params, saved):
            p.data = data


def _exported(engine: ModelEngine) -> dict[str, torch.Tensor]:
    return {name: t.cpu().clone() for name, t in export_hf_weights(engine.chunks, engine.layout)}


def train_on_layout(ckpt: str, sizes: dict, distributed_optimizer: bool, micro_batch_size: int,
                    dtype: torch.dtype = torch.float32, device: str | None = None,
                    registry: GroupRegistry | None = None, lora: LoRASettings | None = None,
                    export_to: Path | None = None) -> dict | None:
    """Logprobs, 3 losses, step-0 gradients (of the trained parameters) and final parameters on `sizes`' layout (HF
    names, full tensors). `dtype`/`device`/`registry` serve the GPU matrix (tests/test_parity_matrix_gpu.py): bf16
    models, a single-GPU reference, several layouts in one process; `lora` trains adapters (tests/test_lora.py),
    and `export_to` then also gets the trained model's log-probs, its PEFT adapter (`peft/`) and merged HF model
    (`merged/`)."""
    sizes = dict(sizes)
    sequence_parallel = sizes.pop("sp", False)
    spec = LayoutSpec(world_size=torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
                      **sizes)
    layout = Layout.create(spec, device=device, registry=registry)
    # eps=1e-3: some gradients are exactly zero in exact arithmetic (k_proj.bias: softmax ignores a per-query
    # constant) and only reduction-order noise in practice; Adam with a tiny eps would blow that noise up to +-lr.
    optim = OptimOptions(lr=1e-2, eps=1e-3, weight_decay=0.1, clip_grad=0.5, distributed=distributed_optimizer)
    engine = ModelEngine(ModelConfig.from_pretrained(ckpt), layout,
                         EngineOptions(dtype=dtype, optim=optim, lora=lora, sequence_parallel=sequence_parallel),
                         hf_path=ckpt)
    dp, dp_rank = layout.dp_size, layout.dp_rank
    batch = make_batch()
    share = batch.take(list(range(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)))
    log_probs, _ = compute_log_prob(engine, share, ForwardBatching(micro_batch_size, None))

    micro_batches, _ = make_micro_batches(share, KEYS, layout.device, micro_batch_size, None)
    counts = all_reduce_sum(sum(loss_counts(mb.data["response_mask"]) for mb in micro_batches), layout)
    scale = LossScale(counts[0].item(), counts[1].item(), RESPONSE)
    params = [p for chunk in engine.chunks for p in chunk.parameters() if p.requires_grad]
    trained = {name for p in params for name in get_spec(p).hf_names()}
    if torch.distributed.is_initialized():  # every stage's and expert rank's trained tensors
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, trained)
        trained = set().union(*everyone)
    losses = []
    for step in range(3):
        outputs = engine.run(micro_batches, policy_loss_fn(LOSS, scale, 1.0), forward_only=False)
        losses.append(all_reduce_sum(sum(o["loss"] for o in outputs).double(), layout).item())
        if step == 0 and not distributed_optimizer:
            engine.optimizer.grads.finalize()
            with grads_as_data(params):
                grads = {name: g for name, g in _exported(engine).items() if name in trained}
        engine.step()
    result = dict(losses=losses, log_probs=log_probs, dp_rank=dp_rank,
                  grads=None if distributed_optimizer else grads, params=_exported(engine))
    if export_to is not None:
        result["final_log_probs"], _ = compute_log_prob(engine, share, ForwardBatching(micro_batch_size, None))
        save_peft_adapter(engine.chunks, layout, export_to / "peft", base_model=ckpt)
        save_hf_checkpoint(engine.chunks, layout, export_to / "merged")
    return result if layout.tp_rank == 0 and layout.pp_rank == 0 and layout.rank("cp") == 0 else None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parity")
    return {
        # 4 layers for PP2 x VPP2; 4 heads / 2 KV heads so TP4 replicates KV heads.
        "dense": str(make_tiny_checkpoint("qwen2", Path(root) / "dense", num_hidden_layers=4)),
        "moe": str(make_tiny_checkpoint("qwen3_moe", Path(root) / "moe", num_hidden_layers=4)),
    }


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, dict]:
    return {kind: train_on_layout(path, {}, False, 2) for kind, path in checkpoints.items()}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    scale = expected.abs().max().clamp_min(1e-6)
    err = (actual - expected).abs().max() / scale
    assert err <= rtol, f"{what}: max error {err:.2e} relative to max |ref| {scale:.2e}"


def gathered_log_probs(results: list[dict | None]) -> tuple[list[dict], torch.Tensor]:
    """The reporting ranks' results and the whole batch's log_probs, DP shares in order."""
    results = [r for r in results if r is not None]
    by_dp = sorted({r["dp_rank"]: r for r in results}.values(), key=lambda r: r["dp_rank"])
    return results, torch.cat([r["log_probs"] for r in by_dp])


def check_against_reference(results: list[dict | None], ref: dict, distributed_optimizer: bool,
                            rtol: float = 1e-5) -> None:
    results, log_probs = gathered_log_probs(results)
    mask = make_batch().tensors["response_mask"]  # padded positions hold arbitrary values
    _assert_close(log_probs * mask, ref["log_probs"] * mask, "log_probs", rtol)
    for r in results:
        for step, (a, b) in enumerate(zip(r["losses"], ref["losses"])):
            assert abs(a - b) <= rtol * max(abs(b), 1e-3), f"loss at step {step}: {a} vs {b}"
        if not distributed_optimizer:
            assert r["grads"].keys() == ref["grads"].keys()
            for name, g in ref["grads"].items():
                _assert_close(r["grads"][name], g, f"grad {name}", rtol)
        for name, p in ref["params"].items():
            _assert_close(r["params"][name], p, f"param {name} after 3 steps", rtol)


LAYOUTS = [  # (model kinds, world, sizes, distributed optimizer, micro batch size)
    (("dense", "moe"), 2, dict(tp=2), False, 2),
    (("dense",), 4, dict(tp=4), False, 2),
    (("dense", "moe"), 2, dict(pp=2), False, 1),
    (("dense",), 2, dict(pp=2, vpp=2), False, 1),
    (("dense", "moe"), 2, {}, False, 4),
    (("dense", "moe"), 2, {}, True, 2),
    (("moe",), 2, dict(ep=2), False, 2),
    (("moe",), 4, dict(ep=4), False, 2),
    (("moe",), 4, dict(ep=2, etp=2), False, 2),
    (("moe",), 4, dict(tp=2, ep=2), False, 2),
    (("dense",), 4, dict(tp=2, pp=2), False, 1),
    (("moe",), 4, dict(pp=2, ep=2), False, 1),
    # Context parallel: micro batches of 2-4 sequences of 3-11 tokens, so some are shorter than CP's 2*CP chunks.
    (("dense", "moe"), 2, dict(cp=2), False, 2),
    (("dense", "moe"), 4, dict(cp=2, tp=2, sp=True), False, 2),
    (("dense",), 4, dict(cp=4), False, 4),
    (("dense",), 4, dict(cp=2, pp=2), False, 1),
    (("moe",), 4, dict(cp=2, ep=2), False, 2),
    (("dense",), 4, dict(cp=2, pp=2, vpp=2), False, 1),
    (("moe",), 4, dict(cp=2, ep=2, etp=2), False, 2),
]
# CI time: CP2 and CP2 x TP2 (+SP) stay in the default suite.
SLOW = {"dense-cp4-w4", "dense-cp2-pp2-w4", "moe-cp2-ep2-w4", "dense-cp2-pp2-vpp2-w4", "moe-cp2-ep2-etp2-w4"}


def _layout_id(kinds, world, sizes, distributed_optimizer, _micro) -> str:
    return "-".join(["+".join(kinds), *(f"{d}{n}" for d, n in sizes.items()), f"w{world}",
                     *(["distopt"] if distributed_optimizer else [])])


@pytest.mark.parametrize("kinds, world, sizes, distributed_optimizer, micro", [
    pytest.param(*layout, id=_layout_id(*layout), marks=[pytest.mark.slow] if _layout_id(*layout) in SLOW else [])
    for layout in LAYOUTS])
def test_layout_matches_single_process(checkpoints, references, kinds, world, sizes, distributed_optimizer, micro):
    for kind in kinds:
        results = run_distributed(world, train_on_layout, checkpoints[kind], sizes, distributed_optimizer, micro)
        check_against_reference(results, references[kind], distributed_optimizer)


@pytest.mark.slow  # eight ranks on CI's two cores; tp2 x ep2 and pp2 x ep2 run in the default set
def test_eight_rank_layout_tp2_pp2_ep2(checkpoints, references):
    results = run_distributed(8, train_on_layout, checkpoints["moe"], dict(tp=2, pp=2, ep=2), False, 1)
    check_against_reference(results, references["moe"], False)


@pytest.mark.slow
def test_eight_rank_layout_cp2_tp2_pp2(checkpoints, references):
    results = run_distributed(8, train_on_layout, checkpoints["dense"], dict(cp=2, tp=2, pp=2, sp=True), False, 1)
    check_against_reference(results, references["dense"], False)
