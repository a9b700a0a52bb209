"""Dynamic batch size under expert parallelism: the expert exchange of every MoE layer is a collective over an EP
group carved from DP replicas, so each replica must run as many micro batches as the others, though each cuts its
own share by its tokens. Two replicas with shares of very different lengths get the same count (the larger one's),
every micro batch within the token budget; a dense model's replicas keep their own counts."""

import torch

from shardrl.data.batch import Batch
from shardrl.job.options import EngineOptions
from shardrl.models.config import ModelConfig
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.workers.engine import ModelEngine, make_micro_batches

BUDGET, RESPONSE = 16, 4


def share(lengths: list[int]) -> Batch:
    width = max(lengths)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    return Batch({"input_ids": mask.clone(), "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                  "responses": mask[:, -RESPONSE:].clone()})


def _counts(path: str, sizes: dict) -> tuple[int, list[int]]:
    layout = Layout.create(LayoutSpec(world_size=2, **sizes))
    engine = ModelEngine(ModelConfig.from_pretrained(path), layout, EngineOptions(), hf_path=path)
    lengths = [15, 14, 13, 12] if layout.dp_rank == 0 else [5, 4, 6, 5]  # 4 micro batches vs 2 on their own
    micro, _ = make_micro_batches(share(lengths), (), layout.device, None, BUDGET, count_group=engine.count_group)
    return len(micro), [mb.packed.num_tokens for mb in micro]


def test_ep_replicas_run_as_many_micro_batches_and_dense_ones_their_own(tmp_path):
    moe = make_tiny_checkpoint("qwen3_moe", tmp_path / "moe")
    dense = make_tiny_checkpoint("qwen3", tmp_path / "dense")
    ep = run_distributed(2, _counts, str(moe), dict(ep=2))
    assert [count for count, _ in ep] == [4, 4]
    assert all(n <= BUDGET for _, tokens in ep for n in tokens)
    assert [count for count, _ in run_distributed(2, _counts, str(dense), {})] == [4, 2]
