"""Weight sync over gloo: after a sync every rollout shard is bitwise the slice of the trainer's HF export it should
hold, and the engine generates exactly what an engine built from that export generates; for training layouts
{TP2, PP2, EP2, EP2xETP2, TP2xPP2xEP2} x rollout {TP1, TP2, 2 replicas of TP1} x param offload x colocated/detached.
Also: offloaded params stay offloaded, peak extra memory <= 2 buckets + the largest tensor (CPU memory profiler),
a corrupted bucket is caught and named, verify=full catches a wrong load, rollout ranks build no trainer groups."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from shardrl.job.options import EngineOptions
from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import save_hf_checkpoint
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec, rank_tables
from shardrl.parallel.offload import offload
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.rollout.request import SamplingParams
from shardrl.sync.colocated import ColocatedSync
from shardrl.sync.detached import DetachedSync
from shardrl.sync.plan import trailer_bytes
from shardrl.sync.transport import Transport
from shardrl.sync.verify import SyncVerifyError, checksum
from shardrl.sync.weight_sync import WeightSync
from shardrl.workers.engine import ModelEngine

BUCKET = 8 << 10  # bytes: tiny models still need many buckets and steps
PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 2], [20, 21, 22]]
SAMPLING = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)]


@dataclass(frozen=True)
class Case:
    model: str  # "dense" (tied embeddings, so PP exercises the tied LM-head copy) or "moe"
    trainer: dict
    trainer_world: int
    rollout: dict
    rollout_world: int
    placement: str  # "colocated" (rollout over the trainer's ranks) or "detached" (ranks after the trainer's)
    offload: bool
    rollout_dtype: torch.dtype = torch.float32
    verify: str = "checksum"
    fault: str | None = field(default=None, compare=False)  # "corrupt_bucket" | "skip_load" | "wrong_version"
    bucket: int = BUCKET

    def ranks(self) -> tuple[list[int], list[int]]:
        trainer = list(range(self.trainer_world))
        if self.placement == "colocated":
            return trainer, trainer
        return trainer, list(range(self.trainer_world, self.trainer_world + self.rollout_world))


class CorruptingTransport(Transport):
    """Flips one byte of the second bucket it sends, after its checksum was taken: damage in transit."""

    def pack(self, bucket, buf, compare=None):
        wire = super().pack(bucket, buf, compare)
        if bucket is self.plan.sends[min(1, len(self.plan.sends) - 1)]:
            wire[3] ^= 0x10
        return wire


class AheadTransport(Transport):
    """A receiver one sync ahead of its senders: every bucket arrives intact with its valid trailer, of another
    sync than the one this rank runs (a buffer left over from an earlier sync looks the same)."""

    def run(self, compare=False):
        self.version = max(self.version, 1)
        return super().run(compare)


class SkippingTransport(Transport):
    """Receives every bucket intact but loads nothing from its first one: only verify=full can notice."""

    def unpack(self, bucket, buf, sums, compare):
        if compare is None and bucket is self.plan.recvs[0]:  # checked as received, then nothing loaded
            n = bucket.nbytes
            sums[0] = buf[n:bucket.wire_bytes].view(torch.int64)
            sums[1] = checksum(buf[:n], bucket.identity, self.version)
            return
        super().unpack(bucket, buf, sums, compare)


def _peak_bytes(prof) -> int:
    """Peak of the CPU bytes allocated (minus freed) in the profiled region, from the raw allocator events."""
    current = peak = 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() == "[memory]":
            current += event.nbytes()
            peak = max(peak, current)
    return peak


def _build_sync(case: Case, actor, engine, group):
    """This rank's end; detached cases share the run's sync group (made first, see `run_cases`), so a rank with
    no part in a case still joins the plan's construction."""
    if case.placement == "colocated":
        return ColocatedSync(actor.chunks, actor.layout, actor.host_buffers, engine, case.bucket, case.verify)
    if actor is not None:
        return DetachedSync.sender(actor.chunks, actor.layout, actor.host_buffers, group, case.bucket, case.verify)
    if engine is not None:
        return DetachedSync.receiver(engine, group, case.bucket, case.verify)
    return WeightSync(group, _device(), case.bucket, case.verify)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _inject_fault(case: Case, sync) -> None:
    weights = sync.weights
    faulty = {"corrupt_bucket": CorruptingTransport, "skip_load": SkippingTransport,
              "wrong_version": AheadTransport if weights.target is not None else None}.get(case.fault)
    if faulty is not None:
        t = weights.transport
        weights.transport = faulty(t.plan, t.group, t.device, t.source, t.target, t.watch, t.peers)


def run_case(case: Case, checkpoints: dict[str, str], export_dir: str, group, registry: GroupRegistry
             ) -> dict | None:
    """One sync on this rank's role(s); rollout ranks compare against an engine built from the trainer's export."""
    rank = dist.get_rank()
    trainer_ranks, rollout_ranks = case.ranks()
    known_groups = set(registry.rank_sets())
    actor = engine = None
    if rank in trainer_ranks:
        path = checkpoints[case.model]
        layout = Layout.create(LayoutSpec(case.trainer_world, **case.trainer), trainer_ranks, registry=registry)
        actor = ModelEngine(ModelConfig.from_pretrained(path), layout, EngineOptions(), hf_path=path)
        save_hf_checkpoint(actor.chunks, actor.layout, export_dir)
        if case.offload:
            offload(actor.chunks, actor.host_buffers)
    config = EngineConfig(max_model_len=32, cpu_kv_cache_tokens=96, max_num_batched_tokens=64,
                          dtype=case.rollout_dtype)
    if rank in rollout_ranks:  # starts from other weights, so a missed tensor shows
        layout = Layout.create(LayoutSpec(case.rollout_world, **case.rollout), rollout_ranks, registry=registry)
        engine = Engine.from_pretrained(checkpoints[case.model + "_other"], layout, config)
    result: dict = {"rank": rank}
    if case.placement == "detached" and actor is None and engine is None:
        _build_sync(case, actor, engine, group)
    if actor is not None or engine is not None:
        sync = _build_sync(case, actor, engine, group)
        _inject_fault(case, sync)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            try:
                result["metrics"] = sync.sync(version=5)
            except SyncVerifyError as error:
                result["error"] = str(error)
        result["peak"] = _peak_bytes(prof)
        result["buckets"] = [(b.src, b.dst, b.step, b.names()) for b in sync.weights.plan.buckets]
        result["new_groups"] = sorted(set(registry.rank_sets()) - known_groups)
        result["all_groups"] = sorted(registry.rank_sets())
    if actor is not None:
        result["largest"] = max(p.numel() * p.element_size() for c in actor.chunks for p in c.parameters())
        result["still_offloaded"] = all(p.untyped_storage().nbytes() == 0
                                        for chunk in actor.chunks for p in chunk.parameters())
    dist.barrier()  # the export is written
    if engine is not None and "error" not in result:
        reference = Engine.from_pretrained(export_dir, engine.layout, config)
        expected = dict(reference.model.named_parameters())
        result["differs"] = [n for n, p in engine.model.named_parameters() if not torch.equal(p, expected[n])]
        result["largest"] = max(result.get("largest", 0), max(p.numel() * p.element_size() * engine.layout.tp_size
                                                              for p in expected.values()))
        result["version"] = engine.policy_version
        result["same_generation"] = all(
            [(o.token_ids, o.logprobs) for o in engine.generate(PROMPTS, params)]
            == [(o.token_ids, o.logprobs) for o in reference.generate(PROMPTS, params)] for params in SAMPLING)
    return result


def run_cases(cases: list[Case], checkpoints: dict[str, str], export_root: str) -> list[dict | None]:
    # One registry for every layout this process builds (and the sync group), so each rank set gets one group.
    registry = GroupRegistry()
    group = registry.sync_group(list(range(dist.get_world_size())))
    return [run_case(case, checkpoints, f"{export_root}/{i}", group, registry) for i, case in enumerate(cases)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = Path(tmp_path_factory.mktemp("sync"))
    # 4 layers for PP2; the dense model ties its embeddings; 4 experts for EP2.
    return {name: str(make_tiny_checkpoint(family, root / name, seed=seed, num_hidden_layers=4))
            for name, family, seed in [("dense", "llama", 0), ("dense_other", "llama", 1),
                                       ("moe", "qwen3_moe", 0), ("moe_other", "qwen3_moe", 1)]}


def check_synced(case: Case, results: list[dict], allocator_slack: int = 0) -> None:
    """Rollout shards and generation equal the export's; memory within 2 buckets + the largest tensor (a rollout
    tensor, or the trainer params the offloaded path stages, on CPU too) + the checksums (the sender's and the
    receiver's per received bucket, and one being computed, whose products on CPU take at most a bucket), measured
    by the CPU profiler or, on GPU, the
    allocator (`allocator_slack`: its rounding of every block); offloaded params stay offloaded; detached rollout
    ranks built no trainer groups."""
    trainer_ranks, rollout_ranks = case.ranks()
    by_rank = {r["rank"]: r for r in results}
    for rank in rollout_ranks:
        r = by_rank[rank]
        assert "error" not in r, (case, r["error"])
        assert r["differs"] == [], (case, rank, r["differs"])
        assert r["same_generation"] and r["version"] == 5, case
    largest = max(by_rank[r]["largest"] for r in set(trainer_ranks) | set(rollout_ranks))
    for rank in set(trainer_ranks) | set(rollout_ranks):
        r = by_rank[rank]
        peak = r["metrics"]["sync/peak_extra_bytes"] if allocator_slack else r["peak"]
        received = sum(1 for _, dst, _, _ in r["buckets"] if dst == rank)
        checksums = 2 * trailer_bytes(case.bucket) * (1 + received) + case.bucket
        assert peak <= 2 * case.bucket + largest + checksums + allocator_slack, (case, rank, peak)
        if case.offload and rank in trainer_ranks:
            assert r["still_offloaded"], case
    if case.placement == "detached":  # rollout ranks joined their own layout's groups (and the sync group) only
        for rank in rollout_ranks:
            tables = rank_tables(LayoutSpec(case.rollout_world, **case.rollout), rollout_ranks)
            own = {tuple(g) for table in tables.values() for g in table if rank in g and len(g) > 1}
            assert set(by_rank[rank]["new_groups"]) <= own, (case, by_rank[rank]["new_groups"])
            # In this process's whole life (every case so far) no group of trainer ranks only was built here.
            assert not any(set(g) <= set(trainer_ranks) for g in by_rank[rank]["all_groups"]), case


def check_fault(case: Case, results: list[dict]) -> None:
    """The receivers of damaged buckets raise, naming exactly those buckets and their tensors."""
    trainer_ranks, rollout_ranks = case.ranks()
    by_rank = {r["rank"]: r for r in results}
    buckets = by_rank[rollout_ranks[0]]["buckets"]
    if case.fault == "corrupt_bucket":  # each sender's second bucket
        damaged = [[b for b in buckets if b[0] == src][1] for src in trainer_ranks]
    elif case.fault == "wrong_version":  # every bucket
        damaged = list(buckets)
    else:  # each receiver's first bucket, not loaded
        damaged = [next(b for b in buckets if b[1] == dst) for dst in rollout_ranks]
    for rank in trainer_ranks:
        assert "error" not in by_rank[rank], by_rank[rank]["error"]
    for rank in rollout_ranks:
        mine = [b for b in damaged if b[1] == rank]
        error = by_rank[rank].get("error", "")
        assert bool(mine) == bool(error), (rank, error)
        if case.fault in ("corrupt_bucket", "wrong_version") and mine:
            assert f"{len(mine)} bucket(s) failed their checksum" in error, error
            for src, dst, step, names in mine:  # byte 3 was flipped: the bucket's first tensor is damaged
                assert f"step {step} rank {src} -> rank {dst}: {names[0]}" in error, error
        elif mine:
            assert f"verify=full): rollout rank {rank}" in error, error
            assert all(name in error for _, _, _, names in mine for name in sorted(names)[:10]), error


MOE_TP2 = dict(tp=2, etp=2)  # the rollout's MoE layout at TP2: experts tensor-split (RolloutConfig.layout)
DEFAULT_CASES = [  # a representative subset, all on 4 ranks so that one launch of processes runs them all
    Case("moe", dict(tp=2, pp=2, ep=2), 4, MOE_TP2, 4, "colocated", True),
    Case("moe", dict(ep=2, etp=2), 4, {}, 4, "colocated", False, torch.bfloat16),
    Case("dense", dict(pp=2), 4, dict(tp=2), 4, "colocated", False, verify="full"),
    Case("dense", dict(tp=2), 2, {}, 2, "detached", True),
    Case("moe", dict(ep=2), 2, MOE_TP2, 2, "detached", False, torch.bfloat16),
    Case("dense", dict(pp=2), 2, {}, 1, "detached", True),
    Case("dense", dict(tp=2), 2, {}, 2, "detached", False, fault="corrupt_bucket"),
    Case("moe", dict(ep=2), 2, {}, 1, "detached", True, verify="full", fault="skip_load"),
    Case("dense", dict(pp=2), 2, {}, 1, "detached", False, fault="wrong_version"),
]


def run_and_check(checkpoints, tmp_path, world: int, cases: list[Case]) -> None:
    results = run_distributed(world, run_cases, cases, checkpoints, str(tmp_path))
    for i, case in enumerate(cases):
        (check_fault if case.fault else check_synced)(case, [rank_results[i] for rank_results in results])


def test_sync_default_subset(checkpoints, tmp_path):
    run_and_check(checkpoints, tmp_path, 4, DEFAULT_CASES)


TRAINER_LAYOUTS = [("dense", dict(tp=2), 2), ("dense", dict(pp=2), 2), ("moe", dict(ep=2), 2),
                   ("moe", dict(ep=2, etp=2), 4), ("moe", dict(tp=2, pp=2, ep=2), 4)]


def _matrix(placement: str, worlds: tuple[int, ...]) -> list[Case]:
    """Every training layout of these world sizes x rollout TP1 / TP2 / 2 replicas of TP1 x offload on and off
    (colocated: the rollout spans the trainer's ranks, so TP1 there is world-many replicas)."""
    cases = []
    for model, trainer, world in TRAINER_LAYOUTS:
        if world not in worlds:
            continue
        tp2 = MOE_TP2 if model == "moe" else dict(tp=2)
        rollouts = ([({}, world), (tp2, world)] if placement == "colocated" else [({}, 1), (tp2, 2), ({}, 2)])
        cases += [Case(model, trainer, world, rollout, rollout_world, placement, off)
                  for rollout, rollout_world in rollouts for off in (True, False)]
    return cases


MATRIX = [(2, _matrix("colocated", (2,))), (4, _matrix("colocated", (4,)) + _matrix("detached", (2,))),
          (6, _matrix("detached", (4,)))]


@pytest.mark.slow
@pytest.mark.parametrize("world, cases", MATRIX, ids=["colocated-w2", "colocated-w4+detached-2to1,2",
                                                      "detached-4to1,2"])
def test_sync_full_matrix(checkpoints, tmp_path, world, cases):
    run_and_check(checkpoints, tmp_path, world, cases)
