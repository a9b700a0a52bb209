"""The rollout sampler's seeded draw written out on Python ints and floats, as an independent reference for tests:
the uniform of (seed, counter) from the hash's specification (shift, xor and multiply constants of
`shardrl/rollout/sampler.py`), and a plain-loop inverse CDF over the filtered, temperature-scaled softmax."""

import math

WORD = 2**32


def _mix(x: int) -> int:
    x ^= x >> 16
    x = x * 0x51FB3371 % WORD
    x ^= x >> 15
    x = x * 0x4744B533 % WORD
    return x ^ (x >> 16)


def reference_uniform(seed: int, counter: int) -> float:
    """The uniform a row seeded with `seed` draws the token at index `counter` of its sequence with."""
    seed %= 2**64
    key0 = _mix(_mix(seed % WORD ^ 0x9E3779B9) ^ seed // WORD)
    key1 = _mix(key0 ^ 0x7F4A7C15)
    return (_mix(_mix(counter ^ key0) ^ key1) >> 8) / 2**24


def reference_draw(logits: list[float], u: float, temperature: float = 1.0, top_k: int = 0) -> int:
    """The first token whose cumulative weight exceeds u times the total, over exp((z - max) / T) of the top-k
    logits (all when top_k <= 0; ties at the k-th value broken towards lower ids, as a stable sort does)."""
    ranked = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = set(ranked[:top_k] if top_k > 0 else ranked)
    top = max(logits)
    weights = [math.exp((z - top) / temperature) if i in kept else 0.0 for i, z in enumerate(logits)]
    threshold, running = u * sum(weights), 0.0
    for token, weight in enumerate(weights):
        running += weight
        if weight > 0 and running > threshold:
            return token
    raise AssertionError(f"u={u} found no token")
