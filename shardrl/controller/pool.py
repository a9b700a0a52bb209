"""Resource pools: a reserved block of ranks (one Ray placement-group bundle per rank) that one worker group runs on.

A pool is `nnodes` placement groups of `n_per_node` bundles, each packed onto one node, so ranks `node * n_per_node
.. + n_per_node - 1` share a machine (TP neighbours stay on NVLink). Reserving up front means a job that does not fit
fails at start with a message, instead of workers waiting forever for a GPU. Several pools coexist (a trainer pool
and a rollout pool for the detached modes).

On CPU a bundle asks for a sliver of a core by default rather than a whole one: the ranks of a CPU test run share the
machine's few cores anyway, and whole-core bundles would stop a 2-core runner from hosting a 4-rank world. On a
cluster of the user's own a CPU rank takes a whole core (`whole_cpu_cores`), as a GPU rank takes a whole GPU, so
pools fill nodes and spread over them as they would on GPUs.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

CPU_BUNDLE_CORES = 0.01
DEFAULT_READY_TIMEOUT_S = 60.0


class ResourcePoolError(RuntimeError):
    """The cluster cannot host a pool; the message names the pool, what it asked for and what exists."""


def bundle_for(device: Literal["cpu", "cuda"], whole_cpu_cores: bool = False) -> dict[str, float]:
    """Resources of one rank: a whole GPU (and a core to drive it), or a core (`whole_cpu_cores`) or a sliver."""
    if device == "cuda":
        return {"GPU": 1.0, "CPU": 1.0}
    return {"CPU": 1.0 if whole_cpu_cores else CPU_BUNDLE_CORES}


def _node_capacity(bundle: dict[str, float], n_per_node: int) -> int:
    """How many `n_per_node`-bundle groups the alive nodes of the cluster can hold in total (ignoring current use)."""
    total = 0
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        have = node["Resources"]
        total += min(math.floor(have.get(key, 0.0) / (need * n_per_node) + 1e-9) for key, need in bundle.items())
    return total


class ResourcePool:
    """`nnodes` x `n_per_node` ranks reserved on the cluster; rank r sits in bundle r % n_per_node of node r // n."""

    def __init__(
        self,
        name: str,
        nnodes: int,
        n_per_node: int,
        device: Literal["cpu", "cuda"],
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        whole_cpu_cores: bool = False,
    ) -> None:
        if nnodes < 1 or n_per_node < 1:
            raise ResourcePoolError(f"pool {name!r}: nnodes={nnodes} and n_per_node={n_per_node} must be >= 1")
        if device not in ("cpu", "cuda"):
            raise ResourcePoolError(f"pool {name!r}: device={device!r}, expected 'cpu' or 'cuda'")
        self.name = name
        self.nnodes = nnodes
        self.n_per_node = n_per_node
        self.device = device
        self.bundle = bundle_for(device, whole_cpu_cores)
        self.in_use = False  # set by the worker group that occupies the pool (one group per pool)
        self._check_capacity()
        self.placement_groups: list[PlacementGroup] = [
            placement_group([dict(self.bundle)] * n_per_node, strategy="STRICT_PACK") for _ in range(nnodes)
        ]
        self._wait_ready(ready_timeout_s)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_per_node

    def _request(self) -> str:
        per_rank = ", ".join(f"{v:g} {k}" for k, v in self.bundle.items())
        return f"{self.nnodes} node(s) x {self.n_per_node} ranks of ({per_rank})"

    def _check_capacity(self) -> None:
        """Refuse at once when no arrangement of the cluster's nodes could ever hold the pool."""
        if _node_capacity(self.bundle, self.n_per_node) < self.nnodes:
            total = ray.cluster_resources()
            have = ", ".join(f"{total.get(k, 0.0):g} {k}" for k in self.bundle)
            raise ResourcePoolError(
                f"pool {self.name!r} needs {self._request()}; the cluster has {have} in total "
                f"on {sum(n['Alive'] for n in ray.nodes())} node(s): lower nnodes / n_per_node or add nodes"
            )

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait for the reservation; other pools or jobs may hold the resources, so give up after `timeout_s`."""
        refs = [pg.ready() for pg in self.placement_groups]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            self.release()
            free = ray.available_resources()
            have = ", ".join(f"{free.get(k, 0.0):g} {k}" for k in self.bundle)
            raise ResourcePoolError(
                f"pool {self.name!r} needs {self._request()}; only {have} free after {timeout_s:g} s "
                "(held by other pools or jobs)"
            )

    def node_local_rank(self, rank: int) -> int:
        return rank % self.n_per_node

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Ray actor options that pin one actor to rank `rank`'s bundle and claim the whole bundle."""
        if not 0 <= rank < self.world_size:
            raise ResourcePoolError(f"pool {self.name!r} has ranks 0..{self.world_size - 1}, asked for {rank}")
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.placement_groups[rank // self.n_per_node],
            placement_group_bundle_index=self.node_local_rank(rank),
        )
        return dict(
            num_cpus=self.bundle["CPU"],
            num_gpus=self.bundle.get("GPU", 0.0),
            scheduling_strategy=strategy,
        )

    def release(self) -> None:
        """Give the reservation back to the cluster (after the worker group on it has shut down)."""
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.placement_groups = []
