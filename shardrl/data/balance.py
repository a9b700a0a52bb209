"""Sequence-length balancing across DP ranks and token-budget micro-batching.

Both work on per-sample token counts only and return index lists, so they are pure functions that every rank can
compute identically; the caller applies them with `Batch.take`.

Balancing (`balance_partitions`): k partitions with equal sample counts and near-equal token sums. Cost is taken as
linear in tokens (the MLP/projection part dominates at RL sequence lengths). Method: sort units (samples, or whole
GRPO groups) by tokens, deal them out in rounds of k, each round giving its heaviest unit to the currently lightest
partition (an LPT greedy that keeps counts equal by construction), then improve with pairwise swaps between the
heaviest and lightest partition while a swap narrows their gap. After the rounds, the gap between the heaviest and
lightest partition is at most the largest unit; the swaps only ever shrink it.

Micro-batching (`split_by_token_budget`): first-fit decreasing packs samples into micro batches whose token sum is
at most the budget. A single sample longer than the budget is not an error: it gets a micro batch of its own (failing
a run because one sample exceeds a memory knob is worse than one larger micro batch; the config layer can check
`max_prompt_length + max_response_length` against the budget up front). When a fixed number of micro batches is
required (all ranks of an EP group or a pipeline must run the same count) the samples are spread over exactly that
many micro batches.

The trainer's `balance_batch` (`dp_balanced_order`) balances each optimizer step's samples over the DP ranks, so
the steps' gradients stay what they were without it.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence


def _lpt(weights: Sequence[int], k: int, equal_counts: bool) -> list[list[int]]:
    """Longest-processing-time greedy: units heaviest first, each to the lightest partition.

    With `equal_counts` the units are dealt in rounds of k and each partition takes exactly one unit per round, so
    partition sizes differ by at most one (none when k divides the unit count).
    """
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    parts: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    round_size = k if equal_counts else 1
    for start in range(0, len(order), round_size):
        by_load = sorted(range(k), key=lambda p: loads[p])
        for unit, part in zip(order[start:start + round_size], by_load):
            parts[part].append(unit)
            loads[part] += weights[unit]
    return parts


def _best_swap(hi: list[int], lo: list[int], weights: Sequence[int], gap: int) -> tuple[int, int, int] | None:
    """(new gap, index in hi, index in lo) of the swap that narrows `gap` most, or None if none narrows it.

    Swapping a (in hi) with b (in lo) changes the gap to |gap - 2 (w_a - w_b)|, so for each a the best b has the
    weight nearest w_a - gap / 2: a binary search over lo's sorted weights, not a scan of all pairs.
    """
    lo_sorted = sorted(range(len(lo)), key=lambda j: weights[lo[j]])
    lo_weights = [weights[lo[j]] for j in lo_sorted]
    best = None
    for i, a in enumerate(hi):
        pos = bisect.bisect_left(lo_weights, weights[a] - gap / 2)
        for p in (pos - 1, pos):
            if 0 <= p < len(lo_weights):
                new_gap = abs(gap - 2 * (weights[a] - lo_weights[p]))
                if new_gap < gap and (best is None or new_gap < best[0]):
                    best = (new_gap, i, lo_sorted[p])
    return best


def _swap_refine(parts: list[list[int]], weights: Sequence[int], max_rounds: int = 100) -> None:
    """Swap one unit between the heaviest and lightest partition while that narrows their gap (in place)."""
    loads = [sum(weights[u] for u in p) for p in parts]
    for _ in range(max_rounds):
        hi, lo = loads.index(max(loads)), loads.index(min(loads))
        best = _best_swap(parts[hi], parts[lo], weights, loads[hi] - loads[lo])
        if best is None:
            return
        _, i, j = best
        a, b = parts[hi][i], parts[lo][j]
        parts[hi][i], parts[lo][j] = b, a
        loads[hi] += weights[b] - weights[a]
        loads[lo] += weights[a] - weights[b]


def balance_partitions(
    seq_lens: Sequence[int], k: int, groups: Sequence[Hashable] | None = None
) -> list[list[int]]:
    """Split sample indices into `k` partitions of equal size with balanced token sums.

    seq_lens: tokens per sample. groups: optional group id per sample (GRPO `uid`); samples sharing an id stay in
    one partition, which needs equal-sized groups whose count divides by k. Each partition lists its sample indices
    in ascending order, so group members stay adjacent when they were.
    """
    num = len(seq_lens)
    if k <= 0 or num % k:
        raise ValueError(f"balance_partitions: {num} samples cannot be split into {k} equal partitions")
    if groups is None:
        units = [[i] for i in range(num)]
    else:
        if len(groups) != num:
            raise ValueError(f"balance_partitions: {len(groups)} group ids for {num} samples")
        members: dict[Hashable, list[int]] = {}
        for i, g in enumerate(groups):
            members.setdefault(g, []).append(i)
        units = list(members.values())
        sizes = sorted({len(u) for u in units})
        if len(sizes) > 1 or len(units) % k:
            raise ValueError(
                f"balance_partitions: keeping groups together needs equal group sizes and a group count divisible by "
                f"{k}; got {len(units)} groups of sizes {sizes}"
            )
    weights = [sum(seq_lens[i] for i in unit) for unit in units]
    parts = _lpt(weights, k, equal_counts=True)
    _swap_refine(parts, weights)
    return [sorted(i for u in part for i in units[u]) for part in parts]


def dp_balanced_order(seq_lens: Sequence[int], num_ranks: int, rows_per_mini_batch: int) -> list[int]:
    """A permutation of the samples after which the DP split (rank d takes the d-th of `num_ranks` equal contiguous
    chunks) gives every rank a near-equal token sum, while every optimizer step still trains on the same samples.

    A rank cuts its chunk into mini batches of `rows_per_mini_batch` rows in order, so optimizer step j of the DP
    group trains on rows [j*m, (j+1)*m) of every chunk. The permutation deals exactly those samples out again, balanced
    over the ranks (`balance_partitions`), the heaviest share to the rank with the fewest tokens so far. A step's
    loss is a sum over its samples divided by global counts, so its gradient does not change (up to float summation
    order); only which rank computes which sample does. With one rank it is the identity.
    """
    num = len(seq_lens)
    if num_ranks < 1 or rows_per_mini_batch < 1 or num % (num_ranks * rows_per_mini_batch):
        raise ValueError(f"dp_balanced_order: {num} samples do not split into {num_ranks} ranks x mini batches of "
                         f"{rows_per_mini_batch} rows")
    chunk = num // num_ranks
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for start in range(0, chunk, rows_per_mini_batch):
        step = [d * chunk + start + i for d in range(num_ranks) for i in range(rows_per_mini_batch)]
        shares = [[step[i] for i in part] for part in balance_partitions([seq_lens[i] for i in step], num_ranks)]
        shares.sort(key=lambda share: -sum(seq_lens[i] for i in share))
        for rank, share in zip(sorted(range(num_ranks), key=lambda r: loads[r]), shares):
            ranks[rank] += share
            loads[rank] += sum(seq_lens[i] for i in share)
    return [i for rank in ranks for i in rank]


def _first_fit_decreasing(seq_lens: Sequence[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]):
        target = next((b for b, load in enumerate(loads) if load + seq_lens[i] <= max_tokens), None)
        if target is None:
            bins.append([])
            loads.append(0)
            target = len(bins) - 1
        bins[target].append(i)
        loads[target] += seq_lens[i]
    return bins


def count_micro_batches(seq_lens: Sequence[int], max_tokens: int) -> int:
    """How many micro batches `split_by_token_budget` needs for these samples when free to choose.

    Ranks that must agree on a count take the max of this over the group and pass it as `num_micro_batches`.
    """
    return len(_first_fit_decreasing(seq_lens, max_tokens))


def _fits(bins: list[list[int]], seq_lens: Sequence[int], max_tokens: int) -> bool:
    return all(len(b) == 1 or sum(seq_lens[i] for i in b) <= max_tokens for b in bins)


def split_by_token_budget(
    seq_lens: Sequence[int], max_tokens: int, num_micro_batches: int | None = None
) -> tuple[list[list[int]], list[int]]:
    """Micro batches (sample index lists, ascending) with token sums <= max_tokens, and the restore index.

    With `num_micro_batches` (>= count_micro_batches) exactly that many are returned: token-balanced when the
    balanced split respects the budget, otherwise the first-fit-decreasing bins split further. The restore index
    maps original position -> position in the concatenated micro batches: `concat(outputs)[restore]` is in the
    original order.
    """
    if max_tokens <= 0:
        raise ValueError(f"split_by_token_budget: max_tokens must be positive, got {max_tokens}")
    bins = _first_fit_decreasing(seq_lens, max_tokens)
    if num_micro_batches is not None:
        if not len(bins) <= num_micro_batches <= len(seq_lens):
            raise ValueError(
                f"split_by_token_budget: num_micro_batches={num_micro_batches} must be between {len(bins)} (needed for "
                f"max_tokens={max_tokens}) and the {len(seq_lens)} samples"
            )
        balanced = _lpt(seq_lens, num_micro_batches, equal_counts=False)
        if all(balanced) and _fits(balanced, seq_lens, max_tokens):
            bins = balanced
        while len(bins) < num_micro_batches:
            bins.sort(key=len)
            largest = bins.pop()
            bins += [largest[: len(largest) // 2], largest[len(largest) // 2:]]
    bins = [sorted(b) for b in sorted(bins, key=min)]
    order = [i for b in bins for i in b]
    restore = [0] * len(order)
    for position, i in enumerate(order):
        restore[i] = position
    return bins, restore
