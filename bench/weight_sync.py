"""Weight-sync bandwidth: trainer shards -> rollout shards for a ~3B dense and a ~3B MoE shape (random bf16 weights),
GPU-resident and with the trainer's params offloaded to pinned host memory, against two references measured in the
same run: a raw NCCL broadcast of the bytes one rollout rank receives, and pinned host-to-device copies of the bytes
each trainer rank reads (issue 7's targets: >= 0.70 of the broadcast GPU-resident, >= 0.70 of H2D offloaded).

Default (4 GPUs, colocated as in the hybrid engine): dense Qwen2.5-3B sizes on trainer TP2 x PP2, MoE (64 experts,
8 layers) on trainer EP4, both -> rollout TP2 x 2 replicas. `--world 2` runs at HALF SCALE, with layouts that move
data between the GPUs as the full-scale ones do (dense PP2 -> rollout TP2 and TP2 -> rollout 2 x TP1, MoE EP2 ->
rollout TP2; see `make_setups`), and says so; `--placement detached` puts the trainer on the first half of the
ranks and the rollout on the second (so 8 GPUs give the full-scale layouts). `--profile` prints rank 0's top
operators of one more sync per mode.

    python bench/weight_sync.py                       # the GPU benchmark (4 GPUs)
    python bench/weight_sync.py --world 2 --profile   # half scale on 2 GPUs
    python bench/weight_sync.py --quick               # tiny shapes, 4 CPU processes over gloo: a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen2Config, Qwen3MoeConfig

from shardrl.job.options import EngineOptions
from shardrl.models.config import ModelConfig
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.offload import offload
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.sync.colocated import ColocatedSync
from shardrl.sync.detached import DetachedSync
from shardrl.sync.shards import Shards
from shardrl.workers.engine import ModelEngine

SHAPES = {  # HF configs: Qwen2.5-3B's sizes, and a Qwen3-MoE of about 3.1B parameters
    "dense": (Qwen2Config, dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                                intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True)),
    "moe": (Qwen3MoeConfig, dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                 head_dim=128, moe_intermediate_size=768, num_experts=64, num_experts_per_tok=8,
                                 vocab_size=151936, tie_word_embeddings=False)),
}
QUICK = {
    "dense": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=1000),
    "moe": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=1000),
}


@dataclass(frozen=True)
class Setup:
    trainer: dict
    trainer_ranks: list[int]
    rollout: dict
    rollout_ranks: list[int]

    def describe(self) -> str:
        def sizes(d: dict) -> str:
            return "x".join(f"{k.upper()}{v}" for k, v in d.items() if v > 1 and k != "etp") or "1 rank"
        replicas = len(self.rollout_ranks) // self.rollout.get("tp", 1)
        return (f"trainer {sizes(self.trainer)} on ranks {self.trainer_ranks} -> rollout "
                f"TP{self.rollout.get('tp', 1)} x {replicas} replica(s) on ranks {self.rollout_ranks}")


def make_setups(kind: str, world: int, placement: str) -> list[Setup]:
    """The issue's layouts at 4 trainer ranks: TP2 x PP2 (dense) / EP4 (MoE) -> rollout TP2 x 2 replicas. At 2
    trainer ranks (HALF SCALE) layouts that move data between GPUs as the full-scale ones do (a trainer TP2 ->
    rollout TP2 on the same ranks would only copy in place): dense PP2 -> rollout TP2 (each rank keeps the half of
    its layers' shards it already holds and receives the other stage's layers, as each rank does at full scale) and
    dense TP2 -> rollout 2 x TP1 (each rank receives the other's half of every tensor); MoE EP2 -> rollout TP2 with
    experts tensor-split (each rank keeps its experts' half and receives the other rank's experts' half). One
    trainer rank: everything -> one rollout rank."""
    trainer_world = world if placement == "colocated" else world // 2
    rollout_world = world if placement == "colocated" else world - trainer_world
    if trainer_world not in (1, 2, 4) or rollout_world not in (1, 2, 4):
        raise SystemExit(f"--world {world} with --placement {placement}: needs 1, 2 or 4 trainer and rollout ranks")
    moe_tp2 = dict(tp=2, etp=2)  # the rollout's MoE layout at TP2: experts tensor-split (RolloutConfig.layout)
    if trainer_world == 4:
        layouts = [(dict(tp=2, pp=2), dict(tp=2))] if kind == "dense" else [(dict(ep=4), moe_tp2)]
    elif trainer_world == 2:
        layouts = [(dict(pp=2), dict(tp=2)), (dict(tp=2), {})] if kind == "dense" else [(dict(ep=2), moe_tp2)]
    else:
        layouts = [({}, {})]
    trainer_ranks = list(range(trainer_world))
    rollout_ranks = trainer_ranks if placement == "colocated" else list(range(trainer_world, world))
    return [Setup(trainer, trainer_ranks, rollout if rollout_world > 1 else {}, rollout_ranks)
            for trainer, rollout in layouts]


def model_config(kind: str, quick: bool) -> ModelConfig:
    config_class, shape = SHAPES[kind]
    shape = {**shape, **QUICK[kind]} if quick else shape
    arch = "Qwen2ForCausalLM" if kind == "dense" else "Qwen3MoeForCausalLM"
    return ModelConfig.from_dict(config_class(**shape, architectures=[arch]).to_dict())


def timed(fn, device: torch.device) -> tuple[float, object]:
    """Run `fn` on every rank from a common start; the slowest rank's seconds (and this rank's result)."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = torch.tensor([time.perf_counter() - start], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item(), result


def repeat(fn, device: torch.device, times: int) -> tuple[float, object]:
    fn()  # warm-up: communicators, allocator, pinned staging
    runs = [timed(fn, device) for _ in range(times)]
    return statistics.median(s for s, _ in runs), runs[-1][1]


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def broadcast_seconds(nbytes: int, group, device: torch.device, times: int) -> float:
    """A raw NCCL (gloo) broadcast of `nbytes` from the group's first rank to all of it."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src = dist.get_process_group_ranks(group)[0]
    return repeat(lambda: dist.broadcast(buf, src=src, group=group), device, times)[0]


def device_copy_seconds(nbytes: int, device: torch.device, times: int) -> float:
    """One device-to-device copy of `nbytes`: the least a one-rank colocated sync must do (read the trainer's
    weights, write the rollout's), the resident reference where no other rank exists to broadcast to."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return repeat(lambda: dst.copy_(src), device, times)[0]


def h2d_seconds(nbytes: int, device: torch.device, times: int) -> float:
    """Every rank copies its own `nbytes` from pinned host memory to the device at once."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return repeat(lambda: dev.copy_(host, non_blocking=True), device, times)[0]


def build(kind: str, setup: Setup, args: argparse.Namespace, device: torch.device, group, registry: GroupRegistry):
    """This rank's trainer engine (random weights) and/or rollout engine, and its end of the sync; the layouts' groups
    come from the process's `registry`."""
    config, dtype = model_config(kind, args.quick), torch.bfloat16 if device.type == "cuda" else torch.float32
    rank, actor, engine = dist.get_rank(), None, None
    if rank in setup.trainer_ranks:
        layout = Layout.create(LayoutSpec(len(setup.trainer_ranks), **setup.trainer), setup.trainer_ranks, device,
                               registry=registry)
        actor = ModelEngine(config, layout, EngineOptions(dtype=dtype))
        with torch.no_grad():
            for chunk in actor.chunks:
                for param in chunk.parameters():
                    param.normal_(0.0, 0.02)
    if rank in setup.rollout_ranks:
        layout = Layout.create(LayoutSpec(len(setup.rollout_ranks), **setup.rollout), setup.rollout_ranks, device,
                               registry=registry)
        engine = Engine(config, layout, EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                                                     cpu_kv_cache_tokens=1024, dtype=dtype, enforce_eager=True,
                                                     gpu_memory_utilization=0.9))
    bucket = int(args.bucket_mb * (1 << 20))
    if args.placement == "colocated":
        sync = ColocatedSync(actor.chunks, actor.layout, actor.host_buffers, engine, bucket)
    elif actor is not None:
        sync = DetachedSync.sender(actor.chunks, actor.layout, actor.host_buffers, group, bucket)
    else:
        sync = DetachedSync.receiver(engine, group, bucket)
    return actor, engine, sync


def profiled(fn, device: torch.device) -> str:
    """One more `fn()` under the torch profiler: this rank's operators by device time (CPU time on CPU), to see
    whether copies, checksums, the transfer or gaps between them take the time."""
    cuda = device.type == "cuda"
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    return prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                     row_limit=12)


def copy_calls(fn) -> int:
    """Copy operators `fn()` issues on this thread, counted by the CPU profiler: `aten::copy_` and
    `aten::_foreach_copy_` calls not nested in another copy (a multi-tensor copy counts once, as it launches once
    per few dozen tensors on GPU). The host pays ~10 us for each: the number to compare between versions."""
    names = ("aten::copy_", "aten::_foreach_copy_")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()

    def nested(event) -> bool:
        parent = event.cpu_parent
        while parent is not None and parent.name not in names:
            parent = parent.cpu_parent
        return parent is not None

    return sum(1 for event in prof.events() if event.name in names and not nested(event))


def sum_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item()


def measure(kind: str, setup: Setup, args: argparse.Namespace, device: torch.device, group,
            registry: GroupRegistry) -> dict:
    """Both modes for one model and layout on this rank; every rank returns the same numbers except `rank` and
    `profile`."""
    actor, engine, sync = build(kind, setup, args, device, group, registry)
    boxes = {(s.hf_name, s.box) for s in Shards(engine.model).slices()} if engine is not None else set()
    out: dict = {"setup": setup.describe(), "rank": dist.get_rank(), "boxes": boxes}
    for mode in ("resident", "offloaded"):
        if mode == "offloaded" and actor is not None:
            offload(actor.chunks, actor.host_buffers)
        seconds, metrics = repeat(sync.sync, device, args.repeats)
        received = metrics["sync/bytes"] if engine is not None else 0.0
        host_reads = metrics["sync/bytes_sent"] + (metrics["sync/bytes_local"] if actor is not None else 0.0)
        group = sync.weights.transport.group
        per_rank = max_over_ranks(received, device)
        out[mode] = dict(seconds=seconds, total=sum_over_ranks(received, device), per_rank=per_rank,
                         crossed=sum_over_ranks(metrics["sync/bytes_received"], device),
                         in_place=sum_over_ranks(metrics["sync/bytes_local"] if engine is not None else 0.0, device),
                         peak=max_over_ranks(metrics["sync/peak_extra_bytes"], device),
                         buckets=max_over_ranks(metrics["sync/buckets"], device),
                         launches=max_over_ranks(metrics["sync/copy_launches"], device),
                         pieces=max_over_ranks(_num_pieces(sync.weights.transport.plan), device))
        if args.quick:
            out[mode]["copy_calls"] = max_over_ranks(copy_calls(sync.sync), device)
        if args.profile:
            out[mode]["profile"] = profiled(sync.sync, device)
        if mode == "resident" and group is not None and dist.get_world_size(group) > 1:
            out[mode]["reference"] = broadcast_seconds(int(per_rank), group, device, args.repeats)
        elif mode == "resident":
            out[mode]["reference"] = device_copy_seconds(int(per_rank), device, args.repeats)
        if mode == "offloaded":
            reads = max_over_ranks(host_reads, device)
            out[mode]["reads"] = reads
            out[mode]["host_read"] = max_over_ranks(metrics["sync/bytes_host_read"], device)
            out[mode]["reference"] = h2d_seconds(int(host_reads), device, args.repeats) if reads else None
            still = all(p.untyped_storage().nbytes() == 0 for c in actor.chunks for p in c.parameters()) \
                if actor is not None else True
            out[mode]["still_offloaded"] = max_over_ranks(0.0 if still else 1.0, device) == 0.0
    del actor, engine, sync
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _num_pieces(plan) -> int:
    """Pieces this rank copies per sync: packed, unpacked and kept in place (one copy_ each before batching)."""
    return sum(len(b.pieces) for b in plan.sends + plan.recvs) + len(plan.local)


def rank_main(args: argparse.Namespace) -> list[tuple[str, dict]]:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    # One registry for every layout this process builds, and for the detached sync group.
    registry = GroupRegistry()
    group = registry.sync_group(list(range(args.world))) if args.placement == "detached" else None
    return [(kind, measure(kind, setup, args, device, group, registry)) for kind in args.models
            for setup in make_setups(kind, args.world, args.placement)]


def _size(n: float, unit: str = "B") -> str:
    return f"{n / 1e9:.2f} G{unit}" if n >= 1e8 else f"{n / 1e6:.3f} M{unit}"


def report(kind: str, results: list[dict], args: argparse.Namespace) -> None:
    boxes = set().union(*(r["boxes"] for r in results))  # every rollout shard's box, replicas counted once
    params = sum(torch.Size([b - a for a, b in box]).numel() for _, box in boxes)
    r = results[0]
    print(f"\n{kind}: {_size(params, '')} parameters ({'tiny --quick shape, fp32' if args.quick else 'random bf16'}), "
          f"{r['setup']}, {args.placement}, bucket {_size(args.bucket_mb * (1 << 20))}")
    backend = "gloo" if args.quick else "NCCL"
    resident_reference = (f"{backend} broadcast of the bytes one rollout rank receives" if args.world > 1 else
                          "one device-to-device copy of the bytes the rollout receives (one rank: nothing to "
                          "broadcast)")
    for mode, reference, target in (("resident", resident_reference, 0.70),
                                    ("offloaded", "pinned H2D of the bytes each trainer rank reads", 0.70)):
        m = r[mode]
        print(f"  {mode:9s}: {_size(m['total'])} into rollout shards in {m['seconds'] * 1e3:.1f} ms = "
              f"{m['total'] / m['seconds'] / 1e9:.2f} GB/s total, {m['per_rank'] / m['seconds'] / 1e9:.2f} GB/s per "
              f"rollout rank; peak extra {_size(m['peak'])} (max over ranks); {m['buckets']:.0f} buckets/rank")
        print(f"             moved: {_size(m['crossed'])} between ranks, {_size(m['in_place'])} copied in place")
        print(f"             copy launches per sync: {m['launches']:.0f} for {m['pieces']:.0f} pieces (max over ranks)"
              + (f"; profiler: {m['copy_calls']:.0f} top-level copy ops incl. checksums" if "copy_calls" in m
                 else ""))
        if m.get("reference"):
            print(f"             {reference}: {m['reference'] * 1e3:.2f} ms -> ratio "
                  f"{m['reference'] / m['seconds']:.2f} (target >= {target:.2f})")
        if mode == "offloaded":
            print(f"             read from pinned host memory: {_size(m['host_read'])} (max over ranks; the H2D "
                  f"reference copies {_size(m['reads'])}; more means params staged twice, or column blocks of params "
                  f"this rank only partly needs)")
            print(f"             params still offloaded after the sync: {'yes' if m['still_offloaded'] else 'NO'}")
        if "profile" in m:
            print(f"             profile of one more {mode} sync, rank {r['rank']}:\n{m['profile']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4, help="processes, one GPU each (the issue's setup: 4)")
    parser.add_argument("--placement", choices=("colocated", "detached"), default="colocated")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="actor_rollout_ref.rollout.weight_sync.bucket_size_mb (default 512; --quick: 1/64, i.e. "
                             "16 KB, so tiny models still cross many buckets)")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs per mode (median reported)")
    parser.add_argument("--models", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes on CPU (gloo), 16 KB buckets; prints copy launches per sync (also counted "
                             "by the CPU profiler), the host-side cost to compare between versions")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed syncs, profile one more per mode and print rank 0's top operators")
    parser.add_argument("--p2p-channels", type=int, default=None,
                        help="run everything twice: as is, then with NCCL_NCHANNELS_PER_PEER and "
                             "NCCL_MIN_P2P_NCHANNELS set to this (NCCL gives point-to-point transfers to one peer "
                             "few channels by default, where a broadcast uses them all)")
    args = parser.parse_args()
    if args.bucket_mb is None:
        args.bucket_mb = 1 / 64 if args.quick else 512
    cuda = torch.cuda.is_available() and not args.quick
    if cuda and torch.cuda.device_count() < args.world:
        raise SystemExit(f"--world {args.world} needs {args.world} GPUs, this machine has {torch.cuda.device_count()}")
    trainer_world = args.world if args.placement == "colocated" else args.world // 2
    if trainer_world < 4:
        print(f"HALF SCALE: {trainer_world} trainer rank(s), not the issue's 4 (dense TP2 x PP2, MoE EP4 -> rollout "
              f"TP2 x 2): the layouts below move data between GPUs as the full-scale ones do, on fewer ranks")
    settings = [{}] if args.p2p_channels is None else [
        {}, {"NCCL_NCHANNELS_PER_PEER": str(args.p2p_channels), "NCCL_MIN_P2P_NCHANNELS": str(args.p2p_channels)}]
    for env in settings:
        if args.p2p_channels is not None:
            print(f"\nNCCL point-to-point channels: {env or 'default'}")
        os.environ.update(env)  # the spawned ranks inherit it; NCCL reads it when their communicators start
        results = run_distributed(args.world, rank_main, args, backend="nccl" if cuda else "gloo",
                                  timeout=datetime.timedelta(minutes=10))
        for i, (kind, _) in enumerate(results[0]):
            report(kind, [rank[i][1] for rank in results], args)


if __name__ == "__main__":
    main()
