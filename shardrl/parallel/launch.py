"""Run a function on N local processes joined by torch.distributed (gloo on CPU, NCCL with one GPU each).

Used by the multi-rank tests and the GPU benchmarks; the Ray controller starts its workers differently but they end
up in the same state (env rendezvous, one default process group, a timeout on every collective).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now on `host` ("" = every interface, for rendezvous reached from other nodes)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_process(rank: int, world_size: int, port: int, backend: str, timeout: datetime.timedelta) -> None:
    """Join the default group; on NCCL each rank takes GPU `rank` (one process per GPU)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    join_default_group(rank, world_size, backend, timeout, cuda_index=rank)


def join_default_group(
    rank: int, world_size: int, backend: str, timeout: datetime.timedelta, cuda_index: int
) -> None:
    """Init the default group from MASTER_ADDR/MASTER_PORT in the environment; NCCL ranks use GPU `cuda_index`.

    The one implementation of process-group init: `run_distributed` and the Ray workers (whose only visible GPU is
    index 0) both end here.
    """
    if backend == "nccl":
        if "OMP_NUM_THREADS" not in os.environ:
            # The host's share of the cores (Ray sets OMP_NUM_THREADS itself). Left at every core each, the ranks'
            # thread pools oversubscribe the host and each small CPU op (packing a micro batch) waits on descheduled
            # threads: a 2-rank step on an H200 host spent ~70 ms of GPU idle per micro batch that way.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, torch.cuda.device_count())))
        torch.cuda.set_device(cuda_index)
    else:
        torch.set_num_threads(1)
    # No `device_id`: binding one makes torch create every later NCCL group by ncclCommSplit of the world's
    # communicator, a call every rank of the world must join, while our groups are made by their members only
    # (`use_local_synchronization`: a rollout pool never makes the trainer's groups, PP>=3 middle stages no embedding
    # group). Unbound, each group's NCCL communicator starts on its first collective, among its members.
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)


def _worker(rank: int, world_size: int, port: int, backend: str, timeout: datetime.timedelta,
            fn: Callable[..., Any], args: tuple, result_dir: str) -> None:
    path = os.path.join(result_dir, f"{rank}.pkl")
    try:
        init_process(rank, world_size, port, backend, timeout)
        outcome = ("ok", fn(*args))
    except BaseException as exc:  # reported to the parent with its traceback, then re-raised there
        outcome = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(path + ".tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(path + ".tmp", path)


def run_distributed(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> list[Any]:
    """Call `fn(*args)` on `world_size` fresh processes; return each rank's result (rank order).

    `fn` must be importable (a module-level function). Any rank's exception is raised here with its traceback;
    a rank that dies without reporting is named.
    """
    ctx = mp.get_context("forkserver")
    port = free_port()
    with tempfile.TemporaryDirectory() as result_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, backend, timeout, fn, args, result_dir))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = timeout.total_seconds() * 3
        for p in procs:
            p.join(deadline)
        for p in procs:
            if p.is_alive():
                p.kill()
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(result_dir, f"{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: exited with code {procs[rank].exitcode} without a result")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            (results if status == "ok" else errors).append(value)
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        return results
