"""Move params, gradients and optimizer state to (pinned) host memory and back, keeping every tensor object valid.

Offloading copies each tensor's whole storage to a host buffer and resizes the device storage to 0 bytes; reloading
resizes it back and copies the bytes in. The tensor objects never change, so everything that holds them (optimizer
lists, ``main_grad`` views, modules, autograd) stays valid, and expert params need nothing special. Tensors sharing a
storage are moved once. The host buffer is kept on the tensor (``_host_copy``) and reused by later offloads, so it is
allocated (and pinned, on GPU) once. On a CPU-only machine device and host are both CPU: the host buffer is still a
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


def offload(model: Modules, optimizer: AdamW | None = None, *, params: bool = True, grads: bool = True,
            optimizer_state: bool = True) -> None:
    """Move the selected tensors to host memory and free their device storage (already offloaded ones are skipped)."""
    to_free, seen = [], set()
    for tensor in _selected(model, optimizer, params, grads, optimizer_state):
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        host = getattr(tensor, "_host_copy", None)
        if host is None:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            tensor._host_copy = host
        host.copy_(_storage_bytes(tensor), non_blocking=True)
        to_free.append(storage)
    if any(s.device.type == "cuda" for s in to_free):
        torch.cuda.synchronize()  # the device-to-host copies must land before the host buffers are trusted
    for storage in to_free:
        storage.resize_(0)


def reload(model: Modules, optimizer: AdamW | None = None, *, params: bool = True, grads: bool = True,
           optimizer_state: bool = True) -> None:
    """Reallocate the selected offloaded tensors on their device and copy their bytes back."""
    for tensor in _selected(model, optimizer, params, grads, optimizer_state):
        host = getattr(tensor, "_host_copy", None)
        storage = tensor.untyped_storage()
        if host is None or storage.nbytes() != 0:
            continue  # never offloaded, or restored already through another tensor on the same storage
        storage.resize_(host.numel())
        _storage_bytes(tensor).copy_(host, non_blocking=True)


@contextmanager
def on_device(model: Modules, optimizer: AdamW | None = None, *, params: bool = True, grads: bool = True,
              optimizer_state: bool = True) -> Iterator[None]:
    """Reload the selected tensors for the body of the ``with`` block and offload them again when it exits."""
    flags = dict(params=params, grads=grads, optimizer_state=optimizer_state)
    reload(model, optimizer, **flags)
    try:
        yield
    finally:
        offload(model, optimizer, **flags)
