"""Offloaded trainer params are read from host memory once per sync: trainer EP2 -> rollout TP2 with experts
tensor-split (each rank keeps one column half of its experts and sends the other), on 2 gloo ranks with hand-built
shard specs, so the bytes every rank must read are written out by hand below."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry
from shardrl.parallel.offload import HostBuffers, offload
from shardrl.parallel.spec import ShardSpec, set_spec
from shardrl.sync.shards import Shards
from shardrl.sync.weight_sync import WeightSync

EXPERT = "layers.0.experts.{expert}.w%d"
NUM_EXPERT_PARAMS = 3
BUCKET = 1024  # colocated ranks use half-bucket buffers: 448 data bytes, all three expert pieces (128 B each)


def _full_tensors() -> dict[str, torch.Tensor]:
    """The HF tensors, identical on both ranks: 4 experts [4, 8] per expert param, a dense [6, 8] the rollout splits
    by columns and a dense [8, 4] it splits by rows."""
    gen = torch.Generator().manual_seed(0)
    full = {EXPERT % k: torch.randn(4, 4, 8, generator=gen) for k in range(NUM_EXPERT_PARAMS)}
    full["cols"], full["rows"] = torch.randn(6, 8, generator=gen), torch.randn(8, 4, generator=gen)
    return full


def _module(tensors: dict[str, tuple[torch.Tensor, ShardSpec]]) -> nn.Module:
    module = nn.Module()
    for i, (value, spec) in enumerate(tensors.values()):
        param = nn.Parameter(value.clone(), requires_grad=False)
        set_spec(param, spec)
        module.register_parameter(f"p{i}", param)
    return module


def _sync_rank() -> dict:
    rank, full = dist.get_rank(), _full_tensors()
    group = GroupRegistry().sync_group([0, 1])  # the only group this process makes
    own = (2 * rank, 2 * rank + 2)  # EP2: this rank's two experts
    trainer = _module({
        **{name: (full[name][own[0]:own[1]], ShardSpec(name, (4, 8), expert_ids=tuple(range(*own))))
           for name in full if "experts" in name},
        "cols": (full["cols"], ShardSpec("cols", (6, 8))), "rows": (full["rows"], ShardSpec("rows", (8, 4)))})
    rollout = _module({
        **{name: (torch.zeros(4, 4, 4), ShardSpec(name, (4, 8), dim=1, num_shards=2, index=rank, group="etp",
                                                  expert_ids=(0, 1, 2, 3))) for name in full if "experts" in name},
        "cols": (torch.zeros(6, 4), ShardSpec("cols", (6, 8), dim=1, num_shards=2, index=rank)),
        "rows": (torch.zeros(4, 4), ShardSpec("rows", (8, 4), dim=0, num_shards=2, index=rank))})
    host = HostBuffers()
    offload(trainer, host)
    sync = WeightSync(group, torch.device("cpu"), BUCKET, source=Shards(trainer, sending=True, host=host),
                      target=Shards(rollout))
    metrics = sync.sync()
    half = slice(4 * rank, 4 * rank + 4)
    expected = {**{name: full[name][:, :, half] for name in full if "experts" in name},
                "cols": full["cols"][:, half], "rows": full["rows"][half]}
    return {"host_read": metrics["sync/bytes_host_read"], "sent": metrics["sync/bytes_sent"],
            "loaded": all(torch.equal(p, expected[name]) for name, p in
                          zip(expected, rollout.parameters())),
            "still_offloaded": all(p.untyped_storage().nbytes() == 0 for p in trainer.parameters())}


def test_offloaded_params_are_read_from_host_once():
    # Per rank: each expert param whole, once (one column half kept, the other sent): 3 x 2 experts x 4 x 8 x 4 B;
    # `cols` whole (a column block is staged with its param): 6 x 8 x 4 B; `rows` only its half: 4 x 4 x 4 B.
    needed = NUM_EXPERT_PARAMS * 2 * 4 * 8 * 4 + 6 * 8 * 4 + 4 * 4 * 4
    for result in run_distributed(2, _sync_rank):
        assert result["loaded"] and result["still_offloaded"], result
        assert result["sent"] == NUM_EXPERT_PARAMS * 2 * 4 * 4 * 4, result  # the other column half of its experts
        assert result["host_read"] == needed, result
