"""The weight sync's watchdog: a peer that stops mid-sync is named within the group's timeout, and the rollout it
was feeding refuses to generate from its half-written weights until a sync completes.

Over gloo with real processes: a trainer rank that stops after its first bucket (its next pack sleeps), a rollout
rank that waits for it. Units: the deadline logic on the GPU path (transfers polled at the end of the sync) with
stand-in transfers, and the controller's report naming the rank still inside a call when the others failed.
"""

from __future__ import annotations

import datetime
import socket
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError

from shardrl.controller.group import PendingCall, WorkerError
from shardrl.job.options import EngineOptions
from shardrl.models.config import ModelConfig
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.rollout.engine import Engine, EngineConfig, EngineError
from shardrl.rollout.request import SamplingParams
from shardrl.sync.detached import DetachedSync
from shardrl.sync.transport import Transport
from shardrl.sync.watch import DEADLINE_SHARE, SyncStalledError, SyncWatch, Transfer, step_transfers
from shardrl.workers.engine import ModelEngine

TIMEOUT = datetime.timedelta(seconds=4)
STALL_S = 6.0  # the stopped trainer rank's pause: past the receiver's deadline (3.6 s after its sync began)


class Stopped(Exception):
    """Ends the stopped rank once its pause is over."""


class StoppingTransport(Transport):
    """Sends its first bucket, then stops responding (sleeps) while packing the second."""

    def pack(self, bucket, buf, compare=None):
        if bucket is not self.plan.sends[0]:
            time.sleep(STALL_S)
            raise Stopped
        return super().pack(bucket, buf, compare)


def _stalled_sync(model_path: str, other_path: str) -> dict:
    rank = dist.get_rank()
    registry = GroupRegistry()
    group = registry.sync_group([0, 1], TIMEOUT)
    if rank == 0:
        layout = Layout.create(LayoutSpec(1), [0], registry=registry)
        actor = ModelEngine(ModelConfig.from_pretrained(model_path), layout, EngineOptions(), hf_path=model_path)
    else:
        layout = Layout.create(LayoutSpec(1), [1], registry=registry)
        engine = Engine.from_pretrained(other_path, layout, EngineConfig(max_model_len=32, cpu_kv_cache_tokens=96,
                                                                         max_num_batched_tokens=64))
        before = {n: p.clone() for n, p in engine.model.named_parameters()}
    dist.barrier()  # the slow builds are done: the short timeout covers the sync alone
    if rank == 0:
        sync = DetachedSync.sender(actor.chunks, actor.layout, actor.host_buffers, group, 8 << 10, timeout=TIMEOUT)
        t = sync.weights.transport
        sync.weights.transport = StoppingTransport(t.plan, t.group, t.device, t.source, t.target, t.watch, t.peers)
        try:
            sync.sync(version=1)
        except Stopped:
            return {"buckets_sent": len(t.plan.sends)}
        raise AssertionError("the stopped rank's sync returned")
    sync = DetachedSync.receiver(engine, group, 8 << 10, timeout=TIMEOUT)
    start = time.monotonic()
    try:
        sync.sync(version=1)
        raise AssertionError("the sync with a stopped peer returned")
    except SyncStalledError as exc:
        error, seconds = str(exc), time.monotonic() - start
    changed = sum(not torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    try:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        refused = None
    except EngineError as exc:
        refused = str(exc)
    return {"error": error, "seconds": seconds, "changed": changed, "total": len(before), "refused": refused,
            "version": engine.policy_version}


def test_a_peer_that_stops_mid_sync_is_named_and_the_rollout_refuses_its_torn_weights(tmp_path):
    model = make_tiny_checkpoint("llama", tmp_path / "a", seed=0)
    other = make_tiny_checkpoint("llama", tmp_path / "b", seed=1)
    stopped, waiting = run_distributed(2, _stalled_sync, str(model), str(other))
    assert stopped["buckets_sent"] > 2  # the stop falls mid-sync
    host = socket.gethostname()
    assert waiting["error"].startswith(f"weight sync step 1: receiving from global rank 0 (trainer on {host}) did "
                                       f"not finish within {TIMEOUT.total_seconds() * DEADLINE_SHARE:g} s")
    # Named within the group's timeout (torch's own would end only then, naming nobody), not much sooner.
    assert TIMEOUT.total_seconds() * DEADLINE_SHARE - 0.5 < waiting["seconds"] < TIMEOUT.total_seconds()
    assert 0 < waiting["changed"] < waiting["total"]  # the first bucket landed: the weights are torn
    assert waiting["refused"] is not None and "SyncStalledError: weight sync step 1" in waiting["refused"]
    assert waiting["version"] == 0  # still the previous version's number: nothing claims the new one


class Pending:
    """A transfer that never completes (a peer that stopped), or that completes after `done_after` polls."""

    def __init__(self, done_after: int | None = None) -> None:
        self.polls, self.done_after, self.waited = 0, done_after, []

    def is_completed(self) -> bool:
        self.polls += 1
        return self.done_after is not None and self.polls > self.done_after

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waited.append(timeout)
        if timeout is not None and not self.is_completed():
            time.sleep(timeout.total_seconds())
            raise RuntimeError(f"Timed out waiting {timeout.total_seconds() * 1000:g}ms for recv operation to complete")
        return True


def test_on_gpu_the_host_runs_ahead_and_the_first_pending_transfer_is_named_at_the_deadline():
    watch = SyncWatch(datetime.timedelta(seconds=1), poll_at_end=True)
    watch.start()
    done, stuck, later = Pending(done_after=3), Pending(), Pending()
    start = time.monotonic()
    watch.finish([Transfer(done, "sending to global rank 2 (rollout on h)", 0)])
    watch.finish([Transfer(stuck, "receiving from global rank 0 (trainer on h)", 1),
                  Transfer(later, "receiving from global rank 1 (trainer on h)", 2)])
    assert time.monotonic() - start < 0.1  # finish only ordered streams: nothing blocked the host
    assert [done.waited, stuck.waited] == [[None], [None]]
    with pytest.raises(SyncStalledError, match=r"^weight sync step 1: receiving from global rank 0 \(trainer on h\) "
                                               r"did not finish within 0.9 s"):
        watch.drain()
    assert 0.85 < time.monotonic() - start < 1.0
    assert later.polls == 0  # the first one pending is the one named


def test_on_cpu_each_wait_gets_the_time_left_and_a_closed_peer_is_named():
    watch = SyncWatch(datetime.timedelta(seconds=1), poll_at_end=False)
    watch.start()
    fine = Pending(done_after=0)
    watch.finish([Transfer(fine, "receiving from global rank 0 (trainer on h)", 0)])
    assert 0.8 < fine.waited[0].total_seconds() <= 0.9
    late = SyncWatch(datetime.timedelta(seconds=0.01), poll_at_end=False)
    late.start()
    time.sleep(0.02)  # the deadline passed before this wait: still named as a stop, not as a failure
    with pytest.raises(SyncStalledError, match=r"^weight sync step 2: receiving from p did not finish within 0.009 s"):
        late.finish([Transfer(Pending(), "receiving from p", 2)])
    closed = Pending(done_after=0)
    closed.wait = lambda timeout: (_ for _ in ()).throw(RuntimeError("Connection closed by peer [10.0.0.7]:4242"))
    with pytest.raises(SyncStalledError, match=r"^weight sync step 3: sending to global rank 5 \(rollout on h\) "
                                               r"failed: Connection closed by peer \[10.0.0.7\]:4242; the rollout"):
        watch.finish([Transfer(closed, "sending to global rank 5 (rollout on h)", 3)])


def test_a_step_coalesced_into_one_work_names_every_peer_of_the_step():
    ops = [SimpleNamespace(op=dist.isend, peer=1), SimpleNamespace(op=dist.irecv, peer=0)]
    peers = {0: "global rank 0 (trainer on h)", 1: "global rank 1 (rollout on h)"}
    gloo = step_transfers(["w0", "w1"], ops, peers, 4)
    assert [t.describe() for t in gloo] == ["step 4: sending to global rank 1 (rollout on h)",
                                            "step 4: receiving from global rank 0 (trainer on h)"]
    (nccl,) = step_transfers(["w"], ops, peers, 4)
    assert nccl.describe() == ("step 4: sending to global rank 1 (rollout on h) and receiving from global rank 0 "
                               "(trainer on h)")


class _Group:
    name, failure = "trainer+rollout", None
    nodes = {0: "10.0.0.1", 2: "10.0.0.2"}

    def where(self, rank: int) -> str:
        return f" on {self.nodes[rank]}"

    def kill(self, error: WorkerError) -> None:
        self.failure = error


def test_the_report_names_the_rank_still_inside_the_call_when_its_peers_failed():
    call = PendingCall(_Group(), "rollout", "sync_weights", {}, dict)
    with pytest.raises(WorkerError) as caught:
        call._report({2: RayActorError()}, stuck=[0])
    assert "neither done nor failed: rank 0 on 10.0.0.1" in str(caught.value)
    assert str(caught.value).index("rank 2 on 10.0.0.2 died") < str(caught.value).index("rank 0 on 10.0.0.1")
