"""Issue 10 (MFU): one PPO update reads device values on the host a fixed number of times, not once per micro batch.

On a GPU every such read (`.item()`, `.tolist()`, `float(t)`, `if t:`, `nonzero`, boolean-mask indexing) makes the
host wait for the queued kernels, and the GPU then idles while the host launches the next ones. On CPU there is no
device, so the counter below marks the tensors that would live there: the model's parameters, the optimizer's
gradient buffers and state, whatever is moved with `.to(device)` (the packed micro batches), and everything
computed from them. A read of such a tensor is a synchronisation; work on the host batch before it moves is not.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from shardrl.job.options import EngineOptions, OptimOptions, UpdateOptions
from shardrl.models.config import ModelConfig
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.layout import Layout
from shardrl.workers.actor import update_policy
from shardrl.workers.critic import update_critic
from shardrl.workers.engine import ModelEngine
from test_parity_matrix import BATCH, LOSS, RESPONSE, make_batch

aten = torch.ops.aten
# Ops whose result size or value the host needs before it can go on: each one waits for the device.
SYNCING_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
               aten.unique_consecutive.default, aten._unique2.default, aten.repeat_interleave.Tensor}
# ... unless told the size of their result: repeat_interleave with `output_size` needs no read.
SIZED_BY_CALLER = {aten.repeat_interleave.Tensor: "output_size"}


class HostReads(TorchDispatchMode):
    """Records the call site of every host read of a device-derived tensor (see the module docstring)."""

    def __init__(self, seeds: list[torch.Tensor]) -> None:
        super().__init__()
        self.device_values = WeakIdKeyDictionary()
        for t in seeds:
            self.device_values[t] = True
        self.sites: list[str] = []

    def _derived(self, values) -> bool:
        return any(isinstance(v, torch.Tensor) and v in self.device_values for v in tree_flatten(values)[0])

    def record(self) -> None:
        frame = next(f for f in reversed(traceback.extract_stack()[:-2]) if "shardrl" in f.filename)
        self.sites.append(f"{Path(frame.filename).name}:{frame.lineno} {frame.line}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        derived = self._derived((args, kwargs))
        bool_index = func is aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        sized = kwargs.get(SIZED_BY_CALLER.get(func, ""), None) is not None
        if derived and ((func in SYNCING_OPS and not sized) or bool_index):
            self.record()
        out = func(*args, **kwargs)
        if derived:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.device_values[t] = True
        return out

    def wrap(self, name: str):
        """A Tensor method that reads data without going through the dispatcher on CPU (tolist, cpu, numpy)."""
        original = getattr(torch.Tensor, name)

        def read(t: torch.Tensor, *args, **kwargs):
            if t in self.device_values:
                self.record()
            return original(t, *args, **kwargs)
        return mock.patch.object(torch.Tensor, name, read)

    def moves(self):
        """`Tensor.to` with a device marks its result (on CPU the move returns the tensor itself)."""
        original = torch.Tensor.to

        def to(t: torch.Tensor, *args, **kwargs):
            out = original(t, *args, **kwargs)
            if "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args):
                self.device_values[out] = True
            return out
        return mock.patch.object(torch.Tensor, "to", to)


def count_reads(engine: ModelEngine, update) -> list[str]:
    optimizer = engine.optimizer
    seeds = [p for chunk in engine.chunks for p in chunk.parameters()]
    seeds += optimizer.grads.tensors() + optimizer.state_tensors()
    counter = HostReads(seeds)
    with counter, counter.moves(), counter.wrap("tolist"), counter.wrap("cpu"), counter.wrap("numpy"):
        update()
    return counter.sites


def _engine(tmp_path: Path, value_head: bool) -> ModelEngine:
    ckpt = make_tiny_checkpoint("qwen2", tmp_path / "ckpt", num_hidden_layers=2)
    options = EngineOptions(value_head=value_head, optim=OptimOptions(lr=1e-2, clip_grad=0.5))
    return ModelEngine(ModelConfig.from_pretrained(ckpt), Layout.single(), options, hf_path=ckpt,
                       optional_weights=["score.weight"] if value_head else ())


# 2 epochs x 2 mini batches = 4 optimizer steps of 2 micro batches each (8 forwards and backwards).
UPDATE = UpdateOptions(mini_batch_size=BATCH // 2, micro_batch_size=2, ppo_epochs=2)
NUM_STEPS = 4


def test_actor_update_reads_the_device_once_per_step_plus_once(tmp_path):
    engine = _engine(tmp_path, value_head=False)
    sites = count_reads(engine, lambda: update_policy(engine, make_batch(), LOSS, UPDATE))
    # Allowed: the optimizer's grad-norm read per step (to skip non-finite updates) and one read of all metrics.
    assert len(sites) <= NUM_STEPS + 1, "\n".join(sites)


def test_critic_update_reads_the_device_once_per_step_plus_once(tmp_path):
    engine = _engine(tmp_path, value_head=True)
    batch = make_batch()
    mask = batch.tensors["response_mask"]
    batch.tensors["values"] = torch.randn(BATCH, RESPONSE) * mask
    batch.tensors["returns"] = torch.randn(BATCH, RESPONSE) * mask
    sites = count_reads(engine, lambda: update_critic(engine, batch, UPDATE, "token-mean", 0.2, RESPONSE))
    assert len(sites) <= NUM_STEPS + 1, "\n".join(sites)
