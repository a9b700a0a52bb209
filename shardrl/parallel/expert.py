"""Mixture-of-experts layer: top-k router, dropless token dispatch over EP, expert FFNs sharded over ETP.

Data flow for the `T` tokens this rank owns (every rank of the layer owns different tokens):

1. route: softmax router (fp32) -> top-k experts and weights per token (HF Qwen2/Qwen3-MoE and Mixtral semantics);
2. sort the `T*k` (token, expert) assignments by expert;
3. EP: `all_to_all_single` sends each assignment's row to the EP rank holding its expert (uneven splits, sizes
   learned first from one small all-gather of per-expert counts over the dispatch group);
4. ETP: the rows that arrived at each rank of an ETP group are all-gathered inside it, so every ETP rank runs every
   row through its F-slice of the expert; the partial down-projections are reduce-scattered back;
5. the reverse all-to-all returns the rows, which are unsorted and summed with their routing weights.

No token is ever dropped (no capacity factor). Each collective is an autograd function whose backward is the
transposed collective, so gradients of inputs and weights are exact.

The load-balancing and z losses act on the gradient only: the layer output is returned unchanged but its backward
also back-propagates `aux_loss_scale * (aux_loss_coef * aux + z_loss_coef * z)`, so pipeline stages need not carry
a side loss. Both losses are computed over the micro batch that the TP group holds (the tokens of all its ranks),
as a single process would; the trainer sets `aux_loss_scale` per micro batch to normalise by global token counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from shardrl.parallel.grouped_gemm import ExpertAdapters, can_use_grouped_mm, expert_ffn
from shardrl.parallel.layout import Layout
from shardrl.parallel.moe_rows import combine_rows, dispatch_rows
from shardrl.parallel.spec import ShardSpec, set_spec
from shardrl.parallel.routing import RoutingTable
from shardrl.parallel.tensor import linear, token_split_sizes


@dataclass(frozen=True)
class RouterOptions:
    """How the trainer's routers run: the weights of their load-balancing and z losses (0: off) and whether their
    logits are computed in fp32 (Megatron's `moe_router_dtype=fp32`) rather than the model dtype. Each training
    role gets its own from its `override_transformer_config`; the rollout engine keeps the defaults."""

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    fp32_logits: bool = False


@dataclass(frozen=True)
class MoENames:
    """HF tensor names of one MoE block; `gate`, `up`, `down` are templates with an ``{expert}`` field."""

    router: str
    gate: str
    up: str
    down: str


class MoELayer(nn.Module):
    """Routed experts of one MoE block (a shared expert, if any, belongs to the model block).

    Parameters: `router.weight` [E, H] replicated; `w_gate`, `w_up` [E/EP, F/ETP, H] and `w_down` [E/EP, H, F/ETP]
    hold this rank's contiguous block of experts (EP rank r: experts r*E/EP ...) and its ETP slice of F.
    """

    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, layout: Layout,
                 names: MoENames, norm_topk_prob: bool, router: RouterOptions = RouterOptions(),
                 dtype: torch.dtype = torch.float32, layer_id: int = 0, bitwise: bool = False) -> None:
        """`layer_id`: the model layer it belongs to (which column of a routing table is its). `bitwise`: the
        router and expert GEMMs run batch invariant (`bitwise_kernels`) and the top-k weights are normalised by a
        sum in a fixed order, so a token's routing and output bits do not depend on the rest of the batch."""
        super().__init__()
        ep, etp = layout.ep_size, layout.etp_size
        if num_experts % ep:
            raise ValueError(f"{names.router}: num_experts={num_experts} is not divisible by expert parallel size {ep}")
        if ffn_size % etp:
            raise ValueError(f"{names.router}: expert ffn size {ffn_size} is not divisible by expert TP size {etp}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{names.router}: top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.layout = layout
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.num_local_experts = num_experts // ep
        self.aux_loss_coef, self.z_loss_coef = router.aux_loss_coef, router.z_loss_coef
        self.fp32_logits = router.fp32_logits
        # Weight of this micro batch's router losses, set by the trainer (e.g. micro-batch tokens / global tokens).
        self.aux_loss_scale = 1.0
        # The router losses of the last forward with autograd and a router loss on, over the micro batch of this TP
        # group (unweighted, detached):
        self.last_aux_loss: Tensor | None = None
        self.last_z_loss: Tensor | None = None
        self.last_tokens_per_expert: Tensor | None = None  # [E] top-k assignments per expert
        self.layer_id, self.bitwise = layer_id, bitwise
        self.routing: RoutingTable | None = None  # record or replay the experts chosen (routing.attached)
        # LoRA on the experts' stacked gate/up and down weights (`parallel.lora.ExpertLoRA`, attach_lora).
        self.lora_gate_up: nn.Module | None = None
        self.lora_down: nn.Module | None = None

        device = layout.device
        self.router = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
        set_spec(self.router.weight, ShardSpec(names.router, (num_experts, hidden_size), group="tp",
                                               sum_grad_over_group=layout.tp_size > 1))
        first = layout.ep_rank * self.num_local_experts
        expert_ids = tuple(range(first, first + self.num_local_experts))
        f_local = ffn_size // etp
        for attr, template, local_shape, full_shape, dim in (
            ("w_gate", names.gate, (f_local, hidden_size), (ffn_size, hidden_size), 0),
            ("w_up", names.up, (f_local, hidden_size), (ffn_size, hidden_size), 0),
            ("w_down", names.down, (hidden_size, f_local), (hidden_size, ffn_size), 1),
        ):
            weight = nn.Parameter(torch.empty(self.num_local_experts, *local_shape, device=device, dtype=dtype))
            set_spec(weight, ShardSpec(template, full_shape, dim=dim, num_shards=etp, index=layout.etp_rank,
                                       group="etp", expert_ids=expert_ids))
            setattr(self, attr, weight)
        for weight in (self.router.weight, self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(weight, std=0.02)  # HF's default initializer_range; real runs load checkpoints

    @property
    def reads_host(self) -> bool:
        """Whether a forward reads device values on the host (which no CUDA graph can hold): the dispatch over ranks
        learns its sizes from the device unless it stays inside the TP group (`_Exchange.within_tp`), and the
        portable expert FFN reads its per-expert row counts."""
        over_ranks = self.layout.ep_etp_group is not None and not self._dispatch_within_tp
        return over_ranks or not can_use_grouped_mm(self.w_gate, self.w_gate, self.w_down, self._adapters())

    def _adapters(self) -> ExpertAdapters | None:
        """The experts' enabled LoRA adapters as the expert FFN takes them, or None."""
        gate_up, down = (m if m is not None and m.enabled else None for m in (self.lora_gate_up, self.lora_down))
        if gate_up is None and down is None:
            return None
        return ExpertAdapters((gate_up or down).scale, gate_up.lora_A if gate_up else None,
                              tuple(gate_up.lora_B) if gate_up else (), down.lora_A if down else None,
                              down.lora_B[0] if down else None)

    @property
    def _dispatch_within_tp(self) -> bool:
        # EP 1 with the experts split over exactly the TP group (the rollout's default, "tensor-split like dense
        # layers"): every row stays on its rank and the ETP gather moves each TP rank's own tokens.
        layout = self.layout
        return layout.ep_size == 1 and layout.group_ranks["etp"] == layout.group_ranks["tp"]

    def forward(self, x: Tensor, num_tokens: int | None = None) -> Tensor:
        """x [T_r, H]: the tokens this rank owns; returns [T_r, H]. `num_tokens`: the T that the TP group split
        (`token_split_sizes`), from which a dispatch inside the TP group knows every rank's rows without reading
        the device."""
        if self.fp32_logits:  # the GEMM itself in fp32, not only the softmax after it
            logits = F.linear(x.float(), self.router.weight.float())  # [T, E]
        else:
            logits = linear(x, self.router.weight, bitwise=self.bitwise)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        top_probs, top_experts = self._choose(probs, num_tokens)  # [T, k]
        if self.norm_topk_prob:
            top_probs = top_probs / self._sum_over_choices(top_probs)
        flat = top_experts.flatten()
        # scatter_add, not bincount: bincount reads its input's max back to the host (a sync per layer on CUDA).
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))  # [E]
        out = self._combine(x, top_experts, top_probs.to(x.dtype), counts, num_tokens)
        if not torch.is_grad_enabled() or not (self.aux_loss_coef or self.z_loss_coef):
            # Inference (rollout, logprobs) or no router loss: none of their statistics, nor (at TP > 1) the
            # all-reduce of them in every layer.
            return out
        return self._attach_router_losses(out, logits, probs, counts)

    def _sum_over_choices(self, top_probs: Tensor) -> Tensor:
        """[T, k] -> [T, 1]; in bitwise mode k - 1 elementwise adds in choice order (a reduction kernel may pick its
        order by the tensor's shape)."""
        if not self.bitwise:
            return top_probs.sum(dim=-1, keepdim=True)
        return _ChoiceSum.apply(top_probs)

    def _choose(self, probs: Tensor, num_tokens: int | None) -> tuple[Tensor, Tensor]:
        """Each token's k experts and their router probabilities: its own top-k, or as an attached routing table
        says (`RoutingTable.choose`: recorded into it, or its experts replayed, weighed by this router's
        probabilities of them)."""
        table = self.routing
        if table is None:
            return torch.topk(probs, self.top_k, dim=-1)
        start = 0
        if self.layout.tp_size > 1 and num_tokens is not None:  # this rank's share of the TP group's tokens
            start = sum(token_split_sizes(num_tokens, self.layout.tp_size)[:self.layout.tp_rank])
        return table.choose(self.layer_id, start, probs, self.top_k)

    def _combine(self, x: Tensor, top_experts: Tensor, weights: Tensor, counts: Tensor,
                 num_tokens: int | None) -> Tensor:
        """Run every (token, expert) assignment through its expert and sum each token's k outputs by weight."""
        order = top_experts.flatten().argsort(stable=True)  # [T*k] assignments grouped by expert
        inverse = _inverse(order)
        rows = dispatch_rows(x, order, inverse, self.top_k)  # [T*k, H]
        if self.layout.ep_etp_group is None:
            y = expert_ffn(rows, counts, self.w_gate, self.w_up, self.w_down, bitwise=self.bitwise,
                           adapters=self._adapters())  # [T*k, H]
        else:
            y = self._experts_over_ranks(rows, counts, num_tokens)
        return combine_rows(y, order, inverse, weights)  # [T_r, H]

    def _experts_over_ranks(self, rows: Tensor, counts: Tensor, num_tokens: int | None) -> Tensor:
        """rows [N, H] sorted by global expert with `counts` [E] -> expert outputs [N, H] in the same order."""
        layout = self.layout
        if self._dispatch_within_tp and num_tokens is not None:
            rows_per_rank = [n * self.top_k for n in token_split_sizes(num_tokens, layout.tp_size)]
            if rows.shape[0] != rows_per_rank[layout.etp_rank]:
                raise ValueError(f"MoE dispatch: this rank holds {rows.shape[0] // self.top_k} tokens, not its share "
                                 f"of num_tokens={num_tokens} split over TP {layout.tp_size} (token_split_sizes)")
            plan = _Exchange.within_tp(counts, layout, rows_per_rank)
        else:
            plan = _Exchange.plan(counts, layout, self.num_local_experts)
        rows = all_to_all_rows(rows, plan.send, plan.recv, layout.ep_group)
        rows = gather_rows(rows, plan.etp_rows, layout.etp_group)  # [M, H] by (ETP src, EP src, expert)
        by_expert = plan.row_experts.argsort(stable=True)  # [M]
        back = _inverse(by_expert)
        y = expert_ffn(permute_rows(rows, by_expert, back), plan.expert_counts, self.w_gate, self.w_up, self.w_down,
                       bitwise=self.bitwise, adapters=self._adapters())
        y = permute_rows(y, back, by_expert)  # [M, H] partial sums over this rank's F slice
        y = scatter_sum_rows(y, plan.etp_rows, layout.etp_group)
        return all_to_all_rows(y, plan.recv, plan.send, layout.ep_group)

    def _attach_router_losses(self, out: Tensor, logits: Tensor, probs: Tensor, counts: Tensor) -> Tensor:
        aux, z = self._router_losses(logits, probs, counts)
        loss = self.aux_loss_scale * (self.aux_loss_coef * aux + self.z_loss_coef * z)
        return _InjectLossGrad.apply(out, loss)

    def _router_losses(self, logits: Tensor, probs: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's share of the load-balancing and z losses of the micro batch its TP group holds.

        The model splits a micro batch's tokens over TP (and CP) before this layer; both losses are defined over
        the whole micro batch (as at one process), so the counts are summed over TP x CP first. The returned shares
        sum over TP x CP to the micro batch's losses, and so do their gradients (the router's are summed over TP by
        its spec, over CP with the data-parallel reduction).
        Switch load balancing: E * sum_e f_e * P_e, f_e the fraction of top-k assignments routed to expert e and
        P_e its mean router probability; ST-MoE z-loss: mean over tokens of logsumexp(logits)^2.
        """
        lse_sq = torch.logsumexp(logits.float(), dim=-1).square()  # [T]
        prob_sum = probs.sum(dim=0)  # [E]
        num_experts = self.num_experts
        totals = torch.cat([counts.to(probs.dtype), prob_sum.detach(), lse_sq.sum().detach().view(1),
                            torch.full((1,), probs.shape[0], dtype=probs.dtype, device=probs.device)])  # [2E + 2]
        if self.layout.tp_cp_group is not None:
            dist.all_reduce(totals, group=self.layout.tp_cp_group)
        group_counts, group_prob_sum = totals[:num_experts], totals[num_experts:2 * num_experts]
        num_tokens = totals[-1].clamp(min=1)
        fraction = group_counts / (num_tokens * self.top_k)  # [E]
        self.last_aux_loss = num_experts * (fraction * group_prob_sum).sum() / num_tokens
        self.last_z_loss = totals[-2] / num_tokens
        self.last_tokens_per_expert = group_counts.long()
        return num_experts * (fraction * prob_sum).sum() / num_tokens, lse_sq.sum() / num_tokens


@contextmanager
def attached(model: nn.Module, table: RoutingTable) -> Iterator[RoutingTable]:
    """`table` on every MoE layer of `model` for the body (and off after it)."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        layer.routing = table
    try:
        yield table
    finally:
        for layer in layers:
            layer.routing = None


class _ChoiceSum(torch.autograd.Function):
    """[T, k] -> [T, 1], the k choices added in order, as one autograd node whose backward is a broadcast (a slice
    and an add per choice were 2k - 1 nodes, each a kernel or two: the small models' steps are host-bound)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.num_choices = x.shape[1]
        total = x[:, :1] + x[:, 1:2] if x.shape[1] > 1 else x.clone()
        for j in range(2, x.shape[1]):
            total += x[:, j:j + 1]
        return total

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.expand(-1, ctx.num_choices)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
    """x[perm] for a permutation `perm` whose inverse is given: the backward is the inverse gather."""
    return _PermuteRows.apply(x, perm, inverse)


def _inverse(perm: Tensor) -> Tensor:
    """The permutation that undoes `perm` (x[perm][_inverse(perm)] == x)."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


@dataclass
class _Exchange:
    """Row counts of one dispatch, learned once and reused (transposed) for the combine and the backward."""

    send: list[int]  # rows this rank sends to each EP rank
    recv: list[int]  # rows this rank receives from each EP rank
    etp_rows: list[int]  # rows each ETP rank of this group holds after the EP exchange
    row_experts: Tensor  # [M] local expert of each row after the ETP gather
    expert_counts: Tensor  # [E_local] rows per local expert after the ETP gather

    @classmethod
    def plan(cls, counts: Tensor, layout: Layout, num_local: int) -> _Exchange:
        # One all-gather of every rank's per-expert counts over the dispatch group (member i = ep * ETP + etp).
        table = [torch.empty_like(counts) for _ in range(layout.ep_etp_size)]
        dist.all_gather(table, counts, group=layout.ep_etp_group)
        ep, etp = layout.ep_size, layout.etp_size
        table = torch.stack(table).view(ep, etp, ep, num_local)  # [src EP, src ETP, dest EP, local expert]
        mine = table[:, :, layout.ep_rank].transpose(0, 1)  # [ETP, EP, E_local]: row order after the ETP gather
        host = table.cpu()  # the dispatch's one host sync: split sizes must be Python ints
        mine_host = host[:, :, layout.ep_rank].transpose(0, 1)  # [ETP, EP, E_local]
        etp_rows = mine_host.sum(dim=(1, 2)).tolist()
        row_experts = torch.arange(num_local, device=counts.device).repeat(etp * ep)
        return cls(
            send=host[layout.ep_rank, layout.etp_rank].sum(dim=-1).tolist(),
            recv=mine_host[layout.etp_rank].sum(dim=-1).tolist(),
            etp_rows=etp_rows,
            row_experts=row_experts.repeat_interleave(mine.flatten(), output_size=sum(etp_rows)),
            expert_counts=mine.sum(dim=(0, 1)),
        )


    @classmethod
    def within_tp(cls, counts: Tensor, layout: Layout, rows_per_rank: list[int]) -> _Exchange:
        """The plan when EP is 1 and the experts are split over the TP group (`MoELayer._dispatch_within_tp`): no
        row changes rank, and each ETP rank's rows are its tokens times top-k (`rows_per_rank`, from the host), so
        only the per-expert order of the gathered rows comes from the device. Same plan as `plan`, no host read."""
        table = [torch.empty_like(counts) for _ in range(layout.etp_size)]
        dist.all_gather(table, counts, group=layout.etp_group)
        table = torch.stack(table)  # [ETP, E]: rows per (source rank, expert), the order of the gathered rows
        mine = rows_per_rank[layout.etp_rank]
        row_experts = torch.arange(counts.numel(), device=counts.device).repeat(layout.etp_size)
        return cls(send=[mine], recv=[mine], etp_rows=rows_per_rank,
                   row_experts=row_experts.repeat_interleave(table.flatten(), output_size=sum(rows_per_rank)),
                   expert_counts=table.sum(dim=0))


def all_to_all_rows(x: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> Tensor:
    """Send `send[r]` consecutive rows of x [N, H] to rank r of `group`; returns the received rows [sum(recv), H]."""
    return x if group is None else _AllToAll.apply(x, send, recv, group)


def gather_rows(x: Tensor, sizes: list[int], group: dist.ProcessGroup | None) -> Tensor:
    """Concatenate every group rank's rows (rank r holds `sizes[r]`); backward sums the gradients back."""
    return x if group is None else _GatherRows.apply(x, sizes, group)


def scatter_sum_rows(x: Tensor, sizes: list[int], group: dist.ProcessGroup | None) -> Tensor:
    """Sum x [sum(sizes), H] over the group and keep this rank's block of rows; the transpose of `gather_rows`."""
    return x if group is None else _ScatterSumRows.apply(x, sizes, group)


def _gather(x: Tensor, sizes: list[int], group: dist.ProcessGroup) -> Tensor:
    # Blocks are padded to the largest: gloo has no all-gather of unequal sizes.
    pad = max(sizes)
    blocks = [x.new_empty(pad, *x.shape[1:]) for _ in sizes]
    dist.all_gather(blocks, F.pad(x, (0, 0, 0, pad - x.shape[0])), group=group)
    return torch.cat([b[:n] for b, n in zip(blocks, sizes)])


def _scatter_sum(x: Tensor, sizes: list[int], group: dist.ProcessGroup) -> Tensor:
    pad = max(sizes)
    blocks = [F.pad(b, (0, 0, 0, pad - b.shape[0])) for b in x.split(sizes)]
    out = x.new_empty(pad, *x.shape[1:])
    dist.reduce_scatter(out, blocks, group=group)
    return out[: sizes[dist.get_rank(group)]]


def _all_to_all(x: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, sizes: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _gather(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _scatter_sum(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _ScatterSumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, sizes: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _scatter_sum(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _InjectLossGrad(torch.autograd.Function):
    """Identity on the layer output whose backward also back-propagates a side loss (with gradient 1)."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor) -> Tensor:
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return out.clone()  # a view of `out` would forbid in-place updates of the result (`h += moe(x)`)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype, device = ctx.loss_meta
        return grad, torch.ones(shape, dtype=dtype, device=device)
