"""What runs inside each rank's Ray actor: the rank's environment, its process group, and its role objects.

Worker classes are plain Python classes that find torch.distributed already initialised (STYLE #5): a test builds
them under `run_distributed`, the controller builds them here. The env contract below is the same one
`torch.distributed` and `run_distributed` use, plus our collective timeout and device (`rank_env`).

Several roles (actor + rollout + ref, verl's "hybrid engine") live in one host and so share one process and one
default process group; each role builds its own `Layout` over the same ranks, all from the host's one
`GroupRegistry` (passed to every role as `registry`), so a rank set's group is made once per process.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from shardrl.controller.rank_env import init_distributed_from_env
from shardrl.parallel.launch import free_port
from shardrl.parallel.layout import GroupRegistry

@dataclass(frozen=True)
class Driver:
    """The process that drives the run (the controller): where it runs and which process it is, so that a worker
    on its node can tell when it is gone (a pid alone could be a new process's)."""

    node: str
    pid: int
    started: str | None  # /proc/<pid>/stat's start time; None where there is no /proc

    @classmethod
    def this_process(cls) -> Driver:
        return cls(ray.util.get_node_ip_address(), os.getpid(), _start_time(os.getpid()))

    def alive(self) -> bool:
        return _start_time(self.pid) == self.started if self.started is not None else _pid_exists(self.pid)


def _start_time(pid: int) -> str | None:
    try:  # field 22 of /proc/<pid>/stat, after the parenthesised command name (which may hold spaces)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


DRIVER_CHECK_S = 0.25  # how often a worker on the driver's node checks that the driver is still there


def watch_driver(driver: Driver, interval_s: float = DRIVER_CHECK_S) -> None:
    """Exit this process within `interval_s` of the driver's death (on its node; across nodes Ray ends actors whose
    owner died). Ray runs workers in process groups of their own, so a killed driver would leave them running, and
    one could finish a checkpoint write after the run was gone. `os._exit`: no cleanup of any kind runs."""
    def watch() -> None:
        while driver.alive():
            time.sleep(interval_s)
        print(f"shardrl worker (pid {os.getpid()}): the driver (pid {driver.pid}) is gone; exiting", file=sys.stderr,
              flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="shardrl-driver-watch", daemon=True).start()


class RankHost:
    """One rank's process: holds the role objects and runs their methods for the controller."""

    def __init__(self, driver: Driver | None = None) -> None:
        """`driver`: the controller's process; a host on its node exits when it dies (`watch_driver`)."""
        self.roles: dict[str, Any] = {}
        self.registry: GroupRegistry | None = None  # made with the default group, in `join`
        if driver is not None and driver.node == ray.util.get_node_ip_address():
            watch_driver(driver)

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port on it (asked of rank 0 for the group's MASTER_ADDR/PORT)."""
        return ray.util.get_node_ip_address(), free_port("")

    def join(self, env: dict[str, str]) -> str:
        """Join the group's default process group; returns this node's address (named in failure reports)."""
        os.environ.update(env)
        init_distributed_from_env()
        self.registry = GroupRegistry()
        return ray.util.get_node_ip_address()

    def add_role(self, name: str, cls: type, kwargs: dict[str, Any]) -> None:
        """Build `cls(**kwargs, registry=...)`: every role class takes the process's `GroupRegistry`."""
        self.roles[name] = cls(**kwargs, registry=self.registry)

    def run(self, role: str, method: str, payload: tuple[tuple, dict[str, Any]], keep_result: bool) -> Any:
        """Call `role.method(*args, **kwargs)`; ranks whose output the dispatch mode ignores return None to save
        the transfer."""
        args, kwargs = payload
        result = getattr(self.roles[role], method)(*args, **kwargs)
        return result if keep_result else None
