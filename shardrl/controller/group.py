"""Worker groups: one Ray actor per rank of one or more resource pools, holding role objects, called as a unit.

Building a group starts the actors, points every rank at rank 0's address for the rendezvous, initialises the
default process group in each (one world over all the group's pools), then constructs every role on its ranks.
Calls are routed by a dispatch mode (see dispatch.py) and always waited on with a deadline: the first rank that
raises or dies ends the call with a `WorkerError` naming the role, the rank and the cause, and the whole group is
killed, since its surviving ranks would otherwise sit in a collective with a missing peer until the collective
timeout. Calls to different ranks run at the same time (the trainer pool trains while the rollout pool generates);
calls to one rank run one after another, in the order they were submitted.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from shardrl.controller.dispatch import DISPATCH_ATTR, DISPATCH_LAYOUT_ATTR, Dispatch, route
from shardrl.controller.host import Driver, RankHost
from shardrl.controller.rank_env import rank_env
from shardrl.controller.pool import ResourcePool
from shardrl.errors import UserError
from shardrl.parallel.layout_spec import LayoutSpec

DEFAULT_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
DEFAULT_CALL_TIMEOUT_S = 3600.0
# After the first failure, how long to wait for the other ranks' outcomes: a rank that died is usually the cause of
# its peers' collective errors, and it should be the one named even if a peer's error arrived first.
FAILURE_GRACE_S = 5.0

RemoteRankHost = ray.remote(RankHost)


class WorkerError(RuntimeError):
    """A rank failed during a call; `role`, `rank` and `method` say where, the message says why (one line).
    `user_error`: the rank raised a `UserError` (a bad model file, a reward function's failure...), which the entry
    point reports like one raised before the workers started."""

    def __init__(self, message: str, role: str, rank: int | None, method: str, user_error: bool = False) -> None:
        super().__init__(message)
        self.role, self.rank, self.method, self.user_error = role, rank, method, user_error


@dataclass
class Role:
    """A worker class to build on every rank of the group, under `name`, as `cls(**kwargs, registry=...)`: every role
    class takes its process's `GroupRegistry` and builds its layouts from it, so colocated roles share their groups.

    `layout` is the role's parallel layout over its ranks; DP_COMPUTE reads its DP coordinates from it.
    None means every rank is its own DP replica. `extra_layouts` are other layouts over the same ranks that methods
    declared with `dispatch_mode(..., layout=name)` are split by (the hybrid engine's rollout next to its actor).
    `ranks`: the group's ranks the role lives on, in layout order (None: all of them), e.g. the rollout pool's.
    """

    name: str
    cls: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    layout: LayoutSpec | None = None
    extra_layouts: dict[str, LayoutSpec] = field(default_factory=dict)
    ranks: list[int] | None = None


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _is_user_error(exc: BaseException | None) -> bool:
    return isinstance(exc, RayTaskError) and isinstance(exc.cause, UserError)


def _describe(exc: RayError) -> str:
    """One line: how the rank failed, without Ray's wrapping and remote traceback (chained on the WorkerError)."""
    if isinstance(exc, RayActorError):
        return f"died ({_first_line(str(exc))})"
    if isinstance(exc, RayTaskError) and exc.cause is not None:
        return f"raised {type(exc.cause).__name__}: {_first_line(str(exc.cause))}"
    return f"failed: {type(exc).__name__}: {_first_line(str(exc))}"


class PendingCall:
    """A call in flight on every rank of a group; `get()` waits for it and returns the collected value."""

    def __init__(
        self, group: WorkerGroup, role: str, method: str, refs: dict[int, ray.ObjectRef],
        collect: Callable[[dict[int, Any]], Any],
    ) -> None:
        self.group, self.role, self.method = group, role, method
        self._refs = refs
        self._collect = collect

    def done(self) -> bool:
        """True when every rank has finished (successfully or not); never blocks."""
        ready, _ = ray.wait(list(self._refs.values()), num_returns=len(self._refs), timeout=0, fetch_local=False)
        return len(ready) == len(self._refs)

    def get(self, timeout_s: float | None = None) -> Any:
        """Wait (at most `timeout_s`, default the group's call timeout) and collect; raise WorkerError on failure."""
        timeout_s = self.group.call_timeout_s if timeout_s is None else timeout_s
        rank_of = {ref: rank for rank, ref in self._refs.items()}
        pending = list(self._refs.values())
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                late = sorted(rank_of[ref] for ref in pending)
                self._fail(f"ranks {late} did not finish {self.method!r} within {timeout_s:g} s", late[0], None)
            try:
                results[rank_of[done[0]]] = ray.get(done[0])
            except RayError as exc:
                late, stuck = self._late_failures(pending, rank_of)
                self._report({rank_of[done[0]]: exc} | late, stuck)
        return self._collect(results)

    @staticmethod
    def _late_failures(pending: list[ray.ObjectRef], rank_of: dict[ray.ObjectRef, int]
                       ) -> tuple[dict[int, RayError], list[int]]:
        """Failures among the other ranks that arrive within the grace period, and the ranks still running then."""
        if not pending:
            return {}, []
        ready, running = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S)
        failures = {}
        for ref in ready:
            try:
                ray.get(ref)
            except RayError as exc:
                failures[rank_of[ref]] = exc
        return failures, sorted(rank_of[ref] for ref in running)

    def _report(self, failures: dict[int, RayError], stuck: list[int]) -> None:
        """Fail the call naming each failed rank and, when some failed on a collective, the ranks still inside the
        call: a peer that stopped responding is the one that neither returned nor failed."""
        # Deaths first (the usual root cause), then by rank.
        order = sorted(failures, key=lambda r: (not isinstance(failures[r], RayActorError), r))
        ranks_by_text: dict[str, list[int]] = {}
        for rank in order:
            ranks_by_text.setdefault(_describe(failures[rank]), []).append(rank)
        text = "; ".join(
            f"rank {ranks[0]}{self.group.where(ranks[0])} {desc}" if len(ranks) == 1 else f"ranks {ranks} {desc}"
            for desc, ranks in ranks_by_text.items()
        )
        if stuck and not any(_is_user_error(exc) for exc in failures.values()):
            text += f"; still inside {self.method!r} {FAILURE_GRACE_S:g} s later, neither done nor failed: " + ", ".join(
                f"rank {rank}{self.group.where(rank)}" for rank in stuck)
        self._fail(text, order[0], failures[order[0]])

    def _fail(self, text: str, rank: int, cause: BaseException | None) -> None:
        if self.group.failure is not None:  # this call's ranks were killed because another call failed first
            text += f" (the group had been stopped: {self.group.failure})"
        error = WorkerError(
            f"worker group {self.group.name!r}, role {self.role!r}, {self.method!r}: {text}",
            self.role, rank, self.method, _is_user_error(cause),
        )
        self.group.kill(error)
        raise error from cause


class RoleHandle:
    """One role of a group, called by reference to its worker class's method, so a reader (and an IDE) goes from the
    call straight to the code that runs: `handle.call(ActorRefWorker.compute_log_prob, batch)` runs the method on
    every rank of the role as its `@dispatch_mode` routes it and returns the collected value; `handle.submit(...)`
    starts the call without waiting (for overlapping pools)."""

    def __init__(self, group: WorkerGroup, role: Role) -> None:
        self._group = group
        self._role = role

    @property
    def layout(self) -> LayoutSpec:
        """The layout the role's calls are dispatched by (e.g. its number of DP replicas)."""
        return self._group.layouts[self._role.name]

    def replicas(self, method: Callable[..., Any]) -> int:
        """The DP replicas `method`'s dispatch splits by: of the layout it names (`dispatch_mode(layout=...)`, the
        hybrid engine's rollout), else the role's own. A PER_REPLICA method takes one value per replica."""
        name = getattr(method, DISPATCH_LAYOUT_ATTR, None)
        return (self.layout if name is None else self._role.extra_layouts[name]).dp

    def call(self, method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """`submit(method, ...).get()`."""
        return self.submit(method, *args, **kwargs).get()

    def submit(self, method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> PendingCall:
        """Start `method` (a method of the role's worker class, or of a class it inherits from) on the role's ranks."""
        return self._group.submit(self._role.name, self.method_name(method), self.mode(method), *args, **kwargs)

    def method_name(self, method: Callable[..., Any]) -> str:
        name = getattr(method, "__name__", None)
        cls = self._role.cls
        if name is None or getattr(cls, name, None) is not method:
            raise ValueError(f"role {self._role.name!r}: {method!r} is not a method of {cls.__name__}; pass the "
                             f"worker class's method, e.g. {cls.__name__}.<method>")
        return name

    def mode(self, method: Callable[..., Any]) -> Dispatch:
        mode = getattr(method, DISPATCH_ATTR, None)
        if mode is None:
            raise ValueError(f"role {self._role.name!r}: {self._role.cls.__name__}.{method.__name__} has no "
                             "@dispatch_mode; decorate it or use WorkerGroup.call(role, method, mode, ...)")
        return mode


def _get_together(calls: Sequence[PendingCall]) -> None:
    """Wait for calls that depend on each other (roles that form process groups together while being built): a rank
    that fails is reported at once, not after the calls whose ranks wait for it in a collective time out."""
    call_of = {ref: call for call in calls for ref in call._refs.values()}
    waiting = list(call_of)
    while waiting:
        done, waiting = ray.wait(waiting, num_returns=1, timeout=calls[0].group.call_timeout_s)
        if not done:
            break  # the gets below report the deadline
        try:
            ray.get(done[0])
        except RayError:
            call_of[done[0]].get()  # raises a WorkerError naming the call's role and the failed rank
    for call in calls:
        call.get()


class WorkerGroup:
    """One Ray actor per rank of `pools` (ranks numbered pool after pool) in ONE torch.distributed world; each rank
    holds an instance of every role placed on it (colocated roles share the process and its default process group).

    Several pools make a detached placement: a trainer pool's roles and a rollout pool's roles, each on its own ranks
    (`Role.ranks`) with its own layout, can still form process groups together (the weight-sync group).
    """

    def __init__(
        self,
        pools: ResourcePool | Sequence[ResourcePool],
        roles: Sequence[Role],
        collective_timeout: datetime.timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        self.pools = [pools] if isinstance(pools, ResourcePool) else list(pools)
        self.name = "+".join(p.name for p in self.pools)
        self.world_size = sum(p.world_size for p in self.pools)
        self._submitting = threading.Lock()  # see submit()
        self.call_timeout_s = call_timeout_s
        self.roles = {r.name: r for r in roles}
        self.ranks = {r.name: list(range(self.world_size)) if r.ranks is None else list(r.ranks) for r in roles}
        self.layouts = {r.name: r.layout or LayoutSpec(len(self.ranks[r.name])) for r in roles}
        self._check_roles(roles)
        self.failure: WorkerError | None = None
        self.nodes: dict[int, str] = {}  # rank -> its node's address, once it joined (named in failure reports)
        for pool in self.pools:
            pool.in_use = True
        places = [(pool, local) for pool in self.pools for local in range(pool.world_size)]
        driver = Driver.this_process()
        self.hosts = [RemoteRankHost.options(**pool.actor_options(local)).remote(driver) for pool, local in places]
        host0 = {0: self.hosts[0].rendezvous_address.remote()}
        addr, port = PendingCall(self, "(rendezvous)", "rendezvous_address", host0, lambda by_rank: by_rank[0]).get()
        envs = [rank_env(r, self.world_size, pool.node_local_rank(local), addr, port, pool.device, collective_timeout)
                for r, (pool, local) in enumerate(places)]
        everyone = list(range(self.world_size))
        self.nodes = self._on_ranks("(process group)", "join", everyone, [(env,) for env in envs],
                                    collect=dict).get()
        # All roles at once: a rank builds its roles in list order, but a role may form groups with another role's
        # ranks while being built (a rollout pool joins the trainer's weight-sync group), so none may wait for all.
        _get_together([self._on_ranks(r.name, "add_role", self.ranks[r.name],
                                      [(r.name, r.cls, r.kwargs)] * len(self.ranks[r.name])) for r in roles])

    def _check_roles(self, roles: Sequence[Role]) -> None:
        if not roles or len(self.roles) != len(roles):
            raise ValueError(f"worker group {self.name!r}: roles must be non-empty with unique names, got "
                             f"{[r.name for r in roles]}")
        if len({p.device for p in self.pools}) != 1:
            raise ValueError(f"worker group {self.name!r}: pools of one group share a device type (one backend), "
                             f"got {[p.device for p in self.pools]}")
        for name, ranks in self.ranks.items():
            if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
                raise ValueError(f"worker group {self.name!r}: role {name!r} has ranks {ranks}; expected distinct "
                                 f"ranks in 0..{self.world_size - 1}")
            spec = self.layouts[name]
            if spec.world_size != len(ranks):
                raise ValueError(f"worker group {self.name!r}: role {name!r} has a layout of world size "
                                 f"{spec.world_size}, the role has {len(ranks)} ranks")
        for pool in self.pools:
            if pool.in_use:
                raise ValueError(f"pool {pool.name!r} already hosts a worker group; put colocated roles in one "
                                 "group or give each group its own pool")

    def _on_ranks(self, role: str, host_method: str, ranks: list[int], per_rank_args: list[tuple],
                  collect: Callable[[dict[int, Any]], Any] = lambda by_rank: None) -> PendingCall:
        """A set-up step on `ranks`: `join` the process group, `add_role` to build a role."""
        refs = {r: getattr(self.hosts[r], host_method).remote(*args) for r, args in zip(ranks, per_rank_args)}
        return PendingCall(self, role, host_method, refs, collect)

    def placement(self) -> str:
        """One line: the node each pool's ranks run on."""
        parts, first = [], 0
        for pool in self.pools:
            by_node: dict[str, list[int]] = {}
            for rank in range(first, first + pool.world_size):
                by_node.setdefault(self.nodes.get(rank, "?"), []).append(rank)
            parts.append(f"{pool.name} pool " + ", ".join(
                f"{'rank' if len(ranks) == 1 else 'ranks'} {','.join(map(str, ranks))} on {node}"
                for node, ranks in by_node.items()))
            first += pool.world_size
        return "; ".join(parts)

    def where(self, rank: int) -> str:
        """' on <node address>' of a rank that joined (for failure reports), else ''."""
        node = self.nodes.get(rank)
        return f" on {node}" if node else ""

    def role(self, name: str) -> RoleHandle:
        self._check_role(name)
        return RoleHandle(self, self.roles[name])

    def _check_role(self, name: str) -> None:
        if name not in self.roles:
            raise ValueError(f"worker group {self.name!r} has roles {sorted(self.roles)}, not {name!r}")

    def submit(self, role: str, method: str, mode: Dispatch, /, *args: Any, **kwargs: Any) -> PendingCall:
        """Start `role.method` on every rank of the role as `mode` routes it (by the role's own layout over its own
        ranks); returns at once."""
        if self.failure is not None:
            raise WorkerError(f"worker group {self.name!r} is stopped: {self.failure}",
                              role, self.failure.rank, method)
        self._check_role(role)
        if not callable(getattr(self.roles[role].cls, method, None)):
            raise ValueError(f"role {role!r}: {self.roles[role].cls.__name__} has no method {method!r}")
        layout_name = getattr(getattr(self.roles[role].cls, method), DISPATCH_LAYOUT_ATTR, None)
        spec = self.layouts[role] if layout_name is None else self.roles[role].extra_layouts[layout_name]
        routing = route(mode, spec, args, kwargs)
        payloads = [ray.put(p) for p in routing.payloads]
        reporting = set(routing.reporting_ranks)
        ranks = self.ranks[role]  # the layout's rank i is the group's rank ranks[i]
        # Every rank runs calls in the order they reached it; calls from several threads (the trainer's and the
        # scoring thread's, reward_loop.py) must reach every rank in one order, or two calls that both wait on
        # collectives across these ranks could each hold some of them: hence one submission at a time.
        with self._submitting:
            refs = {
                rank: self.hosts[rank].run.remote(role, method, payloads[routing.payload_of_rank[i]], i in reporting)
                for i, rank in enumerate(ranks)
            }
        local = {rank: i for i, rank in enumerate(ranks)}
        return PendingCall(self, role, method, refs,
                           lambda by_rank: routing.collect({local[r]: v for r, v in by_rank.items()}))

    def call(self, role: str, method: str, mode: Dispatch, /, *args: Any, **kwargs: Any) -> Any:
        """`submit(...).get()`: run `role.method` on every rank and return the collected value."""
        return self.submit(role, method, mode, *args, **kwargs).get()

    def kill(self, failure: WorkerError) -> None:
        """Stop every rank's process now and free the pools; later calls raise `failure`'s story."""
        self.failure = self.failure or failure
        for host in self.hosts:
            ray.kill(host, no_restart=True)
        for pool in self.pools:
            pool.in_use = False

    def shutdown(self) -> None:
        """Stop the ranks and free the pools for another group (idempotent)."""
        self.kill(WorkerError(f"worker group {self.name!r} was shut down", "", None, "shutdown"))
