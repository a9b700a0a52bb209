"""Device-to-host copies of decode-step results that the host reads one step later.

Reading a step's tokens right after launching it would make the host wait for the GPU every step, and the GPU wait
for the host's bookkeeping after it. Instead each step's rows are copied into pinned host memory without blocking,
behind a CUDA event, and read (`HostCopy.rows`) after the next step has been launched. Two buffers alternate: a
step's buffer is read before the step after next is launched into it. On CPU the copy is synchronous and there is
no event; the code path is the same.
"""

from __future__ import annotations

import torch
from torch import Tensor


class HostCopy:
    """One step's rows on their way to the host."""

    def __init__(self, buffer: Tensor, event: torch.cuda.Event | None) -> None:
        self.buffer, self.event = buffer, event

    def rows(self) -> list[list[float]]:
        """Wait until the copy has landed -> the rows as Python lists."""
        if self.event is not None:
            self.event.synchronize()
        return self.buffer.tolist()


class HostCopies:
    def __init__(self, max_rows: int, num_columns: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.buffers = [torch.zeros(max_rows, num_columns, dtype=torch.float64, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0

    def start(self, rows: Tensor) -> HostCopy:
        """rows [N, C] fp64 on the device -> a copy into the next host buffer, queued behind the work before it."""
        buffer, event = self.buffers[self.turn][:rows.shape[0]], self.events[self.turn]
        self.turn ^= 1
        buffer.copy_(rows, non_blocking=True)
        if event is not None:
            event.record()
        return HostCopy(buffer, event)
