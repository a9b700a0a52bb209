"""Actor and reference-policy work on one rank: log-probabilities and PPO updates over a `ModelEngine`.

Plain functions over an engine and a `Batch` (this rank's data-parallel share, identical on its TP/PP ranks), so
they are unit-testable without Ray, and `ActorRefWorker`, which holds the engines and calls them: the policy being
trained plus the optional reference policy, with their checkpoints. Every placement builds on it (the hybrid engine
in hybrid.py, the detached trainer pool in detached.py), so both take the same `ActorOptions` / `RefOptions` from
the plan. Parts the options offload stay in host memory between calls; weight sync reads offloaded params there.

Every worker takes the process's `GroupRegistry` (`registry`; the Ray rank host passes the one all roles of its
process share) and builds all its layouts from it; without one it makes its own, for a process hosting only it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path

import torch
from torch import Tensor

from shardrl.algos import LossScale, actor_loss
from shardrl.algos.distillation import (
    DistillationSettings,
    TopKOverlap,
    distillation_loss,
    overlap_token_advantage,
    topk_distillation_loss,
)
from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.data.batch import Batch
from shardrl.job.options import (
    ActorOptions,
    ForwardBatching,
    PolicyLossOptions,
    RefOptions,
    UpdateOptions,
)
from shardrl.models.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from shardrl.models.hf_bridge import save_hf_checkpoint, save_peft_adapter
from shardrl.models.hf_export import GENERATION_CONFIG
from shardrl.models.transformer import Transformer
from shardrl.parallel.layout import GroupRegistry
from shardrl.parallel.lora import adapters_disabled
from shardrl.parallel.vocab import vocab_parallel_logprobs, vocab_parallel_sum_squared_probs
from shardrl.parallel.vocab_topk import vocab_parallel_topk, vocab_parallel_topk_ids, vocab_parallel_topk_kl
from shardrl.workers.covariance import COVARIANCE_SELECTED, select_covariance_tokens
from shardrl.workers.engine import (
    ROUTED_EXPERTS,
    ROUTING_MISMATCH,
    UNREPLAYED_LOG_PROBS,
    BeforeStep,
    MicroBatch,
    ModelEngine,
    Routing,
    make_micro_batches,
    replay_overridden_fraction,
    stack_outputs,
    train_epochs,
)
from shardrl.workers.packing import pack_responses, unpack_responses
from shardrl.workers.role_model import build_engine, resident, unpadded_rows


TEACHER_TOPK = ("teacher_topk_log_probs", "teacher_topk_ids")  # forward_kl_topk's [B, R, k] teacher tensors
SUM_PI_SQUARED = "sum_pi_squared"  # [B, R] sum over the vocabulary of pi^2 (the optimal token baseline's)


def _logprobs(chunk: Transformer, hidden: Tensor, mb: MicroBatch, temperature: float) -> tuple[Tensor, Tensor]:
    log_prob, entropy = chunk.compute_logprobs(hidden, mb.packed.targets, temperature)  # [T], [T]
    return unpack_responses(log_prob, mb.packed), unpack_responses(entropy, mb.packed)  # [b, R] each


def _logprobs_and_topk_kl(chunk: Transformer, hidden: Tensor, mb: MicroBatch, temperature: float,
                          log_prob_min_clamp: float | None) -> tuple[Tensor, ...]:
    """`_logprobs`, and from the same logits forward_kl_topk's KL to the micro batch's teacher top k, the student's
    mass on them and `TopKOverlap`, all [b, R]."""
    logits = chunk.scaled_logits(hidden, mb.packed.num_tokens, temperature)  # [T, Vp/tp]
    group, vocab_size = chunk.layout.tp_group, chunk.config.vocab_size
    log_prob, entropy = vocab_parallel_logprobs(logits, mb.packed.targets, group, vocab_size)  # [T] each
    mask = mb.data["response_mask"]
    teacher_log_probs, teacher_ids = (pack_responses(mb.data[key], mb.packed, mask) for key in TEACHER_TOPK)
    teacher_ids = teacher_ids.long()  # [T, k]
    kl, mass, terms = vocab_parallel_topk_kl(logits, teacher_log_probs, teacher_ids, group, vocab_size,
                                             log_prob_min_clamp)  # [T], [T], [T, k]
    student_ids = vocab_parallel_topk_ids(logits.detach(), teacher_ids.shape[-1], group, vocab_size)  # [T, k]
    shared = (teacher_ids.unsqueeze(-1) == student_ids.unsqueeze(-2)).any(-1)  # [T, k] in both top k
    overlap = (shared.sum(-1).float(), torch.where(shared, -terms, 0.0).sum(-1))  # TopKOverlap's two [T]
    rows = [unpack_responses(x, mb.packed) for x in (log_prob, entropy, kl, mass, *overlap)]  # [b, R] each
    return *rows[:4], TopKOverlap(*rows[4:])


@torch.no_grad()
def compute_topk_log_probs(engine: ModelEngine, batch: Batch, batching: ForwardBatching, temperature: float,
                           k: int) -> Batch:
    """forward_kl_topk's teacher: the k most likely tokens of every response position under the engine, their
    log-probs [B, R, k] fp32 (`teacher_topk_log_probs`) and ids [B, R, k] int32 (`teacher_topk_ids`)."""
    def loss_fn(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        logits = chunk.scaled_logits(hidden, mb.packed.num_tokens, temperature)  # [T, Vp/tp]
        top = vocab_parallel_topk(logits, k, chunk.layout.tp_group, chunk.config.vocab_size)  # [T, k] each
        return hidden.new_zeros(()), {key: unpack_responses(x, mb.packed) for key, x in zip(TEACHER_TOPK, top)}

    micro_batches, restore = make_micro_batches(batch, (), engine.layout.device, batching.micro_batch_size,
                                                batching.max_token_len, count_group=engine.count_group)
    outputs = engine.run(micro_batches, loss_fn, forward_only=True)
    log_probs, ids = (stack_outputs(outputs, key, restore).cpu() for key in TEACHER_TOPK)
    return Batch({TEACHER_TOPK[0]: log_probs, TEACHER_TOPK[1]: ids.int()})


@torch.no_grad()
def compute_log_prob(engine: ModelEngine, batch: Batch, batching: ForwardBatching,
                     temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-probabilities and entropies `[B, R]` of `batch["responses"]` under the engine's current weights."""
    out = log_prob_pass(engine, batch, batching, temperature, routing=None)
    return out["log_probs"], out["entropy"]


@torch.no_grad()
def log_prob_pass(engine: ModelEngine, batch: Batch, batching: ForwardBatching, temperature: float,
                  routing: Routing, sum_pi_squared: bool = False) -> dict[str, Tensor]:
    """`log_probs` and `entropy` [B, R] on the host; `routing="record"` adds `routed_experts` [B, S, L, k],
    `"replay"` makes every MoE layer use the batch's (`make_micro_batches`); a pass that replays or compares adds
    `routing_mismatch` [B, 2]; `sum_pi_squared` adds `sum_pi_squared` [B, R], sum over the vocabulary of pi^2 at
    each position (the optimal token baseline's)."""
    def loss_fn(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        if not sum_pi_squared:
            log_prob, entropy = _logprobs(chunk, hidden, mb, temperature)
            return hidden.new_zeros(()), {"log_probs": log_prob, "entropy": entropy}
        logits = chunk.scaled_logits(hidden, mb.packed.num_tokens, temperature)  # [T, Vp/tp]
        group, vocab_size = chunk.layout.tp_group, chunk.config.vocab_size
        per_token = (*vocab_parallel_logprobs(logits, mb.packed.targets, group, vocab_size),
                     vocab_parallel_sum_squared_probs(logits, group, vocab_size))
        return hidden.new_zeros(()), {key: unpack_responses(x, mb.packed)
                                      for key, x in zip(("log_probs", "entropy", SUM_PI_SQUARED), per_token)}

    micro_batches, restore = make_micro_batches(batch, (), engine.layout.device, batching.micro_batch_size,
                                                batching.max_token_len, routing, engine.config,
                                                engine.count_group)
    outputs = engine.run(micro_batches, loss_fn, forward_only=True)
    keys = ("log_probs", "entropy") + tuple(k for k in (ROUTED_EXPERTS, ROUTING_MISMATCH, SUM_PI_SQUARED)
                                            if k in outputs[0])
    return {key: stack_outputs(outputs, key, restore).cpu() for key in keys}


def old_log_prob_routing(mode: str, batch: Batch, engine: ModelEngine) -> Routing:
    """The old-logprob pass's routing under `router_replay.mode`: R3 replays the rollout's, R2 records its own
    (compared with the rollout's when the batch has it), and otherwise an MoE pass compares its own routing with the
    rollout's if the rollout recorded it."""
    if mode == "R3":
        return "replay"
    if mode == "R2":
        return "record"
    return "compare" if engine.config.moe is not None and ROUTED_EXPERTS in batch.tensors.keys() else None


def policy_loss_fn(options: PolicyLossOptions, scale: LossScale, temperature: float,
                   distillation: DistillationSettings | None = None):
    """The per-micro-batch actor loss (algos.actor_loss with the mini batch's global counts), with on-policy
    distillation's term (algos.distillation) added to it, or alone when distillation trains without task rewards."""

    topk = distillation is not None and distillation.uses_topk

    def loss_fn(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        if topk:
            log_prob, entropy, topk_kl, student_mass, overlap = _logprobs_and_topk_kl(
                chunk, hidden, mb, temperature, distillation.log_prob_min_clamp)
        else:
            log_prob, entropy = _logprobs(chunk, hidden, mb, temperature)
        d = mb.data
        loss, metrics = actor_loss(
            log_prob, d["old_log_probs"], d["advantages"], d["response_mask"], scale, options.loss_agg_mode,
            options.clip, is_weights=d.get("is_weights"), bypass_is=options.bypass_is, entropy=entropy,
            entropy_coeff=options.entropy_coeff, ref_log_prob=d["ref_log_probs"] if options.use_kl_loss else None,
            kl_loss_coef=options.kl_loss_coef, kl_loss_type=options.kl_loss_type, loss_mode=options.loss_mode,
            selected=d.get(COVARIANCE_SELECTED))
        if topk:
            teacher_mass = d[TEACHER_TOPK[0]].exp().sum(-1)  # [b, R]
            term, term_metrics = topk_distillation_loss(topk_kl, student_mass, teacher_mass, log_prob,
                                                        d["old_log_probs"], d["response_mask"], scale,
                                                        options.loss_agg_mode, distillation, overlap)
        elif distillation is not None:
            term, term_metrics = distillation_loss(log_prob, d["old_log_probs"], d["teacher_log_probs"],
                                                   d["response_mask"], scale, options.loss_agg_mode, distillation)
        if distillation is not None:
            loss = (loss if distillation.use_task_rewards else 0.0) + distillation.coef * term
            metrics |= {"distillation/loss": term.detach()} | {f"distillation/{k}": v for k, v in term_metrics.items()}
        return loss, {**metrics, "log_probs": log_prob}

    return loss_fn


def update_policy(engine: ModelEngine, batch: Batch, loss: PolicyLossOptions, update: UpdateOptions,
                  temperature: float = 1.0, distillation: DistillationSettings | None = None,
                  replay_routing: bool = False) -> dict[str, list[float]]:
    """PPO epochs over mini batches of `batch`; one optimizer step per mini batch; metrics per step. With
    `replay_routing` every MoE layer uses the experts in the batch's `routed_experts` (R2, R3) and the metrics
    gain `router_replay/overridden`."""
    keys = ["old_log_probs", "advantages", "response_mask"]
    keys += [k for k in ("is_weights",) if k in batch.tensors.keys()]
    keys += ["ref_log_probs"] if loss.use_kl_loss else []
    if distillation is not None:
        keys += list(TEACHER_TOPK) if distillation.uses_topk else ["teacher_log_probs"]
    routing = "replay" if replay_routing else None
    select = None if loss.covariance is None else covariance_step(engine, loss, update, temperature)
    metrics = replay_overridden_fraction(train_epochs(
        engine, batch, update, keys, lambda scale: policy_loss_fn(loss, scale, temperature, distillation),
        loss.max_response_length, routing, select))
    return overlap_token_advantage(metrics) if distillation is not None and distillation.uses_topk else metrics


def covariance_step(engine: ModelEngine, loss: PolicyLossOptions, update: UpdateOptions,
                    temperature: float) -> BeforeStep:
    """clip_cov / kl_cov: before each optimizer step, choose the tokens to restrain over its whole mini batch
    (`workers.covariance`) from the log-probs of the weights that step differentiates: the old log-probs for the
    update's first step when the actor computed them (the weights have not moved since), else one forward-only
    pass over the step's micro batches (their routing replayed as in the update). Draws from a generator seeded
    by the update's seed (the step's), the same on every rank."""
    generator = torch.Generator().manual_seed(update.seed)

    def log_probs_only(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return hidden.new_zeros(()), {"log_probs": _logprobs(chunk, hidden, mb, temperature)[0]}

    def before_step(index: int, mini: Batch, micro: list[MicroBatch]) -> None:
        device = engine.layout.device
        if index == 0 and loss.anchor_is_actor:
            log_probs = mini.tensors["old_log_probs"].to(device)
        else:
            with torch.no_grad():
                outputs = engine.run(micro, log_probs_only, forward_only=True)
            log_probs = torch.empty(mini.tensors["old_log_probs"].shape, device=device)
            for mb, out in zip(micro, outputs):
                log_probs[mb.rows] = out["log_probs"].float()
        selected = select_covariance_tokens(loss.covariance, mini, log_probs, loss.clip, engine.layout, generator)
        for mb in micro:
            mb.data[COVARIANCE_SELECTED] = selected[mb.rows]

    return before_step


class ActorRefWorker:
    def __init__(self, actor: ActorOptions, ref: RefOptions | None, model_path: str,
                 registry: GroupRegistry | None = None) -> None:
        torch.manual_seed(actor.seed)
        self.options, self.ref_options, self.model_path = actor, ref, model_path
        self.registry = GroupRegistry() if registry is None else registry  # actor, ref and rollout layouts share it
        self.actor = build_engine(actor.model, model_path, self.registry)
        # With LoRA the reference is the actor's own base (`RefOptions.on_actor`): no second engine.
        self.ref = build_engine(ref.model, model_path, self.registry) if ref is not None and not ref.on_actor else None

    def _actor_resident(self):
        return resident(self.actor, self.options.model)

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """`old_log_probs` and `entropy`; with R2 routing replay also `routed_experts`, which the update replays;
        where the rollout's routing is in the batch, `routing_mismatch` (`old_log_prob_routing`)."""
        o = self.options
        with self._actor_resident():
            out = log_prob_pass(self.actor, batch, o.log_prob, o.temperature,
                                old_log_prob_routing(o.router_replay, batch, self.actor), o.sum_pi_squared)
            if o.measure_unreplayed:  # the same batch and weights, every MoE layer routing itself
                out[UNREPLAYED_LOG_PROBS] = log_prob_pass(self.actor, batch, o.log_prob, o.temperature,
                                                          None)["log_probs"]
        out["old_log_probs"] = out.pop("log_probs")
        return Batch(out)

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """`ref_log_probs`; with ref R3 every MoE layer replays the rollout's routing; with LoRA the actor's engine
        runs the pass with its adapters switched off (the base model)."""
        r = self.ref_options
        engine = self.actor if r.on_actor else self.ref
        base = adapters_disabled(engine.chunks) if r.on_actor else contextlib.nullcontext()
        with resident(engine, self.options.model if r.on_actor else r.model), base:
            out = log_prob_pass(engine, batch, r.log_prob, self.options.temperature,
                                "replay" if r.replay_rollout_routing else None)
        return Batch({"ref_log_probs": out["log_probs"]})

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def update_actor(self, batch: Batch, step: int) -> dict[str, list[float]]:
        update = dataclasses.replace(self.options.update, seed=self.options.update.seed + step)
        with self._actor_resident():
            return update_policy(self.actor, unpadded_rows(batch), self.options.loss, update,
                                 self.options.temperature, self.options.distillation,
                                 self.options.router_replay != "disabled")

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, root: str, step: int, trainer_state: dict) -> None:
        with self._actor_resident():
            save_checkpoint(checkpoint_dir(root, step) / "actor", self.actor.chunks, self.actor.layout,
                            optimizer=self.actor.optimizer, scheduler=self.actor.scheduler,
                            trainer_state=trainer_state, hf_dir=self.model_path,
                            contents=self.options.checkpoint.save_contents)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, step_dir: str) -> dict:
        """Restore the actor (weights, and as `checkpoint.load_contents` asks optimizer, schedule and RNG); the
        controller syncs the rollout after it."""
        with self._actor_resident():
            return load_checkpoint(Path(step_dir) / "actor", self.actor.chunks, self.actor.layout,
                                   optimizer=self.actor.optimizer, scheduler=self.actor.scheduler,
                                   contents=self.options.checkpoint.load_contents)

    @dispatch_mode(Dispatch.ONE_TO_ALL)
    def save_hf(self, out_dir: str) -> None:
        """The actor as an HF checkpoint transformers loads, with the source model's generation config (collective;
        the layout's first rank writes; `hf_export.complete_export` adds the tokenizer). With LoRA
        the checkpoint holds the merged weights and `lora_adapter/` the adapters alone, as PEFT loads them onto the
        base model."""
        with self._actor_resident():
            save_hf_checkpoint(self.actor.chunks, self.actor.layout, out_dir)
            source = Path(self.model_path) / GENERATION_CONFIG  # its sampling defaults and end ids go along
            if self.actor.layout.local_rank == 0 and source.is_file():
                shutil.copyfile(source, Path(out_dir) / GENERATION_CONFIG)
            if self.options.model.engine.lora is not None:
                save_peft_adapter(self.actor.chunks, self.actor.layout, Path(out_dir) / "lora_adapter",
                                  base_model=self.model_path)
