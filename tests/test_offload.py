"""Offload round trips on CPU: storage freed while offloaded (0 bytes), bitwise equal after reload, references kept."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shardrl.parallel.layout import Layout
from shardrl.parallel.offload import HostBuffers, offload, on_device, reload
from shardrl.parallel.optimizer import AdamW
from shardrl.parallel.spec import ShardSpec, set_spec


class _Model(nn.Module):
    """A dense weight, a bf16 norm weight and two local experts (ids 2, 3 of 4)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = set_spec(nn.Parameter(torch.randn(3, 4, generator=g)), ShardSpec("w", (3, 4)))
        self.norm = set_spec(nn.Parameter(torch.randn(4, generator=g).bfloat16()), ShardSpec("norm", (4,)))
        self.experts = set_spec(nn.Parameter(torch.randn(2, 4, 4, generator=g)),
                                ShardSpec("experts.{expert}.w", (4, 4), expert_ids=(2, 3)))

    def loss(self, step: int) -> Tensor:
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step)).to(self.w.device)
        h = (x * self.norm.float()) @ self.experts[0] @ self.experts[1]
        return (h @ self.w.T).square().mean()


def trained(steps: int, device: str = "cpu") -> tuple[_Model, AdamW]:
    model = _Model().to(device)
    opt = AdamW(model.parameters(), Layout.single(device), lr=1e-2)
    for step in range(steps):
        opt.zero_grad()
        model.loss(step).backward()
        opt.step()
    opt.zero_grad()
    model.loss(steps).backward()  # leave accumulated grads in the buffers too
    return model, opt


def groups(model: _Model, opt: AdamW) -> dict[str, list[Tensor]]:
    return dict(params=list(model.parameters()), grads=opt.grads.tensors(), optimizer_state=opt.state_tensors())


def test_round_trip_is_bitwise_and_frees_storage():
    model, opt = trained(2)
    tensors = [t for group in groups(model, opt).values() for t in group]
    before = [t.detach().clone() for t in tensors]
    host = HostBuffers()
    offload(model, host, opt)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    assert model.experts.main_grad.untyped_storage().nbytes() == 0  # the main_grad views go with their buffer
    host_ptrs = {host.get(t).data_ptr() for t in tensors}
    assert all(torch.equal(host.host_view(t), b) for t, b in zip(tensors, before))  # what weight sync reads
    reload(model, host, opt)
    assert all(host.host_view(t) is None for t in tensors)  # on the device again: read there
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))
    assert not host_ptrs & {t.untyped_storage().data_ptr() for t in tensors}  # the copies were separate storage


def test_on_device_restores_for_the_block_and_training_continues_like_never_offloaded():
    def two_steps(model: _Model, opt: AdamW) -> None:
        opt.step()
        opt.zero_grad()
        model.loss(5).backward()
        opt.step()

    model, opt = trained(1)
    twin, twin_opt = trained(1)
    host = HostBuffers()
    offload(model, host, opt)
    with on_device(model, host, opt):
        assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
        two_steps(model, opt)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    two_steps(twin, twin_opt)
    reload(model, host, opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_flags_select_what_moves():
    model, opt = trained(1)
    host = HostBuffers()
    offload(model, host, opt, params=False, optimizer_state=False)
    parts = groups(model, opt)
    assert all(t.untyped_storage().nbytes() == 0 for t in parts["grads"])
    assert all(t.untyped_storage().nbytes() > 0 for t in parts["params"] + parts["optimizer_state"])
    offload(model, host)  # params only; already offloaded grads are left as they are
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    reload(model, host, opt)
    assert all(t.untyped_storage().nbytes() > 0 for group in groups(model, opt).values() for t in group)


def test_tensors_sharing_a_storage_move_once():
    base = torch.arange(10.0)
    module = nn.Module()
    module.a, module.b = nn.Parameter(base[:4]), nn.Parameter(base[4:])
    host = HostBuffers()
    offload(module, host)
    assert base.untyped_storage().nbytes() == 0 and host.get(module.a) is not None and host.get(module.b) is None
    reload(module, host)
    assert torch.equal(module.a, torch.arange(4.0)) and torch.equal(module.b, torch.arange(4.0, 10.0))
