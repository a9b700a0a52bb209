"""Offload on CUDA: pinned host copies, device memory really released to the allocator, bitwise round trip."""

import pytest
import torch

from shardrl.parallel.offload import HostBuffers, offload, on_device, reload
from test_offload import groups, trained

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_offload_releases_cuda_memory_and_round_trips():
    model, opt = trained(2, device="cuda")
    tensors = [t for group in groups(model, opt).values() for t in group]
    before = [t.detach().clone() for t in tensors]
    num_bytes = sum(t.untyped_storage().nbytes() for t in tensors)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    host = HostBuffers()
    offload(model, host, opt)
    assert allocated - torch.cuda.memory_allocated() >= num_bytes
    assert all(host.get(t).is_pinned() and t.untyped_storage().nbytes() == 0 for t in tensors)
    with on_device(model, host, opt):
        assert torch.cuda.memory_allocated() >= allocated
        assert all(torch.equal(t, b) for t, b in zip(tensors, before))
        opt.step()  # still usable: the optimizer's and the buffers' references survived
    assert allocated - torch.cuda.memory_allocated() >= num_bytes
    reload(model, host, opt)
    assert all(t.is_cuda for t in tensors) and not torch.equal(tensors[0], before[0])  # the step happened
