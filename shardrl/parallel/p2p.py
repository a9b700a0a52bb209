"""Point-to-point messages between pipeline stages, and delivery of the last stage's outputs to the whole PP group.

Activations have a shape only their sender knows (packed micro batches differ in length), so every activation is
preceded by a fixed-size header (dtype code, number of dims, sizes). A gradient needs no header: it has the shape
and dtype of the activation it is the gradient of, which its receiver sent earlier.

One exchange posts all of a tick's operations with the neighbours as one batch (``batch_isend_irecv``; NCCL needs
matching sends and receives of both directions in one group, gloo just runs them asynchronously), in two rounds:
headers and gradients first, then activation payloads whose sizes the headers announced. Waits use the process
group's timeout; a failure names the peer's global rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from shardrl.parallel.layout import Layout
from shardrl.parallel.schedules import Message

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool,
          torch.uint8)
MAX_DIMS = 8
HEADER_SIZE = 2 + MAX_DIMS  # dtype code, number of dims, sizes (zero padded)


class PipelineCommError(RuntimeError):
    """A point-to-point transfer with a pipeline neighbour failed or timed out; names the peer's global rank."""


def _header(tensor: Tensor) -> Tensor:
    if tensor.dtype not in DTYPES or tensor.dim() > MAX_DIMS:
        raise PipelineCommError(
            f"cannot send a pipeline activation of dtype {tensor.dtype} with {tensor.dim()} dims "
            f"(supported: {len(DTYPES)} dtypes {DTYPES}, at most {MAX_DIMS} dims)"
        )
    sizes = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
    return torch.tensor([DTYPES.index(tensor.dtype), tensor.dim(), *sizes], dtype=torch.int64, device=tensor.device)


class StageLink:
    """Sends and receives one pipeline tick's messages with the neighbours in this rank's PP group."""

    def __init__(self, layout: Layout) -> None:
        self.group = layout.pp_group
        self.ranks = layout.group_ranks["pp"]  # PP-group rank -> global rank
        self.device = layout.device

    def exchange(self, sends: Sequence[tuple[Message, Tensor]],
                 recvs: Sequence[tuple[Message, tuple[torch.Size, torch.dtype] | None]]) -> list[Tensor]:
        """Send `sends`; receive `recvs`, each with its (shape, dtype) when known (gradients) or None (activations,
        announced by a header). Returns the received tensors in the order of `recvs`.
        """
        sends = [(msg, tensor.contiguous()) for msg, tensor in sends]
        received: list[Tensor | None] = [None] * len(recvs)
        first_round: list[tuple[dist.P2POp, Message]] = []
        headers: list[tuple[int, Tensor]] = []
        for msg, tensor in sends:
            first_round.append((self._op(dist.isend, _header(tensor) if msg.kind == "F" else tensor, msg), msg))
        for i, (msg, known) in enumerate(recvs):
            if known is None:
                headers.append((i, torch.empty(HEADER_SIZE, dtype=torch.int64, device=self.device)))
                first_round.append((self._op(dist.irecv, headers[-1][1], msg), msg))
            else:
                received[i] = torch.empty(known[0], dtype=known[1], device=self.device)
                first_round.append((self._op(dist.irecv, received[i], msg), msg))
        self._run(first_round)

        second_round = [(self._op(dist.isend, tensor, msg), msg) for msg, tensor in sends if msg.kind == "F"]
        for i, header in headers:
            code, ndim, *sizes = header.tolist()
            received[i] = torch.empty(sizes[:ndim], dtype=DTYPES[code], device=self.device)
            second_round.append((self._op(dist.irecv, received[i], recvs[i][0]), recvs[i][0]))
        self._run(second_round)
        return received

    def _op(self, op, tensor: Tensor, msg: Message) -> dist.P2POp:
        return dist.P2POp(op, tensor, peer=self.ranks[msg.peer], group=self.group)

    def _run(self, ops: list[tuple[dist.P2POp, Message]]) -> None:
        if not ops:
            return
        try:
            works = dist.batch_isend_irecv([op for op, _ in ops])  # gloo may already fail here on a dead peer
        except RuntimeError as exc:
            peers = sorted({self.ranks[msg.peer] for _, msg in ops})
            raise PipelineCommError(f"pipeline exchange with global rank(s) {peers} failed: {exc}") from exc
        for work, (op, msg) in zip(works, ops):
            try:
                work.wait()  # bounded by the PP group's timeout
            except RuntimeError as exc:
                what = "activation" if msg.kind == "F" else "gradient"
                direction = "to" if op.op is dist.isend else "from"
                raise PipelineCommError(
                    f"pipeline {what} of micro batch {msg.micro_batch} {direction} global rank {self.ranks[msg.peer]} "
                    f"failed: {exc}"
                ) from exc


def broadcast_dicts(dicts: list[dict[str, Tensor]] | None, layout: Layout) -> list[dict[str, Tensor]]:
    """Give every rank of the PP group the last stage's per-micro-batch dicts (`dicts` on the last stage, else None).

    Keys, shapes and dtypes travel as one small object broadcast, the values as one flat broadcast per dtype (so the
    values must live on `layout.device`). The last stage gets its own `dicts` back.
    """
    if layout.pp_size == 1:
        return dicts
    src = layout.group_ranks["pp"][-1]
    is_src = dicts is not None
    box = [[[(key, value.shape, value.dtype) for key, value in d.items()] for d in dicts] if is_src else None]
    dist.broadcast_object_list(box, src=src, group=layout.pp_group, device=layout.device)
    entries = [(i, key, shape, dtype) for i, items in enumerate(box[0]) for key, shape, dtype in items]
    out: list[dict[str, Tensor]] = [{} for _ in box[0]]
    for dtype in dict.fromkeys(entry[3] for entry in entries):
        mine = [entry for entry in entries if entry[3] == dtype]
        sizes = [shape.numel() for _, _, shape, _ in mine]
        if is_src:
            flat = torch.cat([dicts[i][key].reshape(-1) for i, key, _, _ in mine])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=layout.device)
        dist.broadcast(flat, src=src, group=layout.pp_group)
        for (i, key, shape, _), piece in zip(mine, flat.split(sizes)):
            out[i][key] = piece.view(shape)
    return dicts if is_src else out
