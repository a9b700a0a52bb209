"""Discounted backward recursions over the valid tokens of each response (GAE, discounted returns), vectorised.

Masked positions can sit anywhere in a response, not only at the end: multi-turn rollouts mask tool-output tokens in
the middle. A recursion must step over them as if they were not there: the "next value" of a valid token is the
value of the next *valid* token, and nothing stored at a masked position (reward, value) may enter any result.

Both recursions have the form y[t] = x[t] + c * y[t+1] over the valid tokens. We

1. pack each row's valid tokens to the front, keeping their order (a stable sort on the mask),
2. run the recursion on the packed rows with `discounted_reverse_cumsum`, which works in chunks: inside a chunk the
   recursion is a matrix product with a `[K, K]` matrix of powers of c, and only one value per row is carried from
   chunk to chunk, so the Python loop runs T/K times instead of T times,
3. scatter the results back to their original positions and zero the masked ones.
"""

import torch

# Chunk width of the blocked scan: powers c**k for k < 64 stay well inside float32 range for any c in [0, 1].
SCAN_CHUNK = 64


def discounted_reverse_cumsum(values: torch.Tensor, discount: float) -> torch.Tensor:
    """y[:, t] = sum over s >= t of discount**(s - t) * values[:, s], for `values` `[B, T]`."""
    batch, length = values.shape
    num_chunks = -(-length // SCAN_CHUNK)
    padded = torch.nn.functional.pad(values, (0, num_chunks * SCAN_CHUNK - length))
    chunks = padded.view(batch, num_chunks, SCAN_CHUNK)  # [B, N, K]
    base = torch.tensor(discount, dtype=values.dtype, device=values.device)
    steps = torch.arange(SCAN_CHUNK, device=values.device)
    distance = (steps[None, :] - steps[:, None]).to(values.dtype)  # [K, K]: s - t
    upper = torch.where(distance >= 0, base ** distance.clamp(min=0), 0.0)  # [K(t), K(s)]: discount**(s-t), s >= t
    within = chunks @ upper.T  # [B, N, K]: each chunk's recursion as if nothing followed it
    # What follows a chunk reaches its position t discounted by discount**(K - t).
    carry_decay = base ** (SCAN_CHUNK - steps).to(values.dtype)  # [K]
    out = torch.empty_like(within)
    carry = values.new_zeros(batch)  # [B]: y at the first position of the following chunk
    for n in reversed(range(num_chunks)):
        out[:, n] = within[:, n] + carry[:, None] * carry_decay
        carry = out[:, n, 0]
    return out.reshape(batch, -1)[:, :length]


def pack_valid_first(response_mask: torch.Tensor) -> torch.Tensor:
    """Per-row permutation `[B, T]` that moves the valid tokens to the front, in their original order."""
    invalid = (~response_mask.bool()).to(torch.int8)  # [B, T]: 0 for valid, 1 for masked
    return torch.sort(invalid, dim=-1, stable=True).indices


def gae_advantages_returns(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over valid tokens; returns (advantages, returns) `[B, T]`, not whitened.

    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, returns_t = A_t + V_t, where "next"
    is the next valid token of the row (V_next = 0 after the last one: the episode ends there).
    """
    order = pack_valid_first(response_mask)  # [B, T]
    valid = response_mask.bool().gather(-1, order)  # [B, T]: True on a prefix of each row
    rewards = torch.where(valid, token_level_rewards.gather(-1, order), 0.0)  # [B, T] packed
    packed_values = torch.where(valid, values.gather(-1, order), 0.0)  # [B, T] packed
    next_values = torch.nn.functional.pad(packed_values[:, 1:], (0, 1))  # [B, T]; 0 after the last valid token
    deltas = torch.where(valid, rewards + gamma * next_values - packed_values, 0.0)
    packed_advantages = discounted_reverse_cumsum(deltas, gamma * lam)  # [B, T]
    advantages = torch.zeros_like(packed_advantages).scatter(-1, order, packed_advantages)
    advantages = torch.where(response_mask.bool(), advantages, 0.0)
    returns = torch.where(response_mask.bool(), advantages + values, 0.0)
    return advantages, returns


def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next over valid tokens `[B, T]` (masked tokens skipped, their rewards ignored)."""
    order = pack_valid_first(response_mask)
    valid = response_mask.bool().gather(-1, order)
    rewards = torch.where(valid, token_level_rewards.gather(-1, order), 0.0)  # [B, T] packed
    packed_returns = discounted_reverse_cumsum(rewards, gamma)
    returns = torch.zeros_like(packed_returns).scatter(-1, order, packed_returns)
    return torch.where(response_mask.bool(), returns, 0.0)
