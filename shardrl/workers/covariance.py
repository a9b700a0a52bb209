"""Clip-Cov's and KL-Cov's token selection on the workers: one choice per optimizer step over the whole mini batch.

The choice (`algos.covariance.select_tokens`) reads every valid token of the mini batch, which lies spread over the
data-parallel replicas: each replica sends its tokens' (advantage, log-prob, PPO-clipped) triples to all, every rank
runs the same selection on the same flat vector (replica after replica, each in row order; the random draw from a
generator seeded alike everywhere), and keeps its own share. TP, CP and PP ranks of a replica hold the same rows and
the same log-probs, so they choose alike without talking.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from shardrl.algos import ClipRange
from shardrl.algos.covariance import CovarianceSelection, select_tokens
from shardrl.algos.policy_loss import ppo_clip_active
from shardrl.data.batch import Batch
from shardrl.parallel.expert import gather_rows
from shardrl.parallel.layout import Layout

COVARIANCE_SELECTED = "covariance_selected"  # [b, R] bool per micro batch: the tokens clip_cov / kl_cov restrain


def select_covariance_tokens(selection: CovarianceSelection, mini: Batch, log_probs: Tensor, clip: ClipRange,
                             layout: Layout, generator: torch.Generator) -> Tensor:
    """This rank's rows of the mini batch: which tokens are selected `[b, R]` (bool, on `log_probs`' device).

    `log_probs` [b, R]: the tokens' log-probs under the policy this step differentiates; `mini`: this rank's rows
    with `advantages`, `old_log_probs` and `response_mask`. Collective over the data-parallel group."""
    device = log_probs.device
    t = mini.tensors
    valid = t["response_mask"].to(device).bool()  # [b, R]
    advantages, old_log_probs = t["advantages"].to(device)[valid], t["old_log_probs"].to(device)[valid]  # [n]
    current = log_probs[valid]
    clipped = ppo_clip_active(current, old_log_probs, advantages, clip)
    local = torch.stack([advantages.double(), current.double(), clipped.double()], dim=-1)  # [n, 3]
    group, offset = layout.dp_group, 0
    if group is not None:
        sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(layout.dp_size)]
        dist.all_gather(sizes, torch.tensor([local.shape[0]], device=device), group=group)
        sizes = [int(size) for size in sizes]
        offset = sum(sizes[:layout.dp_rank])
        local = gather_rows(local, sizes, group)  # [N, 3] every replica's tokens, replica after replica
    chosen = select_tokens(selection, local[:, 0], local[:, 1], local[:, 2] > 0, generator)  # [N]
    selected = torch.zeros_like(valid)
    selected[valid] = chosen[offset:offset + int(valid.sum())]
    return selected
