"""Tensor/sequence-parallel layers against single-process torch references (forward and gradients), on gloo."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.testing import assert_close

from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import load_hf_weights
from shardrl.models.tiny import hf_logits, make_tiny_checkpoint, packed_batch
from shardrl.models.transformer import Transformer
from shardrl.parallel.data import GradBuffers
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.spec import get_spec
from shardrl.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    enter_tp,
    gather_tokens,
    scatter_tokens,
    token_split_sizes,
)
from shardrl.parallel.vocab import VocabParallelEmbedding, gather_vocab, vocab_parallel_logprobs

T, H, F_SIZE, VOCAB = 5, 8, 6, 11  # 5 tokens over TP2 and a vocab of 11 (padded to 12): uneven on purpose


def _reference_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_vocab_logprobs_single_rank_matches_log_softmax_and_masks_padding():
    torch.manual_seed(0)
    logits = torch.randn(4, 10, requires_grad=True)
    targets = torch.tensor([0, 3, 7, 6])
    up_lp, up_ent = torch.randn(4), torch.randn(4)
    # Columns 8, 9 are vocab padding: they must not count, whatever their values.
    lp, ent = vocab_parallel_logprobs(logits, targets, None, vocab_size=8)
    (lp * up_lp + ent * up_ent).sum().backward()
    ref_logits = logits.detach()[:, :8].clone().requires_grad_()
    ref_lp, ref_ent = _reference_logprobs(ref_logits, targets)
    (ref_lp * up_lp + ref_ent * up_ent).sum().backward()
    assert_close(lp, ref_lp)
    assert_close(ent, ref_ent)
    assert_close(logits.grad[:, :8], ref_logits.grad)
    assert not logits.grad[:, 8:].any()


def _full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"col.weight": (F_SIZE, H), "col.bias": (F_SIZE,), "row.weight": (H, F_SIZE), "row.bias": (H,),
              "emb.weight": (VOCAB, H), "x": (T, H), "up": (T, H), "logits": (T, VOCAB), "up_lp": (T,),
              "up_ent": (T,), "scale": (T, H)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _chunk(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    return x.split(token_split_sizes(x.shape[0], layout.tp_size))[layout.tp_rank]


def _shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The slice of a full-size reference tensor that `param`'s spec says this rank holds (vocab padding: zeros)."""
    spec = get_spec(param)
    if spec.dim is None:
        return full
    start, stop = spec.slice_range()
    out = torch.zeros(spec.local_shape(), dtype=full.dtype, device=full.device)
    out.narrow(spec.dim, 0, stop - start).copy_(full.narrow(spec.dim, start, stop - start))
    return out


def _check_linears(layout: Layout, ckpt: Path, t: dict, sp: bool) -> None:
    col = ColumnParallelLinear(H, F_SIZE, layout, "col", bias=True)
    row = RowParallelLinear(F_SIZE, H, layout, "row", bias=True, sequence_parallel=sp)
    load_hf_weights([col, row], ckpt)
    x_full = t["x"].clone().requires_grad_()
    ref = F.linear(F.gelu(F.linear(x_full, t["col.weight"].requires_grad_(), t["col.bias"].requires_grad_())),
                   t["row.weight"].requires_grad_(), t["row.bias"].requires_grad_())
    (ref * t["up"]).sum().backward()
    x = (_chunk(t["x"], layout) if sp else t["x"]).clone().requires_grad_()
    y = row(F.gelu(col(enter_tp(x, layout.tp_group, sp, T))))
    up = _chunk(t["up"], layout) if sp else t["up"]
    (y * up).sum().backward()
    assert_close(y, _chunk(ref, layout) if sp else ref)
    assert_close(x.grad, _chunk(x_full.grad, layout) if sp else x_full.grad)
    for param, name in ((col.weight, "col.weight"), (col.bias, "col.bias"), (row.weight, "row.weight")):
        assert_close(param.grad, _shard(t[name].grad, param))
    bias_grad = row.bias.grad.clone()
    if get_spec(row.bias).sum_grad_over_group:  # SP: each rank added the bias to its own tokens only
        dist.all_reduce(bias_grad, group=layout.tp_group)
    assert get_spec(row.bias).sum_grad_over_group == sp
    assert_close(bias_grad, t["row.bias"].grad)
    for name in ("col.weight", "col.bias", "row.weight", "row.bias"):
        t[name].grad = None


def _check_embedding_and_logprobs(layout: Layout, ckpt: Path, t: dict, sp: bool) -> None:
    emb = VocabParallelEmbedding(VOCAB, H, layout, "emb.weight", sequence_parallel=sp)
    load_hf_weights(emb, ckpt)
    ids = torch.tensor([0, 10, 5, 6, 3], device=layout.device)  # both halves of the padded vocab [0..5], [6..11]
    out = emb(ids)
    assert_close(out, _chunk(t["emb.weight"][ids], layout) if sp else t["emb.weight"][ids])
    (out * (_chunk(t["up"], layout) if sp else t["up"])).sum().backward()
    ref_grad = torch.zeros(VOCAB, H, device=layout.device).index_add_(0, ids, t["up"])
    # Complete without any further sum: with SP the backward of the reduce-scatter gathers every token's gradient.
    assert not get_spec(emb.weight).sum_grad_over_group
    assert_close(emb.weight.grad, _shard(ref_grad, emb.weight))
    # With a GradBuffers main_grad the rows' gradients go into its rows (two backwards: they accumulate), no .grad.
    emb.weight.grad = None
    buffers = GradBuffers(emb.parameters(), layout)
    buffers.zero()
    for _ in range(2):
        (emb(ids) * (_chunk(t["up"], layout) if sp else t["up"])).sum().backward()
    assert emb.weight.grad is None
    assert_close(emb.weight.main_grad, 2 * _shard(ref_grad, emb.weight))

    logits = t["logits"].clone().requires_grad_()
    ref_lp, ref_ent = _reference_logprobs(logits, ids)
    (ref_lp * t["up_lp"] + ref_ent * t["up_ent"]).sum().backward()
    padded = F.pad(t["logits"], (0, 1), value=1e4)  # a huge padded column would dominate if it were not masked
    local = padded.chunk(layout.tp_size, dim=-1)[layout.tp_rank].clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(local, ids, layout.tp_group, VOCAB)
    (lp * t["up_lp"] + ent * t["up_ent"]).sum().backward()
    assert_close(lp, ref_lp)
    assert_close(ent, ref_ent)
    assert_close(local.grad, F.pad(logits.grad, (0, 1)).chunk(layout.tp_size, dim=-1)[layout.tp_rank])
    assert_close(gather_vocab(local.detach(), layout.tp_group, VOCAB), t["logits"])


def _check_token_scatter(layout: Layout, t: dict) -> None:
    x = t["x"].clone().requires_grad_()
    y = gather_tokens(scatter_tokens(x, layout.tp_group) * _chunk(t["scale"], layout), layout.tp_group, T)
    (y * t["up"]).sum().backward()
    assert_close(y, t["x"] * t["scale"])
    assert_close(x.grad, t["up"] * t["scale"])


def tp2_layers(ckpt: Path) -> None:
    """Every TP2 layer check, SP off and on; runs on gloo (CPU) or NCCL (tensors on the layout's device)."""
    layout = Layout.create(LayoutSpec(world_size=2, tp=2))
    t = {name: value.to(layout.device) for name, value in _full_tensors().items()}
    for sp in (False, True):
        _check_linears(layout, ckpt, t, sp)
        _check_embedding_and_logprobs(layout, ckpt, t, sp)
    _check_token_scatter(layout, t)


def save_layer_weights(path: Path) -> Path:
    save_file({k: v for k, v in _full_tensors().items() if "." in k}, path / "model.safetensors")
    return path


def test_tp2_layers_forward_and_gradients_match_reference(tmp_path):
    run_distributed(2, tp2_layers, save_layer_weights(tmp_path))


def _reduced_grad(param: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's gradient after the sums the spec asks for (what the optimizer's grad finalisation does)."""
    spec, grad = get_spec(param), param.grad.clone()
    if spec.sum_grad_over_group:
        dist.all_reduce(grad, group=layout.tp_group)
    elif spec.dim is not None and spec.num_shards < layout.tp_size:  # replicated KV shard: sum over its replicas
        grads = [torch.empty_like(grad) for _ in range(layout.tp_size)]
        dist.all_gather(grads, grad, group=layout.tp_group)
        per_shard = layout.tp_size // spec.num_shards
        grad = sum(grads[spec.index * per_shard: (spec.index + 1) * per_shard])
    return grad


def _tp4_kv_heads_below_tp(ckpt: Path, batch: tuple, expected: torch.Tensor) -> list[str]:
    input_ids, position_ids, cu_seqlens = batch
    config = ModelConfig.from_pretrained(ckpt)
    reference = Transformer(config, Layout.single())
    load_hf_weights(reference, ckpt)
    ref_lp, ref_ent = reference.compute_logprobs(reference(input_ids, position_ids, cu_seqlens), input_ids.roll(-1))
    (ref_lp.sum() + ref_ent.sum()).backward()

    layout = Layout.create(LayoutSpec(world_size=4, tp=4))
    model = Transformer(config, layout, sequence_parallel=True)
    load_hf_weights(model, ckpt)
    hidden = model(input_ids, position_ids, cu_seqlens)  # [T/4 (uneven), H]
    assert hidden.shape[0] == token_split_sizes(input_ids.shape[0], 4)[layout.tp_rank]
    logits = gather_vocab(model.compute_logits(hidden, input_ids.shape[0]), layout.tp_group, config.vocab_size)
    assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    lp, ent = model.compute_logprobs(hidden, input_ids.roll(-1))
    (lp.sum() + ent.sum()).backward()
    assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    ref_grads = {get_spec(p).hf_name: p.grad for p in reference.parameters()}
    kv_specs = []
    for param in model.parameters():
        spec = get_spec(param)
        assert_close(_reduced_grad(param, layout), _shard(ref_grads[spec.hf_name], param), atol=1e-5, rtol=1e-4)
        if spec.num_shards == 2 and spec.hf_name.endswith("k_proj.weight"):
            kv_specs.append(f"{spec.hf_name}:{spec.index}")
    return kv_specs


def test_tp4_with_two_kv_heads_and_sequence_parallel(tmp_path):
    ckpt = make_tiny_checkpoint("llama", tmp_path / "llama")  # 4 query heads, 2 KV heads
    batch = packed_batch([4, 3], vocab_size=128)  # 7 tokens: SP chunks 2, 2, 2, 1
    expected = hf_logits(ckpt, batch[0], batch[2])
    out = run_distributed(4, _tp4_kv_heads_below_tp, ckpt, batch, expected)
    # Ranks 0,1 share KV head 0 and ranks 2,3 KV head 1.
    assert [o[0].split(":")[1] for o in out] == ["0", "0", "1", "1"]
