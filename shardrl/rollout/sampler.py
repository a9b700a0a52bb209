"""Sampling the next token of each request in a batch: temperature, top-k, top-p, greedy, per-request seeds.

Order of operations (that of HF's logits warpers): divide by the temperature, keep the top-k logits, keep the
smallest set of those whose renormalised probability reaches top-p; sample from the softmax of what is left. The
logprob returned for each sampled token is taken from exactly that distribution, so the trainer's train/inference
mismatch metric compares like with like. Greedy rows take the argmax and report the filtered temperature-1
logprob (a point mass would always report 0).

Drawing uses the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i, from one
batched noise tensor. Seeded requests draw their row of noise from their own `torch.Generator`, so their samples do
not depend on the rest of the batch; unseeded rows share the engine's generator. Every TP rank runs this on the same
full logits with identically seeded generators, so all ranks pick the same tokens without a broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from shardrl.rollout.request import SamplingParams


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row settings of one batch as tensors (built once per step from the requests' `SamplingParams`)."""

    temperature: Tensor  # [B] fp32, 1.0 on greedy rows
    greedy: Tensor  # [B] bool
    top_k: Tensor | None  # [B] int64, vocab size where off; None when no row filters
    top_p: Tensor | None  # [B] fp32, 1.0 where off
    generators: list[torch.Generator | None]  # a row's own generator, or None: the shared one
    any_greedy: bool
    all_greedy: bool
    unit_temperature: bool  # every row samples at temperature 1 (or is greedy): the logits need no division
    raw: bool  # some row asked for raw temperature-1 logprobs

    @property
    def seeded(self) -> bool:
        """Some row draws from its own generator (which a CUDA graph cannot hold; see `SamplingBuffers`)."""
        return any(g is not None for g in self.generators)

    @property
    def mode(self) -> tuple[bool, ...]:
        """What decides which ops `sample` runs: batches of one mode run the same ops on tensors of the same
        shapes, so one captured CUDA graph serves them all."""
        return self.top_k is not None, self.all_greedy, self.any_greedy, self.unit_temperature, self.raw

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None], vocab_size: int,
              device: torch.device) -> SamplingBatch:
        filtered = any(p.filtered for p in params)
        temperature = [p.temperature or 1.0 for p in params]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]

        def to_device(values: list, dtype: torch.dtype) -> Tensor:
            # Asynchronous: a blocking host-to-device copy would wait for the decode forward still running.
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperature=to_device(temperature, torch.float32), greedy=to_device([p.greedy for p in params], torch.bool),
            top_k=to_device(top_k, torch.int64) if filtered else None,
            top_p=to_device([p.top_p for p in params], torch.float32) if filtered else None,
            generators=generators, any_greedy=any(p.greedy for p in params), all_greedy=all(p.greedy for p in params),
            unit_temperature=all(t == 1.0 for t in temperature), raw=any(p.raw_logprobs for p in params))


class SamplingBuffers:
    """Per-row settings at fixed device addresses, so that a CUDA graph can capture `sample` once and later
    replays read whatever settings `load` wrote since. Only for unseeded batches: a graph replays one fixed
    generator (the engine's shared one), not the per-request generators of seeded rows."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        # Valid settings everywhere from the start: padding rows past a batch read whatever is left here.
        self.temperature = torch.ones(max_rows, device=device)
        self.greedy = torch.zeros(max_rows, dtype=torch.bool, device=device)
        self.top_k = torch.full((max_rows,), vocab_size, dtype=torch.int64, device=device)
        self.top_p = torch.ones(max_rows, device=device)

    def load(self, batch: SamplingBatch) -> None:
        rows = batch.temperature.shape[0]
        self.temperature[:rows].copy_(batch.temperature)
        self.greedy[:rows].copy_(batch.greedy)
        if batch.top_k is not None:
            self.top_k[:rows].copy_(batch.top_k)
            self.top_p[:rows].copy_(batch.top_p)

    def view(self, batch: SamplingBatch, rows: int) -> SamplingBatch:
        """`batch`'s mode over the first `rows` rows of the buffers (rows past the batch's are padding)."""
        if batch.seeded:
            raise ValueError("SamplingBuffers.view: a seeded batch cannot be sampled from fixed buffers")
        filtered = batch.top_k is not None
        return replace(batch, temperature=self.temperature[:rows], greedy=self.greedy[:rows],
                       top_k=self.top_k[:rows] if filtered else None, top_p=self.top_p[:rows] if filtered else None,
                       generators=[None] * rows)


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


def exponential_noise(shape: tuple[int, int], generators: list[torch.Generator | None],
                      shared: torch.Generator | None, device: torch.device) -> Tensor:
    """[B, V] Exp(1) noise; row b from `generators[b]` when set, else from `shared`."""
    noise = torch.empty(shape, device=device)
    if any(g is None for g in generators):
        noise.exponential_(generator=shared)
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # An exact 0 (possible in float32) would turn p/E into inf or nan; the clamp changes no ordering otherwise.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


@torch.no_grad()
def sample(logits: Tensor, batch: SamplingBatch, shared: torch.Generator | None = None) -> Sampled:
    """logits [B, V] (full vocab, any float dtype) -> one token per row with its logprobs.

    Each full [B, V] pass costs about as much as the decode forward of a small model on a 150k vocabulary, so
    there are few: the unnormalised probabilities w = exp(z - max z) serve both the normaliser (logp = z -
    log sum w - max z) and the race (argmax w / E needs no normalisation). At temperature 1 the logits are used as
    they are: every op below computes in fp32 (a bf16 logit converts to fp32 exactly), so skipping the division
    changes no bit of the result and saves a full-size fp32 copy.
    """
    scaled = logits  # [B, V]
    if not batch.unit_temperature:
        scaled = torch.div(logits, batch.temperature.unsqueeze(1))  # fp32 (promoted in the same pass)
    if batch.top_k is not None:
        scaled = filter_top_k_top_p(scaled.float(), batch.top_k, batch.top_p)  # -inf outside the kept set
    weights, top = unnormalised_probs(scaled)  # [B, V], [B, 1] fp32
    normaliser = weights.sum(dim=-1).log_() + top.squeeze(1)  # [B]
    if batch.all_greedy:
        token_ids = scaled.argmax(dim=-1)
    else:
        noise = exponential_noise(tuple(scaled.shape), batch.generators, shared, logits.device)
        token_ids = torch.div(weights, noise, out=noise).argmax(dim=-1)  # the exponential race, over the noise
        if batch.any_greedy:
            token_ids = torch.where(batch.greedy, scaled.argmax(dim=-1), token_ids)
    chosen = token_ids.unsqueeze(1)
    logprobs = scaled.gather(1, chosen).squeeze(1).float() - normaliser
    raw = None
    if batch.raw:  # unscaled and unfiltered: the logprobs above are already the raw ones
        raw = logprobs if scaled is logits else logits.gather(1, chosen).squeeze(1).float() - log_normaliser(logits)
    return Sampled(token_ids, logprobs, raw)


def unnormalised_probs(logits: Tensor) -> tuple[Tensor, Tensor]:
    """logits [B, V] of any float dtype -> (exp(logits - top) [B, V] fp32, top [B, 1] fp32), top the row max (0
    for an all -inf row, which then stays -inf in the normaliser instead of becoming nan).

    The max is taken over the logits as they are and the shifted copy is the only fp32 tensor, instead of
    converting the whole input first.
    """
    top = logits.amax(dim=-1, keepdim=True).float()  # [B, 1]
    top.masked_fill_(top.abs() == torch.inf, 0.0)
    return torch.sub(logits, top).exp_(), top


def log_normaliser(logits: Tensor) -> Tensor:
    """logits [B, V] of any float dtype -> logsumexp over V in fp32, [B]: the same steps, in the same order, as
    `torch.logsumexp` of `logits.float()`, so the same bits."""
    weights, top = unnormalised_probs(logits)
    return weights.sum(dim=-1).log_() + top.squeeze(1)
