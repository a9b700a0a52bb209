"""Sampling the next token of each request in a batch: temperature, top-k, top-p, greedy, per-request seeds.

Order of operations (that of HF's logits warpers): divide by the temperature, keep the top-k logits, keep the
smallest set of those whose renormalised probability reaches top-p; sample from the softmax of what is left. The
logprob returned for each sampled token is taken from exactly that distribution, so the trainer's train/inference
mismatch metric compares like with like. Greedy rows take the argmax and report the filtered temperature-1
logprob (a point mass would always report 0).

Drawing is by inverse CDF: one uniform u per row, and the token is the first whose cumulative weight exceeds u times
the row's total weight. One number per row, instead of the [B, V] noise tensor an exponential race (argmax p / E)
needs, is what makes seeds cheap: a seeded row's u is a hash of (seed, counter), a few integer ops on [B] tensors,
where a per-request random stream meant one noise kernel per seeded row and step, and no CUDA graph (a graph
replays one generator). The counter is the index in the whole sequence (prompt + generated) of the token being
drawn, so a seeded request's tokens depend on nothing but its seed, the weights and its tokens so far: not on the
rest of the batch, steps run ahead and dropped, abort and resume (the re-prefilled request draws its next token
with the same counter), or which replica or TP rank runs it; the hash is exact integer arithmetic, identical on CPU
and CUDA. Unseeded rows draw u from the engine's shared generator. Every TP rank runs this on the same full logits
with identically seeded shared generators, so all ranks pick the same tokens without a broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from shardrl.parallel.vocab import vocab_parallel_logprobs
from shardrl.rollout.request import SamplingParams

_MASK = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so no int64 product overflows on any
# device. Chosen for avalanche: over 2**16 random inputs, flipping any one input bit flipped each output bit of `_mix`
# in a fraction of them within 0.007 of 1/2 (the sampling noise of that test).
_MULTIPLIERS = (0x51FB3371, 0x4744B533)
_SALTS = (0x9E3779B9, 0x7F4A7C15)  # keep seed 0 off `_mix`'s fixed point 0


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row settings of one batch as tensors (built once per step from the requests' `SamplingParams`)."""

    temperature: Tensor  # [B] fp32, 1.0 on greedy rows
    greedy: Tensor  # [B] bool
    top_k: Tensor | None  # [B] int64, vocab size where off; None when no row filters
    top_p: Tensor | None  # [B] fp32, 1.0 where off
    keys: Tensor  # [2, B] int64: each row's `seed_keys` (unused where `has_seed` is False)
    has_seed: Tensor  # [B] bool
    any_greedy: bool
    all_greedy: bool
    unit_temperature: bool  # every row samples at temperature 1 (or is greedy): the logits need no division
    raw: bool  # some row asked for raw temperature-1 logprobs
    common_temperature: float | None = None  # the temperature every row shares (greedy: 1.0), else None

    @property
    def bitwise_ready(self) -> bool:
        """Whether bitwise mode can give this batch the trainer's log-probs: no top-k / top-p (the trainer scores
        the unfiltered distribution) and one temperature (the trainer divides by one number)."""
        return self.top_k is None and self.common_temperature is not None

    @property
    def mode(self) -> tuple[bool, ...]:
        """What decides which ops `sample` runs: batches of one mode run the same ops on tensors of the same
        shapes, so one captured CUDA graph serves them all (seeded rows or not: every batch computes both kinds of
        uniform)."""
        return (self.top_k is not None, self.all_greedy, self.any_greedy, self.unit_temperature, self.raw,
                self.common_temperature)

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int | None], vocab_size: int,
              device: torch.device) -> SamplingBatch:
        """`seeds[b]`: row b's seed (`SamplingParams.seed`, plus i for the i-th of n samples), or None."""
        filtered = any(p.filtered for p in params)
        temperature = [p.temperature or 1.0 for p in params]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]

        def to_device(values: list | Tensor, dtype: torch.dtype) -> Tensor:
            # Asynchronous: a blocking host-to-device copy would wait for the decode forward still running.
            return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperature=to_device(temperature, torch.float32), greedy=to_device([p.greedy for p in params], torch.bool),
            top_k=to_device(top_k, torch.int64) if filtered else None,
            top_p=to_device([p.top_p for p in params], torch.float32) if filtered else None,
            keys=to_device(seed_keys(seeds), torch.int64),
            has_seed=to_device([s is not None for s in seeds], torch.bool),
            any_greedy=any(p.greedy for p in params), all_greedy=all(p.greedy for p in params),
            unit_temperature=all(t == 1.0 for t in temperature), raw=any(p.raw_logprobs for p in params),
            common_temperature=temperature[0] if len(set(temperature)) == 1 else None)


class SamplingBuffers:
    """Per-row settings at fixed device addresses, so that a CUDA graph can capture `sample` once and later
    replays read whatever settings `load` wrote since, seeds included."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        # Valid settings everywhere from the start: padding rows past a batch read whatever is left here.
        self.temperature = torch.ones(max_rows, device=device)
        self.greedy = torch.zeros(max_rows, dtype=torch.bool, device=device)
        self.top_k = torch.full((max_rows,), vocab_size, dtype=torch.int64, device=device)
        self.top_p = torch.ones(max_rows, device=device)
        self.keys = torch.zeros(2, max_rows, dtype=torch.int64, device=device)
        self.has_seed = torch.zeros(max_rows, dtype=torch.bool, device=device)

    def load(self, batch: SamplingBatch) -> None:
        rows = batch.temperature.shape[0]
        self.temperature[:rows].copy_(batch.temperature)
        self.greedy[:rows].copy_(batch.greedy)
        self.keys[:, :rows].copy_(batch.keys)
        self.has_seed[:rows].copy_(batch.has_seed)
        if batch.top_k is not None:
            self.top_k[:rows].copy_(batch.top_k)
            self.top_p[:rows].copy_(batch.top_p)

    def view(self, batch: SamplingBatch, rows: int) -> SamplingBatch:
        """`batch`'s mode over the first `rows` rows of the buffers (rows past the batch's are padding)."""
        filtered = batch.top_k is not None
        return replace(batch, temperature=self.temperature[:rows], greedy=self.greedy[:rows],
                       top_k=self.top_k[:rows] if filtered else None, top_p=self.top_p[:rows] if filtered else None,
                       keys=self.keys[:, :rows], has_seed=self.has_seed[:rows])


@dataclass(frozen=True)
class Sampled:
    token_ids: Tensor  # [B] int64
    logprobs: Tensor  # [B] fp32 under the distribution sampled from
    raw_logprobs: Tensor | None  # [B] fp32 under log_softmax(logits), when the batch asked for them


def filter_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """logits [B, V] -> the same with every token outside row b's top-k / top-p set at -inf.

    Top-p is applied to the distribution renormalised after top-k; a token stays when the probability of the
    tokens ranked above it is still below top_p, so the most likely token always stays.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(logits.shape[-1], device=logits.device)
    drop = rank.unsqueeze(0) >= top_k.unsqueeze(1)  # [B, V] in sorted order
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs  # [B, V]
    drop |= mass_above >= top_p.unsqueeze(1)
    drop = torch.zeros_like(drop).scatter_(-1, order, drop)  # back to vocab order
    return logits.masked_fill(drop, float("-inf"))


def _mix(x: Tensor) -> Tensor:
    """A bijection of 32-bit values (int64 tensors in [0, 2**32)) in which each input bit changes about half of the
    output bits: xor-shift, multiply, xor-shift, multiply, xor-shift, every product masked back to 32 bits."""
    x = x ^ (x >> 16)
    x = (x * _MULTIPLIERS[0]) & _MASK
    x = x ^ (x >> 15)
    x = (x * _MULTIPLIERS[1]) & _MASK
    return x ^ (x >> 16)


def seed_keys(seeds: list[int | None]) -> Tensor:
    """Each row's two 32-bit stream keys [2, B] int64 on the host, from its seed modulo 2**64 (None: seed 0's).

    Derived once per batch, not per step: the low word goes through `_mix`, the high word is mixed in, and the
    second key is a further `_mix` of the first, so neighbouring seeds get unrelated keys.
    """
    words = torch.tensor([[0, 0] if s is None else [(s % 2**64) & _MASK, (s % 2**64) >> 32] for s in seeds]).T
    first = _mix(_mix(words[0] ^ _SALTS[0]) ^ words[1])  # [B]
    return torch.stack([first, _mix(first ^ _SALTS[1])])


def counter_uniforms(keys: Tensor, counters: Tensor) -> Tensor:
    """keys [2, B] (`seed_keys`), counters [B] int64 in [0, 2**32) -> [B] fp32 uniforms in [0, 1).

    u = the top 24 bits of _mix(_mix(counter ^ key0) ^ key1) / 2**24: exactly representable in fp32, the same bits
    on every device. The counter enters through two rounds so that consecutive counters are unrelated, and the
    second key keeps two rows whose first keys differ in a few bits from drawing shifted copies of each other.
    """
    hashed = _mix(_mix(counters ^ keys[0]) ^ keys[1])  # [B]
    return (hashed >> 8).float() * 2.0**-24


def row_uniforms(batch: SamplingBatch, counters: Tensor, shared: torch.Generator | None) -> Tensor:
    """[B] fp32 in [0, 1): seeded rows' from `counter_uniforms`, the others' from the shared generator. Both are
    computed whatever the rows, so one captured graph serves seeded, unseeded and mixed batches."""
    drawn = torch.rand(counters.shape[0], generator=shared, device=counters.device)
    return torch.where(batch.has_seed, counter_uniforms(batch.keys, counters), drawn)


def inverse_cdf(weights: Tensor, uniforms: Tensor, fallback: Tensor) -> Tensor:
    """weights [B, V] fp32 >= 0 (unnormalised), uniforms [B] in [0, 1), fallback [B] int64 (a token of positive
    weight) -> [B] int64: per row the first token whose cumulative weight exceeds u * total, i.e. token i with
    probability weights[i] / total.

    A token of zero weight (filtered, or underflowed) adds nothing to a sequential sum, so it never is that first
    token. A parallel scan (CUDA) may round neighbouring prefixes differently, though, which can leave a zero-weight
    token a sliver of the range of the order of the rounding error: the index is clamped to the vocabulary (against a
    threshold rounding up to the total) and a zero-weight pick becomes `fallback`, so neither can come out.
    """
    cdf = weights.cumsum(dim=-1)  # [B, V]
    threshold = uniforms.unsqueeze(1) * cdf[:, -1:]  # [B, 1]
    index = torch.searchsorted(cdf, threshold, right=True).clamp_(max=weights.shape[-1] - 1)  # [B, 1]
    return torch.where(weights.gather(1, index) > 0, index, fallback.unsqueeze(1)).squeeze(1)


@torch.no_grad()
def sample(logits: Tensor, batch: SamplingBatch, counters: Tensor, shared: torch.Generator | None = None,
           bitwise: bool = False, fused: bool = True) -> Sampled:
    """logits [B, V] (full vocab, any float dtype), counters [B] int64 (the index in its sequence of the token each
    row draws) -> one token per row with its logprobs.

    Each full [B, V] pass costs about as much as the decode forward of a small model on a 150k vocabulary, so
    there are few: the unnormalised probabilities w = exp(z - max z) serve both the normaliser (logp = z -
    log sum w - max z) and the draw (the inverse CDF needs no normalisation), and the max pass gives the greedy
    token. At temperature 1 the logits are used as they are: every op below computes in fp32 (a bf16 logit converts
    to fp32 exactly), so skipping the division changes no bit of the result and saves a full-size fp32 copy.

    The draw's cumulative sum is fp32 as well. Where it accumulates in fp32 (CUDA), a token whose weight is below
    half an ulp of the running sum (a probability below ~2**-24) gets a range of 0 or 1 ulp instead of its own; but
    a 24-bit u quantises the chances of such tokens the same way whatever the sum. On synthetic 150k-token rows with
    1e-3 of their mass below 2**-24 the drawn distribution was ~1e-3 (total variation) from the exact one with an
    fp64 sum and only ~10% further with fp32: an fp64 sum would need a 53-bit u to gain anything, and would double
    the traffic of the largest tensor of the step.

    `bitwise` (the engine's bitwise mode): the logits are divided by the batch's one temperature as the trainer
    divides them (`Transformer.compute_logprobs`: the same op on the same dtype) and the logprobs come from the
    trainer's own function (`vocab_parallel_logprobs`), so they are the trainer's bits for the same logits.

    `fused`: on CUDA an unfiltered batch is sampled by `_sample_fused`, the same function in two Triton launches;
    the ops below are the reference it is tested against (and what runs everywhere else).
    """
    if bitwise:
        return _sample_as_trainer(logits, batch, counters, shared)
    if fused and logits.is_cuda and batch.top_k is None:
        return _sample_fused(logits, batch, counters, shared)
    scaled = logits  # [B, V]
    if not batch.unit_temperature:
        scaled = torch.div(logits, batch.temperature.unsqueeze(1))  # fp32 (promoted in the same pass)
    if batch.top_k is not None:
        scaled = filter_top_k_top_p(scaled.float(), batch.top_k, batch.top_p)  # -inf outside the kept set
    weights, top, best = unnormalised_probs(scaled)  # [B, V], [B, 1] fp32, [B] int64
    normaliser = weights.sum(dim=-1).log_() + top.squeeze(1)  # [B]
    if batch.all_greedy:
        token_ids = best
    else:
        token_ids = inverse_cdf(weights, row_uniforms(batch, counters, shared), best)
        if batch.any_greedy:
            token_ids = torch.where(batch.greedy, best, token_ids)
    chosen = token_ids.unsqueeze(1)
    logprobs = scaled.gather(1, chosen).squeeze(1).float() - normaliser
    raw = None
    if batch.raw:  # unscaled and unfiltered: the logprobs above are already the raw ones
        raw = logprobs if scaled is logits else logits.gather(1, chosen).squeeze(1).float() - log_normaliser(logits)
    return Sampled(token_ids, logprobs, raw)


def _sample_fused(logits: Tensor, batch: SamplingBatch, counters: Tensor,
                  shared: torch.Generator | None) -> Sampled:
    """`sample` of an unfiltered batch on CUDA: one read of the logits (`sample_kernel.py`). The shared generator
    draws what `row_uniforms` draws, so unseeded rows consume the same stream."""
    from shardrl.rollout.sample_kernel import fused_sample  # Triton: CUDA installs only

    drawn = None if batch.all_greedy else torch.rand(counters.shape[0], generator=shared, device=logits.device)
    scale = not batch.unit_temperature
    token_ids, logprobs, raw = fused_sample(logits, batch.temperature, batch.greedy, batch.has_seed, batch.keys,
                                            counters, drawn, scale, batch.raw)
    return Sampled(token_ids, logprobs, raw if batch.raw else None)


def _sample_as_trainer(logits: Tensor, batch: SamplingBatch, counters: Tensor,
                       shared: torch.Generator | None) -> Sampled:
    """`sample` in bitwise mode: draw from softmax(logits / T) with the division in the logits' dtype, and report
    the trainer's logprob of the drawn token (raw ones at temperature 1 likewise)."""
    if not batch.bitwise_ready:
        raise ValueError("bitwise_logprobs: a batch with top-k / top-p filtering or mixed temperatures cannot get the "
                         "trainer's log-probs; sample with top_k=-1, top_p=1 and one temperature")
    scaled = logits if batch.common_temperature == 1.0 else logits / batch.common_temperature
    weights, _, best = unnormalised_probs(scaled)
    token_ids = best if batch.all_greedy else inverse_cdf(weights, row_uniforms(batch, counters, shared), best)
    if batch.any_greedy and not batch.all_greedy:
        token_ids = torch.where(batch.greedy, best, token_ids)
    vocab_size = logits.shape[-1]
    logprobs = vocab_parallel_logprobs(scaled, token_ids, None, vocab_size)[0]
    raw = None
    if batch.raw:
        raw = logprobs if scaled is logits else vocab_parallel_logprobs(logits, token_ids, None, vocab_size)[0]
    return Sampled(token_ids, logprobs, raw)


def unnormalised_probs(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """logits [B, V] of any float dtype -> (exp(logits - top) [B, V] fp32, top [B, 1] fp32, argmax [B] int64), top
    the row max (0 for an all -inf row, which then stays -inf in the normaliser instead of becoming nan) and argmax
    the first index holding it.

    The max is taken over the logits as they are and the shifted copy is the only fp32 tensor, instead of
    converting the whole input first.
    """
    top, best = logits.max(dim=-1, keepdim=True)  # [B, 1]
    top = top.float()
    top.masked_fill_(top.abs() == torch.inf, 0.0)
    return torch.sub(logits, top).exp_(), top, best.squeeze(1)


def log_normaliser(logits: Tensor) -> Tensor:
    """logits [B, V] of any float dtype -> logsumexp over V in fp32, [B]: the same steps, in the same order, as
    `torch.logsumexp` of `logits.float()`, so the same bits."""
    weights, top, _ = unnormalised_probs(logits)
    return weights.sum(dim=-1).log_() + top.squeeze(1)
