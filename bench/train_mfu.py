"""Training throughput and MFU of one PPO actor step (forward + backward + AdamW) through the real trainer path.

Shapes (random weights, bf16, no checkpoint files): a ~1.24B dense model (Llama-3.2-1B's sizes) and a MoE of 2.5B
total / 0.8B active parameters (Mixtral-style, 16 experts, top-4). Synthetic batches of full-length sequences
(default 4096 tokens: 1024 prompt + 3072 response) go through `update_policy` -> `train_epochs` -> `ModelEngine`
(packing, vocab-parallel logprobs, PPO loss, gradient finalisation, clipping, AdamW), one optimizer step per call.
Each configuration runs without and with activation recompute.

Layouts (issue 10): dense TP2 x DP2 and MoE EP4 on 4 GPUs. `--world 2` runs them at half scale (dense TP2, MoE
EP2; the same per-GPU work, no DP replica) and says so. `--quick` is a smoke test: tiny shapes on 2 CPU ranks (gloo).

Speed options (`FastPaths`, none changes the maths): `--no-tp-overlap` (column-parallel backward waits for its
all-reduce before the weight gradients), `--tp-comm-chunks N` (row-parallel forward pipelines N token pieces with
their collectives), `--compile` (torch.compile of RMSNorm, rotary, SwiGLU). `--variants` runs several such settings
one after another in the same processes and prints a table with each one's ratio to the first. Before the models,
an all-reduce probe times bf16 all-reduces of a few sizes over the TP group (NCCL_PROTO / NCCL_ALGO and the other
NCCL_* variables in effect are printed; unset means NCCL's own choice).

    PYTHONPATH=. python bench/train_mfu.py                   # 4 GPUs
    PYTHONPATH=. python bench/train_mfu.py --world 2 --profile
    PYTHONPATH=. python bench/train_mfu.py --world 2 --model dense --recompute off --variants all
    python bench/train_mfu.py --quick --profile               # CPU
    python bench/train_mfu.py --quick --variants all --model dense --recompute off
    PYTHONPATH=. python bench/train_mfu.py --world 4 --cp 2 --dense-tp 2   # context parallel (2+ GPUs)

FLOPs per step (the model's, not the hardware's: recomputed forwards are not counted, so this is MFU, not HFU):
    6 * N_active * tokens  +  6 * L * n_heads * head_dim * sum over sequences of s^2
N_active counts every weight matrix a token multiplies: q/k/v/o, the dense MLP or (MoE) the router, the top-k routed
experts' gate/up/down and a shared expert, and the LM head (V x H); not the embedding lookup or norms. The second
term is causal attention (QK^T and AV, forward 2 * s^2 * n_heads * head_dim per layer, backward twice that), half
of PaLM's 12 * L * H * s per token, which counts the masked half; the PaLM-convention MFU is printed next to it.
MFU = FLOPs / (step seconds * GPUs * peak); peak defaults to the H200's dense bf16 datasheet number, 989 TFLOP/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from shardrl.job.options import EngineOptions, OptimOptions, PolicyLossOptions, UpdateOptions
from shardrl.algos import ClipRange
from shardrl.data.batch import Batch
from shardrl.models.config import ModelConfig
from shardrl.models.fast_paths import FastPaths
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.tensor_overlap import TPOverlap
from shardrl.workers.actor import update_policy
from shardrl.workers.engine import ModelEngine

H200_BF16_DENSE_TFLOPS = 989.0
SHAPES = {  # HF config.json dicts
    "dense": dict(architectures=["LlamaForCausalLM"], hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                  rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072),
    "moe": dict(architectures=["MixtralForCausalLM"], hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=1408, num_local_experts=16, num_experts_per_tok=4,
                vocab_size=32000, rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=32768),
}
VARIANTS = {  # --variants: name -> speed options; "all" runs them in this order, the first is the baseline
    "plain": FastPaths(TPOverlap(backward=False, chunks=1)),
    "overlap": FastPaths(TPOverlap(backward=True, chunks=1)),
    "chunks2": FastPaths(TPOverlap(backward=True, chunks=2)),
    "chunks4": FastPaths(TPOverlap(backward=True, chunks=4)),
    "compile": FastPaths(TPOverlap(backward=True, chunks=1), compile=True),
    "chunks2+compile": FastPaths(TPOverlap(backward=True, chunks=2), compile=True),
}
PROBE_MIB = (1, 8, 32, 128)  # all-reduce probe sizes; 32 MiB is one micro batch's [8192, 2048] bf16 activations
QUICK_SHAPES = {
    "dense": dict(SHAPES["dense"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256),
    "moe": dict(SHAPES["moe"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=256),
}


@dataclass(frozen=True)
class Setup:
    """What one spawned run measures (picklable: sent to every rank)."""

    shape: dict
    sizes: dict  # LayoutSpec sizes besides world_size
    seq_len: int
    seqs_per_micro: int
    micro_batches: int
    warmup: int
    steps: int
    recompute: tuple[bool, ...]
    variants: tuple[tuple[str, FastPaths], ...]
    sequence_parallel: bool
    distributed_optimizer: bool
    profile: bool
    profile_rows: int
    lag: bool


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 gloo ranks on CPU, 64-token sequences")
    p.add_argument("--world", type=int, default=None, help="GPUs (default: min(4, visible GPUs)); 2 = half scale")
    p.add_argument("--model", choices=["dense", "moe", "both"], default="both")
    p.add_argument("--recompute", choices=["off", "on", "both"], default="both")
    p.add_argument("--dense-tp", type=int, default=2, help="TP of the dense model (the rest of --world is DP)")
    p.add_argument("--cp", type=int, default=1,
                   help="context parallel ranks of both models (each holds 1/CP of every sequence's tokens)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (a quarter of them prompt)")
    p.add_argument("--seqs-per-micro", type=int, default=2, help="sequences packed into one micro batch")
    p.add_argument("--micro-batches", type=int, default=4, help="micro batches per optimizer step per DP replica")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism with TP")
    p.add_argument("--distributed-optimizer", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="profile one more step; print its top kernels (--profile-rows), its host-sync count and (GPU) "
                        "where they come from")
    p.add_argument("--profile-rows", type=int, default=10, help="rows of each --profile table")
    p.add_argument("--lag", action="store_true",
                   help="(GPU) run one more step with timing markers and no profiler: by phase, the host's and the "
                        "GPU's time and how far the GPU runs behind the host (near zero: it waits for the host)")
    p.add_argument("--no-tp-overlap", action="store_true",
                   help="column-parallel backward waits for the input-gradient all-reduce (default: overlap)")
    p.add_argument("--tp-comm-chunks", type=int, default=1, help="row-parallel forward pipelines this many pieces")
    p.add_argument("--compile", action="store_true", help="torch.compile the elementwise chains")
    p.add_argument("--fused-logprobs", action="store_true",
                   help="log-probs from the LM head one vocabulary chunk at a time (model.use_fused_kernels)")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated from {', '.join(VARIANTS)}, or 'all': one table, ratios to the first "
                        f"(overrides the three flags above)")
    p.add_argument("--no-probe", action="store_true", help="skip the all-reduce bandwidth probe")
    p.add_argument("--attention", choices=["flash", "fa4", "auto"], default="flash",
                   help="attention kernel of every variant (FastPaths.attention): torch's flash, FlashAttention-4 "
                        "(the optional flash-attn-4 package), or FA4 where it runs")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="per-GPU peak for MFU")
    args = p.parse_args()
    if args.variants is not None:
        unknown = set(args.variants.split(",")) - set(VARIANTS) - {"all"}
        if unknown:
            p.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)} or 'all'")
    if args.quick:
        args.world, args.seq_len, args.seqs_per_micro, args.micro_batches = 2, 64, 2, 2
        args.warmup, args.steps = 1, 2
    elif not torch.cuda.is_available():
        p.error("no CUDA device: run on the GPU machine, or pass --quick for the CPU smoke test")
    elif args.world is None:
        args.world = min(4, torch.cuda.device_count())
    return args


def active_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies (see the module docstring)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attention = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, o; k, v
    dense_mlp = 3 * h * cfg.intermediate_size
    total = cfg.vocab_size * h  # LM head
    for layer in range(cfg.num_layers):
        moe = cfg.moe
        if moe is not None and layer in moe.layers:
            shared = 3 * h * moe.shared_expert_size + (h if moe.shared_expert_size else 0)  # + its sigmoid gate
            total += attention + h * moe.num_experts + moe.top_k * 3 * h * moe.ffn_size + shared
        else:
            total += attention + dense_mlp
    return total


def step_flops(cfg: ModelConfig, num_seqs: int, seq_len: int) -> tuple[float, float]:
    """(causal-attention FLOPs, PaLM-convention FLOPs) of one training step over `num_seqs` sequences."""
    matmuls = 6.0 * active_params(cfg) * num_seqs * seq_len
    attention = 6.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * num_seqs * seq_len ** 2
    return matmuls + attention, matmuls + 2 * attention


def synthetic_batch(num_seqs: int, seq_len: int, vocab: int, seed: int) -> Batch:
    """Full-length sequences (no padding): prompt seq_len/4, response the rest; random advantages/old logprobs."""
    g = torch.Generator().manual_seed(seed)
    prompt = seq_len // 4
    response = seq_len - prompt
    ids = torch.randint(0, vocab, (num_seqs, seq_len), generator=g)  # [B, S]
    return Batch({
        "input_ids": ids, "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(seq_len).expand(num_seqs, -1).clone(), "responses": ids[:, prompt:],
        "response_mask": torch.ones(num_seqs, response),
        "advantages": torch.randn(num_seqs, response, generator=g),
        "old_log_probs": -torch.rand(num_seqs, response, generator=g) * 10,
    })


@torch.no_grad()
def random_init(chunks: list[torch.nn.Module], std: float) -> None:
    """Matrices N(0, std), vectors (the RMSNorm weights; these shapes have no biases) 1. Same seed on every rank, so
    data-parallel replicas start equal."""
    torch.manual_seed(0)
    for chunk in chunks:
        for param in chunk.parameters():
            if param.dim() > 1:
                param.normal_(0.0, std)
            else:
                param.fill_(1.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def top_ops_table(prof: profile, cuda: bool, rows: int = 10) -> str:
    """The `rows` CUDA kernels with the most total GPU time and (GPU) the `rows` torch ops with the most self GPU
    time, which names the op behind an anonymous elementwise kernel (CPU: the ops with the most self CPU time)."""
    averages = prof.key_averages()
    if cuda:
        tables = [("GPU kernel", [(e.key, e.device_time_total, e.count) for e in averages
                                  if e.device_type == DeviceType.CUDA]),
                  ("torch op (self GPU time)", [(e.key, e.self_device_time_total, e.count) for e in averages
                                                if e.device_type == DeviceType.CPU and e.self_device_time_total > 0])]
    else:
        tables = [("CPU op", [(e.key, e.self_cpu_time_total, e.count) for e in averages])]
    lines = []
    for title, events in tables:
        total = sum(t for _, t, _ in events)
        if not events or total == 0:
            return "profile: no kernel events recorded"
        lines.append(f"{title:<90} {'ms':>9} {'%':>6} {'calls':>6}")
        for name, t, count in sorted(events, key=lambda e: -e[1])[:rows]:
            lines.append(f"{name[:90]:<90} {t / 1e3:9.2f} {100 * t / total:6.1f} {count:6d}")
    return "\n".join(lines)


# CUDA runtime calls that make the host wait for the GPU: every .item()/.tolist()/float() of a CUDA tensor, each
# data-dependent shape (nonzero, boolean masks) and each blocking host-to-device copy ends in one of them.
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def host_syncs_line(prof: profile, seconds: float, cuda: bool) -> str:
    """How often the profiled step made the host wait for the GPU (the bench's own end-of-step sync included), and
    how busy the GPU was: summed kernel time over the step's wall time (NCCL kernels on their own stream overlap
    compute, so this can exceed 100%)."""
    if not cuda:
        return "host syncs: only measured on GPU"
    events = {e.key: e for e in prof.key_averages()}
    counts = ", ".join(f"{key} x{events[key].count}" for key in SYNC_EVENTS if key in events) or "none"
    kernels = sum(e.device_time_total for e in events.values() if e.device_type == DeviceType.CUDA) / 1e6
    return (f"host syncs in the profiled step: {counts}; kernel time {kernels:.3f} s of {seconds:.3f} s wall "
            f"({100 * kernels / seconds:.0f}%)")


def busy_runs(kernels: list[tuple[float, float, object]]) -> list[list]:
    """[start, end, first kernel's tag, last kernel's tag] of each stretch in which some kernel of `kernels`
    ((start, end, tag), any stream, any order) ran, in time order."""
    runs: list[list] = []
    for begin, end, tag in sorted(kernels, key=lambda k: k[0]):
        if runs and begin <= runs[-1][1]:
            if end > runs[-1][1]:
                runs[-1][1], runs[-1][3] = end, tag
        else:
            runs.append([begin, end, tag, tag])
    return runs


# Gap lengths (microseconds) that tell host-bound stretches (many short gaps: launches slower than the kernels) from
# stalls (a few long ones: a wait, an allocation, Python work between launches).
GAP_CLASSES = ((20, "< 20 us"), (200, "20-200 us"), (2000, "0.2-2 ms"), (float("inf"), ">= 2 ms"))


def idle_by_launcher(prof: profile, top: int = 12) -> str:
    """Where the GPU stood idle in a CPU + CUDA profiled step, by the host op that launched the kernel ending each
    gap (the kernel's linked correlation id names the innermost op; its outermost caller, e.g. an autograd node's
    `evaluate_function`, groups a layer's backward), with the gaps counted by length. The profiler's own host cost
    lengthens host-bound gaps somewhat; the CUDA-only `idle_gaps` measures the total without it. Kernels are read
    from the raw profiler events, which carry the linked id on every torch version."""
    ops = {e.id: e for e in prof.events() if e.device_type == DeviceType.CPU and e.id > 0}
    runs = busy_runs([(e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3, e.linked_correlation_id())
                      for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA])
    by_op: Counter[str] = Counter()
    by_root: Counter[str] = Counter()
    count_op: Counter[str] = Counter()
    by_length = [[0, 0.0] for _ in GAP_CLASSES]
    for before, after in zip(runs, runs[1:]):
        gap = after[0] - before[1]
        op = root = ops.get(after[2])  # linked id 0: launched outside any op
        while root is not None and root.cpu_parent is not None:
            root = root.cpu_parent
        name = op.name if op is not None else "(no host op)"
        by_op[name] += gap
        count_op[name] += 1
        by_root[root.name if root is not None else name] += gap
        slot = next(i for i, (limit, _) in enumerate(GAP_CLASSES) if gap < limit)
        by_length[slot][0] += 1
        by_length[slot][1] += gap
    total = sum(by_op.values())
    lines = [f"idle {total / 1e3:.1f} ms in {max(len(runs) - 1, 0)} gaps (CPU + CUDA profile); by length: " + ", ".join(
        f"{label} {n} gaps {t / 1e3:.1f} ms" for (_, label), (n, t) in zip(GAP_CLASSES, by_length))]
    lines.append("  idle before the kernels of (innermost host op):")
    lines += [f"    {t / 1e3:8.2f} ms {count_op[name]:6d} gaps  {name[:80]}" for name, t in by_op.most_common(top)]
    lines.append("  idle before the kernels of (outermost host op):")
    lines += [f"    {t / 1e3:8.2f} ms  {name[:90]}" for name, t in by_root.most_common(top)]
    return "\n".join(lines)


def idle_gaps(train_step: Callable[[], object], device: torch.device, top: int = 10) -> str:
    """Profile one more step with CUDA activity only (kernel and runtime-call times, little host overhead) and find
    where the GPU stood idle: the union of kernel intervals over all streams against the step's wall time, and the
    longest gaps with the kernels around them and the runtime calls the host made meanwhile (many launches: the
    host was slower than the GPU; a synchronize: it waited for a value)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        train_step()
        sync(device)
    wall = time.perf_counter() - start
    events = list(prof.events())
    merged = busy_runs([(e.time_range.start, e.time_range.end, e.name) for e in events
                        if e.device_type == DeviceType.CUDA])  # microseconds
    calls = sorted((e.time_range.start, e.name) for e in events if e.device_type == DeviceType.CPU)
    if not merged:
        return "idle gaps: no kernel events recorded"
    busy = sum(end - begin for begin, end, _, _ in merged) / 1e6
    gaps = sorted(((after[0] - before[1], before, after) for before, after in zip(merged, merged[1:])),
                  key=lambda g: -g[0])[:top]
    origin = merged[0][0]
    lines = [f"GPU busy (any stream) {busy:.3f} s of a {wall:.3f} s step ({100 * busy / wall:.0f}%); first kernel "
             f"{(merged[0][0] - calls[0][0]) / 1e3 if calls else 0:.1f} ms after the first runtime call; longest "
             f"gaps between kernels:"]
    for length, before, after in gaps:
        inside = [name for t, name in calls if before[1] <= t < after[0]]
        waits = sorted({n for n in inside if "Synchronize" in n})
        lines.append(f"  {length / 1e3:7.2f} ms at {(before[1] - origin) / 1e3:7.1f} ms: {len(inside)} runtime calls"
                     f"{' incl. ' + ', '.join(waits) if waits else ''}; after {before[3][:50]!r}, "
                     f"before {after[2][:50]!r}")
    return "\n".join(lines)


def sync_sites(train_step: Callable[[], object], top: int = 12) -> str:
    """Run one step under CUDA's sync debug mode and count where the host waited for the GPU: each synchronizing
    call is keyed by the innermost two shardrl frames of its Python stack (the profile only counts them)."""
    sites: Counter[str] = Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        ours = [f for f in traceback.extract_stack()[:-1] if "/shardrl/" in f.filename]
        sites[" <- ".join(f"{f.filename.split('/shardrl/')[-1]}:{f.lineno} {f.name}" for f in ours[::-1][:2])
              or f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = [f"host sync sites of one more step (sync debug mode): {sum(sites.values())} in all"]
    lines += [f"  {count:4d}  {site}" for site, count in sites.most_common(top)]
    return "\n".join(lines)


def measure(setup: Setup) -> list[dict] | None:
    """On every rank: build the engine for each recompute setting and variant, time its steps; rank 0 returns the
    results."""
    layout = Layout.create(LayoutSpec(world_size=dist.get_world_size(), **setup.sizes))  # NCCL: this rank's GPU
    cfg = ModelConfig.from_dict(setup.shape)
    dtype = torch.bfloat16 if layout.device.type == "cuda" else torch.float32
    num_seqs = setup.seqs_per_micro * setup.micro_batches  # per DP replica
    batch = synthetic_batch(num_seqs, setup.seq_len, cfg.vocab_size, seed=layout.dp_rank)
    loss = PolicyLossOptions(loss_agg_mode="token-mean", clip=ClipRange(0.2),
                             max_response_length=setup.seq_len - setup.seq_len // 4)
    update = UpdateOptions(mini_batch_size=num_seqs, micro_batch_size=setup.seqs_per_micro)
    results = []
    for recompute in setup.recompute:
        for variant, fast in setup.variants:
            options = EngineOptions(sequence_parallel=setup.sequence_parallel, recompute=recompute, dtype=dtype,
                                    optim=OptimOptions(lr=1e-6, distributed=setup.distributed_optimizer), fast=fast)
            engine = ModelEngine(cfg, layout, options,
                                 weights_loader=lambda chunks: random_init(chunks, cfg.initializer_range))
            result = time_steps(engine, lambda: update_policy(engine, batch, loss, update), setup)
            if setup.lag and layout.device.type == "cuda":
                result["lag"] = HostLag(engine).table(lambda: update_policy(engine, batch, loss, update))
            results.append(dict(result, recompute=recompute, variant=variant, num_seqs=num_seqs * layout.dp_size))
            del engine  # free it before the next setting's engine is built
            gc.collect()
            if layout.device.type == "cuda":
                torch.cuda.empty_cache()
    return results if dist.get_rank() == 0 else None


def probe_all_reduce(sizes: dict, mib: tuple[float, ...], iters: int) -> list[tuple[float, float]] | None:
    """On every rank: seconds of one bf16 all-reduce of each size over the TP group (mean of `iters` after 3
    warm-ups), with nothing else running; rank 0 returns (MiB, seconds) pairs."""
    layout = Layout.create(LayoutSpec(world_size=dist.get_world_size(), **sizes))
    results = []
    for size in mib:
        x = torch.ones(int(size * 2**20) // 2, dtype=torch.bfloat16, device=layout.device)
        for step in range(3 + iters):
            if step == 3:
                sync(layout.device)
                start = time.perf_counter()
            dist.all_reduce(x, group=layout.tp_group)
        sync(layout.device)
        results.append((size, (time.perf_counter() - start) / iters))
    return results if dist.get_rank() == 0 else None


def nccl_environment() -> str:
    """The NCCL settings of this environment (the variables the bench's processes inherit) and the peer access."""
    keys = ("NCCL_PROTO", "NCCL_ALGO", "NCCL_NVLS_ENABLE", "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE",
            "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_BUFFSIZE", "CUDA_DEVICE_MAX_CONNECTIONS")
    settings = ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in keys)
    if torch.cuda.device_count() > 1:
        settings += (f"; NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, GPU 0 -> 1 peer access "
                     f"{torch.cuda.can_device_access_peer(0, 1)}")
    return settings


class GCPauses:
    """Python's garbage collector during the timed steps: how often each generation ran and how long the host stood
    in it. A full (generation 2) collection walks every tracked object of the process, which grows with everything
    imported; a pause longer than the GPU's queued work leaves the GPU idle with no host sync to show for it."""

    def __init__(self) -> None:
        self.counting = False
        self.runs = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self._record)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._record)

    def _record(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.counting:
            self.runs[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def summary(self, steps: int, what: str = "timed step") -> str:
        return (f"GC per {what}: " + ", ".join(f"gen {g} x{self.runs[g] / steps:.1f} "
                                                   f"{1e3 * self.seconds[g] / steps:.2f} ms" for g in range(3))
                + f"; {len(gc.get_objects())} objects tracked")


def time_steps(engine: ModelEngine, train_step: Callable[[], object], setup: Setup) -> dict:
    """Seconds of each timed step (after the warm-up steps), peak memory, and the profile of one more step."""
    device = engine.layout.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    allocator_before = allocator_counts(device)
    with GCPauses() as pauses:
        for step in range(setup.warmup + setup.steps):
            sync(device)
            start = time.perf_counter()
            pauses.counting = step >= setup.warmup
            train_step()
            sync(device)
            if step >= setup.warmup:
                times.append(time.perf_counter() - start)
    allocator = {k: v - allocator_before[k] for k, v in allocator_counts(device).items()}
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    table = None
    if setup.profile:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            start = time.perf_counter()
            train_step()
            sync(device)
        seconds = time.perf_counter() - start
        table = top_ops_table(prof, cuda, setup.profile_rows) + "\n" + host_syncs_line(prof, seconds, cuda)
        if cuda:
            table += "\n" + "\n".join((idle_by_launcher(prof), idle_gaps(train_step, device), sync_sites(train_step)))
    return dict(times=times, peak_gib=peak_gib, profile=table, gc=pauses.summary(setup.steps), allocator=allocator)


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The caching allocator's counters that mean a slow step: device allocations and frees (cudaMalloc/cudaFree,
    the latter synchronising) and retries (a failed allocation that freed the whole cache and synchronised)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {key: stats.get(key, 0) for key in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


class HostLag:
    """How far the GPU runs behind the host through one step, without a profiler (whose cost per launch distorts
    where idle time falls). At each marker the host notes its clock and records a CUDA event: at the start of the
    step, before every decoder layer's forward, where every layer's backward begins (a hook on its output's
    gradient), around the optimizer step and at the end. A marker's lag is its event's GPU time minus the host's time
    there, both since the step's first marker (recorded on an idle GPU). The GPU only idles where the lag is near
    zero, i.e. where it has caught up with the host and waits for the next launch; a phase whose host time exceeds
    its GPU time is host-bound."""

    def __init__(self, engine: ModelEngine) -> None:
        self.marks: list[tuple[str, float, torch.cuda.Event]] = []
        self.micro = -1
        for chunk in engine.chunks:
            for index, layer in enumerate(chunk.layers):
                layer.register_forward_pre_hook(self._forward_pre(index))
                layer.register_forward_hook(self._forward_post)
        optimizer = engine.optimizer
        step = optimizer.step

        def marked_step():
            self.mark("optimizer")
            result = step()
            self.mark("after optimizer")
            return result

        optimizer.step = marked_step

    def _forward_pre(self, index: int) -> Callable:
        def hook(module, args) -> None:
            if index == 0:
                self.micro += 1
            self.mark(f"forward {self.micro}")
        return hook

    def _forward_post(self, module, args, output: torch.Tensor) -> None:
        if output.requires_grad:
            micro = self.micro
            output.register_hook(lambda grad: self.mark(f"backward {micro}"))

    def mark(self, name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((name, time.perf_counter(), event))

    def table(self, train_step: Callable[[], object]) -> str:
        """Run `train_step` once with the markers; one line per phase (consecutive markers of one name)."""
        torch.cuda.synchronize()
        self.marks, self.micro = [], -1
        with GCPauses() as pauses:  # a full collection before the first forward would show as idle GPU there
            pauses.counting = True
            self.mark("before the first forward")
            train_step()
            self.mark("end (host waits for the GPU)")
        torch.cuda.synchronize()
        host0, event0 = self.marks[0][1], self.marks[0][2]
        points = [(name, 1e3 * (host - host0), event0.elapsed_time(event)) for name, host, event in self.marks]
        phases: list[list] = []  # [name, host start, gpu start, least lag inside, lag at its first marker]
        for name, host, gpu in points:
            if not phases or phases[-1][0] != name:
                phases.append([name, host, gpu, gpu - host, gpu - host])
            phases[-1][3] = min(phases[-1][3], gpu - host)
        lines = [f"host/GPU lag of one more step (ms; lag = GPU behind host at the phase's markers):",
                 f"  {'phase':<30} {'host':>8} {'GPU':>8} {'lag at start':>13} {'least lag':>10}"]
        for (name, host, gpu, least, first), after in zip(phases, phases[1:] + [None]):
            if after is None:
                lines.append(f"  {name:<30} {'':>8} {'':>8} {first:13.2f}")
                continue
            lines.append(f"  {name:<30} {after[1] - host:8.2f} {after[2] - gpu:8.2f} {first:13.2f} {least:10.2f}")
        return "\n".join(lines + ["  " + pauses.summary(1, "lag step")])


def layouts(args: argparse.Namespace) -> dict[str, dict]:
    """LayoutSpec sizes of each model at `args.world` (dense: TP `--dense-tp` x CP `--cp`, the rest DP; MoE: EP =
    world, CP `--cp`)."""
    tp = min(args.dense_tp, args.world // args.cp)
    return {"dense": dict(tp=tp, cp=args.cp), "moe": dict(ep=args.world, cp=args.cp)}


def report(name: str, cfg: ModelConfig, setup: Setup, world: int, result: dict, peak: float) -> dict:
    """Print one run's line (and profile); return its step seconds, tokens/s and MFU for the table."""
    seconds = sum(result["times"]) / len(result["times"])
    tokens = result["num_seqs"] * setup.seq_len
    flops, flops_palm = step_flops(cfg, result["num_seqs"], setup.seq_len)
    mfu, mfu_palm = (f / (seconds * world * peak * 1e12) for f in (flops, flops_palm))
    recompute = "on " if result["recompute"] else "off"
    print(f"{name:5s} [{result['variant']}] recompute {recompute}: step {seconds:.3f} s "
          f"(min {min(result['times']):.3f}), {tokens / seconds:,.0f} tok/s ({tokens / seconds / world:,.0f} per "
          f"rank), {flops / seconds / world / 1e12:.1f} model TFLOP/s per rank, MFU {100 * mfu:.1f}% "
          f"(PaLM convention {100 * mfu_palm:.1f}%), peak memory {result['peak_gib']:.1f} GiB\n  {result['gc']}\n"
          f"  steps (s): {', '.join(f'{t:.3f}' for t in result['times'])}; allocator during them: "
          f"{', '.join(f'{k} {v}' for k, v in result['allocator'].items()) or 'n/a'}")
    if "lag" in result:
        print(result["lag"])
    if result["profile"] is not None:
        print(f"top kernels of one {name} step [{result['variant']}] (recompute {recompute.strip()}), rank 0:\n"
              f"{result['profile']}")
    return dict(variant=result["variant"], recompute=result["recompute"], seconds=seconds,
                tokens_per_s=tokens / seconds, mfu=mfu)


def variants_table(name: str, rows: list[dict]) -> str:
    """One line per variant and recompute setting; the ratio is tokens/s against the first variant's run with the
    same recompute setting in this process."""
    lines = [f"{name}: {'variant':<18} {'recompute':>9} {'step s':>8} {'tok/s':>10} {'MFU %':>6} {'vs first':>8}"]
    for row in rows:
        base = next(r for r in rows if r["recompute"] == row["recompute"])
        lines.append(f"{name}: {row['variant']:<18} {'on' if row['recompute'] else 'off':>9} {row['seconds']:8.3f} "
                     f"{row['tokens_per_s']:10,.0f} {100 * row['mfu']:6.1f} "
                     f"{row['tokens_per_s'] / base['tokens_per_s']:7.2f}x")
    return "\n".join(lines)


def chosen_variants(args: argparse.Namespace) -> tuple[tuple[str, FastPaths], ...]:
    if args.variants is None:
        fast = FastPaths(TPOverlap(backward=not args.no_tp_overlap, chunks=args.tp_comm_chunks), args.compile,
                         attention=args.attention, fused_logprobs=args.fused_logprobs)
        return (("flags", fast),)
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    return tuple((n, dataclasses.replace(VARIANTS[n], attention=args.attention)) for n in names)


def main() -> None:
    args = parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    backend = "gloo" if args.quick else "nccl"
    recompute = {"off": (False,), "on": (True,), "both": (False, True)}[args.recompute]
    names = ["dense", "moe"] if args.model == "both" else [args.model]
    sizes = layouts(args)
    variants = chosen_variants(args)
    timeout = datetime.timedelta(minutes=4 + 2 * len(variants))
    print(f"train_mfu: {'QUICK smoke test on CPU (tiny shapes; MFU meaningless)' if args.quick else 'bf16 on GPU'}, "
          f"world {args.world}, {args.seq_len}-token sequences, {args.seqs_per_micro} per micro batch, "
          f"{args.micro_batches} micro batches per step per DP replica, {args.warmup} warm-up + {args.steps} timed "
          f"steps; MFU against {args.peak_tflops:g} TFLOP/s per rank"
          f"{' (H200 dense bf16 datasheet peak)' if args.peak_tflops == H200_BF16_DENSE_TFLOPS else ''}")
    print("variants: " + "; ".join(f"{n} = {fast}" for n, fast in variants))
    if not args.quick and args.world < 4:
        tp = sizes["dense"]["tp"]
        print(f"HALF SCALE: world {args.world} < 4, so dense runs TP{tp} x DP{args.world // tp} and MoE "
              f"EP{args.world} instead of issue 10's TP2 x DP2 and EP4 on 4 GPUs (same per-GPU work, fewer replicas)")
    print(f"NCCL environment: {nccl_environment()}")
    if not args.no_probe and sizes["dense"]["tp"] > 1:
        mib = (0.03, 0.25) if args.quick else PROBE_MIB
        probe = run_distributed(args.world, probe_all_reduce, sizes["dense"], mib, 2 if args.quick else 20,
                                backend=backend, timeout=timeout)[0]
        for size, seconds in probe:  # bus bandwidth = algorithm bandwidth * 2 (n - 1) / n for a ring all-reduce
            tp = sizes["dense"]["tp"]
            algbw = size * 2**20 / seconds / 1e9
            print(f"all-reduce probe over TP{tp}: {size:g} MiB bf16 in {seconds * 1e3:.3f} ms, algbw "
                  f"{algbw:.1f} GB/s, busbw {algbw * 2 * (tp - 1) / tp:.1f} GB/s")
    for name in names:
        cfg = ModelConfig.from_dict(shapes[name])
        spec = LayoutSpec(world_size=args.world, **sizes[name])
        setup = Setup(shapes[name], sizes[name], args.seq_len, args.seqs_per_micro, args.micro_batches, args.warmup,
                      args.steps, recompute, variants, args.sequence_parallel, args.distributed_optimizer,
                      args.profile, args.profile_rows, args.lag)
        print(f"{name}: {active_params(cfg) / 1e6:,.1f}M active params, "
              f"layout TP{spec.tp} CP{spec.cp} DP{spec.dp} EP{spec.ep}")
        results = run_distributed(args.world, measure, setup, backend=backend, timeout=timeout)[0]
        rows = [report(name, cfg, setup, args.world, result, args.peak_tflops) for result in results]
        if len(variants) > 1:
            print(variants_table(name, rows))


if __name__ == "__main__":
    main()
