"""Triton kernels launched with little host work, for kernels that run many times per step on small tensors.

Triton's own launch (`kernel[grid](...)`) binds every argument, works out its specialisation (dtype, 16-byte
alignment of each pointer, whether each integer is 1 or a multiple of 16), turns that and the options into a cache
key and looks the compiled kernel up, every call: on one H200 machine's host about 45 us, twice cuBLAS's launch,
and a small model's training step is little but launches (docs/benchmarks.md, bitwise mode).

`FastKernel.launch` keeps the compiled kernels itself, keyed by what it can read cheaply: the constexprs and
options, the tensors' dtypes, the scalars' types, the device. That key decides Triton's specialisation only in
the common case: every pointer 16-byte aligned, every specialised integer a multiple of 16, every integer inside
int32. There the call goes straight to the compiled kernel's launcher with raw pointers. Any other call, and the
first of each key, goes through Triton's own launch, which compiles where needed; so do all calls while a Triton
launch hook (a profiler) is set, and under torch.compile (which traces Triton's launch, not this one). Under
Triton's interpreter (TRITON_INTERPRET=1, the CPU tests of the kernels) there is nothing compiled to call: every call
goes through Triton's launch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
from torch import Tensor
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction

_INT32_MIN, _INT32_MAX = -0x80000000, 0x7FFFFFFF


class FastKernel:
    """A `@triton.jit` kernel whose parameters are its pointers (named `*_ptr`) first, then its scalars, then its
    constexprs; `launch` is `fn[grid](*tensors, *scalars, **constexprs, num_warps=..., num_stages=...)`."""

    def __init__(self, fn: triton.runtime.JITFunction | InterpretedFunction) -> None:
        self.fn = fn
        self.interpreted = isinstance(fn, InterpretedFunction)  # TRITON_INTERPRET=1: numpy on the host, no launcher
        if self.interpreted:
            return
        params = [p for p in fn.params if not p.is_constexpr]
        self.num_pointers = sum(p.name.endswith("_ptr") for p in params)
        if any(p.name.endswith("_ptr") for p in params[self.num_pointers:]):
            raise ValueError(f"{fn.__name__}: its pointer parameters must come first")
        self.specialised = frozenset(i for i, p in enumerate(params[self.num_pointers:]) if not p.do_not_specialize)
        self.compiled: dict[tuple, tuple] = {}  # key -> (launcher, CUfunction, packed metadata)

    def launch(self, grid: Sequence[int], tensors: Sequence[Tensor], scalars: Sequence[int | float],
               num_warps: int, num_stages: int = 3, **constexprs) -> None:
        if self.interpreted:
            self.launch_through_triton(grid, tensors, scalars, num_warps, num_stages, constexprs)
            return
        pointers = [t.data_ptr() for t in tensors]
        unusual = 0  # nonzero: a key of ours might not decide Triton's specialisation
        for pointer in pointers:
            unusual |= pointer
        unusual &= 15
        every = 0
        for i, value in enumerate(scalars):
            kind = type(value)
            if kind is int:
                every |= value
                if i in self.specialised:
                    unusual |= value & 15  # 1 is specialised too (as a constant)
            elif kind is not float:
                unusual = 1
        if unusual or not _INT32_MIN <= every <= _INT32_MAX or _launch_hooked() or torch.compiler.is_compiling():
            self.launch_through_triton(grid, tensors, scalars, num_warps, num_stages, constexprs)
            return
        device = _driver().get_current_device()
        key = (device, num_warps, num_stages, *constexprs.items(), *(t.dtype for t in tensors), *map(type, scalars))
        entry = self.compiled.get(key)
        if entry is None:
            compiled = self.launch_through_triton(grid, tensors, scalars, num_warps, num_stages, constexprs)
            self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return
        run, function, metadata = entry
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            _driver().get_current_stream(device), function, metadata, None, None, None, *pointers, *scalars,
            *constexprs.values())

    def launch_through_triton(self, grid: Sequence[int], tensors: Sequence[Tensor], scalars: Sequence[int | float],
                              num_warps: int, num_stages: int, constexprs: dict):
        """Triton's own launch (binding, specialisation, a compile on a miss); returns the compiled kernel."""
        return self.fn[tuple(grid)](*tensors, *scalars, **constexprs, num_warps=num_warps, num_stages=num_stages)


def _launch_hooked() -> bool:
    """Whether a Triton launch hook (a profiler) is set: Triton 3.6 keeps them in a HookChain, never None."""
    hook = knobs.runtime.launch_enter_hook
    return bool(hook.calls) if isinstance(hook, _HOOK_CHAIN) else hook is not None


_HOOK_CHAIN = getattr(knobs, "HookChain", ())


def _driver():
    return triton.runtime.driver.active
