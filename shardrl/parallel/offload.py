"""Move params, gradients and optimizer state to (pinned) host memory and back, keeping every tensor object valid.

Offloading copies each tensor's whole storage to a host buffer and resizes the device storage to 0 bytes; reloading
resizes it back and copies the bytes in. The tensor objects never change, so everything that holds them (optimizer
lists, ``main_grad`` views, modules, autograd) stays valid, and expert params need nothing special. Tensors sharing a
storage are moved once. The host buffers live in a `HostBuffers` that the owner of the tensors keeps and passes to
every offload, reload and reader of offloaded tensors (weight sync), so a buffer is allocated (and pinned, on GPU)
once and reused by later offloads. On a CPU-only machine device and host are both CPU: the host buffer is still a
separate storage and the original one is still freed, which is what the tests check.

On GPU the freed blocks return to PyTorch's caching allocator (reusable by this process at once); call
``torch.cuda.empty_cache()`` if another process needs the memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from shardrl.parallel.optimizer import AdamW

Modules = nn.Module | Iterable[nn.Module]  # one model, or its virtual-pipeline chunks


class HostBuffers:
    """The host copies of the tensors offloaded through it, by tensor: each tensor's whole storage as bytes.

    A tensor keeps its buffer after a reload, for the next offload. Of tensors sharing a storage, only the one that
    moved it has a buffer."""

    def __init__(self) -> None:
        # id(tensor) -> (the tensor, its storage's bytes on the host); holding the tensor keeps its id its own.
        self._buffers: dict[int, tuple[Tensor, Tensor]] = {}

    def get(self, tensor: Tensor) -> Tensor | None:
        """`tensor`'s host buffer (uint8 [storage bytes]); None when it was never offloaded through this object."""
        entry = self._buffers.get(id(tensor))
        return None if entry is None else entry[1]

    def _get_or_allocate(self, tensor: Tensor) -> Tensor:
        """`tensor`'s host buffer, allocated (pinned when the storage is on a GPU) on first use."""
        host = self.get(tensor)
        if host is None:
            storage = tensor.untyped_storage()
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            self._buffers[id(tensor)] = (tensor, host)
        return host

    def host_view(self, tensor: Tensor) -> Tensor | None:
        """`tensor` read in place from its host buffer, laid out like it, while it is offloaded; None while its
        storage is on the device (or it was never offloaded through this object)."""
        host = self.get(tensor)
        if host is None or tensor.untyped_storage().nbytes() != 0:
            return None
        return host.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def _storage_bytes(tensor: Tensor) -> Tensor:
    """A uint8 tensor over the whole storage of `tensor` (all its bytes, whatever the view's offset)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _selected(model: Modules, optimizer: AdamW | None, params: bool, grads: bool,
              optimizer_state: bool) -> list[Tensor]:
    modules = [model] if isinstance(model, nn.Module) else list(model)
    tensors: list[Tensor] = [p for m in modules for p in m.parameters()] if params else []
    if optimizer is not None and grads:
        tensors += optimizer.grads.tensors()
    if optimizer is not None and optimizer_state:
        tensors += optimizer.state_tensors()
    return tensors


def offload(model: Modules, host: HostBuffers, optimizer: AdamW | None = None, *, params: bool = True,
            grads: bool = True, optimizer_state: bool = True) -> None:
    """Move the selected tensors into their buffers in `host` and free their device storage (already offloaded ones
    are skipped)."""
    to_free, seen = [], set()
    for tensor in _selected(model, optimizer, params, grads, optimizer_state):
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        host._get_or_allocate(tensor).copy_(_storage_bytes(tensor), non_blocking=True)
        to_free.append(storage)
    if any(s.device.type == "cuda" for s in to_free):
        torch.cuda.synchronize()  # the device-to-host copies must land before the host buffers are trusted
    for storage in to_free:
        storage.resize_(0)


def reload(model: Modules, host: HostBuffers, optimizer: AdamW | None = None, *, params: bool = True,
           grads: bool = True, optimizer_state: bool = True) -> None:
    """Reallocate the selected tensors offloaded into `host` on their device and copy their bytes back."""
    for tensor in _selected(model, optimizer, params, grads, optimizer_state):
        buffer = host.get(tensor)
        storage = tensor.untyped_storage()
        if buffer is None or storage.nbytes() != 0:
            continue  # never offloaded, or restored already through another tensor on the same storage
        storage.resize_(buffer.numel())
        _storage_bytes(tensor).copy_(buffer, non_blocking=True)


@contextmanager
def on_device(model: Modules, host: HostBuffers, optimizer: AdamW | None = None, *, params: bool = True,
              grads: bool = True, optimizer_state: bool = True) -> Iterator[None]:
    """Reload the selected tensors from `host` for the body of the ``with`` block and offload them into it again
    when it exits."""
    flags = dict(params=params, grads=grads, optimizer_state=optimizer_state)
    reload(model, host, optimizer, **flags)
    try:
        yield
    finally:
        offload(model, host, optimizer, **flags)
