"""One role's model on one rank: pipeline chunks, optimizer and the forward/backward over micro batches.

The actor, reference and critic all run through this class; only their loss functions differ (actor.py,
critic.py). It ties together the pieces that each know one thing: `Transformer` (models/), the pipeline schedule
(parallel/pipeline.py), gradient buffers + AdamW (parallel/optimizer.py) and packing (packing.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from shardrl.algos import LossScale, loss_counts
from shardrl.data.balance import split_by_token_budget
from shardrl.data.batch import Batch
from shardrl.job.options import EngineOptions, UpdateOptions
from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import load_hf_weights
from shardrl.models.transformer import Transformer
from shardrl.parallel.layout import Layout
from shardrl.parallel.lora import attach_lora
from shardrl.parallel.offload import HostBuffers
from shardrl.parallel.optimizer import AdamW, LRScheduler
from shardrl.parallel.pipeline import chunk_pre_post, forward_backward, stage_layer_ids
from shardrl.parallel.expert import attached
from shardrl.parallel.context import gather_tokens
from shardrl.parallel.routing import RoutingTable, expert_id_dtype
from shardrl.workers.packing import Packed, pack

# loss_fn(last chunk, hidden [T, H] of the last stage, micro batch) -> (scalar loss, outputs dict of tensors)
LossFn = Callable[[Transformer, Tensor, "MicroBatch"], tuple[Tensor, dict[str, Tensor]]]
# MoE routing of a pass (routing replay): "record" each token's experts (output as `routed_experts`, R2's record),
# "replay" the batch's `routed_experts` (R2's update, R3's passes), or route itself and "compare" its choices with
# the batch's `routed_experts` (the rollout's). A pass that replays or has `routed_experts` to compare with outputs
# `routing_mismatch`.
Routing = Literal["record", "replay", "compare"] | None
# Called before each optimizer step of an update with (step index, the rank's mini batch, its micro batches).
BeforeStep = Callable[[int, Batch, list["MicroBatch"]], None]
ROUTED_EXPERTS = "routed_experts"  # [B, S, L, k]: per token of input_ids, the experts of each MoE layer
# [B, 2] per row, summed over its tokens and MoE layers: (pairs where the pass's own top-k differed from the batch's
# `routed_experts`, pairs compared); a replayed pass's first column counts the tokens whose choice replay overrode.
ROUTING_MISMATCH = "routing_mismatch"
# [B, R] the old-logprob pass's log-probs with every MoE layer routing itself, beside the R3-replayed ones
# (`router_replay.measure_unreplayed`): the mismatch with the rollout that replay removed, on the same batch.
UNREPLAYED_LOG_PROBS = "unreplayed_log_probs"
OVERRIDDEN_PAIRS, COMPARED_PAIRS = "router_replay/overridden_pairs", "router_replay/compared_pairs"

@dataclass
class MicroBatch:
    """A packed micro batch plus the per-sample tensors its loss reads ([b, R] each) and its rows in the batch.

    `max_seqlen` is known on the host when packing; passing it on spares the model a device read per forward."""

    packed: Packed
    data: dict[str, Tensor]
    rows: list[int] = field(default_factory=list)
    max_seqlen: int | None = None
    routing: RoutingTable | None = None  # the MoE layers record into it or replay it (`Routing`)
    records_routing: bool = False  # the pass outputs the table's experts (`Routing` "record")
    attention_mask: Tensor | None = None  # [b, S] on the host, with a table: where its tokens' rows go back


class ModelEngine:
    def __init__(self, config: ModelConfig, layout: Layout, options: EngineOptions, hf_path: str | None = None,
                 optional_weights: Sequence[str] = (),
                 weights_loader: Callable[[list[Transformer]], None] | None = None) -> None:
        """Build this rank's chunks and load `hf_path` (or call `weights_loader` on the chunks) before the optimizer
        copies the weights into its fp32 master copy. `optional_weights`: HF names that may be missing (a critic's
        value head)."""
        self.config, self.layout, self.options = config, layout, options
        self.host_buffers = HostBuffers()  # host copies of its offloaded tensors; weight sync reads params there
        pp, vpp = layout.pp_size, layout.spec.vpp
        self.chunks = []
        for chunk in range(vpp):
            pre, post = chunk_pre_post(pp, vpp, layout.pp_rank, chunk)
            self.chunks.append(Transformer(
                config, layout, stage_layer_ids(config.num_layers, pp, vpp, layout.pp_rank, chunk), pre, post,
                value_head=options.value_head, sequence_parallel=options.sequence_parallel,
                recompute=options.recompute, dtype=options.dtype, router=options.router, fast=options.fast))
        if hf_path is not None:
            load_hf_weights(self.chunks, hf_path, optional=optional_weights)
        if weights_loader is not None:
            weights_loader(self.chunks)
        if options.lora is not None:  # before the optimizer: it and the gradient buffers then hold adapters only
            for chunk in self.chunks:
                attach_lora(chunk, options.lora, layout)
                if options.value_head and chunk.post_process:  # new, not in the base: it trains whole (PEFT's
                    chunk.score.weight.requires_grad_(True)  # modules_to_save of a token-classification model)
        self.optimizer: AdamW | None = None
        self.scheduler: LRScheduler | None = None
        if options.optim is not None:
            o = options.optim
            params = [p for chunk in self.chunks for p in chunk.parameters() if p.requires_grad]
            self.optimizer = AdamW(params, layout, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                   clip_grad=o.clip_grad, distributed=o.distributed)
            if o.total_steps is None:
                raise ValueError("OptimOptions.total_steps is None: bind the plan's steps first "
                                 "(JobPlan.with_total_steps)")
            self.scheduler = LRScheduler(self.optimizer, total_steps=o.total_steps, warmup_steps=o.warmup_steps,
                                         warmup_steps_ratio=o.warmup_ratio, style=o.decay_style,
                                         min_lr_ratio=o.min_lr_ratio, decay_steps=o.decay_steps)
        else:
            for chunk in self.chunks:
                chunk.requires_grad_(False)

    def run(self, micro_batches: list[MicroBatch], loss_fn: LossFn, forward_only: bool) -> list[dict[str, Tensor]]:
        """Forward (+ backward) every micro batch through the pipeline; per-micro-batch outputs on every rank."""
        last = self.chunks[-1]
        if self.layout.cp_size > 1:  # each CP rank runs its share of every micro batch's tokens (and routing rows)
            micro_batches = [self._context_share(mb) for mb in micro_batches]

        def forward_step(chunk: Transformer, mb: MicroBatch, x: Tensor | None) -> Tensor:
            p = mb.packed
            with attached(chunk, mb.routing) if mb.routing is not None else contextlib.nullcontext():
                return chunk(p.input_ids if x is None else x, p.position_ids, p.cu_seqlens, max_seqlen=mb.max_seqlen,
                             context=p.context)

        outputs = forward_backward(self.chunks, micro_batches, self.layout, forward_step,
                                   lambda hidden, mb: loss_fn(last, hidden, mb), forward_only=forward_only,
                                   broadcast_outputs=True)
        groups = [self.layout.tp_group, self.layout.pp_group]  # each rank routed its tokens at its layers
        for mb, out in zip(micro_batches, outputs):
            table, context = mb.routing, mb.packed.context
            if table is None:
                continue

            def whole(per_token: Tensor) -> Tensor:  # a CP share's rows -> the micro batch's, in packed order
                return per_token if context is None else gather_tokens(per_token, context, replicated=True)

            if table.counts_mismatch:
                out[ROUTING_MISMATCH] = per_row(whole(table.mismatch_per_token(groups)), mb.attention_mask)
            if mb.records_routing:
                table.complete(groups)
                out[ROUTED_EXPERTS] = unpack_routing(whole(table.experts), mb.attention_mask,
                                                     self.config.moe.num_experts)
        return outputs

    def _context_share(self, mb: MicroBatch) -> MicroBatch:
        """This CP rank's share of a micro batch: its tokens, and its rows of the routing table."""
        packed = mb.packed.context_share(self.layout)
        routing = None if mb.routing is None else mb.routing.context_share(packed.context.local_index)
        return dataclasses.replace(mb, packed=packed, routing=routing)

    @property
    def count_group(self) -> dist.ProcessGroup | None:
        """The ranks that must run as many micro batches per pass: an MoE layer's expert exchange spans DP
        replicas (EP groups are carved from them), each of which cuts its own share by its tokens (dynamic batch
        size). None when no collective crosses DP replicas inside a forward."""
        if self.config.moe is None or self.layout.ep_size == 1:
            return None
        return self.layout.dp_cp_group

    def step(self) -> dict[str, float]:
        """Apply one optimizer update from the accumulated gradients, then advance the LR schedule."""
        assert self.optimizer is not None and self.scheduler is not None, "step() on an inference-only engine"
        lr = self.optimizer.lr
        grad_norm, skipped = self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        return {"grad_norm": grad_norm, "lr": lr, "update_skipped": float(skipped)}


def make_micro_batches(batch: Batch, keys: Sequence[str], device: torch.device, micro_batch_size: int | None,
                       max_token_len: int | None, routing: Routing = None, model_config: ModelConfig | None = None,
                       count_group: dist.ProcessGroup | None = None) -> tuple[list[MicroBatch], list[int]]:
    """Cut a rank's batch into packed micro batches: fixed `micro_batch_size` samples, or (dynamic batch size)
    at most `max_token_len` tokens each, as many on every rank of `count_group` (the most any of them needs:
    `ModelEngine.count_group`). Returns them and `restore` so that concatenated per-row outputs `[restore]` are
    back in batch order. `routing` (with the MoE model's `model_config`): each micro batch records its tokens'
    experts (the pass then outputs `routed_experts`) or replays the batch's `routed_experts`, packed like its
    tokens."""
    lengths = batch.tensors["attention_mask"].sum(-1).tolist()
    if max_token_len is not None:
        groups, restore = split_by_token_budget(lengths, max_token_len)
        if count_group is not None:
            most = torch.tensor([len(groups)], device=device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=count_group)
            if int(most) > len(groups):
                groups, restore = split_by_token_budget(lengths, max_token_len, min(int(most), len(lengths)))
    else:
        if not micro_batch_size or micro_batch_size < 1:
            raise ValueError(f"micro batch size must be >= 1, got {micro_batch_size}")
        groups = [list(range(i, min(i + micro_batch_size, len(batch)))) for i in range(0, len(batch),
                                                                                     micro_batch_size)]
        restore = list(range(len(batch)))
    response_length = batch.tensors["responses"].shape[1]
    out = []
    for rows in groups:
        t = batch.tensors.rows(rows)
        packed = pack(t["input_ids"], t["attention_mask"], t["position_ids"], response_length).to(device)
        mb = MicroBatch(packed, {k: t[k].to(device) for k in keys}, rows, max(lengths[r] for r in rows))
        if routing is not None:
            mb.routing = routing_table(t, packed.num_tokens, routing, model_config, device)
            mb.records_routing = routing == "record"
            mb.attention_mask = t["attention_mask"]
        out.append(mb)
    return out, restore


def routing_table(t, num_tokens: int, routing: Routing, config: ModelConfig, device: torch.device) -> RoutingTable:
    """A micro batch's routing table: empty to record into (compared against its rows' `routed_experts` where the
    batch has them), or those `routed_experts` packed like their tokens (row after row, the attention-masked
    positions) to replay."""
    layer_ids = sorted(config.moe.layers)
    batch_routing = None
    if ROUTED_EXPERTS in t.keys():
        batch_routing = t[ROUTED_EXPERTS][t["attention_mask"].bool()].to(device)  # [T, L, k]
    elif routing != "record":
        raise ValueError(f"routing {routing}: the batch has no {ROUTED_EXPERTS!r} (recorded by the old-logprob pass, "
                         f"R2, or the rollout, R3: actor_rollout_ref.rollout.enable_rollout_routing_replay)")
    if routing == "replay":
        return RoutingTable(batch_routing, layer_ids, replay=True)
    return RoutingTable.recording(num_tokens, layer_ids, config.moe.top_k, device, reference=batch_routing)


def unpack_routing(experts: Tensor, attention_mask: Tensor, num_experts: int) -> Tensor:
    """A recorded table's experts [T, L, k] (packed order) back to their rows: [b, S, L, k] on the host in the
    smallest integer type of the expert ids, zero at padding."""
    mask = attention_mask.bool()
    out = torch.zeros(*mask.shape, *experts.shape[1:], dtype=expert_id_dtype(num_experts))
    out[mask] = experts.cpu().to(out.dtype)
    return out


def per_row(per_token: Tensor, attention_mask: Tensor) -> Tensor:
    """Packed per-token counts [T, C] -> per-row sums [b, C] (float64, on their device: no host read per micro
    batch)."""
    rows = attention_mask.bool().nonzero()[:, 0].to(per_token.device, non_blocking=True)  # [T] each token's row
    return torch.zeros(attention_mask.shape[0], per_token.shape[1], dtype=torch.float64,
                       device=per_token.device).index_add_(0, rows, per_token.double())


def mini_batches(batch: Batch, size: int, shuffle: bool, seed: int) -> list[Batch]:
    if size < 1 or len(batch) % size:
        raise ValueError(f"per-rank mini batch {size} must be >= 1 and divide the rank's {len(batch)} samples")
    order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed)) if shuffle else None
    rows = order.tolist() if order is not None else list(range(len(batch)))
    return [batch.take(rows[i:i + size]) for i in range(0, len(batch), size)]


def train_epochs(engine: ModelEngine, batch: Batch, update: UpdateOptions, keys: Sequence[str],
                 make_loss_fn: Callable[[LossScale], LossFn], max_response_length: int,
                 routing: Routing = None, before_step: BeforeStep | None = None) -> dict[str, list[float]]:
    """PPO epochs over mini batches of `batch`, one optimizer step each. The loss of every micro batch is built
    with the mini batch's global counts (`LossScale`, summed over micro batches and DP), so the gradient does not
    depend on the cut. Metrics per step are exact mini-batch values (micro-batch shares summed, then over DP).
    `before_step(i, mini, micro batches)` runs before step i's forward, at the weights that step differentiates,
    and may add per-row tensors to its micro batches' data (clip_cov / kl_cov's token selection).

    Host reads of device values: the counts and the data's copies to the device before the first forward, the
    optimizer's grad norm once per step, and every step's metrics once at the end; nothing per micro batch."""
    minis = [mini for epoch in range(update.ppo_epochs)
             for mini in mini_batches(batch, update.mini_batch_size, update.shuffle, update.seed + epoch)]
    if not minis:
        return {}
    counts = global_counts(minis, engine.layout)
    # Every step's micro batches go to the device now: a blocking host-to-device copy waits for the queued kernels,
    # which is free before the first forward and a stall between steps.
    micros = [make_micro_batches(mini, keys, engine.layout.device, update.micro_batch_size, update.max_token_len,
                                 routing, engine.config, engine.count_group)[0] for mini in minis]
    names: list[str] = []
    step_sums: list[Tensor] = []  # [num metrics] float64 on the device, per step
    step_metrics: list[dict[str, float]] = []
    for index, (mini, micro, (num_tokens, num_seqs)) in enumerate(zip(minis, micros, counts)):
        if before_step is not None:
            before_step(index, mini, micro)
        scale = LossScale(num_tokens, num_seqs, max_response_length)
        outputs = engine.run(micro, make_loss_fn(scale), forward_only=False)
        for o in outputs:  # a replayed update's routing counts, as metrics (`replay_overridden_fraction`)
            if ROUTING_MISMATCH in o:
                overridden, compared = o.pop(ROUTING_MISMATCH).sum(0)
                o[OVERRIDDEN_PAIRS], o[COMPARED_PAIRS] = overridden, compared
        names = names or [k for k, v in outputs[0].items() if v.dim() == 0]  # scalars are metrics, the rest outputs
        step_sums.append(torch.stack([sum(o[k] for o in outputs).double() for k in names]))
        step_metrics.append(engine.step())
    sums = all_reduce_sum(torch.stack(step_sums), engine.layout).tolist()  # [steps][metrics]
    metrics: dict[str, list[float]] = {}
    for values, host in zip(sums, step_metrics):
        for k, v in (dict(zip(names, values)) | host).items():
            metrics.setdefault(k, []).append(v)
    return metrics


def replay_overridden_fraction(metrics: dict[str, list[float]]) -> dict[str, list[float]]:
    """An update's per-step routing counts -> `router_replay/overridden`: the fraction of (token, MoE layer) pairs
    where replay overrode the layer's own top-k (how far the update's routing had drifted from the replayed one)."""
    if OVERRIDDEN_PAIRS not in metrics:
        return metrics
    overridden, compared = metrics.pop(OVERRIDDEN_PAIRS), metrics.pop(COMPARED_PAIRS)
    return metrics | {"router_replay/overridden": [o / max(c, 1.0) for o, c in zip(overridden, compared)]}


def global_counts(minis: list[Batch], layout: Layout) -> list[list[float]]:
    """(num_tokens, num_seqs) of each mini batch over all DP replicas: counted on the host from the response masks,
    then one all-reduce (and one read back) for the whole update when there are DP replicas."""
    counts = torch.stack([loss_counts(mini.tensors["response_mask"]) for mini in minis])  # [steps, 2] float64
    if layout.dp_group is not None:
        counts = all_reduce_sum(counts.to(layout.device), layout)
    return counts.tolist()


def all_reduce_sum(values: Tensor, layout: Layout) -> Tensor:
    """Sum over the data-parallel replicas (each replica's TP/CP/PP ranks hold the same rows)."""
    group = layout.dp_group
    if group is not None:
        dist.all_reduce(values, group=group)
    return values


def stack_outputs(outputs: list[dict[str, Tensor]], key: str, restore: list[int]) -> Tensor:
    """Concatenate a per-row output over micro batches and put the rows back in batch order."""
    return torch.cat([o[key] for o in outputs])[restore]


