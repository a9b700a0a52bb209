"""Replayed local copies in a colocated sync (`Transport._copy_local`): a resident sync after the first reissues the
same grouped copies, and every change of where a param lives — updated in place, given new `.data`, offloaded and
reloaded, the rollout repacked by sleep/wake — still leaves the rollout bitwise equal to the actor. A stale replay
would copy from or into storage the params no longer use, which no checksum would catch (local copies have none)."""

from __future__ import annotations

import pytest
import torch

from shardrl.job.options import EngineOptions
from shardrl.models.config import ModelConfig
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.layout import GroupRegistry, Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.offload import offload, reload
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.sync.colocated import ColocatedSync
from shardrl.sync.shards import Shards
from shardrl.workers.engine import ModelEngine


def _assert_synced(actor: ModelEngine, engine: Engine, what: str) -> None:
    source, target = Shards(actor.chunks, sending=True, host=actor.host_buffers), Shards(engine.model)
    for slice_ in target.slices():
        got = target.view(slice_.hf_name, slice_.box)
        want = source.view(slice_.hf_name, slice_.box)
        assert torch.equal(got.cpu(), want.cpu().to(got.dtype)), f"{what}: {slice_.hf_name} differs"


def test_replayed_local_copies_follow_every_move_of_the_params(tmp_path):
    check_replays(tmp_path, torch.device("cpu"))


@pytest.mark.gpu
def test_replayed_local_copies_on_cuda_graphs_follow_every_move_of_the_params(tmp_path):
    """On CUDA the replay becomes a CUDA graph from the second sync on: the same moves must re-cut it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    check_replays(tmp_path, torch.device("cuda"))


def check_replays(tmp_path, device: torch.device) -> None:
    path = str(make_tiny_checkpoint("qwen2", tmp_path / "m"))
    registry = GroupRegistry()
    layout = Layout.create(LayoutSpec(1), [0], device, registry=registry)
    actor = ModelEngine(ModelConfig.from_pretrained(path), layout, EngineOptions(), hf_path=path)
    engine = Engine.from_pretrained(path, Layout.create(LayoutSpec(1), [0], device, registry=registry),
                                    EngineConfig(max_model_len=32, cpu_kv_cache_tokens=96, max_num_batched_tokens=64))
    sync = ColocatedSync(actor.chunks, actor.layout, actor.host_buffers, engine, bucket_bytes=1 << 20)
    params = [p for chunk in actor.chunks for p in chunk.parameters()]
    gen = torch.Generator().manual_seed(0)

    def perturb() -> None:
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device))

    sync.sync()
    _assert_synced(actor, engine, "first sync")
    transport = sync.weights.transport
    assert transport.replays, "a resident sync remembers its local copies for the next one"

    replays = None
    for step in range(3):  # optimizer steps, in place: CPU replays from the second sync, CUDA records a graph there
        perturb()
        sync.sync()
        _assert_synced(actor, engine, f"after in-place update {step}")
        if replays is not None:
            assert all(transport.replays[k][1] is r for k, (_, r) in replays.items()), "the replay was not reused"
        replays = dict(transport.replays)
    for _, replay in replays.values():
        assert replay is not None and (replay.graph is not None) == (device.type == "cuda")
        if device.type == "cuda":  # the graph holds no tensor, so a sleeping engine's weights can be freed
            assert not replay.singles and not replay.groups

    with torch.no_grad():  # a param given a new tensor
        params[0].data = params[0].data.clone() + 1
    sync.sync()
    _assert_synced(actor, engine, "after new .data")

    offload(actor.chunks, actor.host_buffers)
    sync.sync()
    _assert_synced(actor, engine, "while offloaded")
    reload(actor.chunks, actor.host_buffers)
    perturb()
    sync.sync()
    _assert_synced(actor, engine, "after reloading")

    engine.sleep()  # the KV cache first, so the next drop is the weights alone
    weights_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    engine.sleep(offload_weights=True)
    if device.type == "cuda":
        freed = before - torch.cuda.memory_allocated(device)
        assert freed >= weights_bytes, f"sleep freed {freed} of {weights_bytes} weight bytes: something holds them"
    engine.wake_up()
    perturb()
    sync.sync()
    _assert_synced(actor, engine, "after the rollout slept and woke")
