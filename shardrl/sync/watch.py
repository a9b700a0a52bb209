"""The weight sync's watchdog: every transfer of a sync finishes before its deadline, or the sync fails naming the
peer that stopped.

A peer that stops responding mid-sync (a hung process, a lost node) would otherwise leave this rank waiting until
the process group's own timeout: gloo then raises a message naming no rank, and torch's NCCL watchdog ends the
*waiting* process, so the report blames the rank that was fine. The deadline is `DEADLINE_SHARE` of the group's
timeout after the sync started, so it always comes before torch's (which counts from each transfer's start, never
earlier than the sync's). On CPU (gloo) each wait is bounded by the time left; on GPU the waits only order CUDA
streams (the host runs ahead to keep packing, transfer and unpacking overlapped), so the transfers are polled at the
end of the sync, before its checksums are read, and the first one not done names its peer.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from shardrl.errors import first_line

DEADLINE_SHARE = 0.9  # of the group's timeout: the sync's deadline comes before torch's own
POLL_S = 0.0005  # between polls of GPU transfers that are not done yet at the end of a sync


class SyncStalledError(RuntimeError):
    """A transfer of a weight sync did not finish before the sync's deadline (or failed): names the peer."""


@dataclass(frozen=True)
class Transfer:
    """What a sync step waits for: a `dist.Work` and what `SyncStalledError` names when it does not finish."""

    work: dist.Work
    what: str  # "sending to <peer>" / "receiving from <peer>" (both, joined, for NCCL's one work per step)
    step: int

    def describe(self) -> str:
        return f"step {self.step}: {self.what}"


def step_transfers(works: list[dist.Work], ops: list[dist.P2POp], peers: Mapping[int, str], step: int
                   ) -> list[Transfer]:
    """The transfers of one step's `batch_isend_irecv`: one per op on gloo; NCCL coalesces a step's ops into one
    work, which then names every peer of the step."""
    whats = [f"{'sending to' if op.op is dist.isend else 'receiving from'} {peers[op.peer]}" for op in ops]
    if len(works) != len(whats):
        whats = [" and ".join(whats)] * len(works)
    return [Transfer(work, what, step) for work, what in zip(works, whats)]


class SyncWatch:
    """The deadline of the sync in progress and the transfers it still waits for."""

    def __init__(self, timeout: datetime.timedelta, poll_at_end: bool) -> None:
        """`timeout`: the sync group's collective timeout; `poll_at_end`: GPU (see the module's doc)."""
        self.seconds = timeout.total_seconds() * DEADLINE_SHARE
        self.poll_at_end = poll_at_end
        self.deadline = float("inf")
        self.pending: list[Transfer] = []

    def start(self) -> None:
        self.deadline = time.monotonic() + self.seconds
        self.pending = []

    def finish(self, transfers: list[Transfer]) -> None:
        """Wait for one step's transfers: bounded by the deadline on CPU; on GPU the current stream waits for them
        and the host goes on (`drain` checks them)."""
        for transfer in transfers:
            if self.poll_at_end:
                transfer.work.wait()  # NCCL: the current stream waits; the host does not
                self.pending.append(transfer)
                continue
            left = max(self.deadline - time.monotonic(), 0.001)  # past it: a done transfer still returns
            try:
                transfer.work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as exc:  # gloo: a timeout, or the peer's connection closed
                raise self._stalled(transfer, exc) from exc

    def drain(self) -> None:
        """GPU: return once every transfer of the sync is done; raise naming the first one still pending at the
        deadline (or that failed)."""
        for transfer in self.pending:
            while not self._completed(transfer):
                if time.monotonic() > self.deadline:
                    raise self._stalled(transfer)
                time.sleep(POLL_S)
        self.pending = []

    def _completed(self, transfer: Transfer) -> bool:
        try:
            return transfer.work.is_completed()
        except RuntimeError as exc:  # NCCL: the communicator failed
            raise self._stalled(transfer, exc) from exc

    def _stalled(self, transfer: Transfer, cause: BaseException | None = None) -> SyncStalledError:
        """The error naming `transfer`'s peer: it ran out of time (no `cause`, or the transport's own timeout), or the
        transport failed (`cause`: a closed connection, a failed communicator)."""
        if cause is None or "Timed out" in str(cause):
            why = (f"did not finish within {self.seconds:g} s of the sync's start (a share {DEADLINE_SHARE} of "
                   f"trainer.collective_timeout_s): the peer stopped responding")
        else:
            why = f"failed: {first_line(cause)}"
        return SyncStalledError(f"weight sync {transfer.describe()} {why}; the rollout's weights are left partly "
                                f"updated and refuse to generate until a sync completes")
