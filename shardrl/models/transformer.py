"""One decoder-only transformer for every supported family, built as one pipeline stage.

A stage owns the decoder layers `layer_ids`; the first stage (`pre_process`) also owns the token embedding, the
last (`post_process`) the final norm and the output head: the LM head, or with `value_head=True` a scalar head
`score.weight` [1, H] without bias (the name and shape of HF's `*ForSequenceClassification` heads, which reward
models ship; a critic starting from a causal LM checkpoint initialises it, see `hf_bridge.load_hf_weights`).

With tied embeddings the LM head is the embedding matrix. When both live on one stage they are one parameter;
across pipeline stages the last stage holds its own copy under the same HF name, loaded from the same tensor and
marked `tied_group` so the gradients of the two copies are summed.

Inputs are packed sequences: `input_ids [T]`, `position_ids [T]`, `cu_seqlens [N+1]` int32 (no padding). Hidden
states between stages are `[T, H]`, or this rank's token chunk `[T_r, H]` with sequence parallelism; with context
parallelism every tensor holds only this CP rank's share of the tokens (`parallel/context.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from shardrl.models.attention import Attention, KVCacheHook, PackedSeqs
from shardrl.models.config import ModelConfig
from shardrl.models.fast_paths import FastPaths
from shardrl.models.mlp import MLP, MoEBlock
from shardrl.parallel.context import ContextShard
from shardrl.models.norm import RMSNorm
from shardrl.models.rope import RotaryEmbedding
from shardrl.parallel.expert import MoELayer, RouterOptions
from shardrl.parallel.fused_logprobs import fused_vocab_parallel_logprobs
from shardrl.parallel.layout import Layout
from shardrl.parallel.spec import set_spec
from shardrl.parallel.tensor import ColumnParallelLinear, ReplicatedLinear, enter_tp, gather_tokens, linear
from shardrl.parallel.vocab import VocabParallelEmbedding, vocab_parallel_logprobs, vocab_spec

VALUE_HEAD_NAME = "score.weight"


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layout: Layout, layer_id: int, sequence_parallel: bool,
                 dtype: torch.dtype, router: RouterOptions, fast: FastPaths) -> None:
        super().__init__()
        prefix, eps, tp = f"model.layers.{layer_id}", config.rms_norm_eps, layout.tp_size
        self.input_layernorm = RMSNorm(config.hidden_size, eps, f"{prefix}.input_layernorm.weight",
                                       sequence_parallel and tp > 1, layout.device, dtype, fast.compile, fast.bitwise)
        self.self_attn = Attention(config, layout, layer_id, sequence_parallel, dtype, fast)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, f"{prefix}.post_attention_layernorm.weight",
                                                sequence_parallel and tp > 1, layout.device, dtype, fast.compile,
                                                fast.bitwise)
        if config.moe is not None and layer_id in config.moe.layers:
            self.mlp = MoEBlock(config, layout, layer_id, sequence_parallel, dtype, router, fast)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, layout, f"{prefix}.mlp", config.mlp_bias,
                           sequence_parallel, dtype, fast)

    def forward(self, h: Tensor, seqs: PackedSeqs) -> Tensor:
        normed, h = self.input_layernorm.with_residual(h)
        h = self.self_attn(normed, seqs, residual=h)
        normed, h = self.post_attention_layernorm.with_residual(h)
        return self.mlp(normed, seqs.num_tokens, residual=h)


class Transformer(nn.Module):
    """One pipeline stage (the whole model by default) of a Llama / Qwen2 / Qwen3 / Mixtral / Qwen-MoE decoder.

    `recompute`: checkpoint every layer (activations recomputed in backward). `router`: how MoE routers train
    (the weights of the router losses that `MoELayer` back-propagates, fp32 logits). `fast`: communication overlap and
    compiled elementwise kernels (`fast_paths`), which change speed, not results.
    """

    def __init__(self, config: ModelConfig, layout: Layout, layer_ids: range | None = None,
                 pre_process: bool = True, post_process: bool = True, value_head: bool = False,
                 sequence_parallel: bool = False, recompute: bool = False, dtype: torch.dtype = torch.float32,
                 router: RouterOptions = RouterOptions(), fast: FastPaths = FastPaths()) -> None:
        super().__init__()
        self.config, self.layout, self.bitwise, self.fused_logprobs = config, layout, fast.bitwise, fast.fused_logprobs
        self.layer_ids = range(config.num_layers) if layer_ids is None else layer_ids
        self.pre_process, self.post_process, self.value_head = pre_process, post_process, value_head
        self.sequence_parallel, self.recompute = sequence_parallel and layout.tp_size > 1, recompute
        sp, tied = self.sequence_parallel, config.tie_word_embeddings and not value_head
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, layout.device)
        self.lm_head: nn.Parameter | None = None
        if pre_process:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, layout, "model.embed_tokens.weight", sp,
                tied_group=tied and not post_process, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layout, i, sp, dtype, router, fast)
            for i in self.layer_ids)
        if post_process:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, "model.norm.weight", sp, layout.device, dtype,
                                fast.compile, fast.bitwise)
            if value_head:
                self.score = ReplicatedLinear(config.hidden_size, 1, layout, "score", sp, dtype, fast.bitwise)
            elif not (tied and pre_process):  # else the LM head is `embed_tokens.weight` itself
                name = "model.embed_tokens.weight" if tied else "lm_head.weight"
                spec = vocab_spec(name, config.vocab_size, config.hidden_size, layout, tied_group=tied)
                self.lm_head = nn.Parameter(torch.empty(spec.local_shape(), device=layout.device, dtype=dtype))
                set_spec(self.lm_head, spec)

    def forward(self, x: Tensor, position_ids: Tensor, cu_seqlens: Tensor, kv_cache: KVCacheHook | None = None,
                max_seqlen: int | None = None, context: ContextShard | None = None) -> Tensor:
        """x: input_ids [T] on the first stage, else the previous stage's hidden states.

        Returns hidden states [T, H] ([T_r, H] with sequence parallelism), after the final norm on the last stage;
        feed those to `compute_logprobs`, `compute_logits` or `compute_values`. The rollout engine passes its
        `kv_cache` hook, and `max_seqlen` when it knows it (computing it is a host sync a CUDA graph cannot hold).
        With context parallelism `x` and `position_ids` are this CP rank's share (`context`) of the micro batch
        that `cu_seqlens` describes, and so is everything returned.
        """
        cos, signed_sin = self.rotary(position_ids)
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        seqs = PackedSeqs(cu_seqlens, max_seqlen, cos, signed_sin, kv_cache, context)
        h = self.embed_tokens(x) if self.pre_process else x
        for layer in self.layers:
            h = checkpoint(layer, h, seqs, use_reentrant=False) if self.recompute else layer(h, seqs)
        return self.norm(h) if self.post_process else h

    def column_groups(self) -> list[tuple[ColumnParallelLinear, ...]]:
        """Per layer the column-parallel linears that read the same input (q/k/v; gate/up of a dense MLP or a shared
        expert), which an inference engine packs so each group runs as one GEMM (`pack_adjacent`)."""
        return [m.column_linears for m in self.modules() if isinstance(m, (Attention, MLP))]

    def reads_host(self) -> bool:
        """Whether a forward reads device values on the host, so no CUDA graph can capture it: an MoE layer whose
        dispatch learns its sizes from the device (`MoELayer.reads_host`)."""
        return any(m.reads_host for m in self.modules() if isinstance(m, MoELayer))

    def lm_head_weight(self) -> Tensor:
        """[Vp/tp, H] this rank's rows of the (padded) output vocabulary."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: Tensor, num_tokens: int) -> Tensor:
        """hidden [T, H] (or [T_r, H]) -> logits [T, Vp/tp] of this rank's vocab block (`gather_vocab` for all)."""
        h = enter_tp(hidden, self.layout.tp_group, self.sequence_parallel, num_tokens)  # [T, H]
        if self.bitwise:
            return linear(h, self.lm_head_weight(), bitwise=True)
        return torch.nn.functional.linear(h, self.lm_head_weight())

    def compute_logprobs(self, hidden: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
        """Log-probabilities of `targets` [T] (the next token of each position) and entropies, both [T] fp32,
        computed vocab-parallel without gathering the logits; with `FastPaths.fused_logprobs` straight from the
        hidden states, one token chunk of logits at a time (`parallel/fused_logprobs.py`)."""
        if self.fused_logprobs:
            h = enter_tp(hidden, self.layout.tp_group, self.sequence_parallel, targets.shape[0])  # [T, H]
            return fused_vocab_parallel_logprobs(h, self.lm_head_weight(), targets, self.layout.tp_group,
                                                 self.config.vocab_size, temperature)
        logits = self.scaled_logits(hidden, targets.shape[0], temperature)  # [T, Vp/tp]
        return vocab_parallel_logprobs(logits, targets, self.layout.tp_group, self.config.vocab_size)

    def scaled_logits(self, hidden: Tensor, num_tokens: int, temperature: float) -> Tensor:
        """`compute_logits` divided by the sampling temperature: what every log-prob of the trainer is taken of."""
        logits = self.compute_logits(hidden, num_tokens)  # [T, Vp/tp]
        return logits / temperature if temperature != 1.0 else logits

    def compute_values(self, hidden: Tensor, num_tokens: int) -> Tensor:
        """Value-head output [T] (replicated over TP)."""
        values = self.score(hidden).squeeze(-1)  # [T] or [T_r]
        return gather_tokens(values, self.layout.tp_group, num_tokens) if self.sequence_parallel else values
